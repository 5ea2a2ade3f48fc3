"""One training run of the micro Llama on a parallel layout, as a spawned rank function, and the
shared inputs (HF-named initial weights, the global batch) every layout gets."""

from __future__ import annotations

import numpy as np
import torch

from mcore_rl.models.presets import get_preset
from mcore_rl.models.spec import ModelSpec

SPEC = get_preset("micro")  # Llama, GQA (4 heads / 2 kv heads), 4 layers, vocab 250
# Qwen3-MoE: q/k norms, 4 experts of width 64 per layer, top-2 without renormalization.
MOE_SPEC = SPEC.with_(family="qwen3_moe", architecture="Qwen3MoeForCausalLM", qk_norm=True,
                      num_experts=4, moe_ffn=64, experts_per_token=2, norm_topk_prob=False)
# MoE layouts ride along in the launch of a dense layout with the same world size (a launch
# costs seconds): dense layout kwargs → (MoE layout kwargs, token dispatcher). The MoE
# reference (one process) rides with the dense one.
MOE_PARTNERS = {
    (): ((), "allgather"),
    (("dp", 2),): ((("dp", 2), ("ep", 2)), "alltoall"),                       # EP2
    (("sequence_parallel", True), ("tp", 2)): (
        (("ep", 2), ("etp", 1), ("sequence_parallel", True), ("tp", 2)), "alltoall"),  # TP2·EP2
    (("pp", 2), ("tp", 2)): ((("dp", 2), ("ep", 2), ("pp", 2)), "allgather"),   # PP2·EP2
    # expert-TP2·EP2. Not alltoall: with etp > 1 it all-gathers uneven token counts over
    # expert-TP, which gloo's all_gather refuses ("invalid tensor size") — a CPU gap.
    (("dp", 2), ("tp", 2), ("use_distributed_optimizer", True)): (
        (("dp", 2), ("ep", 2), ("sequence_parallel", True), ("tp", 2)), "allgather"),
}
GLOBAL_MICRO_BATCHES, MICRO_BATCH, SEQ = 4, 2, 16
STEPS = 3


