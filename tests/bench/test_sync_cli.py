"""`mcore-rl bench sync` end to end: it launches its own ranks, checks bit-exactness (FP8 syncs:
the arithmetic) and reports bytes and staging memory per rank; `plan_only=true` plans 70B from
shapes alone."""

import json

import pytest

from mcore_rl.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, json.loads(out.out.strip().splitlines()[-1]) if code == 0 else None, out


def test_sync_with_baseline_checks_bytes_and_memory(capsys, tmp_path):
    code, report, _ = run_cli(capsys, "bench", "sync", "model=micro", "actor.tp=2",
                              "actor.pp=2", "rollout.tp=2", "sync.bucket_mb=0.0625",
                              "baseline=[gather,link]", "check=true", "--out", str(tmp_path))
    assert code == 0
    assert report["check"] == "pass" and report["baseline"]["check"] == "pass"
    _check_link_baseline(report)
    bucket = 0.0625 * (1 << 20)
    assert report["max_peak_extra_bytes"] <= 2 * bucket  # two rounds in flight
    # the baseline holds the whole model on training rank 0
    assert report["baseline_max_peak_extra_bytes"] >= report["model_bytes"]
    # each inference rank receives only its shard: about half the model at TP2
    for rank in ("4", "5"):
        assert 0.45 < report["bytes_received"][rank] / report["model_bytes"] < 0.56
    assert report["speedup_vs_baseline"] > 0
    # every sync of ours is verified by digests; what that costs is reported
    assert 0 < report["digest_s"] < report["wall_s"] and 0 < report["compare_s"]
    assert report["digest_share"] == pytest.approx(
        (report["digest_s"] + report["compare_s"]) / report["wall_s"])
    assert report["baseline"]["digest_s"] == 0  # gather + broadcast verifies nothing
    assert all((tmp_path / f"sync.{ext}").is_file() for ext in ("json", "md", "png"))


def _check_link_baseline(report):
    """--baseline link moved the plan's byte matrix, and link_efficiency is its time over
    ours (medians, and run by run)."""
    from mcore_rl.bench.sync import (InferenceGrid, SyncBenchConfig, SyncSettings, make_plan,
                                     resolve_model)
    from mcore_rl.bench.sync_link import byte_matrix
    from mcore_rl.parallel import ParallelConfig

    cfg = SyncBenchConfig(model="micro", actor=ParallelConfig(tp=2, pp=2),
                          rollout=InferenceGrid(tp=2), sync=SyncSettings(bucket_mb=0.0625))
    _, _, plan = make_plan(cfg, resolve_model("micro"))
    link = report["link"]
    assert link["byte_matrix"] == {f"{s}->{d}": n for (s, d), n in byte_matrix(plan).items()}
    assert {int(r): n for r, n in link["bytes_received"].items() if n} == plan.bytes_received()
    assert {int(r): n for r, n in link["bytes_sent"].items() if n} == plan.bytes_sent()
    assert sum(byte_matrix(plan).values()) == sum(plan.bytes_received().values())
    assert report["link_efficiency"] == pytest.approx(link["wall_s"] / report["wall_s"])
    assert report["link_efficiency_runs"] == pytest.approx(
        [a / b for a, b in zip(link["wall_s_runs"], report["wall_s_runs"])])
    assert report["link_gbs_per_receiver"] > 0 and report["sync_gbs_per_receiver"] > 0
    assert link["check_failures"] == {}  # nothing to check: the link carries no shards


@pytest.mark.fast  # (the fast tier: scripts/test.sh -m fast)
def test_plan_only_projects_70b_against_the_baseline(capsys):
    code, report, out = run_cli(capsys, "bench", "sync", "plan_only=true", "model=llama3-70b",
                                "actor.tp=8", "actor.pp=2", "rollout.tp=8", "rollout.engines=2",
                                "sync.dtype=bf16", "sync.bucket_mb=512")
    assert code == 0
    assert report["projected_s"] > 0 and report["baseline_projected_s"] > report["projected_s"]
    # one inference rank needs ~1/8 of the bf16 weights, never the whole 141 GB
    assert report["max_rank_bytes_received"] < report["model_bytes"] / 7
    assert "GB/s" in out.out


