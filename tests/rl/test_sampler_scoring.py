"""Issue #43: what the engines and the reward function receive, through the sampler's real
encoding and scoring path (`Sampler.collect`: draw → encode_all → generate → score) with a real
HF tokenizer that has a chat template, engines faked. A messages prompt reaches the engines as
exactly `apply_chat_template(..., tokenize=True)` and the reward as exactly its
`tokenize=False` text; a reward that raises stops the step naming the sample (RewardFailed), or
scores 0 and is counted in `reward/errors` (task.reward_errors: zero); a batch generated ahead
whose reward raised is raised by its own step, never by the sync before it, and is left out of
the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_rl.config import load_config
from mcore_rl.launch.timing import PhaseTimer
from mcore_rl.rl.sampler import Sampler
from mcore_rl.rollout.engine import Completion
from mcore_rl.rollout.pipeline import RolloutPipeline
from mcore_rl.runconfig import RLConfig
from mcore_rl.tasks.base import Example, RewardFailed
from mcore_rl.tasks.jsonl import JsonlTask
from tests.support.user_model import WORD_PROBLEMS, bpe_chat_tokenizer

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

SYSTEM = {"role": "system", "content": "You are a careful tutor. End with #### and the number."}


@pytest.fixture(scope="module")
def tok():
    rows = [json.loads(line) for line in WORD_PROBLEMS.read_text().splitlines() if line.strip()]
    return bpe_chat_tokenizer([r["question"] + "\n" + r["answer"] for r in rows])


@pytest.fixture
def chat_data(tmp_path):
    """Four word problems as messages with a system turn; line 3 is a text prompt."""
    rows = [json.loads(line) for line in WORD_PROBLEMS.read_text().splitlines()][:4]
    lines = [{"messages": [SYSTEM, {"role": "user", "content": r["question"]}],
              "answer": r["answer"]} for r in rows]
    lines[2] = {"messages": rows[2]["question"], "answer": {"value": 3}}
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


class FakeEngines:
    """Engines that record the prompt ids they get and answer each with `n` short samples."""

    def __init__(self):
        self.prompts = []

    def generate(self, prompts, sampling, timeout_s=None, routing_start=None):
        self.prompts += [list(p) for p in prompts]
        return [[Completion((7 + j,), (-1.0,), "length") for j in range(sampling.n)]
                for _ in prompts]


class NoKills:
    def inject(self, phase):
        pass


def sampler_for(path, tok, reward, *overrides) -> tuple[Sampler, FakeEngines]:
    cfg = load_config(RLConfig, None, [
        "task.kind=jsonl", f"task.path={path}", "task.prompt_key=messages",
        "model.hf_dir=/not/here", "warmup.max_steps=0", "prompts_per_step=4",
        "samples_per_prompt=2", "max_prompt_tokens=128", "max_new_tokens=8", *overrides])
    engines = FakeEngines()
    task = JsonlTask(path, prompt_key="messages", chats=True)
    return Sampler(cfg, tokenizer=tok, task=task, reward=reward, multi_turn=None,
                   engines=engines, reward_model=None, recovery=None, kills=NoKills(),
                   watchdog=None), engines


def rendered(tok, example: Example, tokenize: bool):
    messages = ([{"role": "user", "content": example.prompt}] if isinstance(example.prompt, str)
                else [{"role": m.role, "content": m.content} for m in example.prompt])
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize,
                                   **({"return_dict": False} if tokenize else {}))


@pytest.mark.parametrize("chat_template", [False, True])
def test_the_reward_and_the_engines_get_exactly_the_rendered_chat_template(
        chat_data, tok, chat_template):
    seen = []

    def reward(prompt, response, answer):
        seen.append((prompt, answer))
        return float(len(seen) % 2)

    sampler, engines = sampler_for(chat_data, tok, reward,
                                   f"task.chat_template={str(chat_template).lower()}")
    rollouts = sampler.collect(1, PhaseTimer())
    examples = rollouts.examples
    assert sorted(e.source for e in examples) == [f"{chat_data}:{i}" for i in range(1, 5)]
    for example, ids, engine_ids in zip(examples, rollouts.prompt_ids, engines.prompts):
        is_text = isinstance(example.prompt, str)
        if is_text and not chat_template:  # text as it is, with the tokenizer's specials
            assert engine_ids == ids == tok(example.prompt)["input_ids"]
            want = example.prompt
        else:  # system turn and all, the generation prompt, no special token added twice
            assert engine_ids == ids == rendered(tok, example, tokenize=True)
            want = rendered(tok, example, tokenize=False)
            if not is_text:
                assert want.startswith("<|im_start|>system\nYou are a careful tutor.")
            assert want.endswith("<|im_start|>assistant\n")
        got = [p for p, _ in seen if p == want]
        assert len(got) == 2  # each of the prompt's samples
    assert len(seen) == 8
    # the answer that is a JSON object reaches the reward as its JSON text
    assert ('{"value": 3}' in [a for _, a in seen])
    assert rollouts.stats["reward/errors"] == 0.0


def test_a_raising_reward_stops_the_step_naming_the_sample(chat_data, tok):
    def reward(prompt, response, answer):
        if answer == '{"value": 3}':
            raise ValueError("no final\n  answer")
        return 1.0

    sampler, _ = sampler_for(chat_data, tok, reward)
    with pytest.raises(RewardFailed) as failed:
        sampler.collect(4, PhaseTimer())
    message = str(failed.value)
    assert f"({chat_data}:3): ValueError: no final answer" in message
    assert message.startswith("the reward function raised on step 4, prompt ")
    assert " sample 0 " in message and "\n" not in message
    assert failed.value.example.source == f"{chat_data}:3"
    assert isinstance(failed.value.error, ValueError)


def test_zero_mode_scores_the_raising_samples_0_and_counts_them(chat_data, tok):
    def reward(prompt, response, answer):
        if answer == '{"value": 3}':
            raise ValueError("bad answer")
        return 1.0

    sampler, _ = sampler_for(chat_data, tok, reward, "task.reward_errors=zero")
    rollouts = sampler.collect(1, PhaseTimer())
    assert rollouts.stats["reward/errors"] == 2.0  # the one prompt's 2 samples
    by_answer = {e.answer: s for e, s in zip(rollouts.examples, rollouts.scores)}
    assert by_answer['{"value": 3}'] == [0.0, 0.0]
    assert all(s == [1.0, 1.0] for a, s in by_answer.items() if a != '{"value": 3}')


def test_a_generated_prompt_is_named_by_its_text():
    failed = RewardFailed(step=2, prompt_index=5, sample_index=1,
                          example=Example("37+05=", "042"), error=ZeroDivisionError("div"))
    assert str(failed) == ("the reward function raised on step 2, prompt 5 sample 1 (prompt "
                           "'37+05='): ZeroDivisionError: div")


class RewardFailsAt:
    """A pipeline's collect whose reward raises on the batch of `step`."""

    def __init__(self, step):
        self.step, self.generated = step, []

    def collect(self, step, timer):
        self.generated.append(step)
        if step == self.step:
            raise RewardFailed(step=step, prompt_index=0, sample_index=0,
                               example=Example("p", "a", "d.jsonl:9"), error=ValueError("x"))
        return _Batch(step)


class _Batch:
    def __init__(self, step):
        self.step = step

    def to_state(self):
        return {"step": self.step}


def test_a_batch_ahead_whose_reward_raised_fails_its_own_step_and_is_not_saved(tmp_path):
    """one_step (k=1): batch 3 is generated during step 2; waiting for it before step 2's sync
    does not raise (step 2 completes), step 3's take raises it, and the checkpoint written
    after step 2 leaves it out (a resumed run generates it again)."""
    run = RewardFailsAt(3)
    p = RolloutPipeline(run.collect, max_staleness=1, last_step=5,
                        wait=lambda f: f.result(timeout=30))
    for step in (1, 2):
        batch, _ = p.take(step, PhaseTimer())
        assert batch.step == step
        p.quiesce(PhaseTimer(), (0.0, 1.0))  # the sync of this step: batch 3 is done by now
    assert 3 in run.generated
    state = p.state()
    assert [b["step"] for b in state["batches"]] == []  # 3 failed: not saved
    torch.save(state, tmp_path / "rollout_buffer.pt")
    with pytest.raises(RewardFailed, match=r"step 3, .*\(d.jsonl:9\): ValueError: x"):
        p.take(3, PhaseTimer())
    p.shutdown()
