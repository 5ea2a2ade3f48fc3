"""The policy's LoRA adapter served by vLLM's LoRA support (`actor.lora.sync: adapter`): the
engine keeps its base weights and applies the adapter the trainer streams it at every sync.

vLLM loads adapters from a directory when a request names one it has not registered
(`LRUCacheWorkerLoRAManager.add_adapter`). Ours never touches a disk: each worker builds the
`LoRAModel` from the tensors it received (`LoRAModel.from_lora_tensors`, as vLLM's own loader
does after reading the files) and registers it with the model's LoRA manager under
`ADAPTER_ID`, replacing the previous version. A request naming `ADAPTER_ID` then finds it
registered and vLLM never reads `lora_path`. Each worker gets every adapter tensor whole; its
LoRA layers cut their TP rank's slice when the adapter is activated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

ADAPTER_ID = 1
ADAPTER_NAME = "mcore-rl-policy"
# vLLM reads no file of an adapter it holds already; the request still needs a path.
ADAPTER_PATH = "/nonexistent/mcore-rl-policy-adapter-is-streamed"
# vLLM's `LoRAConfig.max_lora_rank` takes one of these (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class EngineLoRA:
    """What an engine needs to serve the policy's adapter: its rank and scale."""

    rank: int
    alpha: float

    @property
    def max_lora_rank(self) -> int:
        """The smallest rank vLLM accepts that holds `rank`."""
        fits = [r for r in VLLM_LORA_RANKS if r >= self.rank]
        if not fits:
            raise ValueError(f"LoRA rank {self.rank}: vLLM serves ranks up to "
                             f"{VLLM_LORA_RANKS[-1]}")
        return fits[0]

    def llm_kwargs(self) -> dict[str, Any]:
        """vLLM's `LLM(...)` arguments: one adapter slot, held in host memory once."""
        return {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1,
                "max_lora_rank": self.max_lora_rank}

    def peft_config(self, target_modules: list[str]) -> dict[str, Any]:
        """The adapter_config.json fields vLLM's PEFT helper reads."""
        return {"r": self.rank, "lora_alpha": self.alpha, "target_modules": target_modules,
                "bias": "none"}


def lora_request():
    """The request every generate call passes once an adapter is installed."""
    from vllm.lora.request import LoRARequest  # lazy: vllm

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH)


def target_modules(names: list[str]) -> list[str]:
    """HF module names (`q_proj`, ...) of PEFT tensor names `...q_proj.lora_A.weight`."""
    return sorted({n.rsplit(".", 3)[-3] for n in names})


def unsupported_lora_reason(architecture: str, lm_head: bool = False) -> str | None:
    """Why vLLM cannot serve a LoRA adapter on `architecture` (None: it can): the model class
    must implement vLLM's SupportsLoRA, and name `lm_head` among its `embedding_modules` for
    an adapter on the output layer (`lm_head`)."""
    from vllm.model_executor.models import ModelRegistry  # lazy: vllm
    from vllm.model_executor.models.interfaces import supports_lora  # lazy: vllm

    if architecture not in ModelRegistry.get_supported_archs():
        return f"vLLM does not know the architecture {architecture}"
    model_cls = ModelRegistry._try_load_model_cls(architecture)
    if model_cls is None:
        return f"vLLM cannot load its model class for {architecture}"
    if not supports_lora(model_cls):
        return f"vLLM's {model_cls.__name__} does not support LoRA"
    if lm_head and "lm_head" not in getattr(model_cls, "embedding_modules", {}):
        return f"vLLM's {model_cls.__name__} serves no LoRA on its lm_head"
    return None


@dataclass
class ReceivedAdapter:
    """The adapter a worker received: whole tensors by PEFT name, and its PEFT config."""

    tensors: dict[str, torch.Tensor]
    peft: dict[str, Any]


def install_adapter(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                    peft: Mapping[str, Any]) -> list[str]:
    """Replace the adapter `ADAPTER_ID` of this worker's model by `tensors` (PEFT names, whole
    tensors) with the PEFT config `peft`; returns the names installed. Raises ValueError for
    an engine started without LoRA, a name that is not a LoRA matrix or a module vLLM's model
    cannot adapt, and vLLM's own refusals (a rank above the engine's, ...)."""
    from vllm.lora.lora_model import LoRAModel  # lazy: vllm
    from vllm.lora.peft_helper import PEFTHelper  # lazy: vllm

    manager = check_adapter(model, tensors, int(peft["r"]))
    helper = PEFTHelper.from_dict(dict(peft))
    helper.validate_legal(manager.lora_config)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    adapter = LoRAModel.from_lora_tensors(
        ADAPTER_ID, {f"base_model.model.{k}": v for k, v in tensors.items()}, helper,
        device="cpu", dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    manager.remove_adapter(ADAPTER_ID)  # deactivates it: the next step loads the new one
    manager.add_adapter(adapter)
    manager.activate_adapter(ADAPTER_ID)
    return sorted(tensors)


def check_adapter(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], rank: int):
    """The model's LoRA manager, once every name of `tensors` is a LoRA matrix of rank `rank`
    (A [rank, in], B [out, rank]) of a module vLLM's model adapts, and vLLM serves that rank
    (ValueError naming the first that is not)."""
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise ValueError("this engine serves no LoRA adapters (started without enable_lora)")
    expected = set()
    for module in manager.supported_lora_modules:
        expected.update(manager.packed_modules_mapping.get(module, [module]))
    for name in tensors:
        parts = name.split(".")
        if len(parts) < 3 or parts[-2] not in ("lora_A", "lora_B") or parts[-1] != "weight":
            raise ValueError(f"{name}: not a PEFT LoRA matrix (<module>.lora_A|B.weight)")
        if parts[-3] not in expected:
            raise ValueError(f"{name}: vLLM's model adapts none of its {parts[-3]} modules "
                             f"(it adapts {', '.join(sorted(expected))})")
        r = tensors[name].shape[0 if parts[-2] == "lora_A" else -1]
        if tensors[name].ndim != 2 or r != rank:
            raise ValueError(f"{name}: shape {tuple(tensors[name].shape)}, not of the "
                             f"adapter's rank {rank}")
    if rank > manager.lora_config.max_lora_rank:
        raise ValueError(f"LoRA rank {rank} > the engine's max_lora_rank "
                         f"{manager.lora_config.max_lora_rank}")
    return manager


__all__ = ["ADAPTER_ID", "ADAPTER_NAME", "EngineLoRA", "ReceivedAdapter", "check_adapter",
           "install_adapter", "lora_request", "target_modules", "unsupported_lora_reason"]
