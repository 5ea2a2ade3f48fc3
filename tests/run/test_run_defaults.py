"""Issue #29: a config for your own model and data resolves to real-run values (the demos'
small ones live in their YAMLs), lengths are declared once and derived, micro batches are
derived, and nothing is cut silently."""

import dataclasses
import json

import pytest
import torch

from mcore_rl.config import ConfigError, load_config
from mcore_rl.rollout.engine import Completion
from mcore_rl.rollout.batches import build_batch, trained_tokens
from mcore_rl.runconfig import RLConfig, derived_micro_batch

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

DATA = "configs/data/word_problems.jsonl"
# model, data and its keys, reward function, response length, steps and batch sizes: nothing else
MINIMAL = ["model.hf_dir=/models/my-model", "task.kind=jsonl", f"task.path={DATA}",
           "task.prompt_key=question", "task.answer_key=answer",
           "task.reward_fn=mcore_rl.tasks.math:answer_reward", "max_new_tokens=48", "steps=50",
           "prompts_per_step=16", "samples_per_prompt=8"]


def test_minimal_user_config_resolves_with_no_demo_values():
    cfg = load_config(RLConfig, None, MINIMAL)
    # lengths: the prompt budget (default 1024) + the responses; a row holds seq_len + 1
    assert cfg.max_prompt_tokens == 1024
    assert cfg.train.seq_len == cfg.critic_train.seq_len == cfg.warmup.train.seq_len == 1071
    assert cfg.rollout.max_model_len == 1072
    # 128 sequences per DP rank and update; derived micro batches hold <= 16384 tokens
    assert cfg.train.micro_batch_size == derived_micro_batch(128, 1071) == 8
    assert cfg.train.forward_micro_batch_size is None  # the forward passes use the same
    assert cfg.warmup.max_steps == 0 and cfg.warmup.label_noise == 0.0
    assert cfg.actor.tp == cfg.actor.dp == 1 and cfg.updates_per_batch == 1
    assert cfg.train.optimizer.lr == 1e-6 and cfg.critic_train.optimizer.lr == 1e-5
    assert cfg.algorithm.clip_c == 3.0 and cfg.algorithm.grpo_eps == 1e-6  # verl's
    # none of the demo's values (seq_len 11, context 64, micro batches 128 / 256, lr 5e-4,
    # 1500 warm-up steps on actor TP2) leaks into it
    assert (cfg.train.seq_len, cfg.rollout.max_model_len) != (11, 64)
    assert cfg.train.micro_batch_size not in (64, 128)


def test_the_worked_example_config_loads():
    cfg = load_config(RLConfig, "configs/grpo_jsonl.yaml", [])
    assert (cfg.max_prompt_tokens, cfg.max_new_tokens) == (512, 1024)
    assert (cfg.train.seq_len, cfg.rollout.max_model_len) == (1535, 1536)
    assert cfg.task.chat_template and cfg.task.overlong_prompts == "error"


@pytest.mark.parametrize("overrides,field,problem", [
    (["train.seq_len=1000"], "train.seq_len",
     r"rows of seq_len \+ 1 = 1001 tokens cannot hold a sample of max_prompt_tokens \+ "
     r"max_new_tokens = 1024 \+ 48 = 1072 tokens: set train.seq_len >= 1071"),
    (["rollout.max_model_len=1071"], "rollout.max_model_len",
     r"cannot hold a sample of max_prompt_tokens \+ max_new_tokens = 1024 \+ 48 = 1072"),
    (["train.micro_batch_size=3"], "train.micro_batch_size",
     "must divide the 128 sequences each DP rank gets per update"),
    (["train.max_tokens_per_micro_batch=512"], "train.max_tokens_per_micro_batch",
     "seq_len=1071"),
    (["task.overlong_prompts=cut"], "task.overlong_prompts", "allowed values: error, filter"),
])
def test_explicit_values_are_checked_against_the_derived_ones(overrides, field, problem):
    with pytest.raises(ConfigError, match=problem) as err:
        load_config(RLConfig, None, MINIMAL + overrides)
    assert err.value.field == field


def test_lengths_fit_exactly_and_sequence_parallel_rounds_up():
    cfg = load_config(RLConfig, None, MINIMAL + ["train.seq_len=1071",
                                                 "rollout.max_model_len=1072"])
    assert cfg.train.seq_len == 1071  # explicit and just large enough
    sp = load_config(RLConfig, None, MINIMAL + ["actor.tp=2", "actor.sequence_parallel=true"])
    assert sp.train.seq_len == 1072 and sp.rollout.max_model_len == 1072


