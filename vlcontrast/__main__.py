"""``python -m vlcontrast``: the ``vlcontrast`` command (defined in :mod:`vlcontrast.cli`)."""

import sys

from vlcontrast.cli import main

if __name__ == "__main__":
    sys.exit(main())
