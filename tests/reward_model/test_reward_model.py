"""The reward-model role: Megatron scores of an HF sequence classifier equal HF's
`AutoModelForSequenceClassification(...).logits[:, 0]` (right padding, pad_token_id set, fp32)
on variable-length rows — at TP2, PP2 and DP2 in one spawned gloo world, and end to end through
the Ray `RewardModelGroup` at TP2 (in the session's Ray). Bad checkpoints and configs fail
naming what is wrong."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_rl.config import ConfigError
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.hf_factory import make_hf_model_dir, make_hf_reward_model_dir
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.reward_model import (RewardModelConfig, RewardModelError,
                                           RewardModelGroup, check_reward_model_dir,
                                           pad_sequences)

PAD = 0
LLAMA = get_preset("micro").with_(layers=2)
QWEN2 = LLAMA.with_(family="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True,
                    rope_theta=1e6, norm_eps=1e-6)
_gen = torch.Generator().manual_seed(7)
# prompt/response token ids in [1, vocab): never the pad id. Rows 0 and 1 share their last
# token but not their prefix (the scores must still differ: context matters).
PROMPTS = [torch.randint(1, LLAMA.vocab, (k,), generator=_gen).tolist() for k in (4, 6, 3, 1, 7)]
RESPONSES = [torch.randint(1, LLAMA.vocab, (k,), generator=_gen).tolist() for k in (9, 2, 5, 3, 8)]
RESPONSES[1][-1] = RESPONSES[0][-1]


def _reward_dir(spec, path, **kwargs):
    """A random reward model, 2-D weights scaled x8 (HF's normal(0, 0.02) init leaves the
    hidden states close to the last token's embedding: the context would barely matter)."""
    out = make_hf_reward_model_dir(spec, path, seed=1, pad_token_id=PAD, **kwargs)
    state = load_file(out / "model.safetensors")
    save_file({k: (v * 8 if v.ndim == 2 else v).contiguous() for k, v in state.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
    return {"llama": _reward_dir(LLAMA, tmp_path_factory.mktemp("rm_llama")),
            "qwen2": _reward_dir(QWEN2, tmp_path_factory.mktemp("rm_qwen2"))}


def _hf_scores(hf_dir) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        str(hf_dir), dtype=torch.float32, local_files_only=True).eval()
    assert model.config.pad_token_id == PAD and model.config.num_labels == 1
    tokens, lengths = pad_sequences(PROMPTS, RESPONSES, PAD)
    mask = (torch.arange(tokens.shape[1]) < lengths.unsqueeze(1)).long()
    with torch.no_grad():
        return model(input_ids=tokens, attention_mask=mask).logits[:, 0]


# name: (model, grid, micro_batch_size) — 5 rows, so micro batches of 2 need a dummy row
GRIDS = {
    "llama_tp2": ("llama", dict(tp=2), 2),    # head replicated over TP, q/k/v interleave
    # SP: the head scores each rank's sequence shard and gathers over TP; rows of odd length
    # (longest 15) right-padded to even
    "llama_tp2_sp": ("llama", dict(tp=2, sequence_parallel=True), 2),
    "llama_pp2": ("llama", dict(pp=2), 2),    # head on the last stage, 1F1B over 3 micro batches
    "llama_dp2": ("llama", dict(dp=2), 2),    # rows split over DP, all-gathered
    "qwen2_tp2": ("qwen2", dict(tp=2), 4),    # q/k/v biases
}


def _score_on_grids(rank, world, dirs):
    """Per grid: the scores from the rank that returns them (None on the others)."""
    from mcore_rl.parallel.groups import init_training_groups
    from mcore_rl.reward_model import load_reward_model, score_batch

    tokens, lengths = pad_sequences(PROMPTS, RESPONSES, PAD)
    out = {}
    for name, (model, grid, mbs) in GRIDS.items():
        cfg = RewardModelConfig(enabled=True, hf_dir=str(dirs[model]),
                                parallel=ParallelConfig(**grid), micro_batch_size=mbs)
        rm = load_reward_model(cfg, init_training_groups(cfg.parallel))
        scores = score_batch(rm, tokens, lengths)
        out[name] = None if scores is None else scores.tolist()
    return out


def test_megatron_scores_equal_hf_on_tp_pp_dp(rm_dirs):
    results = run_on_ranks(_score_on_grids, 2, {k: str(v) for k, v in rm_dirs.items()},
                           timeout_s=300)
    refs = {model: _hf_scores(path) for model, path in rm_dirs.items()}
    for model, ref in refs.items():
        # the test has power: rows differ, and a shared last token does not mean equal scores
        assert float(ref.std()) > 0.1 and abs(float(ref[0] - ref[1])) > 0.1, ref
    for name, (model, _, _) in GRIDS.items():
        got = [r[name] for r in results if r[name] is not None]
        assert len(got) == 1, f"{name}: exactly one rank returns the scores"
        diff = (torch.tensor(got[0]) - refs[model]).abs().max()
        assert diff < 1e-5, f"{name}: max |megatron - HF| = {float(diff):.2e}"


def test_reward_model_group_tp2_end_to_end(ray_cluster, rm_dirs, tmp_path):
    from mcore_rl.launch.watchdog import WatchdogTimeout

    cfg = RewardModelConfig(enabled=True, hf_dir=str(rm_dirs["llama"]),
                            parallel=ParallelConfig(tp=2), micro_batch_size=2)
    ref = _hf_scores(rm_dirs["llama"])
    group = None
    try:
        group = RewardModelGroup(cfg, timeout_s=120, stack_dir=tmp_path / "stacks")
        pids = list(group.pids)
        assert len(set(pids)) == 2 and os.getpid() not in pids
        scores = group.score(PROMPTS, RESPONSES, PAD)
        assert scores.shape == (len(PROMPTS),) and scores.dtype == torch.float32
        assert float((scores - ref).abs().max()) < 1e-5
        # a missed deadline names the late ranks; the group still answers afterwards
        with pytest.raises(WatchdogTimeout, match="reward rank 0, reward rank 1"):
            group.score(PROMPTS, RESPONSES, PAD, timeout_s=1e-3)
        assert torch.equal(group.score(PROMPTS, RESPONSES, PAD), scores)
        group.shutdown()
        group = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "reward workers still running after shutdown"
    finally:
        if group is not None:
            group.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_layout_puts_the_score_head_on_the_last_stage_of_every_tp_rank():
    from mcore_rl.layouts import hf_shards, megatron_shards, vllm_shards
    from mcore_rl.models.hf_factory import hf_config_from_spec
    from mcore_rl.models.spec import ModelSpec

    rm = LLAMA.with_(architecture="LlamaForSequenceClassification", num_labels=1)
    assert ModelSpec.from_hf_config(hf_config_from_spec(rm, pad_token_id=PAD)) == rm
    # tie_word_embeddings means nothing without an LM head
    cfg = hf_config_from_spec(rm).to_dict() | {"tie_word_embeddings": True}
    assert not ModelSpec.from_hf_config(cfg).tied_embeddings
    assert set(hf_shards(rm).hf_shapes) - set(hf_shards(LLAMA).hf_shapes) == {"score.weight"}
    assert "lm_head.weight" not in hf_shards(rm).hf_shapes
    grid = ParallelConfig(tp=2, pp=2)
    smap = megatron_shards(rm, grid)
    for rank in range(grid.world_size):
        head = smap.ranks[rank].get("output_layer.weight")
        if grid.coords_of(rank)["pp"] == 0:
            assert head is None
        else:  # the whole [1, hidden] score head, replicated over TP
            assert head.shape == (1, rm.hidden)
            assert [p.hf_name for p in head.pieces] == ["score.weight"]
    assert "lm_head.weight" not in vllm_shards(rm, 2).ranks[0]


# --- bad input ------------------------------------------------------------------------------


def test_checkpoint_without_score_weight_names_file_and_tensor(rm_dirs, tmp_path):
    out = _reward_dir(LLAMA, tmp_path / "rm")
    state = load_file(out / "model.safetensors")
    del state["score.weight"]
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RewardModelError, match=r"model\.safetensors: no tensor 'score\.weight'"):
        check_reward_model_dir(out)
    # the group refuses before starting any worker (no Ray needed)
    with pytest.raises(RewardModelError, match="score.weight"):
        RewardModelGroup(RewardModelConfig(enabled=True, hf_dir=str(out)), timeout_s=60)


def test_checkpoint_with_two_labels_or_an_lm_head_is_refused(rm_dirs, tmp_path):
    two = make_hf_reward_model_dir(LLAMA, tmp_path / "two", seed=0, num_labels=2,
                                   pad_token_id=PAD)
    with pytest.raises(RewardModelError, match=r"config\.json: num_labels=2"):
        check_reward_model_dir(two)
    lm = make_hf_model_dir(LLAMA, tmp_path / "lm", seed=0)
    with pytest.raises(RewardModelError, match="causal LM"):
        check_reward_model_dir(lm)
    assert check_reward_model_dir(rm_dirs["llama"]).num_labels == 1


@pytest.mark.parametrize("kwargs,field", [
    (dict(enabled=True), "hf_dir"),
    (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(dtype="fp16"), "dtype"),
    (dict(coeff=math.nan), "coeff"),
    (dict(parallel=ParallelConfig(pp=2, vpp=2)), "parallel.vpp"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        RewardModelConfig(**kwargs)
    assert err.value.field == field


def test_grid_that_does_not_fit_the_model_names_the_field(rm_dirs):
    cfg = RewardModelConfig(enabled=True, hf_dir=str(rm_dirs["llama"]),
                            parallel=ParallelConfig(tp=8))
    with pytest.raises(ConfigError) as err:
        RewardModelGroup(cfg, timeout_s=60)
    assert err.value.field == "parallel.tp"


def test_the_old_timeout_key_says_where_it_moved():
    from mcore_rl.config import from_dict

    with pytest.raises(ConfigError, match=r"reward_model.timeout_s=30: this key moved: set "
                                          r"deadlines.reward_model_s"):
        from_dict(RewardModelConfig, {"timeout_s": 30}, prefix="reward_model")


def test_bad_batches_are_refused():
    from mcore_rl.reward_model import check_score_inputs

    with pytest.raises(RewardModelError, match="prompts: 2 rows but responses: 1"):
        pad_sequences([[1], [2]], [[3]], PAD)
    with pytest.raises(RewardModelError, match=r"prompts\[0\] \+ responses\[0\]: empty"):
        pad_sequences([[]], [[]], PAD)
    tokens = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(RewardModelError, match=r"lengths\[1\]=5"):
        check_score_inputs(tokens, torch.tensor([4, 5]), 10)
    with pytest.raises(RewardModelError, match=r"tokens: ids must be in \[0, 10\)"):
        check_score_inputs(tokens * 10, torch.tensor([4, 4]), 10)
