"""Multi-turn rollouts: the engines generate turn by turn for the whole batch, environments
answer between turns (`mcore_rl.tasks.envs`), and every token carries a loss mask.

Per turn, every episode still running gets one sampled turn, all in ONE batched call of
`generate` (the controller's `RayEngines.generate` under its deadline); episodes that finish
drop out of the next call. A turn's tokens are the model's (mask 1, the engine's log-prob
kept); the environment's observation is tokenized and appended (mask 0, never generated, never
trained on). Generation stops at EOS and at the tool format's call-closing token, and a turn
that ran past a multi-token closing tag is cut after it.

An episode ends when its environment says done, after `EpisodeConfig.max_turns` model turns,
or when `EpisodeConfig.max_total_tokens` (prompt + continuation) is reached: each call's
`max_tokens` is the per-turn cap cut to the most any running episode has left, a turn is cut to
its own episode's room, and an observation that leaves no room for a model token ends it.

Each episode is an `Episode`, a `Completion` whose `token_ids` are the whole continuation
(model and observation tokens) and whose `logprobs` are the engine's log-probs of the model
tokens only, in order — so code that pairs a completion's log-probs with the positions of its
loss mask (the controller's `rollout_logprob_max_diff`) works unchanged.

Routed experts (engines that return them, `algorithm.routing_replay: rollout`): each turn's
call asks only for the positions the episode does not hold yet and the rows are joined; a cut
turn keeps the rows of its remaining tokens (rollout/routing.py).

Seeds: turn t of the batch is a call seeded `sampling.keyed("turn", t)`, in which each active
episode's seed follows its index in the call (rollout/config.py): reproducible for a given batch,
and no two turns share a seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from mcore_rl.rollout.config import SamplingConfig
from mcore_rl.rollout.engine import Completion
from mcore_rl.rollout.routing import cut_routing, joined_routing, routing_start
from mcore_rl.tasks.base import Example
from mcore_rl.tasks.envs.base import Environment, EpisodeConfig, load_env_factory
from mcore_rl.tasks.envs.tool_format import TagFormat, tool_format
from mcore_rl.tasks.tokenizer import response_text

Generate = Callable[[list[list[int]], SamplingConfig], list[list[Completion]]]


@dataclass(frozen=True)
class Episode(Completion):
    """One multi-turn episode (see the module doc for `token_ids` and `logprobs`).

    finish_reason: "done" (the environment ended it), "max_turns" or "max_total_tokens".
    loss_mask: per token of `token_ids`, 1 for model tokens, 0 for observation tokens.
    prompt_ids: the first observation's ids. reward: the sum of the environment's rewards.
    turns: model turns. tool_calls / tool_errors: calls made, and those that became errors.
    """

    loss_mask: tuple[int, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def observed_tokens(self) -> int:
        return len(self.loss_mask) - sum(self.loss_mask)

    def token_logprobs(self) -> list[float]:
        """Per token of `token_ids`: the engine's log-prob (0.0 on observation tokens)."""
        model = iter(self.logprobs)
        return [next(model) if m else 0.0 for m in self.loss_mask]


@dataclass
class _Running:
    """An episode being rolled out (mutable; frozen into an Episode at the end)."""

    env: Environment
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish: str | None = None
    routing: torch.Tensor | None = None  # experts of prompt + ids (rollout/routing.py)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.ids)

    def frozen(self) -> Episode:
        return Episode(tuple(self.ids), tuple(self.logprobs), self.finish or "max_turns",
                       loss_mask=tuple(self.mask), prompt_ids=tuple(self.prompt),
                       reward=self.reward, turns=self.turns, tool_calls=self.tool_calls,
                       tool_errors=self.tool_errors, routing=self.routing)


