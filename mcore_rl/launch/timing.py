"""Wall seconds per phase of a step: every phase of an RL step is timed on its own."""

from __future__ import annotations

import time
from contextlib import contextmanager


class PhaseTimer:
    """Wall seconds per phase of one step; phases never nest, so no time is billed twice."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()
        self._open: str | None = None

    @contextmanager
    def __call__(self, phase: str):
        if self._open is not None:
            raise RuntimeError(f"phase {phase!r} started inside {self._open!r}")
        self._open, start = phase, time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
            self._open = None

    def as_metrics(self) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        out["timing_s/step"] = time.perf_counter() - self._start
        return out
