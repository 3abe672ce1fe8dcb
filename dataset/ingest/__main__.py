"""`python -m dataset.ingest`: dataset/ingest/cli.py."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
