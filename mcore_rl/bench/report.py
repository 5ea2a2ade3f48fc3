"""What every `mcore-rl bench` command writes: spread statistics of repeated timings, and the
files under `--out` — NAME.json (the whole report), NAME.md (markdown tables) and NAME.png
(a matplotlib chart, Agg backend, no display needed).

A benchmark builds its report dict, a list of `Table`s for the markdown, and a chart function
`chart(fig) -> None` that draws on a matplotlib Figure; `write_outputs` does the rest.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence


def spread(values: Sequence[float]) -> dict:
    """Median and spread of repeated measurements: {"median", "min", "max", "runs"}."""
    if not values:
        raise ValueError("spread() of no measurements")
    runs = [float(v) for v in values]
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs),
            "runs": runs}


@dataclass(frozen=True)
class Table:
    """One markdown table: a title line, a header row and body rows (cells formatted by
    `fmt`)."""

    title: str
    header: tuple[str, ...]
    rows: tuple[tuple, ...]

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", "| " + " | ".join(self.header) + " |",
                 "|" + "---|" * len(self.header)]
        lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"


def fmt(value) -> str:
    """Table cell: 4 significant digits for floats, str() for the rest."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def scalar_table(report: dict) -> str:
    """The flat `| metric | value |` table of a report's top-level scalars (what
    `mcore-rl bench sync` writes as sync.md)."""
    rows = [("metric", "value")] + [(k, v) for k, v in report.items()
                                     if isinstance(v, (int, float, str))]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return table.replace("| metric | value |", "| metric | value |\n|---|---|", 1) + "\n"


def write_outputs(out: Path, name: str, report: dict, tables: Sequence[Table],
                  chart: Callable | None) -> list[Path]:
    """NAME.json, NAME.md (the given tables, then every top-level scalar) and, when `chart`
    is given, NAME.png. Returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(report, indent=2, default=str))
    body = [f"## mcore-rl bench {name}", ""] + [t.markdown() for t in tables]
    body += ["### all scalars", "", scalar_table(report)]
    paths[1].write_text("\n".join(body))
    if chart is not None:
        import matplotlib  # lazy: matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib

        fig = plt.figure(figsize=(9, 4))
        try:
            chart(fig)
            fig.tight_layout()
            fig.savefig(out / f"{name}.png", dpi=100)
        finally:
            plt.close(fig)
        paths.append(out / f"{name}.png")
    return paths


def bar_with_spread(ax, labels: Sequence[str], stats: Sequence[dict], *, ylabel: str,
                    title: str) -> None:
    """Bars at each `spread()`'s median with min/max whiskers."""
    medians = [s["median"] for s in stats]
    lower = [s["median"] - s["min"] for s in stats]
    upper = [s["max"] - s["median"] for s in stats]
    ax.bar(list(labels), medians, yerr=[lower, upper], capsize=4,
           color=["tab:blue", "tab:orange", "tab:green", "tab:red"][:len(labels)])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)


__all__ = ["Table", "bar_with_spread", "fmt", "scalar_table", "spread",
           "write_outputs"]
