"""The shared artifact tree: seed a node-local dir from it, publish one to it, one writer per artifact.

Each artifact is an immutable directory `<cache_dir>/shared/v1/<checkpoint>/<kind>-<arch>-<fingerprint>/` with a
`MANIFEST.json` (size and sha256 of every file) written last. One writer at a time (an O_EXCL lock file, broken
when stale) copies into a temporary sibling and renames it into place; readers verify every checksum before
anything lands in their local dir. A corrupt or partial artifact is ignored and replaced by the next writer; a
read-only shared mount degrades to compile-locally (logged once). Keys (`ArtifactKey`) come from model/cache.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .cache_dirs import log, resolve_cache_dir, shared_root, warn_once

if TYPE_CHECKING:
    from .cache import ArtifactKey

MANIFEST = "MANIFEST.json"
FORMAT = 1
LOCK_STALE_S = 900.0  # a publish lock older than this belongs to a writer that died
TMP_STALE_S = 3600.0  # abandoned temporary artifact directories older than this are removed


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

    def _write_failed(self, e: OSError, what: str) -> str:
        """The publish status of a write error: `readonly` (warned once per shared root) or `error`."""
        if _readonly_error(e):
            warn_once("ro:" + self.root, "laya-fleet cache: shared cache %s is not writable (%s); compiling "
                      "locally and not publishing", self.root, e.strerror)
            return "readonly"
        log.warning("laya-fleet cache: %s: %s", what, e)
        return "error"

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
            return self._write_failed(e, "cannot publish %s" % final)
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
            return self._write_failed(e, "publishing %s failed" % final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if lock and token:
                self._release(key, token)


__all__ = ["MANIFEST", "FORMAT", "SeedResult", "SharedCache", "list_files"]