def test_derived_values_are_decided_by_one_pure_function_and_the_loader_returns_them():
    loaded = load_config(RLConfig, None, MINIMAL)
    written = RLConfig(model=loaded.model, task=loaded.task, max_new_tokens=48, steps=50,
                       prompts_per_step=16, samples_per_prompt=8)
    # as written: the nulls are still null, and deciding them changes nothing in it
    assert not written.is_derived and written.train.seq_len is None
    fields = written.derived_fields()
    assert written.train.seq_len is None and written.max_prompt_tokens is None
    assert (fields["max_prompt_tokens"], fields["max_new_tokens"]) == (1024, 48)
    assert (fields["train"].seq_len, fields["rollout"].max_model_len) == (1071, 1072)
    derived = written.derived()
    assert derived is not written and derived.is_derived
    assert derived.derived() is derived  # nothing left to derive: itself
    assert derived == loaded  # what the loader returns: what every reader gets
    # an explicit value is kept as written and checked against what it must hold
    assert written.derived_fields()["train"].micro_batch_size == 8
    with pytest.raises(ConfigError, match="train.seq_len >= 1071"):
        dataclasses.replace(derived, train=dataclasses.replace(derived.train, seq_len=1000))


def test_a_derived_field_takes_null_or_its_type_and_nothing_else():
    assert load_config(RLConfig, None, MINIMAL + ["train.seq_len=null"]).train.seq_len == 1071
    with pytest.raises(ConfigError, match="expected an integer") as err:
        load_config(RLConfig, None, MINIMAL + ["train.seq_len=long"])
    assert err.value.field == "train.seq_len"


def test_derived_micro_batch_is_a_divisor_under_the_token_cap():
    assert derived_micro_batch(64, 11) == 64          # small rows: one micro batch
    assert derived_micro_batch(256, 4095) == 4        # 4 x 4095 <= 16384
    assert derived_micro_batch(12, 2000) == 6         # the largest divisor of 12 <= 8
    assert derived_micro_batch(7, 100_000) == 1


def test_build_batch_refuses_a_sequence_longer_than_its_row():
    batch = build_batch([[1, 2, 3]], [[4, 5, 6]], 5, 0)  # 6 tokens: exactly seq_len + 1
    assert batch.mask.sum() == 3
    with pytest.raises(ValueError, match=r"row 1: prompt 3 \+ response 4 = 7 tokens do not fit "
                                         r"a row of train.seq_len \+ 1 = 6"):
        build_batch([[1, 2, 3], [1, 2, 3]], [[4, 5, 6], [4, 5, 6, 7]], 5, 0)


def test_trained_tokens_counts_and_refuses_an_empty_loss():
    completions = [Completion((4, 5, 6), (-0.1,) * 3, "stop"), Completion((7,), (-0.2,), "stop")]
    batch = build_batch([[1, 2], [1, 2]], [c.token_ids for c in completions], 8, 0)
    assert trained_tokens(completions, batch.mask) == {"response_tokens": 4.0,
                                                       "loss_tokens": 4.0}
    with pytest.raises(ValueError, match="4 sampled tokens but its loss mask none"):
        trained_tokens(completions, torch.zeros_like(batch.mask))


def _jsonl(path, prompts):
    path.write_text("".join(json.dumps({"question": p, "answer": "#### 1"}) + "\n"
                            for p in prompts))
    return path


def test_overlong_prompts_are_an_error_naming_the_line_or_filtered(tmp_path):
    from mcore_rl.tasks.jsonl import DatasetError, JsonlTask

    data = _jsonl(tmp_path / "d.jsonl", ["a b", "a b c d e f", "a", "a b c d e f g h"])
    words = lambda texts: [len(t.split()) for t in texts]  # noqa: E731 — one token a word
    with pytest.raises(DatasetError, match=rf"{data}:2: the prompt is 6 tokens .* longer than "
                                           r"max_prompt_tokens=4 \(2 of 4 prompts are\)"):
        JsonlTask(data).fit_prompts(words, 4, drop=False)
    task = JsonlTask(data, heldout_path=data)
    assert task.fit_prompts(words, 4, drop=True) == {"train": 2, "heldout": 2}
    drawn = task.train_examples(4, step=1, attempt=0, seed=0)
    assert sorted({e.prompt for e in drawn}) == ["a", "a b"]
    with pytest.raises(DatasetError, match="every prompt is longer than max_prompt_tokens=0"):
        JsonlTask(data).fit_prompts(words, 0, drop=True)


def test_filtering_is_for_jsonl_data_only():
    with pytest.raises(ConfigError, match="task.overlong_prompts='filter': drops rows of a "
                                          "jsonl dataset"):
        load_config(RLConfig, None, ["task.overlong_prompts=filter"])


