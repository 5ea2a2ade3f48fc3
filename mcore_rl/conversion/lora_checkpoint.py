"""The adapters of a LoRA role checkpoint (`actor.lora`, saved by
`megatron.role_checkpoint.save_role`).

Beside the frozen base, such a checkpoint holds every adapted linear's A and B
(`<linear>.lora.lora_a` / `.lora_b`, stored as the weight they adapt is: layers stacked, or
per layer) and `lora.json` with the adapters' rank, alpha, dropout and targets and the base's
HF directory. The adapters are read at TP1 (a dist checkpoint stores them grid-independently)
as PEFT's HF tensors: `<hf module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], one A
shared by the HF parts of a fused weight (`layouts.lora`).

`mcore-rl convert mcore-to-peft` writes them as a PEFT adapter (`peft_adapter`);
`mcore-rl convert mcore-to-hf` merges them into the weights they adapt (`AdapterMerge`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Mapping

import torch

from mcore_rl.conversion.errors import ConversionError
from mcore_rl.conversion.layout import AdapterLayout, CkptLayout, CkptTensor, adapter_layout
from mcore_rl.layouts.lora import hf_lora_name
from mcore_rl.layouts.shards import assemble_hf
from mcore_rl.megatron.role_checkpoint import LORA_FILE, saved_lora

if TYPE_CHECKING:
    from mcore_rl.conversion.dcp_io import ChunkReader
    from mcore_rl.megatron.config import LoRAConfig

# What every adapter tensor's checkpoint key contains (`layouts.lora.ADAPTER_PARAMS`).
ADAPTER_KEY_PART = ".lora.lora_"


@dataclass(frozen=True)
class LoraMeta:
    """`lora.json`: the adapters' config and the base's HF directory (None: not recorded)."""

    config: "LoRAConfig"
    base_model: str | None


def stored_adapter_keys(reader: "ChunkReader") -> list[str]:
    """The checkpoint's adapter tensors (their optimizer states aside)."""
    return sorted(k for k in reader.metadata.state_dict_metadata
                  if ADAPTER_KEY_PART in k and not k.startswith("optimizer."))


def read_lora_json(src: Path) -> LoraMeta | None:
    """`src/lora.json` (`role_checkpoint.saved_lora`), or None when there is none."""
    try:
        saved = saved_lora(src)
    except ValueError as err:
        raise ConversionError(str(err)) from None
    return None if saved is None else LoraMeta(*saved)


def lora_meta_of(src: Path, reader: "ChunkReader") -> LoraMeta | None:
    """The LoRA metadata of the checkpoint `src`: None for a full model (no adapter tensors,
    no lora.json). Adapter tensors without lora.json are refused: their scale is unknown."""
    meta = read_lora_json(src)
    keys = stored_adapter_keys(reader)
    if meta is None and keys:
        raise ConversionError(f"{src}: {len(keys)} LoRA adapter tensors (e.g. {keys[0]}) but "
                              f"no {LORA_FILE} (their rank and alpha); a LoRA run writes it "
                              "beside its actor checkpoint")
    return meta


def checked_adapters(reader: "ChunkReader", layout: CkptLayout,
                     config: "LoRAConfig") -> AdapterLayout:
    """The adapters `config` puts on `layout`'s weights, each checked to be in the checkpoint
    with its shape; a stored adapter the layout does not know is refused."""
    adapters = adapter_layout(layout, config.rank, config.targets)
    known = {key for t in adapters.tensors for key, _ in t.stored_forms()}
    unknown = [k for k in stored_adapter_keys(reader) if k not in known]
    if unknown:
        raise ConversionError(
            f"{reader.dir}: adapter tensor {unknown[0]} is on no weight that lora.json's "
            f"targets {list(config.targets)} adapt in this model"
            + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    for t in adapters.tensors:
        found = t.stored_form(reader)
        if found is None:
            raise ConversionError(f"{reader.dir}: no adapter tensor {t.key} (stacked or per "
                                  f"layer; rank {config.rank}, targets {list(config.targets)})")
        key, axes = found
        want = tuple(n for _, n in axes) + t.local.shape
        stored = tuple(reader.tensor_metadata(key).size)
        if stored != want:
            raise ConversionError(f"{reader.dir}: adapter tensor {key} has shape {stored}, "
                                  f"expected {want} (lora.json's rank {config.rank})")
    return adapters


def read_adapters(reader: "ChunkReader", adapters: AdapterLayout,
                  weights: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """PEFT's HF adapter tensors (without PEFT's name prefix) of the adapters on `weights` (TP1
    Megatron weight keys, `checkpoint_layout`'s; None: every adapter), read as stored."""
    local = {}
    for t in adapters.tensors:
        module = t.local.key.split(".lora.", 1)[0]
        if weights is None or f"{module}.weight" in weights:
            local[t.local.key] = _read_whole(reader, t)
    names = {p.hf_name for key in local for p in adapters.tp1.ranks[0][key].pieces}
    return assemble_hf(adapters.tp1, {0: local}, names)


def _read_whole(reader: "ChunkReader", t: CkptTensor) -> torch.Tensor:
    """The TP1 tensor of the checkpoint tensor `t` (located by `checked_adapters`)."""
    key, axes = t.stored_form(reader)
    out = torch.empty((1,) * len(axes) + t.local.shape,
                      dtype=reader.tensor_metadata(key).properties.dtype)
    offsets = tuple(i for i, _ in axes) + (0,) * len(t.local.shape)
    reader.read([(key, offsets, out)])
    return out.reshape(t.local.shape)


@dataclass(frozen=True)
class AdapterMerge:
    """W + scale·B·A for the HF weights that `tensors` (`read_adapters`) adapt."""

    scale: float
    tensors: Mapping[str, torch.Tensor]

    def adapts(self, hf_weight: str) -> bool:
        return hf_lora_name(hf_weight, "A") in self.tensors

    def merge_(self, hf_weight: str, w: torch.Tensor) -> None:
        """Add the adapter's delta to the float32 weight `w`, in place."""
        a = self.tensors[hf_lora_name(hf_weight, "A")].float()
        b = self.tensors[hf_lora_name(hf_weight, "B")].float()
        w.addmm_(b, a, alpha=self.scale)


__all__ = ["ADAPTER_KEY_PART", "AdapterMerge", "LoraMeta", "checked_adapters",
           "lora_meta_of", "read_adapters", "read_lora_json", "stored_adapter_keys"]
