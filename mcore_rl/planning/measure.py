"""Measure on CPU what the planner estimates: the tensor bytes megatron-core actually allocates
for a training rank, and the activations it keeps, during one real training step.

Run as a rank function through `mcore_rl.launch.spawn.run_on_ranks(measure_grids, world,
cases)`; every case must use all `world` ranks (one launch measures several grids: megatron's
model-parallel state is rebuilt per case).

What is counted, per rank (tensors deduplicated by storage, so views count once):
  weights      storages of the model chunks' parameters (the DDP param buffer with the
               distributed optimizer)
  grads        the DDP grad buffers (`ddp.buffers[*].grad_data`)
  main params  the optimizer's parameters that are not model storages (fp32 copies)
  main grads   their `.grad` tensors that are not grad-buffer storages
  adam         the optimizer state tensors (m, v, step), after the step created them
  activations  the peak, over the whole forward-backward schedule, of the bytes of live
               tensors saved for backward (`torch.autograd.graph.saved_tensors_hooks`:
               a saved tensor is live from its pack until autograd drops it), parameters and
               optimizer tensors excluded. This is Korthikanti et al.'s quantity; transient
               workspaces (matmul outputs freed at once, gradients in flight) are not in it.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from mcore_rl.config.dtypes import DtypeName, dtype_bytes
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.megatron.config import TrainConfig
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.groups import destroy_training_groups, init_training_groups
from mcore_rl.planning.memory import (
    ActivationModel,
    in_flight_layers,
    last_stage_terms,
    layer_activation_bytes,
    mcore_stage_params,
    recompute_workspace,
    state_bytes_per_param,
)


def _key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class SavedTensorTracker:
    """Live bytes of tensors saved for backward, deduplicated by storage; keeps the peak."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.live: dict[int, list[int]] = {}
        self.bytes = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor):
        ptr, nbytes = _key(tensor)
        if ptr in self.exclude or nbytes == 0:
            return tensor
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, nbytes]
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
        else:
            entry[0] += 1
        return _Saved(self, ptr, tensor)

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self.live[ptr]


class _Saved:
    __slots__ = ("tracker", "ptr", "tensor")

    def __init__(self, tracker: SavedTensorTracker, ptr: int, tensor: torch.Tensor):
        self.tracker, self.ptr, self.tensor = tracker, ptr, tensor

    def __del__(self):
        self.tracker.release(self.ptr)


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def static_bytes(trainer) -> dict[str, int]:
    """Bytes of weights, grads, main params, main grads and Adam states on this rank."""
    params: dict[int, int] = {}
    numel = {}
    for chunk in trainer.model:
        for p in chunk.parameters():
            ptr, nbytes = _key(p)
            params[ptr] = nbytes
            numel[id(p)] = p.numel()
    grads: dict[int, int] = {}
    for ddp in trainer.model:
        for buf in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
            ptr, nbytes = _key(buf.grad_data)
            grads[ptr] = nbytes
    main, main_grads, adam = {}, {}, {}
    for opt in _optimizers(trainer.optimizer):
        torch_opt = opt.optimizer
        for group in torch_opt.param_groups:
            for p in group["params"]:
                ptr, nbytes = _key(p)
                if ptr not in params:
                    main[ptr] = nbytes
                if p.grad is not None:
                    gptr, gbytes = _key(p.grad)
                    if gptr not in grads:
                        main_grads[gptr] = gbytes
                for value in torch_opt.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        sptr, sbytes = _key(value)
                        adam[sptr] = sbytes
    return {
        "weights": sum(params.values()),
        "grads": sum(grads.values()),
        "main params": sum(main.values()),
        "main grads": sum(main_grads.values()),
        "adam": sum(adam.values()),
        "params": sum(numel.values()),
    }


