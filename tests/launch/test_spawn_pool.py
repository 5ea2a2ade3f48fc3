"""`launch.spawn.RankPool`: spawned gloo ranks reused from call to call. A call's values and a
rank's traceback come back as from `run_on_ranks`; a hung rank is named within the deadline and
a dead one reported, and the next call gets fresh processes; no process group, megatron-core
state, environment variable, RNG state or torch setting of one call reaches the next; the
test session's `run_on_ranks` reuses its ranks unless a call asks for fresh processes."""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from mcore_rl.launch.spawn import DistributedRunError, RankPool, pooled_ranks, run_on_ranks

PROBE = "MCORE_RL_POOL_PROBE"


def _report(rank: int, world: int) -> dict:
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {"pid": os.getpid(), "sum": total.item(), "probe": os.environ.get(PROBE),
            "store_port": os.environ["MCORE_RL_STORE_PORT"]}


def _raise_on_rank_1(rank: int, world: int) -> int:
    dist.barrier()  # (a rank that leaves before its peers joined fails their join)
    if rank == 1:
        raise ValueError("rank 1 refuses this call")
    return rank


def _hang_on_rank_1(rank: int, world: int) -> int:
    dist.barrier()  # (a rank that leaves before its peers joined fails their join)
    if rank == 1:
        time.sleep(300)
    return rank


def _exit_on_rank_1(rank: int, world: int) -> int:
    dist.barrier()  # (a rank that leaves before its peers joined fails their join)
    if rank == 1:
        os._exit(7)
    return rank


class _Holder(torch.nn.Module):
    """A module that keeps a gloo group, and a tensor whose autograd graph reaches a hook on
    its own weight's gradient accumulator (as megatron's DDP hooks and MoE dispatchers do)."""

    def __init__(self, group):
        super().__init__()
        self.group, self.linear = group, torch.nn.Linear(2, 2)
        self.accumulator = self.linear.weight.expand_as(self.linear.weight).grad_fn \
            .next_functions[0][0]
        self.accumulator.register_hook(lambda *grads: self.group)  # held from C++ only
        self.kept = self.linear(torch.ones(1, 2)).sum()


