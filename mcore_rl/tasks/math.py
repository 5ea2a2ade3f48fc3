"""Rule rewards for math word problems (GSM8K style), pluggable by import path.

The final answer of a response is, in order of preference: what follows the last `####`
(GSM8K's marker), the content of the last `\\boxed{...}`, else the last number in the text.
A reference answer may be the bare answer ("42") or a whole GSM8K solution ending in
"#### 42". Numbers compare after normalisation: `$`, thousands commas and spaces dropped,
"42.0" = "42", "0.50" = ".5"; a non-numeric final answer compares as whitespace-stripped text.

`answer_reward` (exact match: 1 or 0) and `format_reward` (1 if the response states its final
answer with `####` or `\\boxed{}` and that answer parses) take (prompt, response, answer).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from mcore_rl.tasks.addition import EOS_TEXT

_NUMBER_RE = re.compile(r"-?\$?\s?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
# A whole answer that is a number: optional sign and $, digits with thousands commas, optional
# decimals, optionally one unit word ("72 clips", "5%").
_WHOLE_NUMBER_RE = re.compile(r"-?\$?\s?-?(\d[\d,]*(?:\.\d+)?|\.\d+)\s*(?:[A-Za-z%]+)?")
_MARKER = "####"
_BOXED = "\\boxed{"


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces kept), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unclosed: no stated answer


def _after_marker(text: str) -> str | None:
    if _MARKER not in text:
        return None
    tail = text.rsplit(_MARKER, 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else None


def stated_answer(text: str) -> str | None:
    """The answer a response states explicitly (`####` or `\\boxed{}`), or None."""
    text = text.replace(EOS_TEXT, "")
    for found in (_after_marker(text), _boxed(text)):
        if found:
            return found
    return None


def final_answer(text: str) -> str | None:
    """The stated answer, else the last number in the text, else None."""
    stated = stated_answer(text)
    if stated is not None:
        return stated
    numbers = _NUMBER_RE.findall(text.replace(EOS_TEXT, ""))
    return numbers[-1].strip() if numbers else None


def _as_number(text: str) -> Decimal | None:
    """The value of an answer that is a number (with optional $ and one unit word)."""
    m = _WHOLE_NUMBER_RE.fullmatch(text)
    if m is None:
        return None
    sign = -1 if text.lstrip("$ ").startswith("-") else 1
    try:
        return sign * Decimal(m.group(1).replace(",", ""))
    except InvalidOperation:
        return None


def normalize(answer: str) -> str | None:
    """Canonical text of an answer: a number as its plain decimal ("1,000.0" → "1000",
    "$0.50" → "0.5", "72 clips" → "72"), else the text with runs of whitespace made one
    space and a trailing period dropped; None for an empty answer."""
    text = answer.strip().rstrip(".").strip()
    value = _as_number(text)
    if value is None:
        return " ".join(text.split()) or None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def reference_answer(answer: str) -> str:
    """The final answer of a reference: after `####` when it is a GSM8K solution."""
    return _after_marker(answer) or answer.strip()


def answer_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 iff the response's final answer equals the reference's (normalised), else 0.0.
    Import path `mcore_rl.tasks.math:answer_reward`."""
    got = final_answer(response)
    want = normalize(reference_answer(answer))
    if want is None:
        raise ValueError(f"reference answer {answer!r} is empty")
    return 1.0 if got is not None and normalize(got) == want else 0.0


def format_reward(prompt: str, response: str, answer: str = "") -> float:
    """1.0 iff the response states a final answer (`#### x` or `\\boxed{x}`) that parses as a
    number, else 0.0 (the answer's correctness is not looked at). Import path
    `mcore_rl.tasks.math:format_reward`."""
    stated = stated_answer(response)
    return 1.0 if stated is not None and _as_number(stated.rstrip(".")) is not None else 0.0


__all__ = ["answer_reward", "final_answer", "format_reward", "normalize", "reference_answer",
           "stated_answer"]
