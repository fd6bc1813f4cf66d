"""The import path every Serve config names (`import_path: serve_app.app:build_app`): the online app builder.

`python -m serve_app.app fused CONFIG ...` prints a config turned to the fused topology
(serve_app/online/fused_config.py).
"""

from .online.app import AppArgs, IngressOptions, ScorerOptions, build_app
from .online.fused_config import fused_config, main

__all__ = ["AppArgs", "IngressOptions", "ScorerOptions", "build_app", "fused_config", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
