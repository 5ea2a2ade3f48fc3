"""A prompt dataset from JSONL files (one JSON object per line), e.g. GSM8K.

Data position: the training file is read once; its examples are visited in one shuffled order
per epoch (epoch e's order is a permutation seeded by (seed, e)), as one stream. Step k (steps
count from 1, as the controller's RL steps do) reads stream positions [(k-1)·n, k·n), wrapping
into the next epoch at the end of the file: a run resumed at step k draws what an
uninterrupted run would. An extra draw within a step (attempt a >= 1, dynamic sampling) takes
n examples at random, seeded by (seed, step, a), so it never shifts the stream.

Held-out examples come from `heldout_path` (a seeded sample of n distinct lines). The task has
no supervised targets, so it has no warm-up data.

What a line holds, checked when the file is read (errors name the file, the line and the key):
the prompt is text (not blank) or a list of chat messages — objects with exactly "role"
(system, user, assistant, tool) and "content" (text, not blank), at least one user turn, not
ending with the assistant's — kept as a `Chat` for the tokenizer's chat template; anything else
is refused, never turned into text with str(). The answer is handed to the reward as it is when
it is text, as its JSON text (`json.dumps`) otherwise; a null answer is refused. Each example
carries its "file:line" (`Example.source`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from mcore_rl.tasks.base import ROLES, Example, Message, Prompt


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the file and line. `key`:
    the missing key, when that is what is wrong (so a caller can name its config field)."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key


def read_jsonl(path: str | Path, prompt_key: str, answer_key: str, *,
               chats: bool = True) -> list[Example]:
    """Every line of `path` as an Example; errors name the file, the line and the key (module
    doc). chats False: a chat (messages) prompt is refused too (a multi-turn task's
    environment takes text)."""
    return [example for _, example in read_jsonl_lines(path, prompt_key, answer_key,
                                                       chats=chats)]


def read_jsonl_lines(path: str | Path, prompt_key: str, answer_key: str, *,
                     chats: bool = True) -> list[tuple[int, Example]]:
    """`read_jsonl` with each example's line number (blank lines are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file (a JSONL dataset, one object per line)")
    examples = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object, got "
                                   f"{type(row).__name__}")
            for key in (prompt_key, answer_key):
                if key not in row:
                    raise DatasetError(f"{path}:{lineno}: missing key {key!r} (has: "
                                       f"{', '.join(sorted(row)) or 'no keys'})", key=key)
            at = f"{path}:{lineno}"
            examples.append((lineno, Example(_prompt(row[prompt_key], at, prompt_key, chats),
                                             _answer(row[answer_key], at, answer_key),
                                             source=at)))
    if not examples:
        raise DatasetError(f"{path}: no examples (empty file)")
    return examples


def _prompt(value, at: str, key: str, chats: bool) -> Prompt:
    """A line's prompt value as text or a Chat; DatasetError naming `at` ("file:line") and
    the key for anything else (module doc)."""
    def refuse(problem: str):
        return DatasetError(f"{at}: {key!r} {problem}", key=key)

    what = 'expected the prompt text or a list of chat messages ({"role", "content"})'
    if isinstance(value, str):
        if not value.strip():
            raise refuse(f"is {'empty' if not value else 'blank'} text: {what}")
        return value
    if not isinstance(value, list):
        raise refuse(f"is {_kind(value)}: {what}")
    if not value:
        raise refuse(f"is an empty list: {what}")
    if not chats:
        raise refuse("is a list of chat messages, but a multi-turn task (task.env) takes its "
                     "prompt as text")
    chat = []
    for i, message in enumerate(value):
        problem = _message_problem(message)
        if problem:
            raise refuse(f"message {i} {problem}")
        chat.append(Message(message["role"], message["content"]))
    if not any(m.role == "user" for m in chat):
        raise refuse("has no user message")
    if chat[-1].role == "assistant":
        raise refuse("ends with the assistant's message: the prompt is what the model answers "
                     "(leave the answer out of it)")
    return tuple(chat)


def _message_problem(message) -> str | None:
    """What is wrong with one chat message (None: nothing)."""
    if not isinstance(message, dict):
        return f'is {_kind(message)}, not an object with "role" and "content"'
    missing = [k for k in ("role", "content") if k not in message]
    if missing:
        return f"has no {' or '.join(map(repr, missing))}"
    extra = sorted(set(message) - {"role", "content"})
    if extra:
        return f"has keys other than 'role' and 'content' ({', '.join(extra)}): not supported"
    role, content = message["role"], message["content"]
    if role not in ROLES:
        return f"has role {role!r}: expected one of {', '.join(ROLES)}"
    if not isinstance(content, str):
        return f"({role}) has content that is {_kind(content)}: expected text"
    if not content.strip():
        return f"({role}) has {'empty' if not content else 'blank'} content"
    return None


