"""Where compiled artifacts live: one `cache_dir` setting for every compiler this project uses.

`cache_dir` comes from (first wins) an explicit argument / config value / CLI flag, the environment
variable `LAYA_FLEET_CACHE_DIR`, or `~/.cache/laya-fleet`. It may be a network mount shared by a fleet.

Two tiers (docs/caching.md has the whole story):

* **node-local** working directories, one per compiler (`local_dir(kind)`): inductor's FX-graph and
  AOTAutograd caches, Triton's cache, TileLang's kernel cache, AOTInductor packages. Compilers only ever
  write here. Default `<cache_dir>/local`, or `$LAYA_FLEET_LOCAL_CACHE_DIR`; when `cache_dir` sits on a
  network filesystem and no local root is set, a directory under the system temp dir is used instead.
* **shared** artifacts under `<cache_dir>/shared/v1/<checkpoint hash>/<kind>-<arch>-<fingerprint>/`,
  keyed by torch / triton / tilelang / CUDA versions, GPU architecture and checkpoint hash. Each is an
  immutable directory tree with a `MANIFEST.json` (sizes and sha256 of every file) written last.
  One writer per artifact (an O_EXCL lock file) copies into a temporary sibling and renames it into
  place; readers copy what exists into their local directory and verify every checksum before using
  it. A corrupt or partial artifact is ignored and replaced by the next writer; a read-only shared
  mount degrades to compile-locally (logged once).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ENV = "LAYA_FLEET_CACHE_DIR"
LOCAL_ENV = "LAYA_FLEET_LOCAL_CACHE_DIR"
KINDS = ("inductor", "triton", "tilelang", "aoti")
LAYOUT = "v1"
MANIFEST = "MANIFEST.json"
FORMAT = 1
LOCK_STALE_S = 900.0  # a publish lock older than this belongs to a writer that died
TMP_STALE_S = 3600.0  # abandoned temporary artifact directories older than this are removed
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "lustre", "gpfs", "ceph",
                        "glusterfs", "beegfs", "afs", "9p", "virtiofs", "wekafs", "panfs"})

# Which compilers' caches each backend uses: seeded before it compiles, published after warm-up.
BACKEND_KINDS = {
    "compile": ("inductor", "triton"),
    "fast": ("tilelang", "inductor", "triton"),
    "aot": (),  # the AOTInductor package is seeded / published by the backend itself (see compiled.py)
    "eager": (),
}

_warned: set[str] = set()
_warn_lock = threading.Lock()
_current: CacheSession | None = None


def _warn_once(tag: str, msg: str, *args: Any) -> None:
    with _warn_lock:
        if tag in _warned:
            return
        _warned.add(tag)
    log.warning(msg, *args)


# -- where ------------------------------------------------------------------------------------------
def resolve_cache_dir(cache_dir: str | None = None) -> str:
    """The shared cache root: argument, else $LAYA_FLEET_CACHE_DIR, else ~/.cache/laya-fleet."""
    d = cache_dir or os.environ.get(ENV) or os.path.join(os.path.expanduser("~"), ".cache", "laya-fleet")
    return os.path.abspath(d)


def filesystem_type(path: str, mounts: str = "/proc/mounts") -> str:
    """The filesystem type of the mount holding `path` (from /proc/mounts), or "" when unknown."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    path = os.path.realpath(path)
    best, fstype = -1, ""
    try:
        with open(mounts, encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > best:
                    best, fstype = len(mnt), parts[2]
    except OSError:
        return ""
    return fstype


def is_network_fs(fstype: str) -> bool:
    """Whether a filesystem type names a network / distributed filesystem (nfs, lustre, fuse.*...)."""
    return fstype in NETWORK_FS or fstype.startswith("fuse.") or fstype.startswith("nfs")


def local_root(cache_dir: str | None = None) -> str:
    """The node-local root: $LAYA_FLEET_LOCAL_CACHE_DIR, else `<cache_dir>/local` unless that is on a
    network filesystem, in which case `<tmp>/laya-fleet-<uid>/local` (compilers never write to a mount)."""
    env = os.environ.get(LOCAL_ENV)
    if env:
        return os.path.abspath(env)
    root = resolve_cache_dir(cache_dir)
    fstype = filesystem_type(root)
    if is_network_fs(fstype):
        tmp = os.path.join(tempfile.gettempdir(), "laya-fleet-%d" % os.getuid(), "local")
        _warn_once("netfs:" + root, "laya-fleet: cache_dir %s is on %s; compiling into node-local %s "
                   "(set %s to choose)", root, fstype, tmp, LOCAL_ENV)
        return tmp
    return os.path.join(root, "local")


def local_dir(kind: str, cache_dir: str | None = None) -> str:
    """A node-local directory for one compiler's artifacts (`inductor`, `triton`, `tilelang`, `aoti`)."""
    path = os.path.join(local_root(cache_dir), kind)
    os.makedirs(path, exist_ok=True)
    return path


def shared_root(cache_dir: str | None = None) -> str:
    """The root of published artifacts: `<cache_dir>/shared/v1` (not created here)."""
    return os.path.join(resolve_cache_dir(cache_dir), "shared", LAYOUT)


# -- keys -------------------------------------------------------------------------------------------
def _pkg_version(*names: str) -> str:
    from importlib import metadata

    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return "none"


_versions: dict[str, str] | None = None


def versions() -> dict[str, str]:
    """Versions every artifact depends on: torch, triton, tilelang, CUDA (torch's build), Python."""
    global _versions
    if _versions is None:
        import torch

        _versions = {"torch": torch.__version__, "triton": _pkg_version("triton", "pytorch-triton"),
                     "tilelang": _pkg_version("tilelang"), "cuda": str(torch.version.cuda or "none"),
                     "transformers": _pkg_version("transformers"), "python": "%d.%d" % sys.version_info[:2]}
    return dict(_versions)


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Source files whose changes change what gets compiled (graphs, packages, kernels), per kind.
CODE_FILES = {
    "model": ("model/network.py", "model/native.py", "model/bundle.py", "model/backends/compiled.py"),
    # the files whose code becomes kernel code (kernels/forward.py and precompile.py only choose and launch kernels,
    # whose names carry every parameter and tile config, so editing them keeps every compiled kernel valid)
    "kernels": ("kernels/_tl.py", "kernels/gemm.py", "kernels/geglu.py", "kernels/layernorm.py", "kernels/attention.py",
                "kernels/rope.py", "kernels/gemm_manual.py"),
}


@functools.cache
def code_fingerprint(group: str = "model") -> str:
    """12 hex digits of sha256 over the sources that shape compiled artifacts (`model` or `kernels`), so a
    code change gets fresh artifacts instead of seeding stale ones that miss and never get republished.
    Computed once per process (the sources a process runs do not change under it)."""
    import glob

    h = hashlib.sha256()
    for pattern in CODE_FILES[group]:
        for f in sorted(glob.glob(os.path.join(_REPO, pattern))):
            h.update(os.path.relpath(f, _REPO).encode() + b"\0")
            try:
                with open(f, "rb") as fh:
                    h.update(fh.read())
            except OSError:
                pass
    return h.hexdigest()[:12]


def device_arch(device: Any) -> str:
    """`sm_90` style for a CUDA device; `cpu-<machine>-<vector ISA>-t<threads>` for CPU (inductor's CPU
    code is built per ISA and thread count)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return "sm_%d%d" % (major, minor)
    if dev.type != "cpu":
        return dev.type
    try:
        # ATen's dispatch level (AVX512, AVX2, ...): cheap, unlike inductor's pick_vec_isa(), which
        # compiles test programs (seconds) and would be paid even by a process that only loads a package
        isa = torch.backends.cpu.get_cpu_capability() or "default"
        # inductor's own default is -1 (= torch's thread count); only code that imported it can have set
        # another value, so a process that never imported it (the fast backend) need not pay the import
        inductor_config = sys.modules.get("torch._inductor.config")
        threads = int(inductor_config.cpp.threads) if inductor_config is not None else -1
    except Exception:
        isa, threads = "unknown", -1
    # inductor's CPU kernels specialise on the thread count: replicas with another count would miss
    threads = threads if threads >= 1 else torch.get_num_threads()
    return "cpu-%s-%s-t%d" % (platform.machine() or "unknown", _slug(isa), threads)


def _slug(s: str) -> str:
    # artifact names end up in compiler command lines and paths: no spaces or shell metacharacters
    return "".join(c if c.isalnum() or c in "._" else "+" for c in s.strip()) or "none"


# The version fields each kind of artifact depends on.
KEY_FIELDS = {
    "inductor": ("torch", "triton", "cuda", "python", "transformers"),
    "triton": ("torch", "triton", "cuda", "transformers"),
    "tilelang": ("tilelang", "torch", "cuda"),
    "aoti": ("torch", "cuda", "transformers"),
}
KEY_CODE = {"inductor": "model", "triton": "model", "tilelang": "kernels", "aoti": "model"}


@dataclass(frozen=True)
class ArtifactKey:
    """What one shared artifact is for: its kind, checkpoint hash, architecture and version fields."""

    kind: str
    checkpoint: str
    arch: str
    fields: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict[str, str]:
        """The key as a flat JSON-friendly dict."""
        return {"kind": self.kind, "checkpoint": self.checkpoint, "arch": self.arch, **dict(self.fields)}

    @property
    def fingerprint(self) -> str:
        """12 hex digits of sha256 over the whole key."""
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:12]

    @property
    def name(self) -> str:
        """The artifact's directory name: `<kind>-<arch>-<fingerprint>`."""
        return "%s-%s-%s" % (self.kind, self.arch, self.fingerprint)

    @property
    def relpath(self) -> str:
        """Where the artifact lives under the shared root: `<checkpoint>/<name>`."""
        return os.path.join(self.checkpoint, self.name)


def artifact_key(kind: str, checkpoint_hash: str, device: Any = "cpu", variant: str | None = None,
                 arch: str | None = None, version_info: dict[str, str] | None = None) -> ArtifactKey:
    """The key of one kind of artifact for a checkpoint on a device (`variant` e.g. "bf16" for AOTI).

    `arch` and `version_info` override what is detected (`device_arch(device)`, `versions()`, and the
    source fingerprint under "code:model" / "code:kernels").
    """
    if kind not in KEY_FIELDS:
        raise ValueError("unknown cache kind %r; use one of %s" % (kind, list(KEY_FIELDS)))
    v = version_info or versions()
    fields = [(f, v.get(f, "none")) for f in KEY_FIELDS[kind]]
    fields.append(("code", v.get("code:" + KEY_CODE[kind]) or code_fingerprint(KEY_CODE[kind])))
    if variant:
        fields.append(("variant", variant))
    return ArtifactKey(kind, _slug(checkpoint_hash), _slug(arch or device_arch(device)), tuple(fields))


# -- files ------------------------------------------------------------------------------------------
def _skip(name: str) -> bool:
    # lock files, other processes' in-flight temporaries, bytecode: never part of an artifact
    return (name.startswith(".") or name.startswith("tmp") or name.endswith(".tmp") or name.endswith(".lock")
            or name in ("locks", "__pycache__"))


def list_files(src: str) -> list[str]:
    """Relative paths of the regular files under `src` that belong in an artifact, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if not _skip(d) and not os.path.islink(os.path.join(dirpath, d)))
        for f in filenames:
            p = os.path.join(dirpath, f)
            if _skip(f) or os.path.islink(p) or not os.path.isfile(p):
                continue
            out.append(os.path.relpath(p, src))
    return sorted(out)


def _copy_hash(src: str, dst: str, fsync: bool) -> tuple[int, str]:
    """Copy src to dst (dst's directory must exist); returns (bytes, sha256 of the bytes copied)."""
    h = hashlib.sha256()
    n = 0
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while True:
            b = fi.read(1 << 20)
            if not b:
                break
            h.update(b)
            fo.write(b)
            n += len(b)
        if fsync:
            fo.flush()
            os.fsync(fo.fileno())
    shutil.copystat(src, dst, follow_symlinks=False)
    return n, h.hexdigest()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _safe_rel(rel: Any) -> bool:
    return (isinstance(rel, str) and rel != "" and not os.path.isabs(rel)
            and ".." not in rel.replace("\\", "/").split("/"))


def _readonly_error(e: OSError) -> bool:
    return e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)


def _retry_stale(fn, *args):
    """Call fn; on ESTALE (NFS stale file handle) retry once after a short pause."""
    try:
        return fn(*args)
    except OSError as e:
        if e.errno != errno.ESTALE:
            raise
        time.sleep(0.2)
        return fn(*args)


@dataclass
class SeedResult:
    """What seeding one artifact did: state is hit | miss | corrupt | error."""

    kind: str
    state: str
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy."""
        return dict(self.__dict__)


class SharedCache:
    """Seed from / publish to the shared artifact tree under `<cache_dir>/shared/v1`."""

    def __init__(self, cache_dir: str | None = None):
        self.cache_dir = resolve_cache_dir(cache_dir)
        self.root = shared_root(self.cache_dir)

    def path(self, key: ArtifactKey) -> str:
        """The artifact's directory (it may not exist)."""
        return os.path.join(self.root, key.relpath)

    # -- reading ----------------------------------------------------------------------------------
    def read_manifest(self, key: ArtifactKey) -> dict | None:
        """The artifact's manifest if present and well formed for this key, else None."""
        f = os.path.join(self.path(key), MANIFEST)

        def _read():
            with open(f, encoding="utf-8") as fh:
                return json.load(fh)

        try:
            m = _retry_stale(_read)
        except (OSError, ValueError):
            return None
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("key") != key.as_dict():
            return None
        files = m.get("files")
        if not isinstance(files, list) or not files:
            return None
        for e in files:
            if not (isinstance(e, dict) and _safe_rel(e.get("path")) and isinstance(e.get("size"), int)
                    and isinstance(e.get("sha256"), str)):
                return None
        return m

    def state(self, key: ArtifactKey, verify: bool = True) -> str:
        """`absent`, `valid` or `corrupt` (a directory whose manifest or files do not check out)."""
        d = self.path(key)
        if not os.path.isdir(d):
            return "absent"
        m = self.read_manifest(key)
        if m is None:
            return "corrupt"
        if not verify:
            return "valid"
        try:
            for e in m["files"]:
                p = os.path.join(d, e["path"])
                if os.path.getsize(p) != e["size"]:
                    return "corrupt"
                h = hashlib.sha256()
                with open(p, "rb") as fh:
                    for b in iter(lambda fh=fh: fh.read(1 << 20), b""):
                        h.update(b)
                if h.hexdigest() != e["sha256"]:
                    return "corrupt"
        except OSError:
            return "corrupt"
        return "valid"

    def seed(self, key: ArtifactKey, dest: str) -> SeedResult:
        """Copy a valid artifact into `dest`, verifying every checksum first; nothing lands on a mismatch."""
        t0 = time.perf_counter()
        src = self.path(key)
        if not os.path.isdir(src):
            return SeedResult(key.kind, "miss", seconds=time.perf_counter() - t0)
        m = self.read_manifest(key)
        if m is None:
            log.warning("laya-fleet cache: %s has no valid manifest; ignoring it (it will be rebuilt)", src)
            return SeedResult(key.kind, "corrupt", seconds=time.perf_counter() - t0, detail="manifest")
        os.makedirs(dest, exist_ok=True)
        stage = os.path.join(dest, ".seed-%d-%s" % (os.getpid(), uuid.uuid4().hex[:8]))
        nbytes = 0
        try:
            for e in m["files"]:
                out = os.path.join(stage, e["path"])
                os.makedirs(os.path.dirname(out), exist_ok=True)
                n, digest = _retry_stale(_copy_hash, os.path.join(src, e["path"]), out, False)
                if n != e["size"] or digest != e["sha256"]:
                    log.warning("laya-fleet cache: %s in %s fails its checksum (%d of %d bytes); ignoring the "
                                "artifact (it will be rebuilt)", e["path"], src, n, e["size"])
                    return SeedResult(key.kind, "corrupt", seconds=time.perf_counter() - t0, detail=e["path"])
                nbytes += n
            for e in m["files"]:  # all verified: move into place, one atomic rename per file
                out = os.path.join(dest, e["path"])
                os.makedirs(os.path.dirname(out), exist_ok=True)
                os.replace(os.path.join(stage, e["path"]), out)
        except OSError as e:
            # vanished mid-copy (replaced by a writer), stale NFS handle, permissions: compile locally
            log.warning("laya-fleet cache: could not read %s (%s); compiling locally", src, e)
            return SeedResult(key.kind, "error", seconds=time.perf_counter() - t0, detail=str(e))
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return SeedResult(key.kind, "hit", len(m["files"]), nbytes, time.perf_counter() - t0)

    # -- writing ----------------------------------------------------------------------------------
    def _lock_path(self, key: ArtifactKey) -> str:
        return os.path.join(self.root, key.checkpoint, ".%s.lock" % key.name)

    def _lock_stale(self, path: str) -> bool:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return True
        age = time.time() - st.st_mtime
        if age > LOCK_STALE_S:
            return True
        try:
            with open(path, encoding="utf-8") as fh:
                info = json.load(fh)
        except (OSError, ValueError):
            return age > 60  # unreadable: being written right now, or left half-written long ago
        if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
            try:
                os.kill(info["pid"], 0)
            except ProcessLookupError:
                return True  # its writer on this node is gone
            except PermissionError:
                return False
        return False

    def _acquire(self, key: ArtifactKey) -> str | None:
        path = self._lock_path(key)
        token = uuid.uuid4().hex
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self._lock_stale(path):
                    return None
                log.warning("laya-fleet cache: breaking stale publish lock %s", path)
                grave = "%s.stale-%s" % (path, token[:8])
                try:
                    os.rename(path, grave)
                    os.unlink(grave)
                except OSError:
                    pass
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"host": socket.gethostname(), "pid": os.getpid(), "token": token, "time": time.time()},
                          fh)
            return token
        return None

    def _release(self, key: ArtifactKey, token: str) -> None:
        path = self._lock_path(key)
        try:
            with open(path, encoding="utf-8") as fh:
                if json.load(fh).get("token") != token:
                    return  # someone broke our lock as stale; theirs now
            os.unlink(path)
        except (OSError, ValueError):
            pass

    def _clean_tmp(self, parent: str) -> None:
        try:
            names = os.listdir(parent)
        except OSError:
            return
        for n in names:
            if n.startswith(".tmp-") or n.startswith(".trash-"):
                p = os.path.join(parent, n)
                try:
                    if time.time() - os.stat(p).st_mtime > TMP_STALE_S or n.startswith(".trash-"):
                        shutil.rmtree(p, ignore_errors=True)
                except OSError:
                    pass

    def publish(self, key: ArtifactKey, src: str, lock: bool = True, files: Iterable[str] | None = None) -> str:
        """Publish the files under `src` as this artifact, at most one writer at a time.

        Returns `published` (ours is now the artifact), `replaced` (ours replaced a corrupt one),
        `exists` (a valid one was already there), `busy` (another writer holds the lock), `empty`
        (nothing to publish), `readonly` (the shared dir cannot be written; logged once), or `error`.
        `lock=False` skips the lock (tests show the rename alone keeps one intact copy).
        """
        rels = sorted(files) if files is not None else list_files(src)
        if not rels:
            return "empty"
        final = self.path(key)
        parent = os.path.dirname(final)
        if self.state(key) == "valid":
            return "exists"
        try:
            os.makedirs(parent, exist_ok=True)
            token = self._acquire(key) if lock else "nolock"
        except OSError as e:
            if _readonly_error(e):
                _warn_once("ro:" + self.root, "laya-fleet cache: shared cache %s is not writable (%s); compiling "
                           "locally and not publishing", self.root, e.strerror)
                return "readonly"
            log.warning("laya-fleet cache: cannot publish %s: %s", final, e)
            return "error"
        if token is None:
            return "busy"
        tmp = os.path.join(parent, ".tmp-%s-%s-%d-%s" % (key.name, socket.gethostname(), os.getpid(),
                                                          uuid.uuid4().hex[:8]))
        try:
            st = self.state(key)  # under the lock: did someone finish while we waited?
            if st == "valid":
                return "exists"
            self._clean_tmp(parent)
            entries = []
            for rel in rels:
                out = os.path.join(tmp, rel)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                n, digest = _copy_hash(os.path.join(src, rel), out, fsync=True)
                entries.append({"path": rel, "size": n, "sha256": digest})
            manifest = {"format": FORMAT, "key": key.as_dict(), "files": entries,
                        "bytes": sum(e["size"] for e in entries), "created": time.time(),
                        "writer": {"host": socket.gethostname(), "pid": os.getpid()}}
            mtmp = os.path.join(tmp, MANIFEST + ".tmp")
            with open(mtmp, "w", encoding="utf-8") as fh:  # the manifest is written last
                json.dump(manifest, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(mtmp, os.path.join(tmp, MANIFEST))
            _fsync_dir(tmp)
            status = "published"
            if st == "corrupt":
                trash = os.path.join(parent, ".trash-%s-%s" % (key.name, uuid.uuid4().hex[:8]))
                try:
                    os.rename(final, trash)
                except FileNotFoundError:
                    pass
                status = "replaced"
            try:
                os.rename(tmp, final)  # atomic; fails if a (non-empty) artifact is already there
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR):
                    return "exists"
                raise
            _fsync_dir(parent)
            if st == "corrupt":
                self._clean_tmp(parent)
            log.info("laya-fleet cache: %s %s (%d files, %.1f MB)", status, final, len(entries),
                     manifest["bytes"] / 1e6)
            return status
        except OSError as e:
            if _readonly_error(e):
                _warn_once("ro:" + self.root, "laya-fleet cache: shared cache %s is not writable (%s); compiling "
                           "locally and not publishing", self.root, e.strerror)
                return "readonly"
            log.warning("laya-fleet cache: publishing %s failed: %s", final, e)
            return "error"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if lock and token:
                self._release(key, token)


