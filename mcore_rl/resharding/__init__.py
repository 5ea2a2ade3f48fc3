"""Resharding: a pure planner (shard map → shard map transfers) and a streaming transport."""

from mcore_rl.resharding.copy_service import CopyService, P2PCopy
from mcore_rl.resharding.planner import Plan, PlanError, Transfer, build_plan
from mcore_rl.resharding.sync_group import (SyncGroupSpec, host_store, join_sync_group,
                                            sync_group_spec)
from mcore_rl.resharding.stats import SyncStats
from mcore_rl.resharding.transport import SyncError, receive_shards, send_shards, verify_plan

__all__ = ["CopyService", "P2PCopy", "Plan", "PlanError", "SyncError", "SyncGroupSpec",
           "SyncStats", "Transfer", "build_plan", "host_store", "join_sync_group",
           "receive_shards", "send_shards", "sync_group_spec", "verify_plan"]
