"""The tool task: prompts, the reward (exact answer after the last observation, + EOS), warm-up
traces and their noise, a tokenizer that keeps the tool tags whole, and its TaskConfig."""

import pytest

from mcore_rl.config import ConfigError
from mcore_rl.tasks import tokenizer as tk
from mcore_rl.tasks.config import TaskConfig, build_task
from mcore_rl.tasks.tool_calc import ToolCalcTask, expected_answer, reward

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def test_reward_is_the_exact_answer_after_the_last_observation():
    p = "37*45="
    assert reward(p, "<call>calc: 37*45</call><result>1665</result>1665</s>") == 1.0
    assert reward(p, "1665</s>") == 1.0  # right without the tool is right
    assert reward(p, "<call>calc: 37*45</call><result>1665</result>1665") == 0.0  # no EOS
    assert reward(p, "<call>calc: 37*45</call><result>1665</result>1666</s>") == 0.0
    assert reward(p, "1665</s><result>1</result>") == 0.0
    assert reward(p, "<result>1665</result> 1665</s>") == 0.0
    assert reward(p, "x</s>", "7") == 0.0 and reward(p, "7</s>", "7") == 1.0
    assert expected_answer("99*99=") == "9801" and expected_answer("09*9=") is None
    with pytest.raises(ValueError, match="not a product"):
        reward("1+1=", "2</s>")


def test_examples_and_heldout_split():
    task = ToolCalcTask()
    train = task.train_examples(200, step=3, attempt=0, seed=0)
    assert train == task.train_examples(200, step=3, attempt=0, seed=0)
    for e in train:
        a, b = map(int, e.prompt[:-1].split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and e.answer == str(a * b)
        assert not task.is_heldout(a, b)
    held = task.heldout_examples(64, seed=0)
    assert len({e.prompt for e in held}) == 64
    assert all(task.is_heldout(*map(int, e.prompt[:-1].split("*"))) for e in held)


def test_warmup_traces_have_room_for_rl():
    task = ToolCalcTask()
    clean = task.warmup_examples(100, seed=1, p=0.0)
    assert all(t == task.trace(*map(int, p[:-1].split("*"))) for p, t in clean)
    noisy = task.warmup_examples(2000, seed=1, p=0.4)
    tool = [(p, t) for p, t in noisy if t.startswith("<call>")]
    assert 0.55 < len(tool) / len(noisy) < 0.65  # 40 % answer without the tool
    copied = sum(t.endswith(expected_answer(p)) for p, t in tool) / len(tool)
    assert 0.1 < copied < 0.3  # 4 digits kept each with p 0.6 + 0.04: ~0.2
    with pytest.raises(ValueError):
        task.warmup_examples(1, seed=0, p=1.5)


def test_tokenizer_keeps_the_tags_whole(tmp_path):
    tok = tk.load_tokenizer(tk.build_tokenizer_dir(tmp_path, ToolCalcTask(), vocab_size=64))
    for tag in ("<call>", "</call>", "<result>", "</result>"):
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1, tag
    text = "<call>calc: 37*45</call><result>error: division by zero</result>1665"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tk.response_text(ids + [tok.eos_token_id], tok) == text + "</s>"


def test_task_config():
    cfg = TaskConfig(kind="tool_calc")
    assert cfg.multi_turn and cfg.env_path == "mcore_rl.tasks.envs.tool_env:calculator_env"
    assert cfg.reward_path == "mcore_rl.tasks.tool_calc:reward" and cfg.has_targets
    assert isinstance(build_task(cfg), ToolCalcTask)
    assert not TaskConfig().multi_turn  # addition stays single-turn
    assert TaskConfig(env="mcore_rl.tasks.envs.tool_env:tools_env").multi_turn
    with pytest.raises(ConfigError, match="digits"):
        TaskConfig(kind="tool_calc", digits=5)
    with pytest.raises(ConfigError, match="env.*must accept"):
        TaskConfig(env="mcore_rl.tasks.envs.tools:lookup")
    with pytest.raises(ConfigError, match="env"):
        TaskConfig(env="no.such.module:f")
    with pytest.raises(ConfigError, match="chat_template"):
        TaskConfig(kind="tool_calc", chat_template=True)
