"""A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) from
adapter shards: the ranks' adapter tensors are assembled into PEFT's HF tensors through their
layouts (`layouts.lora.lora_shards`), and PEFT's own `LoraConfig` writes the config, so
`PeftModel.from_pretrained(hf_base, dir)` loads it onto the HF base model.

`mcore_to_peft` does it from a LoRA role checkpoint (`mcore-rl convert mcore-to-peft`): the
adapters are read at TP1 (a dist checkpoint stores them grid-independently, layers stacked on
a leading axis) with the rank, alpha and base recorded in its `lora.json`.

The directory is written all-or-nothing (a temp dir beside it, renamed into place).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from mcore_rl.conversion import output
from mcore_rl.conversion.errors import ConversionError
from mcore_rl.layouts.layout import ShardMap
from mcore_rl.layouts.shards import assemble_hf

if TYPE_CHECKING:
    from mcore_rl.conversion.dcp_io import ChunkReader

ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT stores a causal LM's adapter under the PeftModel's names: `base_model.model.<hf name>`.
PEFT_PREFIX = "base_model.model."


def peft_tensors(adapters: ShardMap,
                 local: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """PEFT's adapter tensors (names as PEFT saves them) from ranks' adapter shards."""
    hf = assemble_hf(adapters, local)
    return {f"{PEFT_PREFIX}{name}": t.contiguous() for name, t in sorted(hf.items())}


def target_modules(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The HF modules adapted (q_proj, gate_proj, ...): PEFT's `target_modules`."""
    return sorted({name.rsplit(".", 3)[-3] for name in tensors})


def write_peft_adapter(dst: Path, tensors: Mapping[str, torch.Tensor], *, rank: int,
                       alpha: float, dropout: float = 0.0, base_model: str | None = None,
                       force: bool = False) -> Path:
    """Write `tensors` (`peft_tensors`) as a PEFT LoRA adapter at `dst`."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    if (dst.exists() or dst.is_symlink()) and not force:
        raise ConversionError(f"destination {dst} already exists (pass --force to replace it)")
    tmp = output.temp_dir_for(dst)
    try:
        tmp.mkdir(parents=True)
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none",
                            target_modules=target_modules(tensors), task_type="CAUSAL_LM",
                            base_model_name_or_path=base_model, inference_mode=True)
        config.save_pretrained(str(tmp))
        save_file(dict(tensors), str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        output.commit(tmp, dst, force=force)
    finally:
        output.remove(tmp)
    return dst


def mcore_to_peft(src: str | Path, dst: str | Path, *, hf_config: str | Path | None = None,
                  force: bool = False) -> Path:
    """Write the adapters of the LoRA role checkpoint `src` as a PEFT adapter at `dst`.
    hf_config: a folder with the base model's config.json (default: the base recorded in
    `src/lora.json`)."""
    from mcore_rl.conversion.convert import open_checkpoint
    from mcore_rl.conversion.hf_source import read_spec
    from mcore_rl.layouts import megatron_shards
    from mcore_rl.layouts.lora import lora_shards
    from mcore_rl.megatron.config import LoRAConfig
    from mcore_rl.megatron.role_checkpoint import LORA_FILE
    from mcore_rl.parallel import ParallelConfig

    src, dst = Path(src).absolute(), Path(dst).absolute()
    reader = open_checkpoint(src)
    meta_path = src / LORA_FILE
    if not meta_path.is_file():
        raise ConversionError(f"{src}: no {LORA_FILE} (not a LoRA checkpoint: a run with "
                              "actor.lora.rank > 0 writes one beside its actor checkpoint)")
    meta = json.loads(meta_path.read_text())
    base = meta.pop("base_model", None)
    lora = LoRAConfig(**{**meta, "targets": tuple(meta["targets"])})
    config_dir = Path(hf_config) if hf_config else Path(base) if base else None
    if config_dir is None or not (config_dir / "config.json").is_file():
        raise ConversionError(f"{config_dir or src}: no config.json of the base model; pass "
                              "--hf-config DIR (a folder with the base's HF config.json)")
    spec = read_spec(config_dir)
    adapters = lora_shards(megatron_shards(spec, ParallelConfig()), lora.rank, lora.targets)
    local = {key: _read_layer_tensor(reader, key, t.shape)
             for key, t in adapters.ranks[0].items()}
    return write_peft_adapter(dst, peft_tensors(adapters, {0: local}), rank=lora.rank,
                              alpha=lora.alpha, dropout=lora.dropout, base_model=base,
                              force=force)


def _read_layer_tensor(reader: "ChunkReader", key: str,
                       shape: tuple[int, ...]) -> torch.Tensor:
    """A decoder layer's TP1 tensor `decoder.layers.<l>.<rest>` from a dist checkpoint: the
    stacked key `decoder.layers.<rest>` at layer l, or a per-layer key
    (non_homogeneous_layers)."""
    head, rest = key.split("layers.", 1)
    layer, rest = rest.split(".", 1)
    for stored, offsets, lead in ((f"{head}layers.{rest}", (int(layer),), (1,)),
                                  (key, (), ())):
        md = reader.tensor_metadata(stored)
        if md is not None:
            out = torch.empty((*lead, *shape), dtype=md.properties.dtype)
            reader.read([(stored, (*offsets, *(0 for _ in shape)), out)])
            return out.reshape(shape)
    raise ConversionError(f"{reader.dir}: no adapter tensor {key} (stacked or per layer)")


__all__ = ["ADAPTER_WEIGHTS", "PEFT_PREFIX", "mcore_to_peft", "peft_tensors",
           "target_modules", "write_peft_adapter"]
