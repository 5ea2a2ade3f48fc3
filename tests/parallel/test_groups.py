"""`init_training_groups` puts every rank where `ParallelConfig.rank_of` says, on the two
4-rank grids of the layout table (TP2·PP2 and DP2·TP2): each rank's TP / PP / DP group holds
exactly the ranks that differ from it only along that axis, in our groups and in megatron's
ProcessGroupCollection. Reads the layout table's launches (tests/support/layout_run.py)."""

from __future__ import annotations

import pytest

from mcore_rl.parallel.config import ParallelConfig
from tests.support.layout_run import layout_results

GRIDS = {"tp2pp2": dict(tp=2, pp=2),
         "dp2tp2": dict(dp=2, tp=2, use_distributed_optimizer=True)}


def _expected_members(parallel: ParallelConfig, coords: dict, axis: str) -> list[int]:
    return sorted(parallel.rank_of(**{**coords, axis: i}) for i in range(getattr(parallel, axis)))


@pytest.mark.parametrize("grid", list(GRIDS))
def test_ranks_placed_as_rank_of_says(grid):
    parallel = ParallelConfig(**GRIDS[grid])
    ranks = layout_results(GRIDS[grid])
    assert len(ranks) == 4
    for rank, out in enumerate(ranks):
        coords = {k: int(v) for k, v in out["coords"].items()}
        assert coords == parallel.coords_of(rank)
        assert parallel.rank_of(**coords) == rank
        for axis in ("tp", "pp", "dp"):
            want = _expected_members(parallel, coords, axis)
            assert sorted(out["group_members"][axis]) == want, (grid, rank, axis)
            assert sorted(out["group_members"][f"megatron_{axis}"]) == want, (grid, rank, axis)
