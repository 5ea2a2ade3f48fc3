"""The planner against what megatron-core allocates on CPU (one spawned 2-rank launch).

Per rank: weights, grads, fp32 main params and Adam states must equal the tensor bytes megatron
allocated within 1 % (DDP buffer padding, Adam's step scalars); activations must equal the
peak of live saved-for-backward bytes during the real 1F1B / interleaved schedule within 10 %
(see mcore_rl.planning.measure for what is counted). `python -m mcore_rl.planning.measure`
prints the full table (TP, SP, PP, VPP, DP, distributed optimizer, bf16, recompute).
"""

from __future__ import annotations

import pytest

from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.planning.measure import measure_grids, predict_case

CASES = [
    # TP2 + SP, bf16 mixed precision (fp32 main params), selective recompute
    dict(spec_name="micro", parallel_kw=dict(tp=2, sequence_parallel=True), dtype="bf16",
         recompute="selective"),
    # interleaved 1F1B: PP2 · VPP2, 4 micro batches — per-stage params and in-flight chunks
    dict(spec_name="micro", parallel_kw=dict(pp=2, vpp=2), dtype="fp32"),
    # DP2 with the distributed optimizer (fp32 states / 2), bf16, full recompute
    dict(spec_name="micro", parallel_kw=dict(dp=2, use_distributed_optimizer=True),
         dtype="bf16", recompute="full"),
]
STATIC = ("params", "weights", "grads", "main params", "adam")


@pytest.fixture(scope="module")
def measured():
    return run_on_ranks(measure_grids, 2, CASES, timeout_s=240)


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=["tp2sp-bf16-selective", "pp2vpp2-fp32", "dp2distopt-bf16-full"])
def test_planner_matches_megatron_allocations(measured, index):
    case = CASES[index]
    for rank_results in measured:
        got = rank_results[index]
        want = predict_case(**case, coords=got["coords"])
        for key in STATIC:
            assert want[key] == pytest.approx(got[key], rel=0.01, abs=1), (key, got["coords"])
        assert got["main grads"] == want["main grads"] == 0
        assert want["activations"] == pytest.approx(got["activations"], rel=0.10), got["coords"]
        assert got["left_live"] == 0  # every saved tensor was released by the end of the step
