"""A task that needs a tool: multiply two `digits`-digit numbers, `"37*45="` → `"1665"` + EOS.

The demo's 0.5 M-parameter model cannot multiply 2-digit numbers by itself; with the calculator
(`mcore_rl.tasks.envs.tool_env:calculator_env`) it only has to call it and copy the result:

    prompt  37*45=
    model   <call>calc: 37*45</call>          (generation stops at </call>)
    env     <result>1665</result>             (an observation: appended, never trained on)
    model   1665</s>                           (the answer ends the episode)

Reward (`reward`): 1 only when the text after the last observation is exactly the product's
digits followed by EOS; using the tool is not rewarded by itself. Operands have exactly
`digits` digits (no leading zeros: the calculator reads Python number syntax).

Warm-up traces (`warmup_examples(n, seed, p)`): with probability p a trace answers directly
(the true product, which the model cannot learn to compute; sampled, such answers are mostly
wrong); otherwise it calls the calculator and copies the result with each digit replaced by a
random one with probability p. So after the warm-up the model calls the tool about 1 - p of the
time and copies imperfectly: room for RL to raise both the tool-call rate and the reward.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from mcore_rl.config import ConfigError
from mcore_rl.config.seeds import derive_seed
from mcore_rl.tasks.addition import EOS_TEXT
from mcore_rl.tasks.base import Example
from mcore_rl.tasks.envs.tool_env import calculator_env
from mcore_rl.tasks.envs.tool_format import TagFormat

_PROMPT_RE = re.compile(r"([1-9][0-9]*)\*([1-9][0-9]*)=")
FORMAT = TagFormat()
# error observations the tokenizer should spell (the env's messages; see envs.tool_env)
_ERROR_TURNS = ("<call>calc: 1/0</call>", "<call>calc 1</call>", "<call>calc: 1",
                "<call>x: 1</call>", "<call>calc: a</call>", "<call>calc: 9**99</call>",
                "<call>calc: " + "1" * 201 + "</call>")


@dataclass(frozen=True, kw_only=True)
class ToolCalcTask:
    """Shape of the task.

    digits: digits of each operand (1..4).
    heldout_fraction: share of all operand pairs reserved for evaluation.
    split_salt: changes which pairs are held out.
    """

    digits: int = 2
    heldout_fraction: float = 0.1
    split_salt: str = "tool-calc-v1"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 4:
            raise ConfigError("digits", self.digits, "must be in [1, 4]")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ConfigError("heldout_fraction", self.heldout_fraction, "must be in (0, 1)")

    # the tokenizer keeps these as single pieces (`</call>` stops generation)
    user_symbols = FORMAT.tags

    @property
    def low(self) -> int:
        return 10 ** (self.digits - 1) if self.digits > 1 else 1

    def prompt(self, a: int, b: int) -> str:
        return f"{a}*{b}="

    def answer(self, a: int, b: int) -> str:
        return str(a * b)

    def is_heldout(self, a: int, b: int) -> bool:
        h = hashlib.blake2b(f"{self.split_salt}:{self.digits}:{a}:{b}".encode(), digest_size=8)
        return int.from_bytes(h.digest(), "big") < self.heldout_fraction * 2 ** 64

    def sample_pairs(self, n: int, *, seed: int, split: str = "train") -> list[tuple[int, int]]:
        if split not in ("train", "heldout"):
            raise ValueError(f"split={split!r}: must be 'train' or 'heldout'")
        rng = random.Random(f"{self.split_salt}:{split}:{seed}")
        pairs: list[tuple[int, int]] = []
        while len(pairs) < n:
            a, b = rng.randrange(self.low, 10 ** self.digits), rng.randrange(self.low,
                                                                             10 ** self.digits)
            if self.is_heldout(a, b) == (split == "heldout"):
                pairs.append((a, b))
        return pairs

    def train_examples(self, n: int, *, step: int, attempt: int, seed: int) -> list[Example]:
        pairs = self.sample_pairs(n, seed=derive_seed(seed, "data", step, attempt))
        return [Example(self.prompt(a, b), self.answer(a, b)) for a, b in pairs]

    def heldout_examples(self, n: int, *, seed: int) -> list[Example]:
        seen: dict[tuple[int, int], None] = {}
        batch_seed = seed
        while len(seen) < n:
            for pair in self.sample_pairs(n, seed=batch_seed, split="heldout"):
                seen.setdefault(pair)
                if len(seen) == n:
                    break
            batch_seed += 1_000_003
        return [Example(self.prompt(a, b), self.answer(a, b)) for a, b in seen]

    def trace(self, a: int, b: int, *, answer: str | None = None, tool: bool = True) -> str:
        """The continuation text of one episode (model turns and observations), without EOS:
        a calculator call, its result and `answer` (default: the product), or the answer alone
        with tool=False."""
        answer = self.answer(a, b) if answer is None else answer
        if not tool:
            return answer
        return FORMAT.call("calc", f"{a}*{b}") + FORMAT.result(self.answer(a, b)) + answer

    def warmup_examples(self, n: int, *, seed: int, p: float) -> list[tuple[str, str]]:
        """`n` (prompt, trace) pairs, see the module docstring for the noise. The trainer
        appends EOS and masks the observations out of the loss."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p={p}: must be in [0, 1]")
        rng = random.Random(f"{self.split_salt}:warmup:{seed}")
        out = []
        for a, b in self.sample_pairs(n, seed=seed, split="train"):
            if rng.random() < p:
                out.append((self.prompt(a, b), self.trace(a, b, tool=False)))
                continue
            copy = "".join(str(rng.randrange(10)) if rng.random() < p else c
                           for c in self.answer(a, b))
            out.append((self.prompt(a, b), self.trace(a, b, answer=copy)))
        return out

    def corpus(self, n: int = 2000, *, seed: int = 0) -> list[str]:
        """Tokenizer input: prompts with whole traces, direct answers, and the error
        observations the calculator environment can show."""
        lines = [self.prompt(a, b) + self.trace(a, b, tool=i % 4 != 0)
                 for i, (a, b) in enumerate(self.sample_pairs(n, seed=seed, split="train"))]
        env = calculator_env(Example("1*1=", "1"), reward)
        env.reset()
        lines += [turn + (env.step(turn).observation or "") for turn in _ERROR_TURNS]
        return lines


def final_answer_text(response: str) -> str:
    """What follows the last observation (`</result>`), i.e. the answer turn."""
    return response.rsplit(FORMAT.result_close, 1)[-1]


def expected_answer(prompt_text: str) -> str | None:
    m = _PROMPT_RE.fullmatch(prompt_text)
    return None if m is None else str(int(m.group(1)) * int(m.group(2)))


def reward(prompt_text: str, response_text: str, answer: str | None = None) -> float:
    """1.0 iff the answer turn (after the last observation) is exactly the product's digits
    followed by EOS, else 0.0. `response_text` is the whole transcript after the prompt.
    Import path `mcore_rl.tasks.tool_calc:reward`."""
    if answer is None:
        answer = expected_answer(prompt_text)
        if answer is None:
            raise ValueError(f"prompt {prompt_text!r} is not a product like '37*45='")
    return 1.0 if final_answer_text(response_text) == answer + EOS_TEXT else 0.0


__all__ = ["ToolCalcTask", "expected_answer", "final_answer_text", "reward"]