class MultiTurnRollout:
    """Runs episodes of one task: its environment factory and reward, the episode bounds, the
    tool format (its stop token and call cut; given to each environment), and the tokenizer
    (observations, turn text)."""

    def __init__(self, env_factory, reward_fn, episode: EpisodeConfig, tokenizer, *,
                 fmt=TagFormat()):
        self.env_factory, self.reward_fn, self.episode = env_factory, reward_fn, episode
        self.tokenizer, self.fmt = tokenizer, fmt
        self.stop_ids = tuple(fmt.stop_token_ids(tokenizer))

    def rollout(self, generate: Generate, examples: Sequence[Example],
                encode: Callable[[str], list[int]],
                sampling: SamplingConfig) -> tuple[list[list[int]], list[list[Episode]]]:
        """`sampling.n` episodes per example. Returns each example's prompt ids (its
        environment's first observation, encoded by `encode`) and its episodes, in order."""
        runs = []
        for example in examples:
            for _ in range(sampling.n):
                env = self.env_factory(example, self.reward_fn, self.fmt)
                runs.append(_Running(env, list(encode(env.reset()))))
        self._run(generate, runs, sampling)
        episodes = [r.frozen() for r in runs]
        n = sampling.n
        groups = [episodes[i * n:(i + 1) * n] for i in range(len(examples))]
        return [list(g[0].prompt_ids) for g in groups], groups

    def _run(self, generate: Generate, runs: list[_Running], sampling: SamplingConfig) -> None:
        budget = self.episode.max_total_tokens
        for r in runs:
            if r.length >= budget:
                r.finish = "max_total_tokens"
        stops = tuple(dict.fromkeys((*sampling.stop_token_ids, *self.stop_ids,
                                     self.tokenizer.eos_token_id)))
        for turn in range(self.episode.max_turns):
            active = [r for r in runs if r.finish is None]
            if not active:
                return
            room = max(budget - r.length for r in active)
            turn_sampling = replace(sampling.keyed("turn", turn), n=1,
                                    max_tokens=min(sampling.max_tokens, room),
                                    stop_token_ids=stops)
            outs = generate([r.prompt + r.ids for r in active], turn_sampling,
                            **routing_start([r.routing for r in active]))
            for r, out in zip(active, outs):
                self._advance(r, out[0])

    def _advance(self, r: _Running, completion: Completion) -> None:
        """Append one model turn, let the environment answer, append its observation."""
        ids, logprobs = list(completion.token_ids), list(completion.logprobs)
        keep = min(self.fmt.cut_after_call(ids, self.tokenizer),
                   self.episode.max_total_tokens - r.length)
        ids, logprobs = ids[:keep], logprobs[:keep]
        r.ids += ids
        r.mask += [1] * len(ids)
        r.logprobs += logprobs
        r.routing = cut_routing(joined_routing(r.routing, completion.routing), r.length)
        r.turns += 1
        step = r.env.step(response_text(ids, self.tokenizer))
        r.reward += float(step.reward)
        r.tool_calls += step.tool_calls
        r.tool_errors += step.tool_errors
        if step.done:
            r.finish = "done"
            return
        if r.turns >= self.episode.max_turns:
            r.finish = "max_turns"
            return
        obs = self._token_ids(step.observation)
        if r.length + len(obs) + 1 > self.episode.max_total_tokens:
            r.finish = "max_total_tokens"
            return
        r.ids += obs
        r.mask += [0] * len(obs)

    def _token_ids(self, observation: str | list[int] | None) -> list[int]:
        """Text (tokenized without special tokens) or ids → ids."""
        if not observation:
            return []
        if isinstance(observation, str):
            return list(self.tokenizer(observation, add_special_tokens=False)["input_ids"])
        return [int(t) for t in observation]

    def encode_trace(self, trace: str) -> tuple[list[int], list[int]]:
        """A supervised trace (model turns and observations as one text, EOS appended here)
        → (ids, loss mask): each model segment and observation tokenized on its own, as a
        rollout would hold them; observations masked 0."""
        pieces, pos = [], 0
        for start, end in self.fmt.observation_spans(trace):
            pieces += [(trace[pos:start], 1), (trace[start:end], 0)]
            pos = end
        pieces.append((trace[pos:], 1))
        ids: list[int] = []
        mask: list[int] = []
        for text, is_model in pieces:
            part = self._token_ids(text) if text else []
            ids += part
            mask += [is_model] * len(part)
        ids.append(self.tokenizer.eos_token_id)
        mask.append(1)
        return ids, mask


def completion_state(c: Completion) -> dict:
    """A completion (or episode) as plain values (checkpoints of an off-policy batch)."""
    state = {"token_ids": list(c.token_ids), "logprobs": list(c.logprobs),
             "finish_reason": c.finish_reason}
    if c.versions:
        state["versions"] = list(c.versions)
    if c.routing is not None:
        state["routing"] = c.routing
    if isinstance(c, Episode):
        state.update(loss_mask=list(c.loss_mask), prompt_ids=list(c.prompt_ids),
                     reward=c.reward, turns=c.turns, tool_calls=c.tool_calls,
                     tool_errors=c.tool_errors)
    return state


def completion_from_state(state: dict) -> Completion:
    """The inverse of `completion_state`."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in state.items()}
    return Episode(**fields) if "loss_mask" in state else Completion(**fields)


def build_multi_turn(task_cfg, tokenizer, reward_fn) -> MultiTurnRollout | None:
    """The task's multi-turn rollout (None for a single-turn task)."""
    if not task_cfg.multi_turn:
        return None

    return MultiTurnRollout(load_env_factory(task_cfg.env_path), reward_fn, task_cfg.episode,
                            tokenizer, fmt=tool_format(tokenizer, task_cfg.chat_template))


def loss_masks(completions: Sequence[Completion]) -> list[tuple[int, ...]] | None:
    """Per completion its loss mask when they are episodes, else None (every token counts)."""
    if not completions or not isinstance(completions[0], Episode):
        return None
    return [c.loss_mask for c in completions]


def episode_metrics(completions: Sequence[Completion]) -> dict[str, float]:
    """turns/mean, tool_calls/mean, tool_errors/frac (errors per call), tokens/generated and
    tokens/observed (sums over the batch); empty for single-turn completions."""
    episodes = [c for c in completions if isinstance(c, Episode)]
    if not episodes:
        return {}
    n = len(episodes)
    calls = sum(e.tool_calls for e in episodes)
    return {"turns/mean": sum(e.turns for e in episodes) / n,
            "tool_calls/mean": calls / n,
            "tool_errors/frac": sum(e.tool_errors for e in episodes) / max(calls, 1),
            "tokens/generated": float(sum(e.model_tokens for e in episodes)),
            "tokens/observed": float(sum(e.observed_tokens for e in episodes))}


__all__ = ["Episode", "Generate", "MultiTurnRollout", "build_multi_turn", "completion_from_state",
           "completion_state", "episode_metrics", "loss_masks"]
