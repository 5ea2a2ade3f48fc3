"""A megatron-core training step in bf16 against the fp32 CPU reference — on CUDA with the CPU
compat shims off (GPU check), and its CPU twin: the same run on the CPU (shims on).

Both load the same HF-named weights (tests/support/layout_run.py), run the same global batch
for 3 Adam steps at TP1, and must match the one-process fp32 model on CPU — computed by the
same code with CUDA hidden, on whatever machine runs the test — within bf16 rounding: logits,
per-step loss and grad norm, and every parameter after the steps. The layer spec is "local":
the GPU machine has no TransformerEngine (tests/models/test_gpu_layer_spec.py covers TE names).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_twins import device_params

from mcore_rl.layouts import assemble_hf, megatron_shards
from mcore_rl.parallel.config import ParallelConfig

from tests.support.layout_run import SPEC, from_numpy, hf_init, layout_results

# bf16 weights and activations against fp32: bf16 rounding (2^-8 relative), as the tp2_bf16
# row of test_parallel_layouts.py. The parameter tolerance is above one step's update (~1e-3),
# so the updates themselves are compared too: |Δ_bf16 − Δ_fp32| / |Δ_fp32| over all tensors
# (measured 0.07 on CPU, where the loss falls 5.69 → 4.09 over the 3 steps; a missing or
# wrong step gives ~1).
BF16 = dict(logits=0.1, loss=0.02, params=0.02, update=0.25)


def _as_hf(out: dict):
    return assemble_hf(megatron_shards(SPEC, ParallelConfig()), {0: from_numpy(out["params"])})


@pytest.mark.parametrize("device", device_params("tests/megatron/test_gpu_step.py::"
                                                 "test_bf16_step_matches_fp32_cpu_reference[cpu]"))
def test_bf16_step_matches_fp32_cpu_reference(device):
    reference = layout_results({}, "fp32", "cpu")[0]
    (run,) = layout_results({}, "bf16", device)
    assert reference["device"] == "cpu"
    assert run["device"] == ("cuda:0" if device == "cuda" else "cpu")
    assert run["keys"] and run["load_error"] == 0.0
    assert run["param_dtypes"] == ["torch.bfloat16"]

    for got, want in zip(run["logits"], reference["logits"], strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=BF16["logits"])
    np.testing.assert_allclose(run["loss"], reference["loss"], rtol=0, atol=BF16["loss"])
    np.testing.assert_allclose(run["grad_norm"], reference["grad_norm"], rtol=10 * BF16["loss"])
    assert run["loss"][-1] < run["loss"][0]  # it trains

    got, want = _as_hf(run), _as_hf(reference)
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst <= BF16["params"], f"max parameter difference after the steps: {worst:.3g}"
    init = hf_init(SPEC)  # the bf16 run starts from these rounded to bf16
    update = torch.cat([(want[k] - init[k]).flatten() for k in init])
    got_update = torch.cat([(got[k] - init[k].bfloat16().float()).flatten() for k in init])
    relative = float((got_update - update).norm() / update.norm())
    assert relative <= BF16["update"], f"bf16 update differs by {relative:.3g} (relative norm)"
