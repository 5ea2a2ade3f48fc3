"""The `mcore-rl` entry point: --version, the config given positionally, whole help texts."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_rl.cli import _parse, build_parser


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def test_version(parser, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse(parser, ["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("mcore-rl ")


@pytest.mark.parametrize("argv, config, overrides", [
    # the config positionally, then overrides
    (["train", "configs/x.yaml", "steps=3"], Path("configs/x.yaml"), ["steps=3"]),
    # as --config, as before
    (["train", "--config", "configs/x.yaml", "steps=3"], Path("configs/x.yaml"), ["steps=3"]),
    # options after the positional config still parse
    (["train", "configs/x.yaml", "--out", "runs/a", "a.b=1"], Path("configs/x.yaml"), ["a.b=1"]),
    # demo: no config at all is the built-in demo
    (["demo", "steps=3"], None, ["steps=3"]),
    (["demo", "configs/tool_calc.yaml"], Path("configs/tool_calc.yaml"), []),
    # bench kinds keep their FILE string
    (["bench", "step", "configs/x.yaml", "untimed_steps=1"], "configs/x.yaml", ["untimed_steps=1"]),
    (["bench", "sync", "my_sync.yaml"], "my_sync.yaml", []),
])
def test_config_positionally_or_as_option(parser, argv, config, overrides):
    args = _parse(parser, argv)
    assert args.config == config
    assert args.overrides == overrides


@pytest.mark.parametrize("argv, message", [
    (["train", "steps=3"], "a config is required"),
    (["train", "--config", "a.yaml", "b.yaml"], "the config is given twice"),
])
def test_config_errors(parser, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        _parse(parser, argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def _descriptions(parser):
    """Every (prog, description) of the parser tree."""
    yield parser.prog, parser.description
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        for sub in dict.fromkeys(action.choices.values()):
            yield from _descriptions(sub)


def test_help_texts_are_whole_sentences(parser):
    for prog, text in _descriptions(parser):
        if text:
            assert text.rstrip().endswith((".", ")", ":")), f"{prog}: description cut: {text!r}"
