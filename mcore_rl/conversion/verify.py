"""`--verify`: logits of the HF folder (transformers) against the dist checkpoint (Megatron at a
chosen TP/PP/VPP, its own loader) on a few prompts.

Both sides compute in fp32 whatever the stored dtype (bf16/fp16 → fp32 is exact), so the
difference measures the conversion, not 16-bit rounding: fp32 differences between two
correct implementations are ~1e-5. When the conversion changed the dtype (`--dtype`),
`weights_dtype` rounds both sides' weights to it first, so both hold the same values.
Verification loads each model whole (HF in this process, Megatron split over `tp*pp` spawned
ranks): it is a check, not part of the streaming path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.megatron.dist_checkpoint import load_dist_checkpoint
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.groups import Axis, destroy_training_groups, init_training_groups


@dataclass(frozen=True)
class VerifyReport:
    max_abs_diff: float
    max_abs_logit: float
    prompts: int
    seq_len: int
    grid: str

    def summary(self) -> str:
        return (f"verify: max |logit diff| = {self.max_abs_diff:.3e} over {self.prompts} prompts "
                f"x {self.seq_len} tokens (HF transformers vs Megatron {self.grid}; "
                f"max |logit| {self.max_abs_logit:.2f})")


def prompt_tokens(spec: ModelSpec, prompts: int = 3, seq_len: int = 16,
                  seed: int = 0) -> torch.Tensor:
    return torch.randint(0, spec.vocab, (prompts, seq_len),
                         generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def round_weights(modules, dtype: torch.dtype | None) -> None:
    """Round fp32 parameters to `dtype` values (kept in fp32); None: leave them."""
    if dtype is None:
        return
    for module in modules:
        for param in module.parameters():
            param.copy_(param.to(dtype).float())


@torch.no_grad()
def hf_logits(hf_dir: str | Path, tokens: torch.Tensor,
              weights_dtype: torch.dtype | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM  # lazy: transformers

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                 local_files_only=True)
    model.eval()
    round_weights([model], weights_dtype)
    return model(input_ids=tokens).logits.float()


def megatron_logits(spec: ModelSpec, parallel: ParallelConfig, ckpt_dir: str | Path,
                    tokens: torch.Tensor, *, weights_dtype: torch.dtype | None = None,
                    timeout_s: float = 600.0) -> torch.Tensor:
    """Logits [prompts, seq, vocab] of the checkpoint loaded into Megatron on `parallel`."""
    results = run_on_ranks(_megatron_logits_rank, parallel.world_size, spec, parallel,
                           str(ckpt_dir), tokens, weights_dtype, timeout_s=timeout_s)
    return next(r for r in results if r is not None)


def _megatron_logits_rank(rank: int, world: int, spec: ModelSpec, parallel: ParallelConfig,
                          ckpt_dir: str, tokens: torch.Tensor, weights_dtype=None):
    from mcore_rl.megatron.train import MicroBatch, forward_logits  # lazy: megatron
    from mcore_rl.models.gpt import build_gpt_model  # lazy: megatron

    groups = init_training_groups(parallel)
    try:
        chunks = build_gpt_model(spec, parallel, groups, params_dtype=torch.float32)
        load_dist_checkpoint(chunks, ckpt_dir)
        round_weights(chunks, weights_dtype)
        for chunk in chunks:
            chunk.eval()
        # One micro batch of all prompts; interleaved 1F1B wants a multiple of pp of them, so
        # with VPP the same batch runs pp times.
        zeros = torch.zeros_like(tokens)
        batches = [MicroBatch(tokens, zeros, zeros.float())] * (parallel.pp if parallel.vpp else 1)
        out = forward_logits(chunks, batches, vocab=spec.vocab, groups=groups)
        if out is None or groups.rank_in(Axis.TP) != 0 or groups.rank_in(Axis.DP) != 0:
            return None
        return out[0]
    finally:
        destroy_training_groups()


def verify_conversion(hf_dir: str | Path, ckpt_dir: str | Path, spec: ModelSpec,
                      parallel: ParallelConfig, *, weights_dtype: torch.dtype | None = None,
                      prompts: int = 3, seq_len: int = 16,
                      timeout_s: float = 600.0) -> VerifyReport:
    tokens = prompt_tokens(spec, prompts, seq_len)
    ref = hf_logits(hf_dir, tokens, weights_dtype)
    got = megatron_logits(spec, parallel, ckpt_dir, tokens, weights_dtype=weights_dtype,
                          timeout_s=timeout_s)
    grid = f"TP{parallel.tp}·PP{parallel.pp}" + (f"·VPP{parallel.vpp}" if parallel.vpp else "") \
        + (f"·DP{parallel.dp}·EP{parallel.ep}·ETP{parallel.expert_tp}" if spec.is_moe else "")
    return VerifyReport(float((ref - got).abs().max()), float(ref.abs().max()), prompts,
                        seq_len, grid)