def _all_storages(trainer) -> set[int]:
    out = set()
    for chunk in trainer.model:
        for p in chunk.parameters():
            out.add(_key(p)[0])
    for ddp in trainer.model:
        for buf in ddp.buffers:
            out.add(_key(buf.grad_data)[0])
            if buf.param_data is not None:
                out.add(_key(buf.param_data)[0])
    for opt in _optimizers(trainer.optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                out.add(_key(p)[0])
    return out


def predict_case(
    spec_name: str,
    parallel_kw: dict,
    coords: dict,
    *,
    dtype: DtypeName = "float32",
    micro_batch_size: int = 2,
    num_micro_batches: int = 4,
    seq_len: int = 64,
    recompute: Literal["none", "selective", "full"] = "none",
) -> dict[str, float]:
    """The planner's figures for the rank at `coords` of a `measure_case` case (local kernels,
    fp32 grads as the trainer uses), in the same categories."""

    spec = get_preset(spec_name)
    par = ParallelConfig(**parallel_kw)
    stage = coords["pp"]
    n = mcore_stage_params(spec, par, stage)
    states = state_bytes_per_param(dtype, "float32", par.use_distributed_optimizer, par.dp)
    model = ActivationModel.for_kernels(
        "local",
        act_bytes=dtype_bytes(dtype),
        tp=par.tp,
        sequence_parallel=par.sequence_parallel,
        recompute=recompute,
    )
    per_layer = layer_activation_bytes(spec, seq_len, micro_batch_size, model)
    act = in_flight_layers(par, spec.layers, stage, num_micro_batches) * per_layer
    tail = 0.0
    if stage == par.pp - 1:
        terms = last_stage_terms(spec, seq_len, micro_batch_size, model)
        tail = terms["final norm, head input"] + terms["logits (fp32, kept)"]
    act += max(tail, recompute_workspace(spec, seq_len, micro_batch_size, model))
    return {
        "params": n,
        "weights": n * states.weights,
        "grads": n * states.grads,
        "main params": n * states.main_params,
        "main grads": n * states.main_grads,
        "adam": n * states.adam,
        "activations": act,
    }


def measure_case(
    spec_name: str,
    parallel_kw: dict,
    *,
    dtype: DtypeName = "float32",
    micro_batch_size: int = 2,
    num_micro_batches: int = 4,
    seq_len: int = 64,
    recompute: Literal["none", "selective", "full"] = "none",
) -> dict[str, Any]:
    """Build the grid, run one training step under the saved-tensor tracker, return this
    rank's coordinates, static bytes and peak activation bytes."""
    from mcore_rl.megatron.train import MicroBatch, setup_trainer, train_step  # lazy: megatron

    spec = get_preset(spec_name)
    parallel = ParallelConfig(**parallel_kw)
    groups = init_training_groups(parallel)
    train = TrainConfig(
        micro_batch_size=micro_batch_size,
        num_micro_batches=num_micro_batches,
        seq_len=seq_len,
        dtype=dtype,
        recompute=recompute,
    )
    trainer = setup_trainer(spec, groups, train)  # the trainer the RL roles train with
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(num_micro_batches):
        seq = torch.randint(0, spec.vocab, (micro_batch_size, seq_len + 1), generator=gen)
        batches.append(
            MicroBatch(
                tokens=seq[:, :-1],
                labels=seq[:, 1:],
                loss_mask=torch.ones(micro_batch_size, seq_len),
            )
        )
    tracker = SavedTensorTracker(_all_storages(trainer))
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        train_step(trainer, batches)
    out = {
        "coords": dict(groups.coords),
        **static_bytes(trainer),
        "activations": tracker.peak,
        "left_live": tracker.bytes,
    }
    del trainer
    return out


def measure_grids(rank: int, world: int, cases: list[dict]) -> list[dict[str, Any]]:
    """Rank function for `run_on_ranks`: `measure_case(**case)` for each case in turn."""

    results = []
    for case in cases:
        results.append(measure_case(**case))
        destroy_training_groups()
    return results


__all__ = ["SavedTensorTracker", "measure_case", "measure_grids", "predict_case", "static_bytes"]


# `python -m mcore_rl.planning.measure`: the validation table (minutes on a CPU machine).
VALIDATION: dict[int, list[dict]] = {
    1: [
        dict(spec_name="micro", parallel_kw={}, dtype=d, recompute=r)
        for d in ("float32", "bfloat16")
        for r in ("none", "selective", "full")
    ],
    2: [
        dict(spec_name="micro", parallel_kw=dict(tp=2)),
        dict(spec_name="micro", parallel_kw=dict(tp=2, sequence_parallel=True), dtype="bfloat16"),
        dict(spec_name="micro", parallel_kw=dict(pp=2)),
        dict(spec_name="micro", parallel_kw=dict(pp=2, vpp=2)),
        dict(
            spec_name="micro",
            parallel_kw=dict(dp=2, use_distributed_optimizer=True),
            dtype="bfloat16",
        ),
    ],
    4: [
        dict(
            spec_name="micro",
            parallel_kw=dict(tp=2, pp=2, sequence_parallel=True),
            dtype="bfloat16",
        ),
        dict(spec_name="micro", parallel_kw=dict(pp=2, dp=2, use_distributed_optimizer=True)),
        dict(spec_name="micro", parallel_kw=dict(pp=4), num_micro_batches=2),
    ],
}


def _validation_table() -> str:

    keys = ("weights", "grads", "main params", "adam")
    rows = [
        "| case | rank (tp,pp,dp) | states planned / measured (B) | err | activations "
        "planned / measured (B) | err |",
        "|---|---|---|---|---|---|",
    ]
    for world, cases in VALIDATION.items():
        results = run_on_ranks(measure_grids, world, cases, timeout_s=600)
        for i, case in enumerate(cases):
            label = (
                ",".join(f"{k}={v}" for k, v in case["parallel_kw"].items()) or "1 rank"
            ) + f" {case.get('dtype', 'float32')} {case.get('recompute', 'none')}"
            seen = set()
            for per_rank in results:
                got = per_rank[i]
                c = got["coords"]
                if (c["pp"],) in seen:  # TP / DP replicas measure the same
                    continue
                seen.add((c["pp"],))
                want = predict_case(**case, coords=c)
                st_w, st_g = sum(want[k] for k in keys), sum(got[k] for k in keys)
                rows.append(
                    f"| {label} | {c['tp']},{c['pp']},{c['dp']} | {st_w:,.0f} / "
                    f"{st_g:,} | {st_w / st_g - 1:+.2%} | {want['activations']:,.0f} / "
                    f"{got['activations']:,} | "
                    f"{want['activations'] / got['activations'] - 1:+.2%} |"
                )
    return "\n".join(rows)


if __name__ == "__main__":
    print(_validation_table())
