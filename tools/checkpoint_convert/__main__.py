"""`python -m tools.checkpoint_convert {hf-to-mcore,mcore-to-hf} SRC DST ...` (see cli.py)."""

import sys

from tools.checkpoint_convert.cli import main

if __name__ == "__main__":  # dist checkpointing and --workers spawn processes: keep the guard
    sys.exit(main())
