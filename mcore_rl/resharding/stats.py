"""What one rank's sync moved (`SyncStats`): a leaf module, so the copy services and the
transport that fill it import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SyncStats:
    """What one rank moved. peak_extra_bytes: staging buffers alive at once (the rank's own
    parameters/shards are not counted: it holds those anyway). bytes_in_place: of
    bytes_received, those received straight into the tensors they replace (an engine's
    parameters: no buffer, no install copy)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_in_place: int = 0
    peak_extra_bytes: int = 0
    messages: int = 0
    zero_copy_messages: int = 0
    seconds: float = 0.0
    digest_seconds: float = 0.0   # digesting what moved (`digest.py`)
    compare_seconds: float = 0.0  # comparing the digests (waiting for the last rank included)
    _live: int = field(default=0, repr=False)

    def hold(self, nbytes: int) -> None:
        self._live += nbytes
        self.peak_extra_bytes = max(self.peak_extra_bytes, self._live)

    def release(self, nbytes: int) -> None:
        self._live -= nbytes

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


__all__ = ["SyncStats"]
