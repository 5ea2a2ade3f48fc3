"""Write docs/reference/config.md from the config dataclasses' docstrings.

    .venv/bin/python scripts/gen_config_reference.py          # rewrite the file
    .venv/bin/python scripts/gen_config_reference.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

from mcore_rl.config.reference import render_reference
from mcore_rl.runconfig import RLConfig

TARGET = Path(__file__).resolve().parent.parent / "docs" / "reference" / "config.md"


def main(argv: list[str]) -> int:
    from generated_page import write_or_check

    return write_or_check(TARGET, lambda: render_reference(RLConfig), argv,
                          "gen_config_reference.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