def test_moe_sync_tp2ep2_is_bit_exact_and_each_rank_gets_only_its_shards(capsys):
    """TP2·EP2 (experts whole on each EP rank) → vLLM TP2: stacked w13/w2 per inference rank,
    bit-exact in BF16. With `rollout.quantization` the same plan is also synced with its FP8
    weights quantized inside it (per tensor: one scale per expert), alternating with it: each
    engine rank's FP8 shards are checked against the arithmetic, and the bytes the senders sent
    are the plan's — one per FP8 element, the scales computed on the engine ranks."""
    code, report, out = run_cli(capsys, "bench", "sync", "model=micro-moe", "actor.tp=2",
                                "actor.ep=2", "actor.etp=1", "rollout.tp=2",
                                "sync.bucket_mb=0.0625", "check=true", "sync.dtype=bf16",
                                "rollout.quantization=fp8_per_tensor")
    assert code == 0 and report["check"] == "pass"
    assert report["actor"] == "tp2 pp1 vpp1 dp1 ep2 etp1"
    assert report["received_over_ideal"] == 1.0
    assert report["fp8"]["check"] == "pass", report["fp8"]
    wire = report["fp8_sync"]
    assert report["fp8_bytes_sent"] == wire["fp8_bytes"] + wire["unquantized_bytes"]
    assert report["fp8_bytes_sent"] < 0.6 * sum(report["bytes_sent"].values())
    assert report["fp8_speedup"] == pytest.approx(report["wall_s"] / report["fp8"]["wall_s"])
    assert "fp8_per_tensor: " in out.out and "check pass" in out.out


def test_plan_only_projects_qwen3_30b_a3b_with_expert_parallel(capsys):
    code, report, out = run_cli(capsys, "bench", "sync", "plan_only=true",
                                "model=qwen3-30b-a3b", "actor.tp=4", "actor.dp=2", "actor.ep=8",
                                "actor.etp=1", "rollout.tp=8", "sync.dtype=bf16",
                                "sync.bucket_mb=512")
    assert code == 0
    assert report["baseline_projected_s"] > report["projected_s"] > 0
    # every inference rank receives exactly its own shards: 1/8 of the ~61 GB, nothing more
    assert report["received_over_ideal"] == 1.0
    assert report["max_rank_bytes_received"] < report["model_bytes"] / 7.5
    assert "its own shards" in out.out


@pytest.mark.parametrize("argv, message", [
    (["model=micro-moe", "actor.dp=3", "actor.ep=3"],
     "actor.ep=3: does not divide num_experts=4"),
    (["actor.dp=2", "actor.ep=2"], "actor.ep=2: needs a mixture-of-experts model"),
    (["actor.tp=3"], "actor.tp=3: does not divide num_attention_heads=4"),
    (["rollout.tp=3"], "vLLM tp=3 does not divide num_attention_heads=4"),
    (["model=no-such-model"], "model='no-such-model': neither a preset"),
    (["transport=ipc", "rollout.tp=2"], "transport='ipc': ipc is colocated"),
    # the override machinery names the field of a bad spelling, a bad value or a bad type
    (["actor.tpp=2"], "actor.tpp=2: unknown field"),
    (["rollout.engines=0"], "rollout.engines=0: must be >= 1"),
    (["baseline=[gather,nccl]"], "baseline[1]='nccl': allowed values: gather, link"),
    (["sync.bucket_mb=big"], "sync.bucket_mb='big': expected a number"),
    (["link_model.gpus_per_node=0"], "link_model.gpus_per_node=0: must be >= 1"),
    # the bench's names of before (train.*, infer.*, infer.ep, bucket_mb, dtype) are refused
    # with the run config's name that replaced them
    (["train.tp=2"], "config error: train={'tp': 2}: this key moved: actor (the run config's "
                     "name: actor.tp, actor.pp, ...)"),
    (["infer.tp=2"], "config error: infer={'tp': 2}: this key moved: rollout (rollout.tp, "
                     "rollout.engines, rollout.expert_parallel)"),
    (["rollout.ep=true"], "config error: rollout.ep=True: this key moved: "
                          "rollout.expert_parallel"),
    (["bucket_mb=16"], "config error: bucket_mb=16: this key moved: sync.bucket_mb"),
    (["dtype=bf16"], "config error: dtype='bf16': this key moved: sync.dtype"),
    (["sync_bucket_mb=16"], "config error: sync_bucket_mb=16: this key moved: sync.bucket_mb"),
    (["warmup=1"], "config error: warmup=1: this key moved: untimed"),
])
def test_bad_input_fails_before_any_rank_starts(capsys, argv, message):
    code = main(["bench", "sync", "model=micro", *argv])  # a later model= wins
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_config_file_then_overrides_then_repeats_flag(tmp_path):
    """`--config FILE` sets fields, overrides win over it, `--repeats` over both."""
    from mcore_rl.bench.cli import bench_config
    from mcore_rl.bench.sync import SyncBenchConfig
    from mcore_rl.cli import build_parser

    (tmp_path / "sync.yaml").write_text("model: micro\nrollout: {tp: 2}\nrepeats: 5\n")
    args = build_parser().parse_args(["bench", "sync", "--config", str(tmp_path / "sync.yaml"),
                                      "rollout.engines=2", "actor.tp=2", "--repeats", "3"])
    cfg = bench_config(SyncBenchConfig, args)
    assert (cfg.model, cfg.rollout.tp, cfg.rollout.engines, cfg.actor.tp, cfg.repeats) == \
        ("micro", 2, 2, 2, 3)