def _answer(value, at: str, key: str) -> str:
    """A line's answer as the reward gets it: text as it is, anything else as JSON text."""
    if value is None:
        raise DatasetError(f"{at}: {key!r} is null: expected the reference answer (text, or any "
                           "JSON value, handed to the reward as its JSON text)", key=key)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _kind(value) -> str:
    """What a JSON value is, in words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({json.dumps(value)})"
    if isinstance(value, (int, float)):
        return f"a number ({json.dumps(value)})"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


class JsonlTask:
    """Examples from `path` (training) and `heldout_path` (evaluation, optional). chats False:
    a chat prompt is refused (a multi-turn task's environment takes text)."""

    def __init__(self, path: str | Path, *, heldout_path: str | Path | None = None,
                 prompt_key: str = "question", answer_key: str = "answer", chats: bool = True):
        self.path, self.heldout_path = Path(path), heldout_path
        self.train, self._train_lines = _split(read_jsonl_lines(path, prompt_key, answer_key,
                                                                chats=chats))
        self.heldout, self._heldout_lines = (
            _split(read_jsonl_lines(heldout_path, prompt_key, answer_key, chats=chats))
            if heldout_path is not None else (None, None))
        self._order: tuple[tuple[int, int], list[int]] | None = None  # last epoch's order

    def fit_prompts(self, lengths: Callable[[list[Prompt]], list[int]], limit: int, *,
                    drop: bool) -> dict[str, int]:
        """Every prompt's token count (`lengths` of the prompts, as the engines get them:
        chat template included) against `limit`, once, when the run starts. drop False:
        DatasetError naming the file, line and count of the first prompt that is longer;
        drop True: those rows are dropped (from both files). Returns the rows dropped per
        file ("train", "heldout"). A prompt `lengths` cannot encode (a chat, and a tokenizer
        without a chat template): DatasetError naming the file."""
        dropped = {}
        for name, path in (("train", self.path), ("heldout", self.heldout_path)):
            examples, lines = getattr(self, name), getattr(self, f"_{name}_lines")
            if examples is None:
                continue
            try:
                counts = lengths([e.prompt for e in examples])
            except ValueError as err:
                raise DatasetError(f"{path}: {err}") from None
            over = [i for i, n in enumerate(counts) if n > limit]
            if over and not drop:
                i = over[0]
                raise DatasetError(f"{path}:{lines[i]}: the prompt is {counts[i]} tokens (chat "
                                   f"template included), longer than max_prompt_tokens={limit} "
                                   f"({len(over)} of {len(examples)} prompts are): raise "
                                   "max_prompt_tokens, or set task.overlong_prompts: filter to "
                                   "drop them")
            if len(over) == len(examples):
                raise DatasetError(f"{path}: every prompt is longer than max_prompt_tokens="
                                   f"{limit} (the shortest: {min(counts)} tokens)")
            keep = [i for i, n in enumerate(counts) if n <= limit]
            setattr(self, name, [examples[i] for i in keep])
            setattr(self, f"_{name}_lines", [lines[i] for i in keep])
            dropped[name] = len(over)
        self._order = None
        return dropped

    def _epoch_order(self, seed: int, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != (seed, epoch):
            order = list(range(len(self.train)))
            random.Random(f"jsonl:{seed}:epoch:{epoch}").shuffle(order)
            self._order = ((seed, epoch), order)
        return self._order[1]

    def train_examples(self, n: int, *, step: int, attempt: int, seed: int) -> list[Example]:
        if step < 1:
            raise ValueError(f"step={step}: steps count from 1")
        if attempt:
            rng = random.Random(f"jsonl:{seed}:step:{step}:attempt:{attempt}")
            return [self.train[rng.randrange(len(self.train))] for _ in range(n)]
        size = len(self.train)
        out = []
        for pos in range((step - 1) * n, step * n):
            epoch, i = divmod(pos, size)
            out.append(self.train[self._epoch_order(seed, epoch)[i]])
        return out

    def heldout_examples(self, n: int, *, seed: int) -> list[Example]:
        if self.heldout is None:
            raise ValueError("the jsonl task has no held-out set: set task.heldout_path")
        if n > len(self.heldout):
            raise ValueError(f"{self.heldout_path}: asked for {n} held-out examples, the file "
                             f"has {len(self.heldout)}")
        return random.Random(f"jsonl:heldout:{seed}").sample(self.heldout, n)

    def warmup_examples(self, n: int, *, seed: int, p: float) -> list[tuple[str, str]]:
        raise ValueError(f"{self.path}: the jsonl task has no supervised warm-up targets; "
                         "set warmup.max_steps=0")


def _split(rows: list[tuple[int, Example]]) -> tuple[list[Example], list[int]]:
    return [e for _, e in rows], [line for line, _ in rows]


__all__ = ["DatasetError", "JsonlTask", "read_jsonl", "read_jsonl_lines"]
