"""A step's batch as the actor sees it, built from the engines' rollouts.

`Rollouts` is one step's generated groups (plain values, so a batch generated ahead can be
saved with a checkpoint); `build_batch` turns prompts + responses into the [n, s] tokens,
labels and response mask the actor trains on; `engine_logprobs` aligns the engine's sampled
log-probs with that mask (π_rollout of the rollout correction); `mini_batches` cuts a batch
for the updates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.rollout.engine import Completion
from mcore_rl.rollout.multi_turn import completion_from_state, completion_state, loss_masks
from mcore_rl.rollout.routing import batch_rows
from mcore_rl.tasks.base import Example


@dataclass
class Rollouts:
    """One step's generated groups: per prompt its example, its token ids, its samples and
    their rewards; `stats` are the sampling statistics (dynamic sampling). Plain values, so
    an off-policy batch in flight can be saved with a checkpoint (`to_state` /
    `from_state`)."""

    step: int
    examples: list[Example]
    prompt_ids: list[list[int]]
    completions: list[list[Completion]]
    scores: list[list[float]]
    stats: dict[str, float]

    def to_state(self) -> dict:
        examples = [e.to_state() for e in self.examples]
        return {"step": self.step, "prompts": [e["prompt"] for e in examples],
                "answers": [e["answer"] for e in examples],
                "sources": [e["source"] for e in examples], "scores": self.scores,
                "prompt_ids": self.prompt_ids,
                "stats": self.stats,
                "completions": [[completion_state(c) for c in group]
                                for group in self.completions]}

    @classmethod
    def from_state(cls, state: dict) -> "Rollouts":
        completions = [[completion_from_state(c) for c in group]
                       for group in state["completions"]]
        sources = state.get("sources", [None] * len(state["prompts"]))  # saved before them
        examples = [Example.from_state({"prompt": p, "answer": a, "source": s})
                    for p, a, s in zip(state["prompts"], state["answers"], sources)]
        return cls(step=state["step"], examples=examples, prompt_ids=state["prompt_ids"],
                   completions=completions,
                   scores=state["scores"], stats=state["stats"])


@dataclass
class Batch:
    """Sequences [n, s] as the actor sees them: tokens (inputs), labels (next tokens), and the
    response mask aligned with labels; routing (`algorithm.routing_replay: rollout`): the
    experts the engines routed each token to, [n, s, layers, k] (-1 where none, see
    rollout/routing.py)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    routing: torch.Tensor | None = None


def build_batch(prompts: list[list[int]], responses: list[list[int]], length: int,
                pad_id: int, response_masks: list[list[int]] | None = None,
                routing: list[torch.Tensor | None] | None = None) -> Batch:
    """Concatenate prompt + response ids, pad to `length` + 1 tokens, shift into
    (tokens, labels); the mask marks the labels that are response tokens — of those, with
    `response_masks` (one per response, per token: multi-turn episodes), only the ones it
    marks 1 (model tokens; observation tokens stay 0). routing: per sample the experts of its
    positions (`Completion.routing`), aligned with the tokens. A sequence longer than a row is
    never cut: ValueError naming the row and its lengths (the config's lengths are derived so
    that none is, `RLConfig.sample_tokens`)."""
    rows, masks = [], []
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        seq = list(prompt) + list(response)
        if len(seq) > length + 1:
            raise ValueError(f"row {i}: prompt {len(prompt)} + response {len(response)} = "
                             f"{len(seq)} tokens do not fit a row of train.seq_len + 1 = "
                             f"{length + 1}; raise train.seq_len (or set it null: derived "
                             "from max_prompt_tokens + max_new_tokens)")
        pad = length + 1 - len(seq)
        rows.append(seq + [pad_id] * pad)
        kept = [1] * len(response) if response_masks is None else list(response_masks[i])
        mask = [0] * (len(prompt) - 1) + kept[:len(seq) - len(prompt)] + [0] * pad
        masks.append(mask[:length])
    full = torch.tensor(rows, dtype=torch.long)
    return Batch(full[:, :-1].contiguous(), full[:, 1:].contiguous(),
                 torch.tensor(masks, dtype=torch.float32),
                 None if routing is None else batch_rows(routing, length))


