"""``python -m vlcontrast.cli``: the command torchrun, deepspeed and srun launch on every rank."""

import sys

from vlcontrast.cli import main

if __name__ == "__main__":
    sys.exit(main())
