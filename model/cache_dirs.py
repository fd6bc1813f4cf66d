"""Where compiled artifacts live: the shared cache root and the node-local directories compilers write into.

`cache_dir` comes from (first wins) an explicit argument / config value / CLI flag, $LAYA_FLEET_CACHE_DIR, or
`~/.cache/laya-fleet`; it may be a network mount shared by a fleet. Compilers only ever write node-local dirs
(`local_dir(kind)`): `<cache_dir>/local`, or $LAYA_FLEET_LOCAL_CACHE_DIR; when `cache_dir` sits on a network
filesystem and no local root is set, a directory under the system temp dir. model/cache.py has the whole story.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from typing import Any

from . import settings

log = logging.getLogger("model.cache")   # one logger for the whole cache

ENV = "LAYA_FLEET_CACHE_DIR"
LOCAL_ENV = "LAYA_FLEET_LOCAL_CACHE_DIR"
LAYOUT = "v1"
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "lustre", "gpfs", "ceph",
                        "glusterfs", "beegfs", "afs", "9p", "virtiofs", "wekafs", "panfs"})

_warned: set[str] = set()
_warn_lock = threading.Lock()


def warn_once(tag: str, msg: str, *args: Any) -> None:
    """Log a warning the first time `tag` is seen in this process."""
    with _warn_lock:
        if tag in _warned:
            return
        _warned.add(tag)
    log.warning(msg, *args)


def resolve_cache_dir(cache_dir: str | None = None) -> str:
    """The shared cache root: argument, else $LAYA_FLEET_CACHE_DIR, else ~/.cache/laya-fleet."""
    d = cache_dir or settings.get(ENV) or os.path.join(os.path.expanduser("~"), ".cache", "laya-fleet")
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
    env = settings.get(LOCAL_ENV)
    if env:
        return env
    root = resolve_cache_dir(cache_dir)
    fstype = filesystem_type(root)
    if is_network_fs(fstype):
        tmp = os.path.join(tempfile.gettempdir(), "laya-fleet-%d" % os.getuid(), "local")
        warn_once("netfs:" + root, "laya-fleet: cache_dir %s is on %s; compiling into node-local %s "
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


__all__ = ["ENV", "LOCAL_ENV", "LAYOUT", "NETWORK_FS", "warn_once", "resolve_cache_dir", "filesystem_type",
           "is_network_fs", "local_root", "local_dir", "shared_root"]
