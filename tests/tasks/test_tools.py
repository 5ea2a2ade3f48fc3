"""The built-in tools: the calculator evaluates arithmetic only, within every bound, and refuses
everything else with a ToolError (never eval, never a hang); the lookup reads the bundled
table."""

import time

import pytest

from mcore_rl.config import ConfigError
from mcore_rl.tasks.envs.tools import (CalculatorLimits, ToolError, calculate, lookup,
                                 lookup_table)

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


@pytest.mark.parametrize("expr,want", [
    ("37*45", "1665"), ("12*(3+4)", "84"), ("7/2", "3.5"), ("6/3", "2"), ("7//2", "3"),
    ("-7 % 3", "2"), ("2**10", "1024"), ("-(2**3)", "-8"), ("1.5*4", "6"), (" 99 * 99 ", "9801"),
    ("2**-1", "0.5"), ("10**59", "1" + "0" * 59),
])
def test_calculator_values(expr, want):
    assert calculate(expr) == want


@pytest.mark.parametrize("expr,message", [
    ("", "empty expression"),
    ("   ", "empty expression"),
    ("__import__('os').system('true')", "only numbers"),
    ("os", "only numbers"),
    ("(1).__class__", "only numbers"),
    ("abs(-3)", "only numbers"),
    ("[1, 2]", "only numbers"),
    ("1 if 1 else 2", "only numbers"),
    ("1 < 2", "only numbers"),
    ("1 & 3", "only numbers"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("2j * 2", "only numbers"),
    ("lambda: 1", "only numbers"),
    ("1 +", "not an arithmetic expression"),
    ("3 4", "not an arithmetic expression"),
    ("05*3", "not an arithmetic expression"),
    ("x = 1", "not an arithmetic expression"),
    ("1/0", "division by zero"),
    ("1//0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0**-1", "division by zero"),
    ("2**65", "exponent larger than 64"),
    ("2**10**10", "exponent larger than 64"),
    ("10**60", "result longer than 60 digits"),
    ("99**40", "result longer than 60 digits"),
    ("(10**30)*(10**30)", "result longer than 60 digits"),
    ("1e300*1e300", "result out of range"),
    ("1e59*10", "result out of range"),
    ("(-8)**0.5", "not a real number"),
    ("1" * 201, "longer than 200 characters"),
    ("+".join(["1"] * 60), "more than 100 parts"),
    ("(" * 40 + "1" + ")" * 40 + "+1" * 50, "more than 100 parts"),
    ("-" * 150 + "1", "more than 100 parts"),
])
def test_calculator_refuses(expr, message):
    with pytest.raises(ToolError, match=message.replace("(", r"\(").replace("+", r"\+")):
        calculate(expr)


def test_calculator_is_fast_on_its_worst_inputs():
    """The largest allowed work (bounded digits, exponent, nodes) is milliseconds."""
    worst = "*".join(["9" * 5] * 12)[:200]  # 60-digit product chain, refused at 60 digits
    start = time.perf_counter()
    for expr in (worst, "9**63", "(" * 49 + "2" + ")" * 49, "99**29*99**29"):
        try:
            calculate(expr)
        except ToolError:
            pass
    assert time.perf_counter() - start < 0.5


def test_calculator_time_limit():
    with pytest.raises(ToolError, match="time limit"):
        calculate("1+1", CalculatorLimits(time_limit_s=1e-9))
    with pytest.raises(ConfigError, match="time_limit_s"):
        CalculatorLimits(time_limit_s=0)
    with pytest.raises(ConfigError, match="max_digits"):
        CalculatorLimits(max_digits=0)


def test_custom_limits():
    tight = CalculatorLimits(max_input_chars=5, max_nodes=3, max_exponent=2, max_digits=3)
    assert calculate("9*9", tight) == "81"
    with pytest.raises(ToolError, match="longer than 5 characters"):
        calculate("1+2+34", tight)
    with pytest.raises(ToolError, match="more than 3 parts"):
        calculate("-1+2", tight)
    with pytest.raises(ToolError, match="exponent larger than 2"):
        calculate("2**3", tight)
    with pytest.raises(ToolError, match="longer than 3 digits"):
        calculate("99*99", tight)


def test_lookup_table():
    table = lookup_table()
    assert len(table) >= 10 and table["gold"] == "79"
    assert lookup("  Gold ") == "79"
    with pytest.raises(ToolError, match="key not found"):
        lookup("unobtainium")
    with pytest.raises(ToolError, match="empty key"):
        lookup("  ")
