"""Issue #43: `task.reward_fn` (and `task.env`) may name a Python file, "path/to/file.py:function",
relative to the config file that sets it (on the command line: to the working directory). The
loader makes it absolute, so the run needs no PYTHONPATH, works from any working directory, and
the resolved config it writes (RUN_DIR/config.yaml) loads back. A missing file or function is
one ConfigError line naming task.reward_fn."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config, write_config
from mcore_rl.config.paths import code_ref
from mcore_rl.tasks import TaskConfig, build_reward

REWARDS = textwrap.dedent("""
    def score(prompt, response, answer):
        return 0.25 if response == answer else -1.0

    def two_args(prompt, response):
        return 0.0
""")


@pytest.fixture
def config_dir(tmp_path) -> Path:
    """configs/run.yaml with rewards/mine.py beside it, named relative to the YAML."""
    root = tmp_path / "configs"
    (root / "rewards").mkdir(parents=True)
    (root / "rewards" / "mine.py").write_text(REWARDS)
    (root / "run.yaml").write_text("task:\n  reward_fn: rewards/mine.py:score\n")
    return root


@pytest.mark.parametrize("value,expected", [
    ("rewards.py:f", "/cfg/rewards.py:f"),
    ("sub/dir/r.py:f", "/cfg/sub/dir/r.py:f"),
    ("../shared/r.py:f", "/shared/r.py:f"),
    ("/abs/r.py:f", "/abs/r.py:f"),                       # absolute: as it is
    ("mcore_rl.tasks.math:answer_reward", "mcore_rl.tasks.math:answer_reward"),  # a module
])
def test_code_ref_is_relative_to_the_config_directory(value, expected):
    assert code_ref(value, Path("/cfg")) == expected


def test_a_reward_file_loads_without_pythonpath_from_any_directory(config_dir, tmp_path):
    """In a fresh interpreter started elsewhere, PYTHONPATH unset: the config loads, its
    reward scores, and the config written back (as RUN_DIR/config.yaml) loads again."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = textwrap.dedent("""
        import sys
        from mcore_rl.config import load_config, write_config
        from mcore_rl.runconfig import RLConfig
        from mcore_rl.tasks import build_reward
        cfg = load_config(RLConfig, sys.argv[1])
        print(cfg.task.reward_fn)
        print(build_reward(cfg.task)("p", "42", "42"))
        write_config(cfg, "config.yaml")
        again = load_config(RLConfig, "config.yaml")
        print(again == cfg, build_reward(again.task)("p", "41", "42"))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", script, str(config_dir / "run.yaml")],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [f"{config_dir}/rewards/mine.py:score", "0.25",
                                        "True -1.0"]
    assert f"reward_fn: {config_dir}/rewards/mine.py:score" in (
        elsewhere / "config.yaml").read_text()


def test_an_override_is_relative_to_the_working_directory(config_dir, monkeypatch):
    monkeypatch.chdir(config_dir / "rewards")
    cfg = load_config(TaskConfig, None, ["reward_fn=mine.py:score"])
    assert cfg.reward_fn == f"{config_dir}/rewards/mine.py:score"
    assert build_reward(cfg)("p", "a", "a") == 0.25
    # a config in a dataclass built in code is left as given (relative to the working dir)
    monkeypatch.chdir(config_dir)
    assert build_reward(TaskConfig(reward_fn="rewards/mine.py:score"))("p", "a", "b") == -1.0


def test_written_back_the_path_is_absolute_and_loads(config_dir, tmp_path):
    (config_dir / "task.yaml").write_text("reward_fn: rewards/mine.py:score\n")
    cfg = load_config(TaskConfig, config_dir / "task.yaml")
    out = write_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(TaskConfig, out) == cfg
    assert Path(cfg.reward_fn.rpartition(":")[0]).is_absolute()


@pytest.mark.parametrize("value,problem", [
    ("rewards/nope.py:score", "rewards/nope.py: no such file"),
    ("rewards/mine.py:nothing", "rewards/mine.py has no attribute 'nothing'"),
    ("rewards/mine.py:two_args", "must accept (prompt, response, answer)"),
    ("rewards/broken.py:score", "rewards/broken.py: loading it raised SyntaxError: "),
])
def test_a_missing_file_or_function_is_one_line_naming_task_reward_fn(config_dir, value,
                                                                      problem):
    from mcore_rl.runconfig import RLConfig

    (config_dir / "rewards" / "broken.py").write_text("def score(:\n")
    (config_dir / "run.yaml").write_text(f"task:\n  reward_fn: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, config_dir / "run.yaml")
    assert err.value.field == "task.reward_fn"
    message = str(err.value)
    assert message.startswith(f"task.reward_fn='{config_dir}/{value}': ")
    assert problem in message and "\n" not in message


def test_an_environment_file_is_relative_to_the_config_too(config_dir, tmp_path):
    (config_dir / "envs.py").write_text(textwrap.dedent("""
        from mcore_rl.tasks.envs.tool_env import calculator_env

        def my_env(example, reward_fn, tool_format=None):
            return calculator_env(example, reward_fn, tool_format)
    """))
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "2*3=", "answer": "6"}\n')
    (config_dir / "task.yaml").write_text(f"kind: jsonl\npath: {data}\nenv: envs.py:my_env\n")
    cfg = load_config(TaskConfig, config_dir / "task.yaml")
    assert cfg.env == f"{config_dir}/envs.py:my_env" and cfg.multi_turn
    (config_dir / "task.yaml").write_text(f"kind: jsonl\npath: {data}\nenv: envs.py:nope\n")
    with pytest.raises(ConfigError, match=r"^env='.*/envs.py:nope': .*envs.py has no attribute"):
        load_config(TaskConfig, config_dir / "task.yaml")
