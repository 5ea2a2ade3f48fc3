"""Partial rollouts: one batch of GRPO groups generated in chunks, each chunk possibly on newer
weights than the last, every token recording the weight version that produced it.

A `PartialBatch` holds, per prompt, its `n` samples as they grow. `advance(...)` generates
the next chunk of every unfinished sample on the weights the engines hold now (`version`):

- chunk 0 is one call with `n` samples per prompt, exactly as a whole generation is
  (`SamplingConfig.seed`, so prompt i's sample j is seeded `seed + i*n + j`), capped at
  `max_tokens` new tokens;
- a later chunk c continues every unfinished sample from prompt + its tokens so far as a
  request of its own (n = 1): the q-th unfinished sample, in (prompt, sample) order, is seeded
  `seed + c * CHUNK_SEED_STRIDE + q`. The prefill of a continuation is a fresh forward on the
  current weights, so the token's log-prob is the current version's.

A sample is finished when a chunk ended it (EOS / stop id), when it holds the response cap
`sampling.max_tokens`, or when prompt + response fill `max_model_len`. Samples stay unfinished
only after a chunk that ran to its cap, so all unfinished samples of a batch have the same
length.

Continuations are sent in calls whose prefill fits the engines' token budget
(`max_num_batched_tokens` per engine): vLLM 0.32 on CPU fails a seeded request whose prefill is
split over engine steps ("CPU Generator does not use offset"). The seed offset of each call is
its first sample's position, so the seeds do not depend on how the calls are cut.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from mcore_rl.rollout.config import SamplingConfig
from mcore_rl.rollout.engine import Completion

# seeds of chunk c start this far above chunk c - 1's (a batch has far fewer samples)
CHUNK_SEED_STRIDE = 1 << 20

Generate = Callable[[list[list[int]], SamplingConfig], list[list[Completion]]]


@dataclass
class PartialSample:
    """One sample so far: its tokens, their raw log-probs and weight versions, and why it ended
    (None while unfinished)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def extend(self, completion: Completion, version: int) -> None:
        self.token_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.versions += [version] * len(completion.token_ids)
        self.finish_reason = completion.finish_reason  # "length" is re-checked by the batch

    def completion(self) -> Completion:
        return Completion(tuple(self.token_ids), tuple(self.logprobs),
                          self.finish_reason or "length", tuple(self.versions))


@dataclass
class PartialBatch:
    """A batch being generated in chunks: per prompt its token ids and its `sampling.n`
    samples. `chunks`: calls of `advance` so far (the next chunk's index). `gen_s`: seconds
    spent generating it."""

    prompt_ids: list[list[int]]
    sampling: SamplingConfig
    samples: list[list[PartialSample]]
    chunks: int = 0
    gen_s: float = 0.0

    @classmethod
    def start(cls, prompt_ids: Sequence[Sequence[int]], sampling: SamplingConfig) -> "PartialBatch":
        if sampling.seed is None:
            raise ValueError("partial rollouts need seeded sampling (sampling.seed) to be "
                             "reproducible")
        return cls([list(p) for p in prompt_ids], sampling,
                   [[PartialSample() for _ in range(sampling.n)] for _ in prompt_ids])

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for group in self.samples for s in group)

    def completions(self) -> list[list[Completion]]:
        return [[s.completion() for s in group] for group in self.samples]

    def versions(self) -> list[int]:
        """Every token's weight version (all samples)."""
        return [v for group in self.samples for s in group for v in s.versions]

    # --- checkpoints (plain values) ----------------------------------------------------------

    def to_state(self) -> dict:
        sp = self.sampling
        return {"prompt_ids": self.prompt_ids, "chunks": self.chunks, "gen_s": self.gen_s,
                "sampling": {"temperature": sp.temperature, "top_p": sp.top_p,
                             "top_k": sp.top_k, "max_tokens": sp.max_tokens,
                             "stop_token_ids": list(sp.stop_token_ids), "n": sp.n,
                             "seed": sp.seed, "logprobs": sp.logprobs},
                "samples": [[{"token_ids": s.token_ids, "logprobs": s.logprobs,
                              "versions": s.versions, "finish_reason": s.finish_reason}
                             for s in group] for group in self.samples]}

    @classmethod
    def from_state(cls, state: dict) -> "PartialBatch":
        sp = dict(state["sampling"], stop_token_ids=tuple(state["sampling"]["stop_token_ids"]))
        samples = [[PartialSample(list(s["token_ids"]), list(s["logprobs"]),
                                  list(s["versions"]), s["finish_reason"]) for s in group]
                   for group in state["samples"]]
        return cls(state["prompt_ids"], SamplingConfig(**sp), samples, int(state["chunks"]),
                   float(state["gen_s"]))


def advance(batch: PartialBatch, generate: Generate, *, version: int, max_tokens: int | None,
            max_model_len: int, token_budget: int, engines: int) -> None:
    """Generate the next chunk (at most `max_tokens` new tokens per sample; None: to the end)
    of every unfinished sample on the engines' current weights, `version`."""
    if batch.done:
        return
    start, cap = time.perf_counter(), batch.sampling.max_tokens
    if batch.chunks == 0:
        sampling = replace(batch.sampling, max_tokens=min(max_tokens or cap, cap))
        for group, outs in zip(batch.samples, generate(batch.prompt_ids, sampling)):
            for sample, completion in zip(group, outs):
                sample.extend(completion, version)
    else:
        _continue(batch, generate, version, max_tokens, token_budget, engines)
    batch.chunks += 1
    _mark_finished(batch, max_model_len)
    batch.gen_s += time.perf_counter() - start


def _continue(batch: PartialBatch, generate: Generate, version: int, max_tokens: int | None,
              token_budget: int, engines: int) -> None:
    running = [(prompt, s) for prompt, group in zip(batch.prompt_ids, batch.samples)
               for s in group if s.finish_reason is None]
    lengths = {len(s.token_ids) for _, s in running}
    if len(lengths) != 1:  # see the module doc: only full chunks leave samples unfinished
        raise RuntimeError(f"unfinished samples of different lengths {sorted(lengths)}")
    room = batch.sampling.max_tokens - lengths.pop()
    longest = max(len(p) + len(s.token_ids) for p, s in running)
    # RayEngines.generate splits a call evenly over the engines: each share must fit
    per_call = engines * max(1, token_budget // longest)
    base = batch.sampling.seed + batch.chunks * CHUNK_SEED_STRIDE
    for first in range(0, len(running), per_call):
        part = running[first:first + per_call]
        sampling = replace(batch.sampling, n=1, seed=base + first,
                           max_tokens=min(max_tokens or room, room))
        outs = generate([prompt + s.token_ids for prompt, s in part], sampling)
        for (_, sample), (completion,) in zip(part, outs):
            sample.extend(completion, version)


def _mark_finished(batch: PartialBatch, max_model_len: int) -> None:
    """Which samples are done after a chunk (see the module doc)."""
    cap = batch.sampling.max_tokens
    for prompt, group in zip(batch.prompt_ids, batch.samples):
        for s in group:
            reason = s.finish_reason
            if reason in (None, "length"):
                full = len(s.token_ids) >= cap or len(prompt) + len(s.token_ids) >= max_model_len
                s.finish_reason = "length" if full else None
            # "stop" / "abort" end the sample as they are


__all__ = ["CHUNK_SEED_STRIDE", "PartialBatch", "PartialSample", "advance"]
