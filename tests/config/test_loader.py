"""The config loader's scalar rules: what YAML and `a.b=c` overrides may spell a number as."""

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.runconfig import RLConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


@pytest.mark.parametrize("override, expected", [
    ("warmup.train.optimizer.lr=2e-3", 2e-3),   # YAML 1.1 reads this as a string
    ("warmup.train.optimizer.lr=2.0e-3", 2e-3),
    ("warmup.train.optimizer.lr=1", 1.0),
])
def test_a_float_field_takes_every_spelling_of_a_number(override, expected):
    cfg = load_config(RLConfig, None, [override])
    assert cfg.warmup.train.optimizer.lr == expected
    assert isinstance(cfg.warmup.train.optimizer.lr, float)


@pytest.mark.parametrize("override", ["warmup.train.optimizer.lr=fast",
                                      "warmup.train.optimizer.lr=true"])
def test_a_float_field_refuses_what_is_not_a_number(override):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, None, [override])
    assert err.value.field == "warmup.train.optimizer.lr" and "expected a number" in str(err.value)


# YAML that does not parse, and where its parser says the problem is (1-based line:column)
SYNTAX_ERRORS = [
    ("model:\n  preset: tiny\n actor: [\n", 3, 2),      # a key indented off its mapping
    ("a: 1\nb: [1, 2\nc: 3\n", 3, 2),                    # an unclosed flow list
    ('a: "x\n', 2, 1),                                   # an unclosed quote
    ("a:\n\t- 1\n", 2, 1),                               # a tab as indentation
]


@pytest.mark.parametrize("text,line,col", SYNTAX_ERRORS)
def test_yaml_syntax_error_is_one_line_naming_file_line_column(tmp_path, text, line, col):
    from mcore_rl.config import ConfigFileError

    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileError) as err:
        load_config(RLConfig, path)
    message = str(err.value)
    assert message.startswith(f"{path}:{line}:{col}: "), message
    assert "\n" not in message and "<unicode string>" not in message
    assert isinstance(err.value, ConfigError)  # every command's `except ConfigError` takes it


def test_a_config_file_that_is_not_a_mapping_names_the_file(tmp_path):
    from mcore_rl.config import ConfigFileError

    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigFileError, match=r"list\.yaml: top level must be a mapping"):
        load_config(RLConfig, path)
    with pytest.raises(ConfigFileError, match=r"nope\.yaml: no such file"):
        load_config(RLConfig, tmp_path / "nope.yaml")


def test_check_config_returns_every_invalid_field():
    """Each component's fields are checked on their own: three independent mistakes, three
    errors naming their dotted fields (load_config raises the first of them)."""
    from mcore_rl.config import check_config

    overrides = ["actor.tp=0", "rollout.engines=0", "task.kind=bogus", "no_such_key=1"]
    cfg, errors = check_config(RLConfig, None, overrides)
    assert cfg is None
    assert {e.field for e in errors} == {"actor.tp", "rollout.engines", "task.kind",
                                         "no_such_key"}
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, None, overrides)
    assert str(err.value) == str(errors[0])
    cfg, errors = check_config(RLConfig, None, ["actor.tp=2"])
    assert errors == [] and cfg.actor.tp == 2