def _leave_everything_behind(rank: int, world: int) -> int:
    """Megatron's groups, its RNG tracker, an extra gloo group kept by a module out of the
    collector's sight and by megatron's RoPE cache, an env var, torch's seed and default
    dtype and a warnings filter: set, and none of it undone."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from mcore_rl.compat import apply_cpu_compat
    from mcore_rl.parallel import ParallelConfig
    from mcore_rl.parallel.groups import init_training_groups

    apply_cpu_compat()
    init_training_groups(ParallelConfig(tp=2))
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    extra = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=extra)
    _Holder(extra)
    RotaryEmbedding(8, 1.0, cp_group=extra).forward(4, packed_seq=True)  # its cache keeps it
    os.environ[PROBE] = "set by the call before"
    torch.manual_seed(99)
    torch.set_default_dtype(torch.float64)
    warnings.filterwarnings("error", message="a filter a call left")
    return os.getpid()


def _what_is_left(rank: int, world: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    from mcore_rl.compat import megatron_state
    from mcore_rl.launch.spawn import _gloo_threads

    return {"pid": os.getpid(), "default_group": dist.is_initialized(),
            "groups": len(dist.distributed_c10d._world.pg_map),
            "megatron": megatron_state.left(),
            "model_parallel": parallel_state.model_parallel_is_initialized(),
            "rng_tracker": tp_random._CUDA_RNG_STATE_TRACKER,
            "gloo_threads": _gloo_threads(), "probe": os.environ.get(PROBE),
            "rng": torch.get_rng_state(), "dtype": str(torch.get_default_dtype()),
            "warning_filter_left": any(f[0] == "error" and f[1] is not None and
                                       f[1].pattern == "a filter a call left"
                                       for f in warnings.filters)}


def _start_a_thread(rank: int, world: int) -> int:
    threading.Thread(target=time.sleep, args=(30,), name="left-running").start()
    return os.getpid()


@pytest.fixture(scope="module")
def pool():
    with RankPool() as pool:
        yield pool


@pytest.mark.fast  # (the fast tier: scripts/test.sh -m fast)
def test_values_come_back_in_rank_order_from_the_same_processes_each_call(pool):
    first = pool.run(_report, 2)
    second = pool.run(_report, 2)
    assert [r["sum"] for r in first + second] == [3.0] * 4
    assert [r["pid"] for r in first] == [r["pid"] for r in second] == pool.pids[:2]
    assert os.getpid() not in pool.pids
    assert first[0]["store_port"] != second[0]["store_port"]  # a rendezvous per call
    # a larger world keeps the started ranks and starts the missing one
    third = pool.run(_report, 3)
    assert [r["sum"] for r in third] == [6.0] * 3
    assert [r["pid"] for r in third[:2]] == [r["pid"] for r in first]
    assert third[2]["pid"] not in (first[0]["pid"], first[1]["pid"])


def test_a_raising_rank_returns_its_traceback_and_the_next_call_gets_fresh_ranks(pool):
    before = pool.run(_report, 2)
    with pytest.raises(DistributedRunError, match=r"ranks \[.*1.*\] failed") as info:
        pool.run(_raise_on_rank_1, 2)
    assert "--- rank 1 ---" in str(info.value)
    assert "ValueError: rank 1 refuses this call" in str(info.value)
    assert "in _raise_on_rank_1" in str(info.value)  # the traceback itself
    after = pool.run(_report, 2)
    assert [r["sum"] for r in after] == [3.0, 3.0]
    assert not {r["pid"] for r in after} & {r["pid"] for r in before}


def test_a_hung_rank_is_named_within_the_deadline_and_the_pool_recovers(capfd):
    with RankPool() as pool:  # started under capfd: the ranks' stack dumps are captured
        before = pool.run(_report, 2)
        start = time.monotonic()
        with pytest.raises(DistributedRunError) as info:
            pool.run(_hang_on_rank_1, 2, timeout_s=10)
        elapsed = time.monotonic() - start
        assert str(info.value).startswith("ranks [1] failed")  # rank 0 finished
        assert "rank 1 did not finish within 10 s (hung; its Python stack was dumped" in \
            str(info.value)
        assert elapsed < 10 + 5, elapsed  # the deadline, the dump's second, the kill
        assert "in _hang_on_rank_1" in capfd.readouterr().err  # rank 1's dumped stack
        after = pool.run(_report, 2)
        assert [r["sum"] for r in after] == [3.0, 3.0]
        assert not {r["pid"] for r in after} & {r["pid"] for r in before}


def test_a_dead_rank_is_reported_and_replaced(pool):
    before = pool.run(_report, 2)
    with pytest.raises(DistributedRunError, match="process died with exit code 7"):
        pool.run(_exit_on_rank_1, 2, timeout_s=60)
    after = pool.run(_report, 2)
    assert [r["sum"] for r in after] == [3.0, 3.0]
    assert not {r["pid"] for r in after} & {r["pid"] for r in before}


def test_no_group_megatron_state_env_or_torch_setting_survives_a_call(pool):
    pool.run(_report, 2)
    fresh = pool.run(_what_is_left, 2, init_default_group=False)
    pids = pool.run(_leave_everything_behind, 2)
    left = pool.run(_what_is_left, 2, init_default_group=False)
    assert [r["pid"] for r in left] == pids == [r["pid"] for r in fresh]  # the same processes
    assert pool.retired == []
    for got, was in zip(left, fresh):
        assert not got["default_group"] and got["groups"] == 0 and got["gloo_threads"] == []
        assert got["megatron"] == [] and not got["model_parallel"]
        assert got["rng_tracker"] is None
        assert got["probe"] is None
        assert torch.equal(got["rng"], was["rng"])  # the RNG state the process started with
        assert got["dtype"] == "torch.float32" and not got["warning_filter_left"]


def test_the_parents_environment_reaches_each_call_and_the_pools_env_each_process(
        pool, monkeypatch):
    assert {r["probe"] for r in pool.run(_report, 2)} == {None}
    monkeypatch.setenv(PROBE, "the parent's")  # as a fresh spawn would inherit it
    assert {r["probe"] for r in pool.run(_report, 2)} == {"the parent's"}
    assert pool.retired[-1].startswith(f"the parent's environment changed ({PROBE})")
    monkeypatch.delenv(PROBE)
    with RankPool(env={PROBE: "the pool's"}) as other:
        assert {r["probe"] for r in other.run(_report, 2)} == {"the pool's"}


def test_a_rank_that_cannot_be_put_back_is_replaced_and_says_why(pool):
    earlier = len(pool.retired)
    with pytest.warns(UserWarning, match="thread 'left-running' still running"):
        first = pool.run(_start_a_thread, 2)
        second = pool.run(_report, 2)  # (the reports are read by the next call at the latest)
    retired = [why for why in pool.retired[earlier:] if why.startswith("rank ")]
    assert len(retired) == 2 and all("thread 'left-running' still running" in r for r in retired)
    assert second[0]["pid"] != first[0] and second[1]["pid"] != first[1]


def test_run_on_ranks_reuses_ranks_in_pooled_ranks_unless_asked_for_fresh_ones():
    """The test session runs in `pooled_ranks` (tests/support/rank_pools.py); a nested block
    shares its pools."""
    with pooled_ranks():
        one = run_on_ranks(_report, 2, timeout_s=120)
        two = run_on_ranks(_report, 2, timeout_s=120)
        assert [r["pid"] for r in one] == [r["pid"] for r in two]
        fresh = run_on_ranks(_report, 2, timeout_s=120, fresh_processes=True)
        assert [r["sum"] for r in fresh] == [3.0, 3.0]
        assert not {r["pid"] for r in fresh} & {r["pid"] for r in one}
        assert [r["pid"] for r in run_on_ranks(_report, 2, timeout_s=120)] == \
            [r["pid"] for r in one]