# -- process configuration --------------------------------------------------------------------------
@dataclass
class CacheSession:
    """This process's cache configuration: local dirs, keys, and what seeding found per kind."""

    cache_dir: str
    local: dict[str, str]
    keys: dict[str, ArtifactKey] = field(default_factory=dict)
    seeded: dict[str, SeedResult] = field(default_factory=dict)
    published: dict[str, str] = field(default_factory=dict)

    @property
    def shared(self) -> SharedCache:
        """The shared artifact tree."""
        return SharedCache(self.cache_dir)

    def publish(self, kinds: Iterable[str] | None = None) -> dict[str, str]:
        """Publish each configured kind whose seed was not a hit; returns {kind: publish status}."""
        out: dict[str, str] = {}
        for kind in kinds if kinds is not None else self.keys:
            key = self.keys.get(kind)
            if key is None:
                continue
            seeded = self.seeded.get(kind)
            if seeded is not None and seeded.state == "hit":
                out[kind] = "seeded"
                continue
            out[kind] = self.shared.publish(key, self.local[kind])
        self.published.update(out)
        return out

    def report(self) -> dict[str, Any]:
        """A JSON-friendly summary (dirs, keys, seed and publish results)."""
        return {"cache_dir": self.cache_dir, "local": dict(self.local),
                "keys": {k: v.name for k, v in self.keys.items()},
                "seeded": {k: v.as_dict() for k, v in self.seeded.items()}, "published": dict(self.published)}


