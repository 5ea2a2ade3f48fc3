"""The memory planner against published figures (Megatron-Core's distributed-optimizer table,
Korthikanti et al. 2022 Table 2, Llama 3 70B's KV bytes per token), its own consistency, and
the shipped GPU configs. Pure arithmetic: no process groups, no megatron import."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_rl.cli import main
from mcore_rl.config import load_config
from mcore_rl.models.presets import get_preset
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.planning.knobs import plan_with_suggestions
from mcore_rl.planning.memory import (
    ActivationModel,
    in_flight_layers,
    kv_bytes_per_token,
    layer_activation_bytes,
    mcore_stage_params,
    plan_memory,
    state_bytes_per_param,
    POLICY_LOSS_FP32_ROWS,
    training_rank,
    vllm_rank_params,
)
from mcore_rl.planning.sized import TRAINER_GRAD_DTYPE, GiB, SizedRun, sized_run, with_overrides
from mcore_rl.runconfig import RLConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "gpu"
LLAMA3_70B = get_preset("llama3-70b")


def gpu_shape(name: str, overrides: list[str] | None = None) -> SizedRun:
    """The planner's view of a shipped GPU run config (RLConfig YAML)."""
    return sized_run(load_config(RLConfig, CONFIGS / f"{name}.yaml", overrides),
                     cuda_available=False)


# GPT-3 175B, the paper's shape: a = 96 heads, h = 12288, ffn = 4h, s = 2048, L = 96.
GPT3 = ModelSpec(family="llama", architecture="LlamaForCausalLM", hidden=12288, ffn=4 * 12288,
                 heads=96, kv_heads=96, head_dim=128, layers=96, vocab=51200)

STATE_NAMES = ("weights", "grads", "main params", "main grads", "adam m, v")

# Megatron-Core developer guide, "Distributed Optimizer": theoretical bytes per parameter.
MEGATRON_TABLE = [
    # dtype, grad dtype, distributed optimizer, dp, bytes/param
    ("bf16", "bf16", False, 8, 20),          # fp16/bf16 params, fp16/bf16 grads: 20
    ("bf16", "bf16", True, 8, 4 + 16 / 8),   # ... with the distributed optimizer: 4 + 16/d
    ("bf16", "fp32", False, 8, 18),          # bf16 params, fp32 grads: 18
    ("bf16", "fp32", True, 8, 6 + 12 / 8),   # ... 6 + 12/d
    ("bf16", "fp32", True, 2, 6 + 12 / 2),
    ("fp32", "fp32", False, 8, 16),          # fp32 params and grads: 16
    ("fp32", "fp32", True, 8, 8 + 8 / 8),    # ... 8 + 8/d
]


@pytest.mark.parametrize("dtype,grad_dtype,dist_opt,dp,published", MEGATRON_TABLE)
def test_llama3_70b_training_states_match_megatron_table(dtype, grad_dtype, dist_opt, dp,
                                                         published):
    """Every pipeline stage of a 70B grid holds exactly `published` bytes per local param."""
    assert state_bytes_per_param(dtype, grad_dtype, dist_opt, dp).total == pytest.approx(
        published)
    run = gpu_shape("llama3-70b", [f"actor.dp={dp}", f"actor.use_distributed_optimizer={dist_opt}",
                                   f"train.dtype={dtype}"])
    total_params = 0
    for stage in range(4):
        params = mcore_stage_params(LLAMA3_70B, run.cfg.actor, stage)
        if grad_dtype == TRAINER_GRAD_DTYPE:  # the trainer's grads: what the planner sizes
            rank = training_rank(run, LLAMA3_70B, "actor", stage)
            states = sum(c.bytes for c in rank.components if c.name in STATE_NAMES)
            assert states / params == pytest.approx(published, rel=1e-12)
        total_params += params * 8  # 8 TP ranks
    # Rank shards add up to the model, plus megatron's vocab padding (to 128 · tp rows) and
    # the norms every TP rank keeps whole.
    spec = LLAMA3_70B
    padding = 2 * (spec.mcore_padded_vocab(8) - spec.vocab) * spec.hidden
    replicated = 7 * (2 * spec.layers + 1) * spec.hidden
    assert total_params == spec.num_params() + padding + replicated


