"""Where compiled artifacts live: one `cache_dir` setting for every compiler this project uses.

`cache_dir` comes from (first wins) an explicit argument / config value / CLI flag, the environment
variable `LAYA_FLEET_CACHE_DIR`, or `~/.cache/laya-fleet`. Under it each process compiles into a
node-local directory; `model.cache` also seeds that directory from, and publishes to, a shared one
(see `SharedCache`).
"""

from __future__ import annotations

import os

ENV = "LAYA_FLEET_CACHE_DIR"
LOCAL_ENV = "LAYA_FLEET_LOCAL_CACHE_DIR"


def resolve_cache_dir(cache_dir: str | None = None) -> str:
    """The shared cache root: argument, else $LAYA_FLEET_CACHE_DIR, else ~/.cache/laya-fleet."""
    d = cache_dir or os.environ.get(ENV) or os.path.join(os.path.expanduser("~"), ".cache", "laya-fleet")
    return os.path.abspath(d)


def local_dir(kind: str, cache_dir: str | None = None) -> str:
    """A node-local directory for one compiler's artifacts (`inductor`, `triton`, `tilelang`, `aoti`)."""
    root = os.environ.get(LOCAL_ENV) or os.path.join(resolve_cache_dir(cache_dir), "local")
    path = os.path.join(root, kind)
    os.makedirs(path, exist_ok=True)
    return path
