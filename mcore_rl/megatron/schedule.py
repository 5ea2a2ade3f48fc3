"""megatron-core's pipeline schedules, as this project runs them.

`configure_schedule` sets the hooks the schedules read from the model config (DDP's no_sync,
`finalize_model_grads`, the optimizer's loss scale); `run_schedule` runs megatron's
forward-backward schedule for the grid (no pipelining, 1F1B, or interleaved 1F1B with VPP) over
this rank's model chunks and micro batches, with a forward step the caller hands in;
`check_micro_batches` checks the micro batches' shapes first.

A micro batch is anything with tokens, labels and loss_mask tensors ([b, s], or packed [1, T]):
`train.MicroBatch`, `policy.PolicyBatch`, `reward_model.scoring.ScoreBatch`. What runs on them
(forward step, loss) belongs to the caller (`train`, `policy`, `value`, `reward_model.scoring`);
this module imports none of them.
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_model_config

from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.groups import Axis, ParallelGroups


def configure_schedule(config: TransformerConfig, model: list[DistributedDataParallel],
                       optimizer) -> None:
    """The schedules read their hooks from the model config (megatron-core's API). Its p2p
    settings (batch_p2p_comm off with VPP) come from transformer_config_from_spec."""
    config.no_sync_func = [chunk.no_sync for chunk in model]
    if any(chunk.ddp_config.overlap_grad_reduce for chunk in model):
        # the pipeline schedules start each chunk's reduction once its last backward is done,
        # as Megatron-LM does with overlap_grad_reduce (and align_grad_reduce, its default)
        config.grad_sync_func = [chunk.start_grad_sync for chunk in model]
    if len(model) == 1:
        config.no_sync_func = config.no_sync_func[0]
        if config.grad_sync_func is not None:
            config.grad_sync_func = config.grad_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss


def run_schedule(model: list[torch.nn.Module], groups: ParallelGroups,
                 micro_batches: list, *, forward_step, forward_only: bool,
                 collect_non_loss_data: bool = False):
    """megatron's forward-backward schedule for this grid over `micro_batches`."""
    parallel = groups.config
    b, s = check_micro_batches(micro_batches, parallel)
    config = get_model_config(model[0])
    data = [iter(micro_batches) for _ in model]
    schedule = get_forward_backward_func(pp_size=parallel.pp, vp_size=parallel.vpp)
    p2p = P2PCommunicator(pp_group=groups.group(Axis.PP), config=config)
    return schedule(
        forward_step_func=forward_step,
        data_iterator=data if len(data) > 1 else data[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(micro_batches), seq_length=s, micro_batch_size=b,
        forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
        p2p_communicator=p2p, pg_collection=groups.megatron)


def check_micro_batches(micro_batches: list,
                        parallel: ParallelConfig) -> tuple[int, int]:
    """(micro batch size, longest sequence length). Pipeline stages exchange fixed-shape
    activations, so with pp > 1 all micro batches must have one shape; with sequence
    parallelism the sequence splits over tp."""
    if not micro_batches:
        raise ValueError("micro_batches: need at least one micro batch")
    first = micro_batches[0].tokens.shape
    for i, mb in enumerate(micro_batches):
        shape = mb.tokens.shape if parallel.pp == 1 else first
        for name in ("tokens", "labels", "loss_mask"):
            if getattr(mb, name).shape != shape:
                raise ValueError(f"micro_batches[{i}].{name}: shape "
                                 f"{tuple(getattr(mb, name).shape)} != {tuple(shape)} (the "
                                 "schedule sends fixed-shape activations between stages)")
        if parallel.sequence_parallel and shape[1] % parallel.tp:
            raise ValueError(f"micro_batches[{i}].tokens: length {shape[1]} not divisible by "
                             f"tp={parallel.tp} (sequence parallel)")
    return first[0], max(mb.tokens.shape[1] for mb in micro_batches)
