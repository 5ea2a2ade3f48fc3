"""Save and resume a training role (actor or critic) as a megatron-core dist checkpoint.

Model and optimizer go through `dist_checkpointing` (each rank writes only its shards: no
whole-model gather); the few per-rank Python states (LR schedule, RNG) go in a small
`rank{r}.pt` next to them, read back with `torch.load(weights_only=True)`. The controller
writes into a temporary directory and renames it once every rank is done, so a crash never
leaves a half-written checkpoint under the final name.

Keys are the modules' own (`sharded_state_dict`), so they follow the run's layer spec; the
controller records that spec in `controller.json`, and `check_resume` refuses a checkpoint of
the other spec before any worker starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mcore_rl.config import ConfigError

CONTROLLER_FILE = "controller.json"
# What checkpoints written before the field existed were saved with (CPU runs only).
LEGACY_LAYER_SPEC = "local"

from mcore_rl.checkpoint.megatron_io import load_chunk_states, megatron_sharded_state_dict


def _model_sharded_state_dict(trainer) -> dict:
    # The bare GPTModel chunks (not the DDP wrappers, which would prefix every key with
    # "module."): checkpoint keys then match what `mcore-rl convert mcore-to-hf` reads. The
    # optimizer finds its params among these same Parameter objects.
    return megatron_sharded_state_dict(trainer.unwrapped())


def save_role(trainer, ckpt_dir: Path, rank: int) -> None:
    """Every rank of the role's grid calls this (megatron saves collectively)."""
    from megatron.core import dist_checkpointing

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    model_sd = _model_sharded_state_dict(trainer)
    state = {"model": model_sd, "optimizer": trainer.optimizer.sharded_state_dict(model_sd)}
    dist_checkpointing.save(state, str(ckpt_dir))
    torch.save({"scheduler": trainer.scheduler.state_dict(), "rng": torch.get_rng_state()},
               ckpt_dir / f"rank{rank}.pt")


def load_role(trainer, ckpt_dir: Path, rank: int) -> None:
    """Restore model, optimizer, LR schedule and RNG saved by `save_role`."""
    from megatron.core import dist_checkpointing

    model_sd = _model_sharded_state_dict(trainer)
    opt_sd = trainer.optimizer.sharded_state_dict(model_sd, is_loading=True)
    state = dist_checkpointing.load({"model": model_sd, "optimizer": opt_sd}, str(ckpt_dir))
    load_chunk_states(trainer.unwrapped(), state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    local = torch.load(ckpt_dir / f"rank{rank}.pt", weights_only=True)
    trainer.scheduler.load_state_dict(local["scheduler"])
    torch.set_rng_state(local["rng"])


def checkpoint_dir(path: str | Path) -> Path:
    """A step directory as given; a run directory or its checkpoints root → its newest complete
    step (`trainer.checkpoint_store`), or the path itself when it holds none."""
    from mcore_rl.trainer import checkpoint_store

    path = Path(path)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if checkpoint_store.step_of(path) is None and root.name == "checkpoints":
        return checkpoint_store.newest_complete(root) or path
    return path


def check_resume(path: str | Path, layer_spec: str) -> Path:
    """The checkpoint `--resume PATH` names, checked against the run's resolved layer spec
    before any worker starts; returns its step directory.

    Why refuse the other spec although megatron-core spells dist-checkpoint keys the TE way
    under both (so the tensors would load): a resume continues the same run — the same kernels,
    TE's fp8 scaling state in `_extra_state`, bit-for-bit continuation. Switching between the
    local and the TransformerEngine spec is a different run: start it from the weights instead
    (`mcore-rl convert mcore-to-hf`, then `model.hf_dir`).
    """
    ckpt = checkpoint_dir(path)
    meta = ckpt / CONTROLLER_FILE
    if not meta.is_file():
        if (ckpt / "mcore_rl_checkpoint.json").is_file():
            raise ConfigError("--resume", str(path), "is an HF->Megatron converted checkpoint "
                              "(mcore_rl_checkpoint.json), not a training checkpoint "
                              "(RUN_DIR/checkpoints/step_<k> with controller.json); to start "
                              "from its weights convert it back (mcore-rl convert mcore-to-hf) "
                              "and set model.hf_dir")
        raise ConfigError("--resume", str(path), f"not a checkpoint (no {ckpt / CONTROLLER_FILE})")
    saved = json.loads(meta.read_text()).get("layer_spec", LEGACY_LAYER_SPEC)
    if saved != layer_spec:
        names = {"te": "TransformerEngine", "local": "megatron-core's local"}
        raise ConfigError("--resume", str(path), (
            f"saved by a run with layer_spec={saved!r} ({names.get(saved, saved)} layer spec, "
            f"{meta}), but this run resolves layer_spec={layer_spec!r} "
            f"({names.get(layer_spec, layer_spec)}: 'te' on CUDA, 'local' on CPU — "
            "cluster.device); resume on the kind of machine that saved it, or start a new run "
            "from its weights (mcore-rl convert mcore-to-hf, then model.hf_dir)"))
    return ckpt
