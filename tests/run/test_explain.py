"""`mcore-rl explain`: the resolved run as one concise table (a row per rank with `--ranks`),
and with `--json` only one JSON object with the layer spec, the sync backend and one transport
per engine — for the shipped GPU configs (as on their GPUs) and the CPU configs (on this
machine, where no CUDA device is seen)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import mcore_rl.runconfig.resolve as resolve
from mcore_rl.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

CASES = [
    # config, --assume-gpu, layer spec, sync backend, transports (one per engine)
    ("gpu/llama3-70b.yaml", True, "te", "nccl", ["p2p"] * 4),   # disaggregated, 8 nodes
    ("gpu/llama3-8b.yaml", True, "te", "nccl", ["ipc"] * 4),    # colocated: shared devices
    ("gpu/llama2-13b.yaml", False, "te", "nccl", ["p2p"] * 4),  # cluster.device gpu decides
    ("tiny_ci.yaml", False, "local", "gloo", ["p2p"]),
    ("grpo_addition.yaml", False, "local", "gloo", ["p2p"] * 2),  # the second starts late
    ("tiny_ci.yaml", True, "te", "nccl", ["p2p"]),              # a local run, planned for GPUs
]


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine as a CPU-only one, whatever it has."""
    monkeypatch.setattr(resolve, "cuda_present", lambda: False)


@pytest.mark.parametrize("name,assume_gpu,layer_spec,backend,transports", CASES,
                         ids=[f"{c[0]}{'+gpu' if c[1] else ''}" for c in CASES])