def configure(cache_dir: str | None = None, checkpoint_hash: str | None = None, device: Any = None,
              kinds: Iterable[str] = ()) -> CacheSession:
    """Point this process's compilers at node-local dirs and seed them from the shared cache.

    Must run before anything compiles. Sets $LAYA_FLEET_CACHE_DIR (so every later `local_dir()` call
    agrees), $TORCHINDUCTOR_CACHE_DIR, $TRITON_CACHE_DIR and $TILELANG_CACHE_DIR, enables inductor's
    FX-graph and AOTAutograd caches (unless set to 0), and for each of `kinds` (with a checkpoint hash)
    copies a valid shared artifact into the local dir. Inductor and Triton get one local dir per key,
    so what is published later holds this checkpoint's graphs only. Returns the session (also `current()`).
    """
    global _current
    root = resolve_cache_dir(cache_dir)
    os.environ[ENV] = root
    kinds = tuple(kinds)
    local = {k: local_dir(k, root) for k in KINDS}
    keys: dict[str, ArtifactKey] = {}
    if checkpoint_hash and kinds:
        for k in kinds:
            keys[k] = artifact_key(k, checkpoint_hash, device if device is not None else "cpu")
            if k in ("inductor", "triton"):
                local[k] = os.path.join(local[k], keys[k].name)
                os.makedirs(local[k], exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = local["inductor"]
    os.environ["TRITON_CACHE_DIR"] = local["triton"]
    if "tilelang" not in sys.modules:  # TileLang reads it once, at import
        os.environ["TILELANG_CACHE_DIR"] = local["tilelang"]
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    session = CacheSession(root, local, keys)
    shared = session.shared
    for k, key in keys.items():
        res = shared.seed(key, local[k])
        session.seeded[k] = res
        log.info("laya-fleet cache: seed %s: %s (%d files, %.1f MB, %.2fs)", k, res.state, res.files,
                 res.bytes / 1e6, res.seconds)
    _current = session
    return session


def current() -> CacheSession | None:
    """The session the last `configure()` in this process returned, if any."""
    return _current


__all__ = ["ENV", "LOCAL_ENV", "KINDS", "ArtifactKey", "CacheSession", "SeedResult", "SharedCache",
           "artifact_key", "code_fingerprint", "configure", "current", "device_arch", "filesystem_type",
           "is_network_fs", "list_files", "local_dir", "local_root", "resolve_cache_dir", "shared_root", "versions"]
