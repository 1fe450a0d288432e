"""``python -m kvflow``: the ``kvflow`` command (kvflow/entrypoints/cli.py)."""

import sys

from kvflow.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
