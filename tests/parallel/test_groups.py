"""`init_training_groups` puts every rank where `ParallelConfig.rank_of` says, on two grids
whose axes are all > 1 somewhere (TP2·PP2 and DP2·TP2), in one 4-rank launch."""

from __future__ import annotations

import pytest

from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.parallel.config import ParallelConfig

GRIDS = {"tp2pp2": dict(tp=2, pp=2), "dp2tp2": dict(dp=2, tp=2)}
AXES = ("tp", "pp", "dp")


def _placement(rank, world):
    import torch.distributed as dist

    from mcore_rl.parallel.groups import Axis, destroy_training_groups, init_training_groups

    out = {}
    for name, kw in GRIDS.items():
        groups = init_training_groups(ParallelConfig(**kw))
        out[name] = {
            "coords": {axis: groups.rank_in(Axis(axis)) for axis in AXES},
            "members": {axis: dist.get_process_group_ranks(groups.group(Axis(axis)))
                        for axis in AXES},
            # megatron's ProcessGroupCollection holds the same groups.
            "megatron_tp": dist.get_process_group_ranks(groups.megatron.tp),
            "megatron_pp": dist.get_process_group_ranks(groups.megatron.pp),
            "megatron_dp": dist.get_process_group_ranks(groups.megatron.dp),
            "first_last": (groups.is_first_stage, groups.is_last_stage),
        }
        destroy_training_groups()
    return out


@pytest.fixture(scope="module")
def placed():
    return run_on_ranks(_placement, 4, timeout_s=180)


def _expected_members(parallel: ParallelConfig, coords: dict, axis: str) -> list[int]:
    size = getattr(parallel, axis)
    return sorted(parallel.rank_of(**{**coords, axis: i}) for i in range(size))


@pytest.mark.parametrize("grid", list(GRIDS))
def test_ranks_placed_as_rank_of_says(placed, grid):
    parallel = ParallelConfig(**GRIDS[grid])
    for rank, out in enumerate(placed):
        got = out[grid]
        assert got["coords"] == parallel.coords_of(rank)
        assert parallel.rank_of(**got["coords"]) == rank
        for axis in AXES:
            want = _expected_members(parallel, got["coords"], axis)
            assert sorted(got["members"][axis]) == want, (grid, rank, axis)
            assert sorted(got[f"megatron_{axis}"]) == want
        assert got["first_last"] == (got["coords"]["pp"] == 0,
                                     got["coords"]["pp"] == parallel.pp - 1)
