"""Write docs/reference/config.md from the config dataclasses' docstrings.

    .venv/bin/python scripts/gen_config_reference.py          # rewrite the file
    .venv/bin/python scripts/gen_config_reference.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

from mcore_rl.config.reference import render_reference
from mcore_rl.run.config import RLConfig

TARGET = Path(__file__).resolve().parent.parent / "docs" / "reference" / "config.md"


def main(argv: list[str]) -> int:
    text = render_reference(RLConfig)
    if "--check" in argv:
        current = TARGET.read_text() if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET} is out of date: run python scripts/gen_config_reference.py")
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