def test_explain_prints_the_resolved_run(no_cuda, capsys, name, assume_gpu, layer_spec,
                                         backend, transports):
    argv = ["explain", str(CONFIGS / name)] + (["--assume-gpu"] if assume_gpu else [])
    assert main(argv + ["--json"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()  # nothing but the JSON object
    summary = json.loads(line)
    assert (summary["layer_spec"], summary["sync_backend"], summary["transports"]) == (
        layer_spec, backend, transports)
    device = "cuda" if layer_spec == "te" else "cpu"
    assert summary["device"] == device
    assert all(d.startswith(device) for d in summary["actor_devices"])
    # one sync's bytes per engine by transport, from the real plan: IPC never crosses a node
    traffic = summary["sync_traffic"]
    assert summary["cross_node_ipc_bytes"] == traffic["cross_node_ipc_bytes"] == 0
    assert len(traffic["engines"]) == len(transports)
    for engine, transport in zip(traffic["engines"], transports):
        assert engine["ipc_bytes" if transport == "ipc" else "p2p_bytes"] > 0
        if transport == "p2p":
            assert engine["ipc_bytes"] == 0
    # the table says the same, concisely: devices by role, no JSON
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"sync backend │ {backend}" in out and f"layer spec   │ {layer_spec}" in out
    assert f"engines      │ {len(transports)} × tp " in out and "{" not in out
    assert out.count(f"│ {transports[0]} (") == 0  # no row per engine ...
    assert main(argv + ["--ranks"]) == 0  # ... unless asked
    assert capsys.readouterr().out.count(f"│ {transports[0]} (") == len(transports)


def test_explain_overrides_and_bad_input(no_cuda, capsys):
    l8 = str(CONFIGS / "gpu" / "llama3-8b.yaml")
    # disaggregated on two nodes: the engines get their own devices, so p2p
    assert main(["explain", l8, "cluster.placement=disaggregated", "cluster.nodes=2",
                 "rollout.enable_sleep=false", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["transports"] == ["p2p"] * 4 and summary["nodes"] == 2
    # colocated on two nodes: what the other node holds comes over the network, never IPC
    a3b = str(CONFIGS / "gpu" / "qwen3-30b-a3b.yaml")
    assert main(["explain", a3b, "--assume-gpu", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    traffic = summary["sync_traffic"]
    assert summary["cross_node_ipc_bytes"] == 0 and traffic["network_bytes"] > 0
    assert all(e["ipc_bytes"] > 0 and e["network_bytes"] > 0 for e in traffic["engines"])
    # LoRA's adapter sync: each step moves the adapters, a small fraction of the model
    assert main(["explain", l8, "--assume-gpu", "actor.lora.rank=16", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    full, adapters = summary["sync_traffic"], summary["adapter_sync_traffic"]
    assert 0 < 50 * (adapters["ipc_bytes"] + adapters["p2p_bytes"]) < full["ipc_bytes"]
    assert main(["explain", l8, "rollout.engines=8"]) == 2  # 16 engine ranks on 8 devices
    assert "rollout.engines=8: colocated placement" in capsys.readouterr().err


def test_explain_shows_vllm_expert_parallel(no_cuda, capsys):
    a3b = str(CONFIGS / "gpu" / "qwen3-30b-a3b.yaml")
    assert main(["explain", a3b, "rollout.expert_parallel=true", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expert_parallel"] is True
    assert main(["explain", a3b, "rollout.expert_parallel=true"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"model +│ qwen3_moe · ", out) and "MoE, 128 experts (8 per token)" in out
    assert re.search(r"vLLM experts +│ expert parallel \(each engine rank holds whole experts",
                     out)
    # megatron's experts follow the layer spec: one grouped GEMM under te (GPU)
    assert re.search(r"Megatron experts │ TEGroupedMLP \(one grouped GEMM", out)
    assert main(["explain", a3b]) == 0
    out = capsys.readouterr().out
    assert re.search(r"vLLM experts +│ split over TP", out)
    assert re.search(r"routing replay +│ none: every forward's routers choose", out)
    assert main(["explain", a3b, "algorithm.routing_replay=old"]) == 0
    assert re.search(r"routing replay +│ old: the π_old pass records each token's experts",
                     capsys.readouterr().out)
    assert main(["explain", a3b, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["megatron_experts"] == "TEGroupedMLP"
    assert main(["explain", str(CONFIGS / "demo_moe.yaml")]) == 0
    assert re.search(r"Megatron experts │ SequentialMLP", capsys.readouterr().out)
    # a CPU run refuses it, naming the field and why
    assert main(["explain", str(CONFIGS / "demo_moe.yaml"), "rollout.expert_parallel=true"]) == 2
    assert "rollout.expert_parallel=True: the run resolves to cpu" in capsys.readouterr().err


def test_explain_refuses_a_grid_preflight_refuses(no_cuda, capsys):
    """actor.tp=3 on the demo's 4-head model: explain does not draw the ranks; it exits 2 with
    preflight's own message for it, one line."""
    from mcore_rl.run.preflight import preflight_config

    demo = str(CONFIGS / "grpo_addition.yaml")
    assert main(["explain", demo, "actor.tp=3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    _, problems = preflight_config(demo, ["actor.tp=3"])
    (tp,) = [p for p in problems if p.check == "train-tp"]
    assert line == f"mcore-rl explain: [train-tp] {tp.message} (fix: {tp.fix})"
    assert "actor.tp=3: does not divide num_attention_heads=4" in line


def test_explain_shows_start_up_order_and_roles_and_no_experts_for_dense(no_cuda, capsys):
    """A dense model has no expert placement to show; the start-up order follows the
    placement (issue #30, B6) and the roles say where the critic, the reference policy and
    the reward model run."""
    l8 = str(CONFIGS / "gpu" / "llama3-8b.yaml")  # dense, colocated
    assert main(["explain", l8, "--assume-gpu", "algorithm.advantage_estimator=gae",
                 "algorithm.kl_coeff=0.05"]) == 0
    out = capsys.readouterr().out
    assert "vLLM experts" not in out and "│ llama · 8.03 B params · dense · 32 layers" in out
    assert "start-up     │ trainers first, then the engines" in out
    assert ("roles        │ critic (GAE) and reference policy (KL) on the actor ranks' "
            "devices") in out
    assert "actor ranks  │ 8 (tp 4 · pp 1 · dp 2) · node 0: devices 0–7" in out
    assert ("engines      │ 4 × tp 2 · ipc (devices shared with actor ranks) · node 0: "
            "devices 0–7") in out
    assert main(["explain", l8, "--assume-gpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trainers_first"] is True
    seventy = str(CONFIGS / "gpu" / "llama3-70b.yaml")  # disaggregated, GRPO with a KL term
    assert main(["explain", seventy]) == 0
    out = capsys.readouterr().out
    assert "start-up     │ trainers and engines together" in out
    assert "roles        │ reference policy (KL) on the actor ranks' devices" in out
    assert main(["explain", seventy, "algorithm.kl_coeff=0"]) == 0
    assert "roles        │ the policy only" in capsys.readouterr().out


def test_explain_shows_how_trainers_and_engines_run(no_cuda, capsys):
    """The plan's kernel, compile, CUDA-graph and sleep choices, in the table and the JSON."""
    gpu = [str(CONFIGS / "gpu" / "llama3-8b.yaml"), "--assume-gpu"]
    assert main(["explain", *gpu]) == 0
    out = capsys.readouterr().out
    assert re.search(r"trainers run +│ asks for TE fused RoPE \+ apex weight-grad accumulation "
                     r"· DP grad reduce overlapped with the backward", out)
    assert re.search(r"engines run +│ CUDA graphs of decode steps, nothing compiled · sleep "
                     r"level 2 while training", out)
    assert "torch.compile" not in out
    assert re.search(r"after update +│ the trainers give their cached activation peak back", out)
    assert main(["explain", *gpu, "train.compile=true", "rollout.compile=true"]) == 0
    out = capsys.readouterr().out
    assert "· SwiGLU + bias-dropout-add fused" in out
    assert re.search(r"engines run +│ torch.compile \+ CUDA graphs", out)
    assert main(["explain", *gpu, "train.compile=true", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["compiled_fusions"], summary["fused_kernels"]) == (True, True)
    assert summary["release_trainer_cache"] is True  # colocated: engines share the GPUs (N4)
    assert main(["explain", str(CONFIGS / "tiny_ci.yaml")]) == 0
    out = capsys.readouterr().out
    assert "after update" not in out  # CPU: no CUDA allocator to release
    assert re.search(r"trainers run +│ unfused · DP grad reduce after the backward", out)
    assert re.search(r"engines run +│ eager \(no CUDA graphs\)", out)


# each fused kernel's provider: what must import on the node for the kernel to run
PROVIDER_MODULES = {"apply_rope_fusion": "transformer_engine",
                    "gradient_accumulation_fusion": "fused_weight_gradient_mlp_cuda"}


@pytest.mark.parametrize("name", sorted(p.name for p in (CONFIGS / "gpu").glob("*.yaml")))
def test_explain_shows_each_fused_kernels_decision_and_reason(no_cuda, capsys, name):
    """N1: the plan asks for TE's RoPE and apex's weight-grad accumulation on every GPU run;
    `explain --json` shows, per megatron switch, what the plan asks for, what a rank on this
    machine turns on (only where the provider imports) and why — on this apex-less machine
    gradient_accumulation_fusion is off, naming apex's module and what that costs."""
    import importlib.util

    assert main(["explain", str(CONFIGS / "gpu" / name), "--assume-gpu", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    kernels = summary["kernels"]
    assert set(kernels) == {"apply_rope_fusion", "gradient_accumulation_fusion",
                            "bias_activation_fusion", "bias_dropout_fusion",
                            "masked_softmax_fusion", "persist_layer_norm",
                            "cross_entropy_loss_fusion"}
    assert "each actor rank's node" in summary["kernels_decided"]
    for field, module in PROVIDER_MODULES.items():
        here = importlib.util.find_spec(module) is not None
        k = kernels[field]
        assert (k["wanted"], k["on"]) == (True, here), (field, k)
        if not here:
            assert k["reason"].startswith("off: ") and module in k["reason"], k
            assert "; without it " in k["reason"], k  # what running without it costs
    for field in ("bias_activation_fusion", "bias_dropout_fusion"):  # train.compile unset
        assert kernels[field] == {"wanted": False, "on": False, "reason": "off: train.compile "
                                  "is false: nothing is compiled unless asked"}
    assert not any(kernels[f]["on"] for f in ("masked_softmax_fusion", "persist_layer_norm",
                                             "cross_entropy_loss_fusion"))
    # the table says it too, a line per kernel the plan asks for
    assert main(["explain", str(CONFIGS / "gpu" / name), "--assume-gpu"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"kernels +│ apply_rope_fusion (on|off)", out)
    assert "gradient_accumulation_fusion " in out