def _per_layer(model: ActivationModel, s=2048, b=1, spec=GPT3) -> float:
    return layer_activation_bytes(spec, s, b, model)


def test_paper_gpt_layer_reproduces_korthikanti_table_2():
    s, b, h, a, t = 2048, 1, GPT3.hidden, GPT3.heads, 8
    sbh = s * b * h
    paper = ActivationModel.paper(act_bytes=2)
    assert _per_layer(paper) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert _per_layer(paper.__class__.paper(act_bytes=2, tp=t)) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert _per_layer(ActivationModel.paper(act_bytes=2, tp=t, sequence_parallel=True)) == \
        pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert _per_layer(ActivationModel.paper(act_bytes=2, tp=t, sequence_parallel=True,
                                            recompute="selective")) == pytest.approx(
        34 * sbh / t)
    assert _per_layer(ActivationModel.paper(act_bytes=2, recompute="full")) == \
        pytest.approx(2 * sbh)


@pytest.mark.parametrize("pp,vpp,m,stage,expect_layers", [
    (4, None, 8, 0, 96),                     # 1F1B: first stage holds pp micro batches = L
    (4, None, 8, 3, 24),                     # last stage: one micro batch
    (4, None, 2, 0, 48),                     # fewer micro batches than stages: m of them
    (4, 2, 8, 0, 96 * (1 + 3 / (4 * 2))),    # interleaved: L · (1 + (p - 1)/(p·v))
    (4, 3, 8, 0, 96 * (1 + 3 / (4 * 3))),
    (4, 2, 4, 0, 96),                        # m = pp: every micro batch in warm-up (m·v chunks)
    (1, None, 8, 0, 96),                     # no pipeline: one micro batch of all layers
])
def test_in_flight_layers(pp, vpp, m, stage, expect_layers):
    par = ParallelConfig(pp=pp, vpp=vpp)
    assert in_flight_layers(par, 96, stage, m) == pytest.approx(expect_layers)


