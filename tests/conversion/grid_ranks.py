"""Rank function of test_grids: load dist checkpoints into Megatron at several grids (4 ranks),
and save one with megatron-core's own `dist_checkpointing.save` at TP2·PP2."""

from __future__ import annotations

import os

import torch


def load_at_grids(rank, world, spec, ckpt: str, saved: str, grids, tokens):
    """For each (label, ParallelConfig): build the model, load `ckpt` (and, once written,
    `saved`), return the full logits from the (tp 0, dp 0) last-stage rank. At the first grid,
    also save the loaded model with megatron's saver to `saved`."""
    from megatron.core import dist_checkpointing

    from mcore_rl.megatron.dist_checkpoint import (load_dist_checkpoint,
                                                 megatron_sharded_state_dict)
    from mcore_rl.models.gpt import build_gpt_model
    from mcore_rl.parallel.groups import Axis, destroy_training_groups, init_training_groups
    from mcore_rl.megatron.train import MicroBatch, forward_logits

    zeros = torch.zeros_like(tokens)
    out = {}
    sources = {"converted": ckpt}
    for n, (label, parallel) in enumerate(grids):
        groups = init_training_groups(parallel)
        chunks = build_gpt_model(spec, parallel, groups, seed=100 + n)  # random until loaded
        for name, path in sources.items():
            load_dist_checkpoint(chunks, path)
            batches = [MicroBatch(tokens, zeros, zeros.float())] * (
                parallel.pp if parallel.vpp else 1)      # interleaving wants pp micro batches
            with torch.no_grad():
                logits = forward_logits(chunks, batches, vocab=spec.vocab, groups=groups)
            if logits is not None and groups.rank_in(Axis.TP) == 0 and \
                    groups.rank_in(Axis.DP) == 0:
                out[(label, name)] = logits[0]
        if n == 0:
            os.makedirs(saved, exist_ok=True)
            # (on CPU this needs mcore_rl.compat's checkpoint_preload_sync shim)
            dist_checkpointing.save(megatron_sharded_state_dict(chunks), saved)
            sources["megatron_tp2pp2"] = saved
        destroy_training_groups()
    return out


def load_and_save_cases(rank, world, cases, tokens):
    """For each (label, spec, ckpt, ParallelConfig, saved): build the model on that grid, load
    `ckpt`, return the full logits from the (tp 0, dp 0) last-stage rank, and save the loaded
    model with megatron's own saver to `saved` (so it can be converted back)."""
    from megatron.core import dist_checkpointing

    from mcore_rl.megatron.dist_checkpoint import (load_dist_checkpoint,
                                                 megatron_sharded_state_dict)
    from mcore_rl.models.gpt import build_gpt_model
    from mcore_rl.parallel.groups import Axis, destroy_training_groups, init_training_groups
    from mcore_rl.megatron.train import MicroBatch, forward_logits

    zeros = torch.zeros_like(tokens)
    out = {}
    for n, (label, spec, ckpt, parallel, saved) in enumerate(cases):
        groups = init_training_groups(parallel)
        chunks = build_gpt_model(spec, parallel, groups, seed=200 + n)  # random until loaded
        load_dist_checkpoint(chunks, ckpt)
        for chunk in chunks:
            chunk.eval()          # megatron refuses MoE + TP without SP in training mode
        batches = [MicroBatch(tokens, zeros, zeros.float())] * (parallel.pp if parallel.vpp else 1)
        with torch.no_grad():
            logits = forward_logits(chunks, batches, vocab=spec.vocab, groups=groups)
        if logits is not None and groups.rank_in(Axis.TP) == 0 and groups.rank_in(Axis.DP) == 0:
            out[label] = logits[0]
        os.makedirs(saved, exist_ok=True)
        dist_checkpointing.save(megatron_sharded_state_dict(chunks), saved)
        destroy_training_groups()
    return out
