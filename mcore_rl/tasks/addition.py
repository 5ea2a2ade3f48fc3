"""Synthetic verifiable task: fixed-width addition, `"37+05="` → `"042"` followed by EOS.

Text format (for `digits=d`): both operands zero-padded to `d` digits, then `=`; the answer is
the sum zero-padded to `d + 1` digits. The prompt carries its own width, so `reward` needs no
config and works for any `d`.

How EOS reaches the reward: rewards see text only. A response is the text of the generated
token ids with the end of sequence written as the literal `EOS_TEXT` (`"</s>"`, the EOS piece of
`mcore_rl.tasks.tokenizer`), and nothing after it — `tokenizer.response_text(ids, tok)` builds
exactly that from token ids (vLLM's own `.text` drops the EOS, so don't pass it). A response
that stopped for length has no `EOS_TEXT` and gets 0.

As a `mcore_rl.tasks.base.Task`: `train_examples(n, step=k, attempt=a, seed=s)` draws the
prompts seeded `derive_seed(s, "data", k, a)` (a hash: each step and draw its own stream); each
example's answer is the answer digits (no EOS).

Held-out split: a pair `(a, b)` is held out iff a fixed hash of it falls under
`heldout_fraction`; the training sampler never draws a held-out pair, whatever its seed.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from mcore_rl.config import ConfigError
from mcore_rl.config.seeds import derive_seed
from mcore_rl.tasks.base import Example

EOS_TEXT = "</s>"

_PROMPT_RE = re.compile(r"([0-9]+)\+([0-9]+)=")


@dataclass(frozen=True, kw_only=True)
class AdditionTask:
    """Shape of the task.

    digits: digits per operand (operands in [0, 10**digits)); the answer has digits + 1.
    heldout_fraction: share of all operand pairs reserved for evaluation.
    split_salt: changes which pairs are held out (keep the default to compare runs).
    """

    digits: int = 2
    heldout_fraction: float = 0.1
    split_salt: str = "addition-v1"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 18:
            raise ConfigError("digits", self.digits, "must be in [1, 18]")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ConfigError("heldout_fraction", self.heldout_fraction, "must be in (0, 1)")
        if round(self.heldout_fraction * 10 ** (2 * self.digits)) < 1:
            raise ConfigError("heldout_fraction", self.heldout_fraction,
                              f"holds out no pair of {self.digits}-digit operands")

    @property
    def answer_width(self) -> int:
        return self.digits + 1

    def prompt(self, a: int, b: int) -> str:
        return f"{a:0{self.digits}d}+{b:0{self.digits}d}="

    def answer(self, a: int, b: int) -> str:
        """The answer digits, without EOS."""
        return f"{a + b:0{self.answer_width}d}"

    def is_heldout(self, a: int, b: int) -> bool:
        h = hashlib.blake2b(f"{self.split_salt}:{self.digits}:{a}:{b}".encode(), digest_size=8)
        return int.from_bytes(h.digest(), "big") < self.heldout_fraction * 2 ** 64

    def sample_pairs(self, n: int, *, seed: int, split: str = "train") -> list[tuple[int, int]]:
        """`n` operand pairs drawn uniformly (with replacement) from `split` ("train" or
        "heldout"); the same seed gives the same pairs."""
        if split not in ("train", "heldout"):
            raise ValueError(f"split={split!r}: must be 'train' or 'heldout'")
        want_heldout = split == "heldout"
        rng = random.Random(f"{self.split_salt}:{split}:{seed}")
        top = 10 ** self.digits
        pairs: list[tuple[int, int]] = []
        while len(pairs) < n:
            a, b = rng.randrange(top), rng.randrange(top)
            if self.is_heldout(a, b) == want_heldout:
                pairs.append((a, b))
        return pairs

    def prompts(self, n: int, *, seed: int, split: str = "train") -> list[str]:
        return [self.prompt(a, b) for a, b in self.sample_pairs(n, seed=seed, split=split)]

    def train_examples(self, n: int, *, step: int, attempt: int, seed: int) -> list[Example]:
        """The Task API: `n` training prompts at data position `step` (draw `attempt`)."""
        prompts = self.prompts(n, seed=derive_seed(seed, "data", step, attempt))
        return [Example(p, expected_answer(p)) for p in prompts]

    def heldout_examples(self, n: int, *, seed: int) -> list[Example]:
        """The Task API: `heldout_prompts(n, seed=seed)` with their answers."""
        return [Example(p, expected_answer(p)) for p in self.heldout_prompts(n, seed=seed)]

    def heldout_prompts(self, n: int = 256, *, seed: int = 0) -> list[str]:
        """`n` distinct held-out prompts (fixed for a given seed): the evaluation set."""
        total = round(self.heldout_fraction * 10 ** (2 * self.digits))
        if n > total // 2:
            raise ValueError(f"n={n}: asks for more than half of the ~{total} held-out pairs")
        seen: dict[str, None] = {}
        batch_seed = seed
        while len(seen) < n:
            for p in self.prompts(n, seed=batch_seed, split="heldout"):
                seen.setdefault(p)
                if len(seen) == n:
                    break
            batch_seed += 1_000_003
        return list(seen)

    def warmup_examples(self, n: int, *, seed: int, p: float) -> list[tuple[str, str]]:
        """Noisy-label warm-up data: `n` `(prompt, answer)` training pairs where each answer
        digit is independently replaced, with probability `p`, by a uniform random digit
        (which may equal the true one). The trainer appends EOS to the answer; the loss
        covers the answer and EOS only. The demo's p=0.4 leaves room for RL."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p={p}: must be in [0, 1]")
        rng = random.Random(f"{self.split_salt}:warmup:{seed}")
        out = []
        for a, b in self.sample_pairs(n, seed=seed, split="train"):
            answer = "".join(str(rng.randrange(10)) if rng.random() < p else c
                             for c in self.answer(a, b))
            out.append((self.prompt(a, b), answer))
        return out

    def corpus(self, n: int = 2000, *, seed: int = 0) -> list[str]:
        """Lines `prompt + answer` covering every character of the task (tokenizer input)."""
        return [self.prompt(a, b) + self.answer(a, b)
                for a, b in self.sample_pairs(n, seed=seed, split="train")]