def hf_init(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named weights: every layout loads exactly these (via mcore_rl.layouts)."""
    from hf_weights import random_hf_weights

    return random_hf_weights(spec, seed)


def global_batch(spec: ModelSpec, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """GLOBAL_MICRO_BATCHES micro batches of [MICRO_BATCH, SEQ]; ~20 % of labels masked."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(GLOBAL_MICRO_BATCHES):
        seq = torch.randint(0, spec.vocab, (MICRO_BATCH, SEQ + 1), generator=gen)
        mask = (torch.rand(MICRO_BATCH, SEQ, generator=gen) > 0.2).float()
        out.append({"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": mask})
    return out


def to_numpy(obj):
    """Tensors → numpy for the trip back to the parent (torch tensors cross process borders
    as shared-memory handles that die with the child)."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu()
        return obj.float().numpy() if obj.is_floating_point() else obj.numpy()
    if isinstance(obj, dict):
        return {k: to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_numpy(v) for v in obj)
    return obj


def from_numpy(obj):
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: from_numpy(v) for k, v in obj.items()}
    return obj


_RESULTS: dict[tuple, list[dict]] = {}


def layout_results(parallel_kw: dict, dtype: str = "fp32", device: str = "cpu",
                   layer_spec: str = "local") -> list[dict]:
    """Per-rank `run_layout` results, launched once per pytest session and layout (the layout
    table and the group-placement test read the same launch). device "cpu": CUDA hidden from
    the ranks (megatron on CPU with its compat shims, even on a GPU machine); "cuda": one rank
    on cuda:0 over NCCL (tests/gpu_twins.py)."""
    from gpu_twins import spawn_env

    from mcore_rl.launch.spawn import run_on_ranks
    from mcore_rl.parallel.config import ParallelConfig

    key = (tuple(sorted(parallel_kw.items())), dtype, device, layer_spec)
    if key not in _RESULTS:
        parallel = ParallelConfig(**parallel_kw)
        moe = MOE_PARTNERS.get(key[0]) if (dtype, device) == ("fp32", "cpu") else None
        _RESULTS[key] = run_on_ranks(run_layout, parallel.world_size, parallel_kw, dtype,
                                     p2p_control=parallel.vpp is not None, device=device,
                                     layer_spec=layer_spec,
                                     moe=(dict(moe[0]), moe[1]) if moe else None,
                                     timeout_s=300, init_default_group=False,
                                     env=spawn_env(device))
    return _RESULTS[key]


def moe_layout_results(moe_kw: dict) -> list[dict]:
    """Per-rank results of the MoE layout `moe_kw`, from its dense partner's launch."""
    dense = next(d for d, (m, _) in MOE_PARTNERS.items() if dict(m) == moe_kw)
    return [out["moe"] for out in layout_results(dict(dense))]


def run_layout(rank: int, world: int, parallel_kw: dict, dtype: str = "fp32",
               p2p_control: bool = False, device: str = "cpu", layer_spec: str = "local",
               moe: tuple[dict, str] | None = None) -> dict:
    """`train_layout` of the dense micro model; then, with `moe` = (MoE layout kwargs,
    dispatcher), of the MoE model on that layout in the same processes, under "moe"."""
    from gpu_twins import join_world

    from mcore_rl.parallel.groups import leave_worker_world

    on = join_world(rank, world, device)
    out = train_layout(rank, SPEC, parallel_kw, dtype, p2p_control, on, layer_spec)
    if moe is not None:
        out["moe"] = train_layout(rank, MOE_SPEC, moe[0], "fp32", False, on, layer_spec,
                                  dispatcher=moe[1])
    leave_worker_world()
    return out


def train_layout(rank: int, spec: ModelSpec, parallel_kw: dict, dtype: str = "fp32",
                 p2p_control: bool = False, on: torch.device = torch.device("cpu"),
                 layer_spec: str = "local", dispatcher: str = "allgather") -> dict:
    """Load `hf_init` into the layout, return (numpy) this rank's logits of its micro batches,
    per-step (loss, grad norm) and its megatron tensors after STEPS Adam steps. The model and
    batches live on `device`; tensors are named by `layer_spec`."""
    from mcore_rl.layouts import materialize_rank, megatron_shards
    from mcore_rl.models.gpt import load_chunks
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.groups import Axis, init_training_groups
    from mcore_rl.megatron.config import OptimizerConfig, TrainConfig
    from mcore_rl.megatron.train import (MicroBatch, forward_logits, setup_trainer,
                                                 train_step)

    parallel = ParallelConfig(**parallel_kw)
    groups = init_training_groups(parallel, device=str(on))
    shard_map = megatron_shards(spec, parallel, layer_spec=layer_spec)
    hf = hf_init(spec)
    initial = materialize_rank(shard_map, rank, hf.__getitem__)
    per_dp = GLOBAL_MICRO_BATCHES // parallel.dp
    # adam_eps 1e-6, not 1e-8: Adam's update g / (sqrt(v) + eps) turns fp32 reduction-order
    # noise (~1e-9) on near-zero gradients into up to lr * noise / eps of parameter change
    # (6e-5 at eps=1e-8, lr=1e-3, measured); at 1e-6 that bound is ~1e-6.
    # MoE: 1e-5. Token dispatch reorders the experts' sums, and near-zero gradients of rarely
    # routed rows then carry relatively more reduction-order noise (measured: 1.01e-5 of
    # parameter difference at TP2·EP2 with eps 1e-6, loss and grad norm equal to 1e-5).
    eps = 1e-5 if spec.is_moe else 1e-6
    train = TrainConfig(micro_batch_size=MICRO_BATCH, num_micro_batches=per_dp, seq_len=SEQ,
                        dtype=dtype, optimizer=OptimizerConfig(lr=1e-3, adam_eps=eps,
                                                               weight_decay=0.01),
                        moe_dispatcher=dispatcher)
    trainer = setup_trainer(spec, groups, train, load_weights=lambda chunks: load_chunks(
        chunks, initial, parallel.vpp), layer_spec=layer_spec)
    loaded = _local_tensors(trainer, parallel.vpp)
    load_error = max(float((loaded[k].float().cpu() - initial[k].to(loaded[k].dtype).float())
                           .abs().max()) for k in initial)
    dp = groups.rank_in(Axis.DP)
    mine = [MicroBatch(**{k: v.to(on) for k, v in mb.items()})
            for mb in global_batch(spec)[dp * per_dp:(dp + 1) * per_dp]]
    logits = forward_logits(trainer.model, mine, vocab=spec.vocab, groups=groups)
    steps = [train_step(trainer, mine) for _ in range(STEPS)]
    control = None
    if p2p_control:  # a fresh model's first step with megatron's default batched p2p exchange
        fresh = setup_trainer(spec, groups, train, load_weights=lambda chunks: load_chunks(
            chunks, initial, parallel.vpp), layer_spec=layer_spec)
        fresh.config.batch_p2p_comm = True
        step = train_step(fresh, mine)
        control = (step.loss, step.grad_norm)
    result = to_numpy({
        "device": str(next(trainer.unwrapped()[0].parameters()).device),
        "coords": groups.coords, "group_members": _group_members(groups),
        "keys": sorted(loaded) == sorted(initial),
        "load_error": load_error,
        "logits": logits if groups.rank_in(Axis.TP) == 0 else None,
        "control_step": control,
        "param_dtypes": sorted({str(p.dtype) for c in trainer.unwrapped()
                                for p in c.parameters()}),
        "loss": [s.loss for s in steps], "grad_norm": [s.grad_norm for s in steps],
        "params": _local_tensors(trainer, parallel.vpp)})
    return result


def _local_tensors(trainer, vpp) -> dict[str, torch.Tensor]:
    """This rank's parameters under the layout's keys (`model{v}.` prefix with VPP)."""
    out = {}
    for v, chunk in enumerate(trainer.unwrapped()):
        for key, tensor in chunk.state_dict().items():
            if not key.endswith("_extra_state"):
                out[(f"model{v}." if vpp else "") + key] = tensor.detach().clone()
    return out


def _group_members(groups) -> dict[str, list[int]]:
    """Global ranks in this rank's group of each axis, ours and megatron's collection's."""
    import torch.distributed as dist

    from mcore_rl.parallel.groups import Axis

    out = {}
    for axis in ("tp", "pp", "dp"):
        out[axis] = dist.get_process_group_ranks(groups.group(Axis(axis)))
        out[f"megatron_{axis}"] = dist.get_process_group_ranks(getattr(groups.megatron, axis))
    return out
