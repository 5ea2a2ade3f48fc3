"""Rollouts: vLLM engines (TP via vLLM's mp executor), data-parallel engines in Ray actors, and
the worker-side receive/install of streamed weight shards. vLLM and Ray are imported lazily."""

from mcore_rl.rollout.config import RolloutConfig, SamplingConfig
from mcore_rl.rollout.engine import Completion, RolloutEngine
from mcore_rl.rollout.errors import RolloutError
from mcore_rl.rollout.sync_client import RankSync, SyncReport
from mcore_rl.rollout.ray_engines import RayEngines
from mcore_rl.rollout.install import install_from_iterator, rank_shapes

__all__ = ["Completion", "RankSync", "RayEngines", "RolloutConfig", "RolloutEngine",
           "RolloutError", "SamplingConfig", "SyncReport",
           "install_from_iterator", "rank_shapes"]
