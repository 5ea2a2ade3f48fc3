"""Load a dist checkpoint into this rank's Megatron model chunks — megatron-core's own loader,
at whatever grid the chunks were built for."""

from __future__ import annotations

from pathlib import Path

import torch


def megatron_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    """The sharded state dict of this rank's chunks, nested per VPP chunk as Megatron-LM does
    (`model0`, `model1`, ...) when there are several."""
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{v}": chunk.sharded_state_dict() for v, chunk in enumerate(chunks)}


def load_dist_checkpoint(chunks: list[torch.nn.Module], ckpt_dir: str | Path) -> None:
    """`dist_checkpointing.load(model.sharded_state_dict(), dir)` into the chunks, strictly.
    Every rank of the training grid calls it (megatron validates shard access collectively).

    The model's weights only: a run's checkpoint (`role_checkpoint.save_role`) also holds the
    optimizer, whose tensors are not asked for and whose non-sharded state (`common.pt`:
    `optimizer.param_groups`, ...) megatron's load merges into what it returns; those
    top-level keys, not the model's, are dropped here."""
    from megatron.core import dist_checkpointing  # lazy: megatron

    wanted = megatron_sharded_state_dict(chunks)
    state = dist_checkpointing.load(wanted, str(ckpt_dir))
    load_chunk_states(chunks, {key: value for key, value in state.items() if key in wanted})


def load_chunk_states(chunks: list[torch.nn.Module], state: dict) -> None:
    """Load a state dict nested as `megatron_sharded_state_dict` nests it, strictly."""
    with torch.no_grad():
        if len(chunks) == 1:
            chunks[0].load_state_dict(state, strict=True)
        else:
            for v, chunk in enumerate(chunks):
                chunk.load_state_dict(state[f"model{v}"], strict=True)
