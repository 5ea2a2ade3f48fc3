"""The layer spec's parameter names on the device the run computes on: megatron-core builds the
model with `layer_spec(name)`, and its state dict, its dist-checkpoint keys and the layout
tables' names for that spec agree; HF weights loaded through the tables give HF's logits.

Cases: "cpu" (local spec, CUDA hidden: the CPU twin), "cuda" (local spec on cuda:0, compat
shims off: a GPU check) and "cuda-te" (TransformerEngine spec — megatron-core itself against
our TE names; only where TE imports). The TE names are also checked on CPU, without TE, against
megatron-core's TE spec tree: tests/layouts/test_te_names.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_weights import random_hf_weights
from gpu_twins import gpu_marks, join_world, spawn_env

from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.gpt import te_importable
from mcore_rl.models.presets import get_preset

MICRO = get_preset("micro")
SPECS = {"llama": MICRO,
         "qwen2_bias_tied": MICRO.with_(family="qwen2", architecture="Qwen2ForCausalLM",
                                        qkv_bias=True, tied_embeddings=True)}
TOKENS = torch.randint(0, MICRO.vocab, (2, 16), generator=torch.Generator().manual_seed(5))
TWIN = "tests/models/test_gpu_layer_spec.py::test_layer_spec_names_on_device[cpu]"
CASES = [
    pytest.param("cpu", "local", id="cpu"),
    pytest.param("cuda", "local", id="cuda", marks=gpu_marks(TWIN)),
    pytest.param("cuda", "te", id="cuda-te", marks=[
        *gpu_marks(TWIN), pytest.mark.skipif(
            not te_importable(), reason="TransformerEngine is not importable here (the GPU "
            "check machine has none): our TE names are checked without it against "
            "megatron-core's TE spec tree in tests/layouts/test_te_names.py")]),
]


def _hf_logits(spec, weights) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    from mcore_rl.models.hf_factory import hf_config_from_spec

    model = AutoModelForCausalLM.from_config(hf_config_from_spec(spec), dtype=torch.float32)
    model.load_state_dict(weights, strict=False)  # tied: lm_head is embed_tokens
    with torch.no_grad():
        return model(TOKENS).logits.numpy()


def _names_on_device(rank, world, device, layer_spec_name):
    """Per spec: the built model's names (state dict, dist-checkpoint keys), the tables' names
    for the spec, whether loading through the tables reads back exactly, and the logits."""
    from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor,
                                                          ShardedTensorFactory)

    from mcore_rl.conversion.layout import _extra_state_objects, checkpoint_layout
    from mcore_rl.layouts import materialize_rank, megatron_shards
    from mcore_rl.models.gpt import build_gpt_model, load_chunks
    from mcore_rl.parallel import ParallelConfig
    from mcore_rl.parallel.groups import init_training_groups, leave_worker_world

    on = join_world(rank, world, device)
    parallel = ParallelConfig()
    groups = init_training_groups(parallel, device=str(on))
    out = {}
    for name, spec in SPECS.items():
        (chunk,) = build_gpt_model(spec, parallel, groups, layer_spec=layer_spec_name)
        state = chunk.state_dict()
        tensors = materialize_rank(megatron_shards(spec, parallel, layer_spec=layer_spec_name),
                                   0, random_hf_weights(spec).__getitem__)
        load_chunks([chunk], tensors, None)
        after = chunk.state_dict()
        sharded = chunk.sharded_state_dict()
        layout = checkpoint_layout(spec)
        with torch.no_grad():
            positions = torch.arange(TOKENS.shape[1], device=on).expand_as(TOKENS)
            logits = chunk(TOKENS.to(on), positions, None)[..., :spec.vocab]
        out[name] = {
            "device": str(next(chunk.parameters()).device),
            "params": sorted(k for k in state if not k.endswith("_extra_state")),
            "table": sorted(tensors),
            "read_back": all(torch.equal(after[k].cpu(), tensors[k]) for k in tensors),
            "ckpt_tensors": sorted({v.key for v in sharded.values()
                                    if isinstance(v, (ShardedTensor, ShardedTensorFactory))}),
            "ckpt_objects": sorted({v.key for v in sharded.values()
                                    if isinstance(v, ShardedObject)}),
            "layout_tensors": sorted(layout.tensor_keys()),
            "layout_objects": sorted({key for key, _, _ in _extra_state_objects(spec)}),
            "logits": logits.float().cpu().numpy(),
        }
    leave_worker_world()
    return out


@pytest.mark.parametrize("device,layer_spec_name", CASES)
def test_layer_spec_names_on_device(device, layer_spec_name):
    (out,) = run_on_ranks(_names_on_device, 1, device, layer_spec_name,
                          init_default_group=False, env=spawn_env(device), timeout_s=240)
    for name, spec in SPECS.items():
        got = out[name]
        assert got["device"] == ("cuda:0" if device == "cuda" else "cpu")
        # the module's parameters are exactly what the tables name for this spec
        assert got["params"] == got["table"], name
        assert got["read_back"], name
        # dist checkpoints: TE-spelled keys under both specs, as the converter writes them
        assert got["ckpt_tensors"] == got["layout_tensors"], name
        assert got["ckpt_objects"] == got["layout_objects"], name
        np.testing.assert_allclose(got["logits"], _hf_logits(spec, random_hf_weights(spec)),
                                   rtol=0, atol=1e-4, err_msg=name)
