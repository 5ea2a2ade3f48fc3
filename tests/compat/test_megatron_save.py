"""mcore_rl.compat.megatron_save: upstream megatron-core still makes its dist-checkpoint results
queue from a spawned Manager (so the shim is still needed: when an upgrade stops, the first
assertion fails — drop the shim), and with the shim a synchronous save and its load work with
no process left behind (megatron's writer processes are joined; no Manager was started). In a
child interpreter: the shim changes megatron for good, and megatron stays out of the pytest
process."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = r"""
import inspect, json, multiprocessing, os, tempfile
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from mcore_rl.compat import apply_cpu_compat, megatron_save

upstream = inspect.getsource(filesystem_async._get_write_results_queue)
installed, again = megatron_save.install(), megatron_save.install()
tmp = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
apply_cpu_compat("cpu")
weights = torch.arange(12.0).reshape(3, 4)
os.makedirs(f"{tmp}/ckpt")
dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weights, replica_id=0)},
                        f"{tmp}/ckpt")
children = [type(p).__name__ for p in multiprocessing.active_children()]
loaded = dist_checkpointing.load(
    {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), replica_id=0)}, f"{tmp}/ckpt")
print(json.dumps({
    "upstream_manager": 'get_context("spawn")' in upstream and ".Manager()" in upstream,
    "installed": installed, "again": again, "children": children,
    "queue": type(filesystem_async._get_write_results_queue()).__name__,
    "loaded": torch.equal(loaded["w"], weights)}))
"""


def test_a_synchronous_save_needs_no_manager_process():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["upstream_manager"]  # still needed
    assert (seen["installed"], seen["again"]) == (True, False)  # idempotent
    assert seen["queue"] == "Queue" and seen["children"] == []  # nothing spawned or left
    assert seen["loaded"]  # the save went through the queue: its load gives the weights back
