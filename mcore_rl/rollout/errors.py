"""The one error type of the rollout engines."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """An engine failed, died or missed a deadline. Names the engine, the phase ("start-up",
    "generate", "sync", ...) and, when known, the worker (TP rank)."""

    def __init__(self, engine: int, phase: str, detail: str, rank: int | None = None):
        self.engine, self.phase, self.rank, self.detail = engine, phase, rank, detail
        where = f"rollout engine {engine}" + (f" tp rank {rank}" if rank is not None else "")
        super().__init__(f"{where}, {phase}: {detail}")

    def __reduce__(self):  # crosses process boundaries (Ray) with its fields intact
        return (type(self), (self.engine, self.phase, self.detail, self.rank))


__all__ = ["RolloutError"]