def test_kv_cache_and_vllm_weights():
    # Llama 3 70B, bf16: 2 · 80 layers · 8 kv heads · 128 · 2 B = 320 KiB per token.
    assert kv_bytes_per_token(LLAMA3_70B, 1, 2) == 320 * 1024
    assert kv_bytes_per_token(LLAMA3_70B, 8, 2) == 40 * 1024
    # tp 16 > 8 kv heads: each rank keeps one (replicated) kv head.
    assert kv_bytes_per_token(LLAMA3_70B, 16, 2) == 40 * 1024
    spec = get_preset("llama3-8b")
    vocab_pad = 2 * (-(-spec.vocab // 64) * 64 - spec.vocab) * spec.hidden
    assert vllm_rank_params(spec, 1) == spec.num_params() + vocab_pad
    # tp 2: half of everything but the replicated norms.
    norms = (2 * spec.layers + 1) * spec.hidden
    assert vllm_rank_params(spec, 2) == (spec.num_params() + vocab_pad - norms) // 2 + norms


@pytest.mark.parametrize("name", ["llama3-8b", "llama2-13b", "llama3-70b"])
def test_gpu_configs_fit_80_gib(name):
    run = gpu_shape(name)
    assert run.cluster.device_gib == 80
    plan = plan_memory(run)
    assert plan.fits, plan.peak_bytes / GiB
    assert plan.peak_bytes > 0.5 * plan.device_bytes  # and they use the devices


def _too_big() -> SizedRun:
    return gpu_shape("llama3-70b", ["actor.pp=2", "actor.dp=2", "train.recompute=none",
                                    "actor.sequence_parallel=false", "train.micro_batch_size=2"])


def test_suggestions_are_re_estimates_and_some_fit():
    plan = plan_with_suggestions(_too_big())
    assert not plan.fits
    assert plan.suggestions and any(s.fits for s in plan.suggestions)
    for s in plan.suggestions:
        again = plan_memory(with_overrides(plan.run, s.overrides))
        assert again.peak_bytes == pytest.approx(s.peak_bytes)
        assert again.fits == s.fits
        assert s.peak_bytes < plan.peak_bytes
    knobs = {s.knob.split(" +")[0] for s in plan.suggestions}
    assert {"full recompute", "distributed optimizer", "sequence parallel",
            "micro batch 1"} <= knobs


def test_colocated_rollout_sleep_and_cpu():
    """Colocated on GPU the engines sleep (rollout.enable_sleep, which colocation requires):
    the training phases hold none of the engine; the rollout phase holds all of it."""
    base = gpu_shape("llama3-8b")
    gpu = plan_memory(base)
    engine = next(r for r in gpu.roles if r.role == "rollout").total
    asleep = dict(gpu.devices[0].phases[0].parts)["rollout asleep"]
    rollout_phase = next(p for p in gpu.devices[0].phases if p.name == "rollout")
    assert asleep == 0 < engine == dict(rollout_phase.parts)["rollout engine"]
    # On CPU vLLM's sleep is a no-op: planned awake, and said so.
    cpu = plan_memory(with_overrides(base, ["cluster.device=cpu", "sync.backend=gloo"]))
    assert any("no effect on CPU" in n for n in cpu.notes)
    cpu_engine = next(r for r in cpu.roles if r.role == "rollout").total
    assert dict(cpu.devices[0].phases[0].parts)["rollout asleep"] == cpu_engine > 0
    assert cpu.devices[0].phases[0].total > gpu.devices[0].phases[0].total - engine


def test_cli_plan_memory(capsys):
    cfg = str(CONFIGS / "llama3-70b.yaml")
    assert main(["plan-memory", cfg]) == 0
    out = capsys.readouterr().out
    assert "actor (pp stage 0/4)" in out and "FITS" in out
    assert main(["plan-memory", cfg, "--device-gib", "48"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "knobs" in out
    assert main(["plan-memory", cfg, "actor.tp=3"]) == 2
    # a local (CPU) config sized as on a GPU machine: TE kernels, the GPU's memory
    tiny = str(CONFIGS.parent / "tiny_ci.yaml")
    assert main(["plan-memory", tiny, "--assume-gpu"]) == 0
    out = capsys.readouterr().out
    assert "te kernels" in out and "1×3 gpu (80 GiB)" in out
    assert main(["plan-memory", tiny]) == 0
    assert "local kernels" in capsys.readouterr().out


@pytest.mark.parametrize("spec_name, parallel_kw", [
    ("micro-moe", dict(dp=2, ep=2)),                     # EP2: half the experts per rank
    ("micro-moe", dict(tp=2, ep=2, etp=1)),              # TP2·EP2: attention halves, experts whole
    ("micro-moe", dict(tp=2, dp=2, ep=2, pp=2)),         # expert-TP2 (etp = tp) · EP2 · PP2
    ("micro", dict(tp=2, pp=2)),                         # dense: unchanged
])
def test_stage_params_count_exactly_each_ranks_shards(spec_name, parallel_kw):
    """The memory planner's per-rank parameter count equals the elements of the rank's shards in
    the layout tables (expert parameters per EP rank included), on both sides."""
    from mcore_rl.layouts import megatron_shards, vllm_shards
    from mcore_rl.layouts.layout import box_numel
    from mcore_rl.models.presets import get_preset
    from mcore_rl.planning.memory import mcore_stage_params

    spec, parallel = get_preset(spec_name), ParallelConfig(**parallel_kw)
    smap = megatron_shards(spec, parallel)
    for rank, tensors in smap.ranks.items():
        held = sum(box_numel(tuple((0, n) for n in t.shape)) for t in tensors.values())
        assert mcore_stage_params(spec, parallel, parallel.coords_of(rank)["pp"]) == held
    for tp in (1, 2):
        held = sum(box_numel(tuple((0, n) for n in t.shape))
                   for t in vllm_shards(spec, tp).ranks[0].values())
        assert vllm_rank_params(spec, tp) == held
    # vLLM expert parallel: the busiest rank (the first: the remainder of an uneven split)
    for tp, moe_spec in ((2, spec), (4, spec.with_(num_experts=6))) if spec.is_moe else ():
        smap = vllm_shards(moe_spec, tp, expert_parallel=True)
        held = max(sum(box_numel(tuple((0, n) for n in t.shape)) for t in tensors.values())
                   for tensors in smap.ranks.values())
        assert vllm_rank_params(moe_spec, tp, expert_parallel=True) == held


@pytest.mark.fast  # the fast tier: scripts/test.sh -m fast
@pytest.mark.parametrize("parallel_kw", [dict(), dict(tp=2, pp=2), dict(tp=2, dp=2)])
def test_lora_params_count_exactly_each_ranks_adapter_shards(parallel_kw):
    """The planner's LoRA parameter count equals the elements of the rank's adapter shards
    (layouts/lora.py, derived from the weights' layouts)."""
    from mcore_rl.layouts import megatron_shards
    from mcore_rl.layouts.lora import lora_shards
    from mcore_rl.megatron.config import LORA_HEAD, LORA_TARGETS
    from mcore_rl.planning.memory import lora_stage_params

    spec, parallel = get_preset("micro"), ParallelConfig(**parallel_kw)
    for targets in (LORA_TARGETS, (*LORA_TARGETS, LORA_HEAD)):  # the head: the last stage's
        adapters = lora_shards(megatron_shards(spec, parallel), 8, targets)
        for rank, tensors in adapters.ranks.items():
            held = sum(t.shape[0] * t.shape[1] for t in tensors.values())
            stage = parallel.coords_of(rank)["pp"]
            assert lora_stage_params(spec, parallel, stage, 8, targets) == held
    assert lora_stage_params(spec, parallel, 0, 8, ("linear_qkv",)) < held
    last = parallel.pp - 1
    assert (lora_stage_params(spec, parallel, last, 8, (*LORA_TARGETS, LORA_HEAD))
            > lora_stage_params(spec, parallel, last, 8, LORA_TARGETS))


def test_lora_plans_adapter_states_and_no_reference_model():
    """actor.lora: the actor's grads, fp32 main params and Adam states are the adapters'; the
    base's weights stay; the KL reference is the base itself (no reference rank)."""
    full = plan_memory(gpu_shape("llama3-8b"))
    lora = plan_memory(gpu_shape("llama3-8b", ["actor.lora.rank=16"]))

    def role(plan, name):
        ranks = [r for r in plan.roles if r.role == name and r.where.startswith("pp stage 0")]
        return {c.name: c.bytes for c in ranks[0].components} if ranks else None

    a_full, a_lora = role(full, "actor"), role(lora, "actor")
    assert a_lora["weights"] == a_full["weights"]
    assert 0 < a_lora["LoRA adapters"] < a_full["weights"] / 100
    for state in ("grads", "main params", "adam m, v"):
        assert a_lora[state] < a_full[state] / 100, state
    assert role(full, "reference") is not None and role(lora, "reference") is None
    assert lora.peak_bytes < full.peak_bytes


def test_routing_replay_plans_the_replayed_experts():
    """algorithm.routing_replay: each actor rank holds one mini-batch's DP slice of the
    experts it replays, int16 [rows, s, layers, k] (Qwen3-30B-A3B: 48 layers, top-8)."""
    from mcore_rl.planning.memory import plan_memory

    plain = plan_memory(gpu_shape("qwen3-30b-a3b"))
    replay = plan_memory(gpu_shape("qwen3-30b-a3b", ["algorithm.routing_replay=old"]))
    run = gpu_shape("qwen3-30b-a3b")
    rows = run.global_batch // run.cfg.actor.dp
    want = 2 * rows * run.cfg.train.seq_len * 48 * 8
    for plan, expected in ((plain, None), (replay, want)):
        actor = [r for r in plan.roles if r.role == "actor"][0]
        got = {c.name: c.bytes for c in actor.components}.get("MoE routing (replay)")
        assert got == expected


def test_the_actor_plan_covers_the_update_peak_measured_on_a_gpu():
    """`scripts/gpu_check.sh` on an H200 (docs/benchmarks/gpu-check-h200.json): the policy
    update of configs/bench/gpu_actor.yaml (Llama 3.2 1B, TP1, bf16, local spec), its loss
    vocabulary-chunked. The plan must cover the measured peak (without planning more than 10 %
    above it), the policy loss's own measured peak, and the resident states."""
    import json
    from dataclasses import replace

    from mcore_rl.bench.gpu import ACTOR_CONFIG

    root = Path(__file__).resolve().parents[2]
    measured = json.loads((root / "docs" / "benchmarks" / "gpu-check-h200.json").read_text())
    memory = measured["actor"]["memory"]
    run = replace(sized_run(load_config(RLConfig, ACTOR_CONFIG), assume_gpu=True,
                            cuda_available=True), layer_spec="local")
    rank = training_rank(run, run.spec, "actor", 0)
    peak = max(memory["measured_peak_bytes"])
    assert peak <= rank.total <= 1.1 * peak, (rank.total, peak)
    # the loss's own peak beyond its bf16 input logits, in fp32 [s·b, V] buffers (plus a few
    # [s·b] per-token tensors: a fraction of a row)
    rows = memory["policy_loss"]["fp32_vocab_rows"]
    assert rows <= POLICY_LOSS_FP32_ROWS < rows + 1, (rows, POLICY_LOSS_FP32_ROWS)
    resident = memory["measured_resident_bytes"][-1]
    assert abs(rank.resident - resident) <= 0.05 * resident, (rank.resident, resident)


def test_the_weight_syncs_kept_buffers_are_planned():
    """N4/N5: the sync keeps buffers from sync to sync — a colocated actor rank its shared IPC
    buffer (one bucket; the engine copies straight out of it), a point-to-point actor rank two
    staging slots and its engine rank two receive slots, outside vLLM's budget: the rollout
    device holds them beside what gpu_memory_utilization gives vLLM."""
    bucket = 512 << 20  # a GPU run's sync bucket
    colocated = plan_memory(gpu_shape("llama3-8b"))
    actor = {c.name: c for c in colocated.roles[0].components}
    assert actor["weight-sync staging"].bytes == bucket and actor["weight-sync staging"].resident
    engine = next(r for r in colocated.roles if r.role == "rollout")
    assert "weight-sync receive" not in {c.name for c in engine.components}
    apart = plan_memory(gpu_shape("llama3-70b"))
    actor = {c.name: c.bytes for c in apart.roles[0].components}
    engine = next(r for r in apart.roles if r.role == "rollout")
    assert actor["weight-sync staging"] == 2 * bucket
    assert {c.name: c.bytes for c in engine.components}["weight-sync receive"] == 2 * bucket
    (rollout_device,) = [d for d in apart.devices if d.device == "rollout device"]
    assert dict(rollout_device.phases[0].parts)["rollout engine"] == engine.total
    smaller = plan_memory(gpu_shape("llama3-70b", ["sync.bucket_mb=128"]))
    assert {c.name: c.bytes for c in smaller.roles[0].components}["weight-sync staging"] == \
        2 * (128 << 20)
