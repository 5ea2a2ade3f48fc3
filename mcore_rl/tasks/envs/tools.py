"""Built-in tools an environment runs between model turns: a bounded arithmetic calculator and
a lookup over a small table shipped with the package.

A tool is `fn(argument: str) -> str`. It raises `ToolError` (with a short, model-readable
message) for every bad input; the environment turns that into an error observation. Nothing a
model writes is ever given to `eval`/`exec`: the calculator parses with `ast` and walks the tree
itself, accepting only number literals, unary +/-, and the binary operators + - * / // % **.

Bounds (all checked before the work they guard, so a call cannot hang or exhaust memory):
input length, number of AST nodes (also bounds nesting), exponent size, digits of every
intermediate and final result, and a wall-clock deadline checked at every node.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import time
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Callable

from mcore_rl.config import require_above, require_at_least

ToolFn = Callable[[str], str]


class ToolError(Exception):
    """A tool refused its input or failed; the message is shown to the model."""


@dataclass(frozen=True, kw_only=True)
class CalculatorLimits:
    """Bounds of one calculator call.

    max_input_chars: characters of the expression. max_nodes: AST nodes (numbers, operators;
    also bounds the nesting depth). max_exponent: |exponent| of `**`. max_digits: decimal
    digits of any integer result or intermediate (floats: magnitude below 10**max_digits).
    time_limit_s: wall-clock budget of one evaluation.
    """

    max_input_chars: int = 200
    max_nodes: int = 100
    max_exponent: int = 64
    max_digits: int = 60
    time_limit_s: float = 0.05

    def __post_init__(self) -> None:
        require_at_least(self, 1, "max_input_chars", "max_nodes", "max_exponent", "max_digits")
        require_above(self, 0, "time_limit_s")


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# node types an expression may contain (operator nodes are children of BinOp/UnaryOp)
_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, *_BINARY, *_UNARY)


class _Evaluator:
    def __init__(self, limits: CalculatorLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.time_limit_s

    def value(self, node: ast.AST) -> int | float:
        if time.monotonic() > self.deadline:
            raise ToolError("time limit exceeded")
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise ToolError("only numbers are allowed")
            return self.checked(node.value)
        if isinstance(node, ast.UnaryOp):
            return self.checked(_UNARY[type(node.op)](self.value(node.operand)))
        if isinstance(node, ast.BinOp):
            left, right = self.value(node.left), self.value(node.right)
            return self.checked(self.binary(type(node.op), left, right))
        raise ToolError("unsupported expression")  # unreachable after the node check

    def binary(self, op: type, left, right):
        if op is ast.Pow:
            self.check_power(left, right)
        if op in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
            raise ToolError("division by zero")
        try:
            result = _BINARY[op](left, right)
        except (OverflowError, ZeroDivisionError, ValueError):
            raise ToolError("result out of range") from None
        if isinstance(result, complex):  # e.g. (-8) ** 0.5
            raise ToolError("result is not a real number")
        if op is ast.Div and isinstance(result, float) and isinstance(left, int) \
                and isinstance(right, int) and left % right == 0:
            return left // right  # exact quotients stay integers ("6/3" → "2")
        return result

    def check_power(self, base, exponent) -> None:
        """Refuse a power before computing it when its size would break the bounds."""
        if abs(exponent) > self.limits.max_exponent:
            raise ToolError(f"exponent larger than {self.limits.max_exponent}")
        if base == 0 and exponent < 0:
            raise ToolError("division by zero")
        if base not in (0, 1, -1) and exponent > 0:
            digits = exponent * math.log10(abs(base))
            if digits >= self.limits.max_digits:
                raise ToolError(f"result longer than {self.limits.max_digits} digits")

    def checked(self, x: int | float) -> int | float:
        limit = self.limits.max_digits
        if isinstance(x, int):
            # bit length bounds the digit count without converting a huge int to text
            if x.bit_length() > limit * 3.33 + 4 or len(str(abs(x))) > limit:
                raise ToolError(f"result longer than {limit} digits")
        elif not math.isfinite(x) or abs(x) >= 10.0 ** limit:
            raise ToolError("result out of range")
        return x


def calculate(expression: str, limits: CalculatorLimits = CalculatorLimits()) -> str:
    """The value of an arithmetic expression as text ("12*(3+4)" → "84"; "7/2" → "3.5").
    Raises ToolError naming the problem (syntax, a forbidden construct, a bound)."""
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > limits.max_input_chars:
        raise ToolError(f"expression longer than {limits.max_input_chars} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError("not an arithmetic expression") from None
    parts = 0  # numbers and operations (operator tokens and the root are not counted)
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ToolError("only numbers and + - * / // % ** are allowed")
        parts += isinstance(node, (ast.Constant, ast.BinOp, ast.UnaryOp))
        if parts > limits.max_nodes:
            raise ToolError(f"expression has more than {limits.max_nodes} parts")
    try:
        value = _Evaluator(limits).value(tree.body)
    except RecursionError:
        raise ToolError("expression nested too deeply") from None
    return format_number(value)


def format_number(x: int | float) -> str:
    """Integers as digits; floats rounded to 10 significant digits, integral ones as ints."""
    if isinstance(x, int):
        return str(x)
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.10g}"


@lru_cache(maxsize=1)
def lookup_table() -> dict[str, str]:
    """The bundled table (`mcore_rl/tasks/envs/data/lookup.json`): lower-case key → value."""
    data = resources.files("mcore_rl.tasks.envs").joinpath("data/lookup.json").read_text("utf-8")
    table = json.loads(data)
    return {str(k).strip().lower(): str(v) for k, v in table.items()}


def lookup(key: str) -> str:
    """The table's value for `key` (case and surrounding spaces ignored)."""
    wanted = key.strip().lower()
    if not wanted:
        raise ToolError("empty key")
    table = lookup_table()
    if wanted not in table:
        raise ToolError("key not found")
    return table[wanted]


BUILTIN_TOOLS: dict[str, ToolFn] = {"calc": calculate, "lookup": lookup}


__all__ = ["BUILTIN_TOOLS", "CalculatorLimits", "ToolError", "ToolFn", "calculate",
           "format_number", "lookup", "lookup_table"]
