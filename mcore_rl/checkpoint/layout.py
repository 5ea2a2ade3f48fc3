"""Where every Megatron tensor lives in a megatron-core dist checkpoint, derived from the layout
tables (`mcore_rl.layouts`) — not a second name mapping.

A dist checkpoint stores *global* tensors keyed by `ShardedTensor.key`; what megatron-core
0.16.1's `GPTModel.sharded_state_dict()` (default metadata) asks for at load time does not
depend on the grid that saved them:

  decoder layer tensors  key 'decoder.layers.<name inside the layer>', in TE spelling under
                         *both* layer specs (the local spec maps `input_layernorm.weight` to
                         `self_attention.linear_qkv.layer_norm_weight`, gpt_layer_specs.py
                         sharded_state_dict_keys_map), with one layer axis prepended:
                         global [num_layers, *tp1_shape], layer l at offset l
                         (TransformerBlock.sharded_state_dict, non_homogeneous_layers=False).
                         Checkpoints saved with non_homogeneous_layers=True use per-layer keys
                         'decoder.layers.<l>.<name>' without the layer axis; the reader accepts
                         both.
  linear_qkv             per query group [q_g; k_g; v_g], groups in order = the TP1 tensor
                         (TP rank r holds a contiguous run of groups: fragment r of tp on dim 0).
  linear_fc1             [gate; up] = the TP1 tensor (apply_swiglu_sharded_factory: TP rank r
                         holds gate rows at fragment r and up rows at fragment tp + r of 2·tp).
  linear_proj / fc2      split on dim 1 over TP; the TP1 tensor is the global one.
  embedding / output     [V_pad, hidden], V_pad padded by whoever saved (128·tp); loaded with
                         allow_shape_mismatch, so any V_pad >= vocab works; rows >= vocab are 0.
  tied embeddings        no 'output_layer.weight' (the last stage saves its copy under the
                         embedding's key, as a replica).
  '<linear>._extra_state' one ShardedObject per layer for every TP-parallel linear (data [None]
                         for the local spec), unique key '<key>/shard_<l>_<num_layers>'
                         (`layouts.extra_state_modules`).

So the grid- and spec-independent form is the TP1·PP1 Megatron layout with the layers stacked,
named as the layout tables name the TE spec: `megatron_shards(spec, ParallelConfig(),
layer_spec="te")` names every tensor and its HF pieces. The layout tables are the only place
that knows the TE names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mcore_rl.layouts import LocalTensor, ShardMap, extra_state_modules, megatron_shards
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel.config import ParallelConfig

# Dist-checkpoint keys are TE-spelled whatever layer spec saved them (module docstring).
CHECKPOINT_SPELLING = "te"

# TransformerBlock.sharded_state_dict: state-dict prefix f'{prefix}layers.{i}.' ↔ sharded key
# prefix f'{prefix}layers.' plus the layer axis (transformer_block.py, megatron-core 0.16.1).
_LAYER_KEY = re.compile(r"^(?P<head>decoder\.layers\.)(?P<layer>\d+)\.(?P<rest>.+)$")


class CheckpointLayoutError(ValueError):
    """The layout tables and the checkpoint form disagree (a bug, not bad input)."""


@dataclass(frozen=True)
class CkptTensor:
    """One TP1·PP1 Megatron tensor as a chunk of a checkpoint tensor.

    key: the checkpoint (ShardedTensor) key. layer: its index on the prepended layer axis, or
    None for tensors outside the decoder layers. local: its TP1 shape and HF pieces.
    """

    key: str
    layer: int | None
    num_layers: int
    local: LocalTensor

    @property
    def per_layer_key(self) -> str | None:
        """The key a non_homogeneous_layers=True checkpoint stores this layer's tensor under."""
        if self.layer is None:
            return None
        head, rest = self.key.split("layers.", 1)
        return f"{head}layers.{self.layer}.{rest}"

    @property
    def global_shape(self) -> tuple[int, ...]:
        shape = self.local.shape
        return shape if self.layer is None else (self.num_layers, *shape)

    @property
    def chunk_offsets(self) -> tuple[int, ...]:
        zeros = (0,) * len(self.local.shape)
        return zeros if self.layer is None else (self.layer, *zeros)

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        return self.local.shape if self.layer is None else (1, *self.local.shape)


@dataclass(frozen=True)
class CkptLayout:
    """All tensors and extra-state objects of a model's dist checkpoint.

    tp1: the TP1·PP1 shard map (TE names) the tensors come from; tensors: one per local tensor,
    in the map's order; objects: ShardedObject unique keys (each stores `[None]`).
    """

    spec: ModelSpec
    tp1: ShardMap
    tensors: tuple[CkptTensor, ...]
    objects: tuple[str, ...]

    def tensor_keys(self) -> list[str]:
        return list(dict.fromkeys(t.key for t in self.tensors))

    def hf_units(self) -> dict[str, CkptTensor]:
        """HF tensor name → the one checkpoint chunk holding all of it (at TP1 every HF tensor
        lies inside exactly one Megatron tensor)."""
        out: dict[str, CkptTensor] = {}
        for t in self.tensors:
            for piece in t.local.pieces:
                other = out.setdefault(piece.hf_name, t)
                if other is not t:
                    raise CheckpointLayoutError(
                        f"{piece.hf_name} is split over {other.local.key} and {t.local.key} at "
                        "TP1; the checkpoint reader expects one Megatron tensor per HF tensor")
        missing = set(self.tp1.hf_shapes) - set(out)
        if missing:
            raise CheckpointLayoutError(f"no Megatron tensor holds {sorted(missing)[:3]}")
        return out


def checkpoint_layout(spec: ModelSpec) -> CkptLayout:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tp1 = megatron_shards(spec, ParallelConfig(), layer_spec=CHECKPOINT_SPELLING)
    tensors = []
    for local_key, local in tp1.ranks[0].items():
        m = _LAYER_KEY.match(local_key)
        if m:
            tensors.append(CkptTensor(m["head"] + m["rest"], int(m["layer"]), spec.layers, local))
        else:
            tensors.append(CkptTensor(local_key, None, spec.layers, local))
    objects = [ShardedObject(key, None, (spec.layers,), (layer,), replica_id=0).unique_key
               for key in _extra_state_keys(spec) for layer in range(spec.layers)]
    return CkptLayout(spec, tp1, tuple(tensors), tuple(objects))


def _extra_state_keys(spec: ModelSpec) -> list[str]:
    """'decoder.layers.<module>._extra_state' (stacked key) for every TP-parallel linear."""
    keys = []
    for module in extra_state_modules(spec, CHECKPOINT_SPELLING):
        m = _LAYER_KEY.match(module.format(layer=0))
        keys.append(f"{m['head']}{m['rest']}._extra_state")
    return keys
