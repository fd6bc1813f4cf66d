"""Where compiled artifacts live: one `cache_dir` setting for every compiler this project uses.

`cache_dir` comes from (first wins) an explicit argument / config value / CLI flag, the environment
variable `LAYA_FLEET_CACHE_DIR`, or `~/.cache/laya-fleet`. It may be a network mount shared by a fleet.

Two tiers (docs/caching.md has the whole story; where: model/cache_dirs.py, the shared tree: model/shared_cache.py,
keys and this process's configuration: here):

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

import functools
import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .cache_dirs import (
    ENV,
    LAYOUT,
    LOCAL_ENV,
    filesystem_type,
    is_network_fs,
    local_dir,
    local_root,
    log,
    resolve_cache_dir,
    shared_root,
)
from .shared_cache import MANIFEST, SeedResult, SharedCache, list_files

KINDS = ("inductor", "triton", "tilelang", "aoti")
_current: CacheSession | None = None


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
# The model sources whose changes change what inductor and AOTInductor compile (graphs, packages); a backend with
# other compiled code (the fast backend's kernels) passes its own fingerprint to `configure` / `artifact_key`
CODE_FILES = {
    "model": ("model/network.py", "model/bundle.py", "model/backends/torch_encoder.py", "model/backends/padded.py",
              "model/backends/compile.py", "model/backends/aot.py"),
}


@functools.cache
def code_fingerprint(group: str = "model") -> str:
    """12 hex digits of sha256 over the sources that shape compiled artifacts (`CODE_FILES[group]`), so a
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
MODEL_CODE_KINDS = ("inductor", "triton", "aoti")   # keyed by `code_fingerprint("model")` unless told otherwise


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
                 arch: str | None = None, version_info: dict[str, str] | None = None,
                 code: str | None = None) -> ArtifactKey:
    """The key of one kind of artifact for a checkpoint on a device (`variant` e.g. "bf16" for AOTI).

    `code` is the fingerprint of the sources the artifact was compiled from (default: the model's, for inductor,
    Triton and AOTI; a TileLang key needs the kernels' own). `arch` and `version_info` override what is detected
    (`device_arch(device)`, `versions()`, and the code fingerprint under "code:<kind>").
    """
    if kind not in KEY_FIELDS:
        raise ValueError("unknown cache kind %r; use one of %s" % (kind, list(KEY_FIELDS)))
    v = version_info or versions()
    fields = [(f, v.get(f, "none")) for f in KEY_FIELDS[kind]]
    if code is None:
        code = v.get("code:" + kind) or (code_fingerprint("model") if kind in MODEL_CODE_KINDS else None)
    if code is None:
        raise ValueError("a %s cache key needs the fingerprint of the code it was compiled from (code=...)" % kind)
    fields.append(("code", code))
    if variant:
        fields.append(("variant", variant))
    return ArtifactKey(kind, _slug(checkpoint_hash), _slug(arch or device_arch(device)), tuple(fields))


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
              kinds: Iterable[str] | Mapping[str, str | None] = ()) -> CacheSession:
    """Point this process's compilers at node-local dirs and seed them from the shared cache.

    Must run before anything compiles. Sets $LAYA_FLEET_CACHE_DIR (so every later `local_dir()` call
    agrees), $TORCHINDUCTOR_CACHE_DIR, $TRITON_CACHE_DIR and $TILELANG_CACHE_DIR, enables inductor's
    FX-graph and AOTAutograd caches (unless set to 0), and for each of `kinds` (with a checkpoint hash)
    copies a valid shared artifact into the local dir. `kinds` may map each kind to the fingerprint of its code
    (`artifact_key`'s `code`; None: the default). Inductor and Triton get one local dir per key,
    so what is published later holds this checkpoint's graphs only. Returns the session (also `current()`).
    """
    global _current
    root = resolve_cache_dir(cache_dir)
    os.environ[ENV] = root
    code = dict(kinds) if isinstance(kinds, Mapping) else dict.fromkeys(kinds)
    kinds = tuple(code)
    local = {k: local_dir(k, root) for k in KINDS}
    keys: dict[str, ArtifactKey] = {}
    if checkpoint_hash and kinds:
        for k in kinds:
            keys[k] = artifact_key(k, checkpoint_hash, device if device is not None else "cpu", code=code[k])
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


__all__ = ["ENV", "LOCAL_ENV", "KINDS", "LAYOUT", "MANIFEST", "ArtifactKey", "CacheSession", "SeedResult",
           "SharedCache", "artifact_key", "code_fingerprint", "configure", "current", "device_arch", "filesystem_type",
           "is_network_fs", "list_files", "local_dir", "local_root", "resolve_cache_dir", "shared_root", "versions"]
