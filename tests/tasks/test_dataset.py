"""Tasks behind the `Task` API: the JSONL dataset (deterministic per-epoch order, epoch wrap,
resume = same examples, errors naming file/line/key), TaskConfig validation and build_task,
and the addition task drawing exactly the prompts the controller drew before the API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.config.seeds import derive_seed
from mcore_rl.tasks import AdditionTask, Example, TaskConfig, build_reward, build_task
from mcore_rl.tasks.jsonl import DatasetError, JsonlTask
from mcore_rl.tasks.tokenizer import encode_prompt

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

DATA = Path(__file__).resolve().parents[2] / "configs" / "data"
TRAIN, HELDOUT = DATA / "word_problems.jsonl", DATA / "word_problems_heldout.jsonl"


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def numbered(tmp_path) -> JsonlTask:
    """10 examples whose prompt is their line index."""
    return JsonlTask(_write(tmp_path / "n.jsonl",
                            [{"question": str(i), "answer": str(i)} for i in range(10)]))


def test_epoch_is_a_permutation_and_deterministic(numbered):
    seen = [int(e.prompt) for k in range(1, 6)
            for e in numbered.train_examples(2, step=k, attempt=0, seed=3)]
    assert sorted(seen) == list(range(10))                   # 5 steps × 2 = one epoch
    assert seen != list(range(10))                           # shuffled
    again = [int(e.prompt) for k in range(1, 6)
             for e in numbered.train_examples(2, step=k, attempt=0, seed=3)]
    assert again == seen
    other = [int(e.prompt) for k in range(1, 6)
             for e in numbered.train_examples(2, step=k, attempt=0, seed=4)]
    assert other != seen                                     # the seed picks the order


def test_epoch_wrap_and_resume_position(numbered):
    # 3 per step over 10 examples: step 4 takes the last of epoch 0 and two of epoch 1.
    stream = [e.prompt for k in range(1, 8)
              for e in numbered.train_examples(3, step=k, attempt=0, seed=0)]
    assert sorted(stream[:10]) == sorted(stream[10:20]) == [str(i) for i in range(10)]
    assert stream[:10] != stream[10:20]                      # a fresh order each epoch
    # a run resumed at step 4 (a new task object: nothing cached) reads the same examples
    fresh = JsonlTask(numbered.path)
    assert [e.prompt for e in fresh.train_examples(3, step=4, attempt=0, seed=0)] == stream[9:12]


def test_extra_attempts_do_not_shift_the_stream(numbered):
    a1 = numbered.train_examples(4, step=2, attempt=1, seed=0)
    assert a1 == numbered.train_examples(4, step=2, attempt=1, seed=0)
    assert a1 != numbered.train_examples(4, step=2, attempt=2, seed=0)
    assert numbered.train_examples(2, step=3, attempt=0, seed=0) == JsonlTask(
        numbered.path).train_examples(2, step=3, attempt=0, seed=0)
    with pytest.raises(ValueError, match="steps count from 1"):
        numbered.train_examples(2, step=0, attempt=0, seed=0)


def test_sample_dataset_and_heldout():
    task = JsonlTask(TRAIN, heldout_path=HELDOUT)
    assert len(task.train) == 8 and len(task.heldout) == 4
    first = task.train[0]
    assert first.prompt.startswith("Tom has 3 boxes") and first.answer.endswith("#### 29")
    held = task.heldout_examples(3, seed=1)
    assert held == task.heldout_examples(3, seed=1) and len(set(held)) == 3
    with pytest.raises(ValueError, match="asked for 5 held-out examples, the file has 4"):
        task.heldout_examples(5, seed=0)
    with pytest.raises(ValueError, match="set task.heldout_path"):
        JsonlTask(TRAIN).heldout_examples(1, seed=0)
    with pytest.raises(ValueError, match="no supervised warm-up targets"):
        task.warmup_examples(4, seed=0, p=0.4)


def test_sample_dataset_rewards_its_own_solutions():
    """Each reference solution, given as the response, earns reward 1 with the default jsonl
    reward; a wrong final answer earns 0."""
    cfg = TaskConfig(kind="jsonl", path=str(TRAIN))
    task, reward = build_task(cfg), build_reward(cfg)
    for ex in task.train_examples(8, step=1, attempt=0, seed=0):
        assert reward(ex.prompt, ex.answer, ex.answer) == 1.0
        assert reward(ex.prompt, "#### 123456", ex.answer) == 0.0


@pytest.mark.parametrize("rows,message", [
    (['{"question": "q", "answer": "1"}', '{"question": "q2"}'],
     "bad.jsonl:2: missing key 'answer' (has: question)"),
    (['{"question": "q", "answer": "1"}', "", "{not json"], "bad.jsonl:3: not valid JSON"),
    (['["q", "a"]'], "bad.jsonl:1: expected a JSON object, got list"),
    ([], "bad.jsonl: no examples"),
])
def test_dataset_errors_name_file_line_and_key(tmp_path, rows, message):
    path = _write(tmp_path / "bad.jsonl", rows) if rows else tmp_path / "bad.jsonl"
    if not rows:
        path.write_text("\n")
    with pytest.raises(DatasetError) as err:
        JsonlTask(path)
    assert message in str(err.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DatasetError, match="nope.jsonl: no such file"):
        build_task(TaskConfig(kind="jsonl", path=str(tmp_path / "nope.jsonl")))


def test_custom_keys(tmp_path):
    path = _write(tmp_path / "k.jsonl", [{"prompt": "2+2?", "target": "4"}])
    task = build_task(TaskConfig(kind="jsonl", path=str(path), prompt_key="prompt",
                                 answer_key="target"))
    assert task.train_examples(1, step=1, attempt=0, seed=0) == [Example("2+2?", "4")]


def test_addition_task_draws_each_step_and_attempt_from_its_own_stream():
    task = build_task(TaskConfig(digits=2))
    draws = {}
    for seed, step, attempt in [(0, 1, 0), (0, 7, 2), (5, 3, 1), (0, 2, 0), (1, 1, 0)]:
        drawn = AdditionTask(digits=2).prompts(32, seed=derive_seed(seed, "data", step, attempt))
        examples = task.train_examples(32, step=step, attempt=attempt, seed=seed)
        assert [e.prompt for e in examples] == drawn
        draws[seed, step, attempt] = drawn
        for e in examples:
            a, b = map(int, e.prompt[:-1].split("+"))
            assert e.answer == f"{a + b:03d}"
    assert len({tuple(d) for d in draws.values()}) == len(draws)  # no step repeats another
    held = task.heldout_examples(16, seed=0)
    assert [e.prompt for e in held] == AdditionTask().heldout_prompts(16, seed=0)
    # the addition reward takes the 3-argument call and still the old 2-argument one
    reward = build_reward(TaskConfig())
    e = held[0]
    assert reward(e.prompt, e.answer + "</s>", e.answer) == reward(e.prompt, e.answer + "</s>") \
        == 1.0


@pytest.mark.parametrize("overrides,field,problem", [
    (["kind=csv"], "kind", "allowed values: addition, jsonl, tool_calc"),
    (["kind=jsonl"], "path", "needs a JSONL file"),
    (["path=/data/x.jsonl"], "path", 'only for kind "jsonl"'),
    (["digits=0"], "digits", "must be in [1, 18]"),
    (["chat_template=true"], "chat_template", "has no chat template"),
    (["reward_fn=nomodule_xyz:f"], "reward_fn", "No module named 'nomodule_xyz'"),
    (["reward_fn=mcore_rl.tasks.math:nothing"], "reward_fn", "nothing"),
    (["reward_fn=math:sqrt"], "reward_fn", "must accept (prompt, response, answer)"),
    (["reward_fn=mcore_rl.tasks.math"], "reward_fn", "expected 'package.module:function'"),
    (["kind=jsonl", "path=x.jsonl", "answer_key=question"], "prompt_key", "two different"),
])
def test_task_config_errors_name_the_field(overrides, field, problem):
    with pytest.raises(ConfigError) as err:
        load_config(TaskConfig, None, overrides)
    assert err.value.field == field
    assert problem in str(err.value)


def test_chat_template_prompt(tmp_path):
    """encode_prompt with chat_template wraps the prompt as a user turn (HF tokenizer with a
    template); a tokenizer without one is a clear error."""
    from mcore_rl.tasks.tokenizer import build_tokenizer_dir, load_tokenizer

    tok = load_tokenizer(build_tokenizer_dir(tmp_path / "tok"))
    assert encode_prompt(tok, "12+34=") == [1] + tok("12+34=", add_special_tokens=False)[
        "input_ids"]
    with pytest.raises(ValueError, match="has no chat template"):
        encode_prompt(tok, "12+34=", chat_template=True)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    ids = encode_prompt(tok, "12+34", chat_template=True)
    assert ids == tok("12+34=", add_special_tokens=False)["input_ids"]
