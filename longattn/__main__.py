"""``python -m longattn ...``: the same as the ``longattn`` command (see :mod:`longattn.cli`)."""
import sys

from longattn.cli import main

if __name__ == "__main__":
    sys.exit(main())
