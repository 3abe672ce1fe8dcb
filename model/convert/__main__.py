"""`python -m model.convert ...` is `python -m export.convert ...` (export/convert.py)."""
import sys

from export.convert import main

if __name__ == "__main__":
    sys.exit(main())
