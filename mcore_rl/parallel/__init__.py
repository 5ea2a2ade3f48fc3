"""Parallel state: the grid's config, and the explicit process groups built from it once."""

from mcore_rl.parallel.config import ParallelConfig

__all__ = ["ParallelConfig"]
