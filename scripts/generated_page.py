"""The command line both page generators share: write the page, or with --check say whether
the checked-in page is current."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def write_or_check(target: Path, render: Callable[[], str], argv: list[str],
                   script: str) -> int:
    """Write `render()` to `target`; with `--check` in `argv`, exit 1 (naming `script` to run)
    when the file differs from it instead."""
    text = render()
    if "--check" in argv:
        current = target.read_text() if target.exists() else ""
        if current != text:
            print(f"{target} is out of date: run python scripts/{script}")
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {target}")
    return 0
