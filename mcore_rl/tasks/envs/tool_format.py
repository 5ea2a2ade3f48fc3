"""How tool calls look in a model turn, and how their results come back.

`tool_format(tokenizer, chat_template)` picks one: the chat template's format when the task
uses the tokenizer's chat template (`ChatToolFormat`), else the tag format (`TagFormat`).

`TagFormat` (for tokenizers without a chat template, e.g. the demo's sentencepiece): a turn
calls a tool with `<call>NAME: ARGUMENT</call>`; the result comes back as the observation
`<result>TEXT</result>`, an error as `<result>error: MESSAGE</result>`. The tags should be
single tokens (the tool task's tokenizer makes them user-defined pieces): `</call>` then stops
generation (`stop_token_ids`); when it is not a single token the turn is cut after it
(`cut_after_call`).

Parsing looks at the first `<call>` of a turn only (generation stops at its `</call>`). A turn
without one is an answer: the episode ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    argument: str


@dataclass(frozen=True)
class MalformedCall:
    """A turn that opened a call but did not make a well-formed one; `reason` is shown."""

    reason: str


@dataclass(frozen=True)
class TagFormat:
    call_open: str = "<call>"
    call_close: str = "</call>"
    result_open: str = "<result>"
    result_close: str = "</result>"

    @property
    def tags(self) -> tuple[str, ...]:
        return (self.call_open, self.call_close, self.result_open, self.result_close)

    def parse(self, turn: str) -> ToolCall | MalformedCall | None:
        """The turn's tool call, a MalformedCall, or None when the turn calls nothing."""
        start = turn.find(self.call_open)
        if start < 0:
            if self.call_close in turn:
                return MalformedCall(f"{self.call_close} without {self.call_open}")
            return None
        body_start = start + len(self.call_open)
        end = turn.find(self.call_close, body_start)
        if end < 0:
            return MalformedCall(f"{self.call_open} without {self.call_close}")
        name, sep, argument = turn[body_start:end].partition(":")
        name = name.strip()
        if not sep or not name:
            return MalformedCall(f"expected {self.call_open}tool: argument{self.call_close}")
        if not name.isidentifier():
            return MalformedCall("bad tool name")
        return ToolCall(name, argument.strip())

    def result(self, text: str) -> str:
        return f"{self.result_open}{text}{self.result_close}"

    def error(self, message: str) -> str:
        return self.result(f"error: {message}")

    def call(self, name: str, argument: str) -> str:
        """The text of a call (warm-up traces)."""
        return f"{self.call_open}{name}: {argument}{self.call_close}"

    def observation_spans(self, text: str) -> list[tuple[int, int]]:
        """[start, end) character spans of the observations in a whole transcript (each
        `<result>...</result>`), for masking them out of supervised traces."""
        spans, pos = [], 0
        while (start := text.find(self.result_open, pos)) >= 0:
            end = text.find(self.result_close, start)
            end = len(text) if end < 0 else end + len(self.result_close)
            spans.append((start, end))
            pos = end
        return spans

    def stop_token_ids(self, tokenizer) -> list[int]:
        """The id of `</call>` when it is one token (generation stops right after a call)."""
        ids = tokenizer(self.call_close, add_special_tokens=False)["input_ids"]
        return list(ids) if len(ids) == 1 else []

    def cut_after_call(self, ids: list[int], tokenizer) -> int:
        """How many of a turn's tokens to keep: up to and including the token that completes
        the first `</call>`, or all of them when there is none."""
        if self.call_close not in tokenizer.decode(ids, skip_special_tokens=False):
            return len(ids)
        for k in range(1, len(ids) + 1):
            if self.call_close in tokenizer.decode(ids[:k], skip_special_tokens=False):
                return k
        return len(ids)


class ChatToolFormat:
    """The tool-call format of chat templates in the Hermes style (Qwen2.5/3, Hermes, many
    others): a turn calls a tool with `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
    and ends with the template's end of turn (EOS); the result comes back as a `tool`
    message rendered by the tokenizer's own chat template, followed by its generation prompt
    — the text between the conversation before the tool message and the one after it.

    `arguments` may be a string, or an object whose values are joined (our tools take one
    string, e.g. {"expression": "37*45"}). Turns end at EOS (no stop token of its own)."""

    call_open, call_close = "<tool_call>", "</tool_call>"

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{type(tokenizer).__name__} has no chat template: use TagFormat")
        self.tokenizer = tokenizer

    def parse(self, turn: str) -> ToolCall | MalformedCall | None:
        start = turn.find(self.call_open)
        if start < 0:
            return None
        end = turn.find(self.call_close, start)
        if end < 0:
            return MalformedCall(f"{self.call_open} without {self.call_close}")
        try:
            call = json.loads(turn[start + len(self.call_open):end])
        except json.JSONDecodeError:
            return MalformedCall("the call is not JSON")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return MalformedCall('expected {"name": ..., "arguments": ...}')
        args = call.get("arguments", "")
        if isinstance(args, dict):
            args = " ".join(str(v) for v in args.values())
        if not call["name"].isidentifier():
            return MalformedCall("bad tool name")
        return ToolCall(call["name"], str(args).strip())

    def result(self, text: str) -> str:
        """The tool message as the template renders it, and the next assistant header."""
        before = [{"role": "user", "content": "."}]
        after = before + [{"role": "tool", "content": text}]
        head = self.tokenizer.apply_chat_template(before, tokenize=False)
        full = self.tokenizer.apply_chat_template(after, tokenize=False,
                                                  add_generation_prompt=True)
        if not full.startswith(head):
            raise ValueError("the chat template renders a conversation differently once a "
                             "tool message follows: cannot take the tool turn's text")
        return full[len(head):]

    def error(self, message: str) -> str:
        return self.result(f"error: {message}")

    def stop_token_ids(self, tokenizer) -> list[int]:
        return []

    def cut_after_call(self, ids: list[int], tokenizer) -> int:
        return len(ids)


def tool_format(tokenizer, chat_template: bool):
    """The chat template's tool format for chat-template tasks, else the tag format."""
    return ChatToolFormat(tokenizer) if chat_template else TagFormat()


__all__ = ["ChatToolFormat", "MalformedCall", "TagFormat", "ToolCall", "tool_format"]
