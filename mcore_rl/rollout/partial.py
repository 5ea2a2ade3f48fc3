"""Partial rollouts: one batch of GRPO groups generated in chunks, each chunk possibly on newer
weights than the last, every token recording the weight version that produced it.

A `PartialBatch` holds, per prompt, its `n` samples as they grow. `advance(...)` generates
the next chunk of every unfinished sample on the weights the engines hold now (`version`):

- chunk 0 is one call with `n` samples per prompt, exactly as a whole generation is
  (`SamplingConfig.seed`: prompt i's sample j is seeded `sample_seed(seed, i, j)`), capped at
  `max_tokens` new tokens;
- a later chunk c continues every unfinished sample from prompt + its tokens so far as a
  request of its own (n = 1): the q-th unfinished sample, in (prompt, sample) order, is
  sample 0 of prompt q in a call seeded `sampling.keyed("chunk", c)`. The prefill of a
  continuation is a fresh forward on the current weights, so the token's log-prob is the
  current version's.

With engines that return routed experts, a continuation asks only for the positions the sample
does not hold yet: each position keeps the routing of the version that forwarded it
(rollout/routing.py).

A sample is finished when a chunk ended it (EOS / stop id), when it holds the response cap
`sampling.max_tokens`, or when prompt + response fill `max_model_len`. Samples stay unfinished
only after a chunk that ran to its cap, so all unfinished samples of a batch have the same
length.

Continuations are sent in calls whose prefill fits the engines' token budget
(`max_num_batched_tokens` per engine): vLLM 0.32 on CPU fails a seeded request whose prefill is
split over engine steps ("CPU Generator does not use offset"). Each call's `first_prompt` is
its first sample's position, so the seeds do not depend on how the calls are cut.

## The pipeline

Partial rollouts (`rollout.partial_chunk_tokens: N` with mode one_step / async): the rollout
pipeline's schedule with generations that span weight syncs.

Versions as in `rollout.pipeline`: at step n the engines hold version n - 1, and batch m
is started at step max(1, m - k) (k = `rollout.staleness_bound`). Deterministic schedule —
step and version counts only, never wall-clock races:
- at step n, batch n is finished on version n - 1: every unfinished sample continues from its
  prefix to the end in one call (the weights do not change before the step trains on it);
  then every batch ahead (n + 1 .. n + k) gets ONE chunk of at most N new tokens per
  unfinished sample on version n - 1, on the pipeline's thread beside the actor's work;
- before the weight sync the pipeline waits for those chunks only (`quiesce`), never for whole
  generations; after it, the unfinished samples continue on the new weights at the next step.
So batch m's tokens come from versions max(0, m-1-k) .. m-1, each token records its version
(`Completion.versions`) and the engine's raw log-prob under it (`Completion.logprobs`, what
the rollout correction's π_rollout is), and a sample is never staler than k.

Staleness is per token: `staleness/max` is the oldest token's (trainer version - its version,
max over the batch), `staleness/mean` the mean over all generated tokens. A batch whose oldest
token is more than k versions old (only possible when a buffer saved with a larger k is resumed
with a smaller one) is dropped whole, counted in `staleness/dropped`, and regenerated.

The checkpoint after step n carries the unfinished batches n + 1 .. n + k (tokens, log-probs,
versions, chunk counts), so a resumed run continues them exactly as the uninterrupted run does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import torch

from mcore_rl.launch.timing import PhaseTimer
from mcore_rl.rollout.config import SamplingConfig
from mcore_rl.rollout.engine import Completion
from mcore_rl.rollout.routing import joined_routing, routing_start

Generate = Callable[[list[list[int]], SamplingConfig], list[list[Completion]]]


@dataclass
class PartialSample:
    """One sample so far: its tokens, their raw log-probs and weight versions, why it ended
    (None while unfinished), and the experts its positions were routed to (engines that
    return them: each position's from the chunk that forwarded it, `Completion.routing`)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    routing: torch.Tensor | None = None

    def extend(self, completion: Completion, version: int) -> None:
        self.token_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.versions += [version] * len(completion.token_ids)
        self.finish_reason = completion.finish_reason  # "length" is re-checked by the batch
        self.routing = joined_routing(self.routing, completion.routing)

    def completion(self) -> Completion:
        return Completion(tuple(self.token_ids), tuple(self.logprobs),
                          self.finish_reason or "length", tuple(self.versions),
                          routing=self.routing)


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
                              "versions": s.versions, "finish_reason": s.finish_reason,
                              "routing": s.routing}
                             for s in group] for group in self.samples]}

    @classmethod
    def from_state(cls, state: dict) -> "PartialBatch":
        sp = dict(state["sampling"], stop_token_ids=tuple(state["sampling"]["stop_token_ids"]))
        samples = [[PartialSample(list(s["token_ids"]), list(s["logprobs"]),
                                  list(s["versions"]), s["finish_reason"], s.get("routing"))
                    for s in group]
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
    chunk_sampling = batch.sampling.keyed("chunk", batch.chunks)
    for first in range(0, len(running), per_call):
        part = running[first:first + per_call]
        sampling = replace(chunk_sampling, n=1, first_prompt=first,
                           max_tokens=min(max_tokens or room, room))
        outs = generate([prompt + s.token_ids for prompt, s in part], sampling,
                        **routing_start([s.routing for _, s in part]))
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


# (the step's batch, generation timings) as the controller's rl_step takes them
Taken = tuple[Any, dict[str, float]]


@dataclass
class _InFlight:
    """A batch ahead: its examples (whatever `start` returned), its generation so far, and
    the version it was started on (its oldest token's)."""

    examples: Any
    batch: PartialBatch
    version: int


class PartialRolloutPipeline:
    """The batches ahead, generated chunk by chunk across weight syncs.

    start(step): (examples, PartialBatch) of that step's prompts (no generation).
    advance(batch, version, max_tokens): generate the next chunk (None: to the end) on the
        engines' current weights, `version`.
    finish(step, examples, batch, timer): score the finished batch; returns the step's
        batch for training (phase reward on `timer`).
    chunk_tokens: N. max_staleness: k. last_step: no batch after it is started.
    wait(future): the future's result under the caller's deadline.
    examples_to_state / examples_from_state: a batch's examples as plain values and back
        (checkpoints)."""

    def __init__(self, *, start: Callable[[int], tuple[Any, PartialBatch]],
                 advance: Callable[[PartialBatch, int, int | None], None],
                 finish: Callable[[int, Any, PartialBatch, PhaseTimer], Any],
                 chunk_tokens: int, max_staleness: int, last_step: int,
                 wait: Callable[[concurrent.futures.Future], Any],
                 examples_to_state: Callable[[Any], Any] = lambda e: e,
                 examples_from_state: Callable[[Any], Any] = lambda e: e):
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens}: must be >= 1")
        self.start, self.advance, self.finish = start, advance, finish
        self.chunk_tokens, self.k, self.last_step, self._wait = (chunk_tokens, max_staleness,
                                                                 last_step, wait)
        self._examples_to_state, self._examples_from_state = (examples_to_state,
                                                              examples_from_state)
        self.batches: dict[int, _InFlight] = {}
        self.next_step = 1  # the first step whose batch has not been started
        self._chunks: list[concurrent.futures.Future] = []  # chunks running beside training
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        if self._executor is None:  # one thread: calls reach the engines in submission order
            self._executor = concurrent.futures.ThreadPoolExecutor(1, "mcore-rl-gen")
        return self._executor.submit(fn, *args)

    def _chunk(self, flight: _InFlight, version: int) -> tuple[float, float]:
        start = time.perf_counter()
        self.advance(flight.batch, version, self.chunk_tokens)
        return start, time.perf_counter()

    def _complete(self, step: int, flight: _InFlight, version: int) -> Taken:
        self.advance(flight.batch, version, None)
        timer = PhaseTimer()
        rollouts = self.finish(step, flight.examples, flight.batch, timer)
        timing = {k: v for k, v in timer.as_metrics().items() if k != "timing_s/step"}
        return rollouts, {**timing, "timing_s/gen": flight.batch.gen_s}

    def take(self, step: int, timer: PhaseTimer) -> Taken:
        """The batch step `step` trains on (the engines hold version step - 1), finished now,
        and its metrics (generation timings, `timing_s/gen_wait`, staleness/{mean,max,dropped});
        then one chunk of every batch ahead starts on this version."""
        version = step - 1
        self.next_step = max(self.next_step, step)
        while self.next_step <= min(step + self.k, self.last_step):
            self.batches[self.next_step] = _InFlight(*self.start(self.next_step), version)
            self.next_step += 1
        dropped = 0
        flight = self.batches.pop(step, None)
        if flight is not None and version - flight.version > self.k:
            dropped, flight = 1, None
        if flight is None:  # dropped, or its buffer was not saved: generate it now
            flight = _InFlight(*self.start(step), version)
        done = self._submit(self._complete, step, flight, version)
        self._chunks = [self._submit(self._chunk, ahead, version)
                        for _, ahead in sorted(self.batches.items())]
        with timer("gen_wait"):
            rollouts, timing = self._wait(done)
        if getattr(rollouts, "step", step) != step:
            raise RuntimeError(f"batch of step {rollouts.step} offered to step {step}")
        return rollouts, {**timing, **staleness_metrics(flight.batch.versions(), version),
                          "staleness/dropped": float(dropped)}

    def quiesce(self, timer: PhaseTimer | None = None,
                train_window: tuple[float, float] | None = None) -> dict[str, float]:
        """Wait for the chunks in flight (before the weights change; the generations they
        belong to go on after the sync). Returns `gen_overlap_s`, the seconds of generation
        that ran while the step trained (absent when no chunk ran)."""
        if not self._chunks:
            return {}
        chunks, self._chunks = self._chunks, []
        if timer is not None and not all(f.done() for f in chunks):
            with timer("gen_wait"):
                windows = [self._wait(f) for f in chunks]
        else:
            windows = [self._wait(f) for f in chunks]
        if train_window is None:
            return {}
        overlap = sum(max(min(end, train_window[1]) - max(start, train_window[0]), 0.0)
                      for start, end in windows)
        return {"gen_overlap_s": overlap}

    @contextlib.contextmanager
    def weights_changing(self) -> Iterator[None]:
        """Around a weight sync: the chunks in flight are waited for first."""
        self.quiesce()
        yield

    # --- checkpoints --------------------------------------------------------------------------

    def state(self) -> dict:
        """The unfinished batches ahead (plain values: `torch.load(weights_only=True)` reads
        them back)."""
        self.quiesce()
        return {"partial": [{"step": step, "version": f.version,
                             "examples": self._examples_to_state(f.examples),
                             "batch": f.batch.to_state()}
                            for step, f in sorted(self.batches.items())],
                "next_step": self.next_step}

    def load_state(self, state: dict, from_state: Callable[[dict], Any] | None = None) -> None:
        """Restore `state()`'s batches. from_state: unused (the whole-batch pipeline's
        argument; no finished batch is ever saved here)."""
        if "partial" not in state:
            raise ValueError("the checkpoint's rollout buffer holds whole batches (saved "
                             "without rollout.partial_chunk_tokens); resume with the same "
                             "rollout settings")
        self.batches = {int(saved["step"]): _InFlight(self._examples_from_state(saved["examples"]),
                                                      PartialBatch.from_state(saved["batch"]),
                                                      int(saved["version"]))
                        for saved in state["partial"]}
        self.next_step = int(state["next_step"])

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def staleness_metrics(versions: list[int], version: int) -> dict[str, float]:
    """Per-token staleness of a batch trained at `version`: max (the oldest token's) and mean
    over the generated tokens."""
    if not versions:
        return {"staleness/mean": 0.0, "staleness/max": 0.0}
    ages = [version - v for v in versions]
    return {"staleness/mean": sum(ages) / len(ages), "staleness/max": float(max(ages))}


def current_version_logprob_diff(completions, actor_logp: torch.Tensor, mask: torch.Tensor,
                                 version: int) -> dict[str, float]:
    """Max |engine log-prob − actor log-prob| over the tokens the engines produced on the
    actor's own weights (`version`): ~0 shows each token's recorded log-prob is its
    version's even when the sample also holds older tokens. Empty without partial rollouts
    or without such tokens."""
    worst, seen = 0.0, False
    for row, c in enumerate(completions):
        if not c.versions:
            continue
        positions = mask[row].nonzero().flatten()
        for t, (v, lp) in enumerate(zip(c.versions, c.logprobs)):
            if v == version and t < len(positions):
                seen = True
                worst = max(worst, abs(lp - float(actor_logp[row, positions[t]])))
    return {"partial/current_version_logprob_max_diff": worst} if seen else {}


__all__ = ["PartialBatch", "PartialRolloutPipeline", "PartialSample",
           "advance", "current_version_logprob_diff", "staleness_metrics"]
