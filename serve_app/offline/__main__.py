"""`python -m serve_app.offline ...`: see `cli.main`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
