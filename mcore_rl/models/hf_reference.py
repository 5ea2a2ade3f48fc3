"""HF transformers as the reference implementation in tests and checks: load a local model
folder in fp32, greedy-generate, and score given sequences. One process, CPU, no batching
tricks (each sequence runs alone, so padding can never change a result)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch


def load_hf_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32):
    """`AutoModelForCausalLM` from a local folder, offline, in `dtype`, eval mode."""
    from transformers import AutoModelForCausalLM  # lazy: transformers

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                 dtype=dtype)
    return model.eval()


@torch.no_grad()
def greedy_generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    eos_token_id: int | None = None) -> list[list[int]]:
    """Greedy (argmax) continuation of each prompt's ids; returns the new ids only. Stops a
    sequence after it emits `eos_token_id` (the EOS is included); None = never stop early.
    Full forward per step (no KV cache): slow but obviously right."""
    outs = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        new: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            new.append(nxt)
            if nxt == eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        outs.append(new)
    return outs


@torch.no_grad()
def token_logprobs(model, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """For each sequence `s`, the fp32 log-probs `log p(s[t] | s[:t])` for t = 1..len(s)-1
    (a tensor of length len(s) - 1; the first token is given, not scored)."""
    out = []
    for seq in sequences:
        ids = torch.tensor([list(seq)], dtype=torch.long)
        logits = model(input_ids=ids).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


@torch.no_grad()
def top2_margin(model, prefix: Sequence[int]) -> float:
    """Gap between the two largest next-token logits after `prefix`: how safe an argmax
    comparison between two implementations is at that step."""
    logits = model(input_ids=torch.tensor([list(prefix)])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])
