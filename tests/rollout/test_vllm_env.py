"""mcore_rl.rollout.vllm_env.compiler_off: an eager engine compiles nothing (vLLM's sampler
would compile its log-prob rank helper with inductor on the first generation)."""

from __future__ import annotations

import os

import torch

from mcore_rl.rollout.vllm_env import compiler_off


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


def test_compiled_functions_run_as_written_inside_and_compile_again_outside():
    x = torch.arange(4.0)
    inside = torch.compile(lambda t: t * 2 + 1, backend="eager")
    outside = torch.compile(lambda t: t * 3 - 1, backend="eager")
    before, env = _frames_compiled(), os.environ.get("TORCH_COMPILE_DISABLE")
    with compiler_off(True):
        assert os.environ["TORCH_COMPILE_DISABLE"] == "1"  # TP workers started here inherit it
        assert torch.equal(inside(x), x * 2 + 1)
    assert _frames_compiled() == before
    assert os.environ.get("TORCH_COMPILE_DISABLE") == env
    with compiler_off(False):  # enforce_eager false: the user asked for compilation
        assert torch.equal(outside(x), x * 3 - 1)
    assert _frames_compiled() > before