def trained_tokens(completions: list[Completion], mask: torch.Tensor) -> dict[str, float]:
    """What a step trains on: `response_tokens`, the tokens the model sampled (a multi-turn
    episode's model tokens, not its observations), and `loss_tokens`, the tokens in the
    policy loss mask (`build_batch`'s). They are equal, since no row is cut; a batch whose
    loss mask is empty while responses exist is an error, not a zero-gradient step."""
    masks = loss_masks(completions)
    response = (sum(len(c.token_ids) for c in completions) if masks is None
                else sum(sum(m) for m in masks))
    loss = int(mask.ne(0).sum())
    if response and not loss:
        raise ValueError(f"the step's {len(completions)} responses hold {response} sampled "
                         "tokens but its loss mask none: the policy would train on nothing "
                         f"(rows of {mask.shape[-1]} tokens, train.seq_len)")
    return {"response_tokens": float(response), "loss_tokens": float(loss)}


def engine_logprobs(completions: list[Completion], mask: torch.Tensor) -> torch.Tensor:
    """The engine's log-prob of each sampled token, [n, s] aligned with `build_batch`'s
    response mask (0 elsewhere): π_rollout of the rollout correction and of `bypass`."""
    counts = mask.ne(0).sum(-1).tolist()
    for row, (completion, count) in enumerate(zip(completions, counts)):
        if len(completion.logprobs) < count:
            raise ValueError(f"sample {row}: the engine returned {len(completion.logprobs)} "
                             f"log-probs for {count} response tokens")
    out = torch.zeros_like(mask, dtype=torch.float32)
    keep, flat = _first_logprobs(completions, mask, counts)
    out[keep] = flat
    return out


def _first_logprobs(completions, mask: torch.Tensor, counts: list[int]):
    """(positions [n, s] bool, values [k] float32): each row's first min(response tokens,
    engine log-probs) response positions, and the engine's log-probs there in row-major
    order — one tensor for the whole batch, not one per row."""
    takes = [min(count, len(c.logprobs)) for c, count in zip(completions, counts)]
    response = mask.ne(0)
    keep = response & (response.cumsum(-1) <= torch.tensor(takes).unsqueeze(-1))
    flat = torch.tensor([lp for c, take in zip(completions, takes) for lp in c.logprobs[:take]],
                        dtype=torch.float32)
    return keep, flat


def mini_batches(batch: dict[str, torch.Tensor], count: int):
    """`count` equal, contiguous mini-batches of the rows."""
    n = next(iter(batch.values())).shape[0] // count
    for k in range(count):
        yield {key: value[k * n:(k + 1) * n] for key, value in batch.items()}


def dp_slice(batch: dict[str, torch.Tensor], dp: int, dp_rank: int,
             count: int = 1) -> dict[str, torch.Tensor]:
    """The rows data-parallel rank `dp_rank` of `dp` works on: its contiguous 1/dp of each of
    the `count` mini-batches (`mini_batches`), in order, so that `mini_batches(slice, count)`
    on the rank yields its share of each. Only this goes to the ranks of that DP slice: each
    rank needs its rows, not the batch. With dp > 1, tensors of their own, not views (a
    serialized view carries its whole storage); with dp 1 and whole mini-batches, the batch's
    own tensors."""
    n = next(iter(batch.values())).shape[0]
    rows = n // count
    if rows % dp:
        raise ValueError(f"a mini-batch of {rows} sequences does not split over dp={dp}")
    if dp == 1 and rows * count == n:
        return dict(batch)
    per = rows // dp
    starts = [k * rows + dp_rank * per for k in range(count)]
    return {key: torch.cat([value[start:start + per] for start in starts])
            for key, value in batch.items()}


def rollout_logprob_diff(completions, actor_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Max |vLLM log-prob − actor log-prob| over all sampled response tokens (a row with
    fewer engine log-probs than response tokens is compared on its first ones)."""
    keep, flat = _first_logprobs(completions, mask, mask.ne(0).sum(-1).tolist())
    if not len(flat):
        return 0.0
    return float((flat - actor_logp[keep]).abs().max())


__all__ = ["Batch", "Rollouts", "build_batch", "dp_slice", "engine_logprobs", "mini_batches",
           "rollout_logprob_diff", "trained_tokens"]
