"""Save and resume a training role (actor or critic) as a megatron-core dist checkpoint.

Model and optimizer go through `dist_checkpointing` (each rank writes only its shards: no
whole-model gather); the few per-rank Python states (LR schedule, RNG) go in a small
`rank{r}.pt` next to them, read back with `torch.load(weights_only=True)`. The controller
writes into a temporary directory and renames it once every rank is done, so a crash never
leaves a half-written checkpoint under the final name.

Keys are the modules' own (`sharded_state_dict`), so they follow the run's layer spec; the
controller records that spec in `controller.json`, and `rl.checkpoint_dirs.check_resume`
refuses a checkpoint of the other spec before any worker starts.

A LoRA role (`trainer.lora`) also gets `lora.json`: the adapters' rank, alpha, dropout and
targets, and the HF directory of the base — what `mcore-rl convert mcore-to-peft` needs to
write a PEFT adapter from the checkpoint, and `mcore-rl convert mcore-to-hf` to write the
merged model.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mcore_rl.compat import megatron_save
from mcore_rl.config import ConfigError
from mcore_rl.megatron.config import LoRAConfig
from mcore_rl.megatron.dist_checkpoint import load_chunk_states, megatron_sharded_state_dict

if TYPE_CHECKING:
    from mcore_rl.megatron.config import LoRAConfig


def _model_sharded_state_dict(trainer) -> dict:
    # The bare GPTModel chunks (not the DDP wrappers, which would prefix every key with
    # "module."): checkpoint keys then match what `mcore-rl convert mcore-to-hf` reads. The
    # optimizer finds its params among these same Parameter objects.
    return megatron_sharded_state_dict(trainer.unwrapped())


LORA_FILE = "lora.json"


def save_role(trainer, ckpt_dir: Path, rank: int, *, base_model: str | None = None) -> None:
    """Every rank of the role's grid calls this (megatron saves collectively). base_model: the
    HF directory the role's weights came from (recorded for a LoRA role)."""
    from megatron.core import dist_checkpointing  # lazy: megatron

    megatron_save.install()  # no spawned process on the first save (compat/megatron_save.py)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    model_sd = _model_sharded_state_dict(trainer)
    state = {"model": model_sd, "optimizer": trainer.optimizer.sharded_state_dict(model_sd)}
    dist_checkpointing.save(state, str(ckpt_dir))
    torch.save({"scheduler": trainer.scheduler.state_dict(), "rng": torch.get_rng_state()},
               ckpt_dir / f"rank{rank}.pt")
    if trainer.lora is not None and rank == 0:
        _write_json(ckpt_dir / LORA_FILE, {**asdict(trainer.lora), "base_model": base_model})


def saved_lora(ckpt_dir: Path) -> tuple[LoRAConfig, str | None] | None:
    """A LoRA role's `lora.json`: (the adapters' config, the base's HF directory or None);
    None when the checkpoint has none. Only what the adapters' tensors depend on is read: the
    training-side fields (lr, sync) may differ between the version that wrote the file and
    this one. ValueError naming the file when it is unreadable."""
    path = ckpt_dir / LORA_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
        config = LoRAConfig(rank=meta["rank"], alpha=meta["alpha"],
                            dropout=meta.get("dropout", 0.0), targets=tuple(meta["targets"]))
        base = meta.get("base_model")
    except (OSError, ValueError, TypeError, KeyError, ConfigError) as err:
        raise ValueError(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    if not config.enabled:
        raise ValueError(f"{path}: rank={config.rank}: a LoRA checkpoint's rank is >= 1")
    return config, base


def saved_base_model(ckpt_dir: Path) -> str | None:
    """The base model a LoRA role's checkpoint records (None: not a LoRA checkpoint)."""
    saved = saved_lora(ckpt_dir)
    return None if saved is None else saved[1]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def load_role(trainer, ckpt_dir: Path, rank: int) -> None:
    """Restore model, optimizer, LR schedule and RNG saved by `save_role`."""
    from megatron.core import dist_checkpointing  # lazy: megatron

    model_sd = _model_sharded_state_dict(trainer)
    opt_sd = trainer.optimizer.sharded_state_dict(model_sd, is_loading=True)
    state = dist_checkpointing.load({"model": model_sd, "optimizer": opt_sd}, str(ckpt_dir))
    load_chunk_states(trainer.unwrapped(), state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    local = torch.load(ckpt_dir / f"rank{rank}.pt", weights_only=True)
    trainer.scheduler.load_state_dict(local["scheduler"])
    torch.set_rng_state(local["rng"])


