"""A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) from
adapter shards: the ranks' adapter tensors are assembled into PEFT's HF tensors through their
layouts (`layouts.lora.lora_shards`), and PEFT's own `LoraConfig` writes the config, so
`PeftModel.from_pretrained(hf_base, dir)` loads it onto the HF base model.

`mcore_to_peft` does it from a LoRA role checkpoint (`mcore-rl convert mcore-to-peft`): the
adapters are read at TP1 with the rank, alpha and base recorded in its `lora.json`
(`lora_checkpoint`).

The directory is written all-or-nothing (a temp dir beside it, renamed into place).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import save_file

from mcore_rl.conversion import output
from mcore_rl.conversion.errors import ConversionError
from mcore_rl.conversion.hf_source import read_spec
from mcore_rl.conversion.layout import checkpoint_layout
from mcore_rl.conversion.lora_checkpoint import checked_adapters, read_adapters, read_lora_json
from mcore_rl.layouts.layout import ShardMap
from mcore_rl.layouts.shards import assemble_hf
from mcore_rl.megatron.role_checkpoint import LORA_FILE

ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT stores a causal LM's adapter under the PeftModel's names: `base_model.model.<hf name>`.
PEFT_PREFIX = "base_model.model."


def peft_tensors(adapters: ShardMap,
                 local: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """PEFT's adapter tensors (names as PEFT saves them) from ranks' adapter shards."""
    return peft_names(assemble_hf(adapters, local))


def peft_names(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF adapter tensors (`<hf module>.lora_A.weight`, ...) under the names PEFT saves."""
    return {f"{PEFT_PREFIX}{name}": t.contiguous() for name, t in sorted(hf.items())}


def target_modules(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The HF modules adapted (q_proj, gate_proj, ...): PEFT's `target_modules`."""
    return sorted({name.rsplit(".", 3)[-3] for name in tensors})


def write_peft_adapter(dst: Path, tensors: Mapping[str, torch.Tensor], *, rank: int,
                       alpha: float, dropout: float = 0.0, base_model: str | None = None,
                       force: bool = False) -> Path:
    """Write `tensors` (`peft_tensors`) as a PEFT LoRA adapter at `dst`."""
    from peft import LoraConfig  # lazy: peft

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
    # lazy: torch.distributed.checkpoint
    from mcore_rl.conversion.convert import model_config_dir, open_checkpoint

    src, dst = Path(src).absolute(), Path(dst).absolute()
    reader = open_checkpoint(src)
    meta = read_lora_json(src)
    if meta is None:
        raise ConversionError(f"{src}: no {LORA_FILE} (not a LoRA checkpoint: a run with "
                              "actor.lora.rank > 0 writes one beside its actor checkpoint)")
    config_dir = model_config_dir(src, hf_config, meta.base_model)
    adapters = checked_adapters(reader, checkpoint_layout(read_spec(config_dir)), meta.config)
    lora = meta.config
    return write_peft_adapter(dst, peft_names(read_adapters(reader, adapters)), rank=lora.rank,
                              alpha=lora.alpha, dropout=lora.dropout, base_model=meta.base_model,
                              force=force)


__all__ = ["ADAPTER_WEIGHTS", "PEFT_PREFIX", "mcore_to_peft", "peft_names", "peft_tensors",
           "target_modules", "write_peft_adapter"]