def test_ipc_transport_is_exact_with_one_bucket_of_staging(capsys):
    """Colocated ranks (inference rank d on training rank d's device): the refit goes through
    one shared staging buffer per training rank, bit-exact."""
    code, report, _ = run_cli(capsys, "bench", "sync", "model=micro", "actor.tp=2",
                              "rollout.tp=2", "sync.bucket_mb=0.0625", "transport=ipc",
                              "check=true")
    assert code == 0
    assert report["transport"] == "ipc" and report["check"] == "pass"
    bucket = 0.0625 * (1 << 20)
    assert 0 < report["max_train_peak_extra_bytes"] <= bucket
    assert report["max_peak_extra_bytes"] == report["max_train_peak_extra_bytes"]  # receivers: 0
    for rank in ("2", "3"):
        assert 0.45 < report["bytes_received"][rank] / report["model_bytes"] < 0.56


def test_plan_only_with_vllm_expert_parallel(capsys):
    """`rollout.expert_parallel=true` plans into vLLM's expert-parallel layout (each inference
    rank holds whole experts): each rank still receives exactly its own shards, in fewer
    transfers."""
    reports = {}
    for ep in ("false", "true"):
        code, reports[ep], _ = run_cli(capsys, "bench", "sync", "plan_only=true",
                                       "model=micro-moe", "actor.dp=2", "actor.ep=2",
                                       "rollout.tp=2", f"rollout.expert_parallel={ep}")
        assert code == 0
    assert reports["true"]["rollout"] == "tp2 ep x1" and reports["false"]["rollout"] == "tp2 x1"
    for report in reports.values():
        assert report["received_over_ideal"] == 1.0
    # whole experts from whole-expert training shards: fewer, larger transfers
    assert reports["true"]["transfers"] < reports["false"]["transfers"]


def test_gather_baseline_collects_experts_spread_over_expert_dp():
    """DP2·EP2 on two ranks: DP replica 0 (rank 0) holds experts 0-1 only; experts 2-3 live
    on rank 1 (DP replica 1, expert-DP replica 0 of EP rank 1). The baseline gathers every
    piece from the lowest rank holding it — rank 1 sends its experts and nothing dense — so
    the broadcast model is whole and its check passes."""
    from mcore_rl.bench.sync import (InferenceGrid, SyncBenchConfig, SyncSettings,
                                     _gather_senders, make_plan, resolve_model, run_sync_bench)
    from mcore_rl.parallel import ParallelConfig

    cfg = SyncBenchConfig(model="micro-moe", actor=ParallelConfig(dp=2, ep=2),
                          rollout=InferenceGrid(tp=2), sync=SyncSettings(bucket_mb=0.0625),
                          baseline=("gather",), check=True)
    src, _, _ = make_plan(cfg, resolve_model(cfg.model))
    senders = _gather_senders(src)
    assert senders[1] and all("experts" in key for key in senders[1]), senders
    report = run_sync_bench(cfg)
    assert report["check"] == "pass" and report["baseline"]["check"] == "pass", report