def _model_dir(path, positions):
    """An HF model directory with only config.json, of context `positions`: what the lengths
    are derived from when model.hf_dir is on this machine."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "vocab_size": 300, "max_position_embeddings": positions}))
    return path


def _here(model_dir):
    return [f"model.hf_dir={model_dir}"] + [o for o in MINIMAL if not o.startswith(
        ("model.hf_dir=", "max_new_tokens="))]


@pytest.mark.parametrize("lengths,prompt,new", [
    (["max_new_tokens=48"], 464, 48),            # the prompt gets what the context leaves
    ([], 256, 256),                              # neither set: half the context each
    (["max_prompt_tokens=100"], 100, 412),       # the response gets the rest
    (["max_prompt_tokens=400", "max_new_tokens=112"], 400, 112),  # both, summing to 512
])
def test_null_lengths_fit_the_models_context(tmp_path, lengths, prompt, new):
    """Issue #43: a 512-token checkpoint with max_new_tokens 48 gets a prompt budget of 464,
    not 1024 (which preflight then refused naming train.seq_len, a field nobody set); the
    written config holds the numbers and loads back to the same run."""
    from mcore_rl.config import write_config

    cfg = load_config(RLConfig, None, _here(_model_dir(tmp_path / "m", 512)) + lengths)
    assert (cfg.max_prompt_tokens, cfg.max_new_tokens) == (prompt, new)
    assert (cfg.train.seq_len, cfg.rollout.max_model_len) == (prompt + new - 1, prompt + new)
    written = write_config(cfg, tmp_path / "config.yaml")
    assert load_config(RLConfig, written, []) == cfg


def test_a_long_context_keeps_the_real_run_defaults(tmp_path):
    """A context of 2048 or more leaves the defaults as they were: 1024 + 1024 (and 1024 for
    the prompt next to a short response); the context is read from model.preset when hf_dir
    is not here, from the demo spec for the built demo model."""
    cfg = load_config(RLConfig, None, _here(_model_dir(tmp_path / "m", 8192)))
    assert (cfg.max_prompt_tokens, cfg.max_new_tokens) == (1024, 1024)
    cfg = load_config(RLConfig, None, MINIMAL + ["model.preset=tiny"])  # 2048 positions
    assert (cfg.max_prompt_tokens, cfg.max_new_tokens) == (1024, 48)
    cfg = load_config(RLConfig, None, MINIMAL + ["model.preset=micro", "max_new_tokens=200"])
    assert (cfg.max_prompt_tokens, cfg.rollout.max_model_len) == (56, 256)
    demo = load_config(RLConfig, None, [])  # the built demo model: 64 positions
    assert (demo.max_prompt_tokens, demo.max_new_tokens, demo.rollout.max_model_len) == (
        32, 32, 64)


@pytest.mark.parametrize("lengths,field,problem", [
    (["max_prompt_tokens=400", "max_new_tokens=200"], "max_new_tokens",
     "max_prompt_tokens + max_new_tokens = 400 + 200 = 600 tokens exceed the model's context "
     "of 512 tokens (max_position_embeddings in {m}/config.json): set max_prompt_tokens + "
     "max_new_tokens <= 512"),
    (["max_new_tokens=512"], "max_new_tokens",
     "leaves no room for a prompt in the model's context of 512 tokens "
     "(max_position_embeddings in {m}/config.json): set max_new_tokens < 512"),
    (["max_prompt_tokens=600"], "max_prompt_tokens",
     "leaves no room for a response in the model's context of 512 tokens"),
])
def test_lengths_over_the_context_name_the_fields_that_were_set(tmp_path, lengths, field,
                                                                 problem):
    m = _model_dir(tmp_path / "m", 512)
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, None, _here(m) + lengths)
    assert err.value.field == field
    assert problem.format(m=m) in str(err.value)
    assert "seq_len" not in str(err.value) and "max_model_len" not in str(err.value)


def test_preflight_names_the_lengths_not_the_derived_fields(tmp_path, capsys):
    """`mcore-rl preflight` on lengths over the context: one problem naming the lengths that
    were set, exit 2; and a run sized on a shorter model than its lengths were derived for
    names the lengths too (the grid check), not train.seq_len / rollout.max_model_len."""
    from mcore_rl.cli import main
    from mcore_rl.run.preflight import preflight_run

    m = _model_dir(tmp_path / "m", 512)
    assert main(["preflight", "configs/grpo_jsonl.yaml", f"model.hf_dir={m}",
                 f"task.path={DATA}", "task.chat_template=false"]) == 2
    out = capsys.readouterr().out
    (error,) = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert error.startswith("ERROR [config] max_new_tokens=1024: max_prompt_tokens + "
                            "max_new_tokens = 512 + 1024 = 1536 tokens exceed the model's "
                            "context of 512 tokens"), error
    assert "train.seq_len" not in out and "rollout.max_model_len" not in out
    cfg = load_config(RLConfig, None, _here(m) + ["max_new_tokens=48"])
    problems = preflight_run(cfg, _model_dir(tmp_path / "short", 256))
    (seq,) = [p for p in problems if p.check == "seq-len"]
    assert seq.message == ("max_prompt_tokens + max_new_tokens = 464 + 48 = 512 tokens exceed "
                           "the model's max_position_embeddings=256")
    assert seq.fix == "max_prompt_tokens + max_new_tokens <= 256"


def test_a_multi_turn_episode_must_fit_the_models_context():
    from mcore_rl.config import check_config

    _, errors = check_config(RLConfig, "configs/tool_calc.yaml",
                             ["task.episode.max_total_tokens=100"])
    assert [str(e) for e in errors if e.field == "task.episode.max_total_tokens"] == [
        "task.episode.max_total_tokens=100: an episode must fit the model's context of 64 "
        "tokens (the built demo model's max_position_embeddings)"]
    cfg = load_config(RLConfig, "configs/tool_calc.yaml", ["max_new_tokens=null"])
    assert cfg.max_new_tokens == 40 - 7  # what the episode leaves after the prompt
