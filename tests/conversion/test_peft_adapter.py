"""Writing a PEFT adapter directory: all or nothing, never over an existing one unless forced.
(That PEFT loads what is written onto the HF base and gives the actor's logits:
tests/megatron/test_lora.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from mcore_rl.conversion.errors import ConversionError
from mcore_rl.conversion.peft_adapter import target_modules, write_peft_adapter

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

TENSORS = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 8),
           "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2),
           "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": torch.ones(2, 8),
           "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": torch.zeros(8, 2)}


def test_config_names_rank_alpha_and_the_hf_modules(tmp_path):
    assert target_modules(TENSORS) == ["down_proj", "q_proj"]
    dst = write_peft_adapter(tmp_path / "a", TENSORS, rank=2, alpha=4.0, base_model="org/m")
    config = json.loads((dst / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 2, 4.0)
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj"]
    assert config["base_model_name_or_path"] == "org/m"


def test_an_existing_directory_is_kept_unless_forced(tmp_path):
    dst = write_peft_adapter(tmp_path / "a", TENSORS, rank=2, alpha=4.0)
    with pytest.raises(ConversionError, match="already exists .pass --force"):
        write_peft_adapter(dst, TENSORS, rank=3, alpha=4.0)
    assert json.loads((dst / "adapter_config.json").read_text())["r"] == 2
    write_peft_adapter(dst, TENSORS, rank=3, alpha=4.0, force=True)
    assert json.loads((dst / "adapter_config.json").read_text())["r"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temp dirs left
