"""The entry point of the `laya-fleet-haproxy` console script (`python -m serve_app.haproxy` too): the
HAProxy launcher of serve_app/online/haproxy_launcher.py."""

from .online.haproxy_launcher import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
