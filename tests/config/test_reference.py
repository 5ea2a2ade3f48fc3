"""docs/reference/config.md is generated from the config dataclasses' docstrings and must not
drift from them."""

from __future__ import annotations

import pytest

import dataclasses
from pathlib import Path

from mcore_rl.config.reference import field_docs, render_reference, rows
from mcore_rl.runconfig import RLConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"


def test_checked_in_reference_is_current():
    assert REFERENCE.read_text() == render_reference(RLConfig), (
        "docs/reference/config.md is out of date with the config dataclasses' docstrings: "
        "regenerate it with `.venv/bin/python scripts/gen_config_reference.py`")


def test_every_field_is_listed_with_the_parents_default():
    keys = {k: d for k, _, d, _ in rows(RLConfig)}
    for f in dataclasses.fields(RLConfig):
        assert f.name in keys
    assert keys["train.optimizer.lr"] == "`1e-06`"
    assert keys["critic_train.optimizer.lr"] == "`1e-05`"  # the parent's default instance
    assert keys["steps"] == "`200`"
    assert keys["max_new_tokens"] == "`null`"  # derived to fit the model's context
    assert "logging.wandb.project" in keys  # an optional section's keys are listed too


def test_docstring_entries_are_parsed():
    @dataclasses.dataclass
    class Example:
        """Something.

        alpha: the first
            field, continued.
        beta / gamma: shared text. delta: inline entry.
        A new paragraph ends an entry.
        - epsilon null: a bullet case.

        Not an entry: omega is mentioned here.
        """

        alpha: int = 1
        beta: int = 2
        gamma: int = 3
        delta: int = 4
        epsilon: int | None = None
        omega: int = 5

    docs = field_docs(Example)
    assert docs["alpha"] == "the first field, continued."
    assert docs["beta"] == docs["gamma"] == "shared text."
    assert docs["delta"] == "inline entry."
    assert docs["epsilon"] == "a bullet case."
    assert docs["omega"] == "Not an entry: omega is mentioned here."