def expected_answer(prompt_text: str) -> str | None:
    """The exact answer digits for a task prompt, or None if it is not one."""
    m = _PROMPT_RE.fullmatch(prompt_text)
    if m is None or len(m.group(1)) != len(m.group(2)):
        return None
    width = len(m.group(1)) + 1
    return f"{int(m.group(1)) + int(m.group(2)):0{width}d}"


def reward(prompt_text: str, response_text: str, answer: str | None = None) -> float:
    """1.0 iff `response_text` is exactly the answer digits followed by `EOS_TEXT`, else 0.0.

    `prompt_text` is the task prompt (`"37+05="`, no BOS text); `response_text` is the
    generated text with EOS spelled `EOS_TEXT` (see the module docstring). Missing EOS, any
    extra character (also a space) or a wrong digit gives 0. `answer` (the example's answer
    digits) is optional: without it the answer is computed from the prompt. Pluggable by import
    path `mcore_rl.tasks.addition:reward`.
    """
    answer = _answer_of(prompt_text, answer)
    return 1.0 if response_text == answer + EOS_TEXT else 0.0


def digit_reward(prompt_text: str, response_text: str, answer: str | None = None) -> float:
    """Partial credit: the fraction of answer digits the response has right, position by
    position (EOS and extra text ignored). A shaped reward for runs that start from an
    untrained model. Import path `mcore_rl.tasks.addition:digit_reward`."""
    answer = _answer_of(prompt_text, answer)
    return sum(a == b for a, b in zip(answer, response_text)) / len(answer)


def _answer_of(prompt_text: str, answer: str | None) -> str:
    if answer is not None:
        return answer
    expected = expected_answer(prompt_text)
    if expected is None:
        raise ValueError(f"prompt {prompt_text!r} is not an addition prompt like '37+05='")
    return expected
