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
  LoRA adapters          a LoRA run's '<linear>.lora.lora_a' / '.lora_b' are stored as the
                         weight they adapt is, layer axis and all (`adapter_layout`).
  routed experts         (SequentialMLP.sharded_state_dict) 'mlp.experts.local_experts.<j>.<rest>'
                         is stored as 'mlp.experts.experts.<rest>' with an expert axis after the
                         layer axis: global [num_layers, num_experts, *tp1_shape], expert e of
                         layer l at offset (l, e) — whatever EP saved it; each expert's fc1 is
                         [gate; up] and splits over expert-TP like the dense fc1. Extra state:
                         '<key>/shard_<l>.<e>_<num_layers>.<num_experts>'. The TE spec's
                         TEGroupedMLP holds expert j as 'mlp.experts.linear_fc1.weight<j>' and
                         stores it under the same key and axes ("interchangeable with
                         SequentialMLP's", TEGroupedMLP.sharded_state_dict).
  MoE pre-MLP norm       the two specs disagree: the local spec's keys map renames
                         'pre_mlp_layernorm.' to 'mlp.linear_fc1.layer_norm_' in every layer,
                         MoE layers included, while the TE spec has a real pre_mlp_layernorm
                         module there (no fc1 to fuse into). Such tensors are written under both
                         keys (`CkptTensor.aliases`) and read from whichever is present.

So the grid- and spec-independent form is the TP1·PP1 Megatron layout with the layers (and
experts) stacked, named as the layout tables name the TE spec: `megatron_shards(spec,
ParallelConfig(), layer_spec="te")` names every tensor and its HF pieces. The layout tables are
the only place that knows the TE names; the local spec's keys map is read from megatron-core.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from mcore_rl.layouts import LocalTensor, ShardMap, extra_state_modules, megatron_shards
from mcore_rl.layouts.lora import lora_shards
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel.config import ParallelConfig

if TYPE_CHECKING:
    from mcore_rl.conversion.dcp_io import ChunkReader

# Dist-checkpoint keys are TE-spelled whatever layer spec saved them (module docstring).
CHECKPOINT_SPELLING = "te"

# TransformerBlock.sharded_state_dict: state-dict prefix f'{prefix}layers.{i}.' ↔ sharded key
# prefix f'{prefix}layers.' plus the layer axis (transformer_block.py, megatron-core 0.16.1).
_LAYER_KEY = re.compile(r"^(?P<head>decoder\.layers\.)(?P<layer>\d+)\.(?P<rest>.+)$")
# SequentialMLP.sharded_state_dict: state-dict prefix f'{prefix}local_experts.{j}.' ↔ sharded
# key prefix f'{prefix}experts.' plus the expert axis (moe/experts.py, megatron-core 0.16.1).
_EXPERT_KEY = re.compile(r"^(?P<head>.+\.experts\.)local_experts\.(?P<expert>\d+)\."
                         r"(?P<rest>.+)$")
# TEGroupedMLP.sharded_state_dict: its grouped linear's f'{linear}.weight{j}' ↔ the key
# SequentialMLP gives expert j's f'{linear}.weight' (f'{prefix}experts.{linear}.weight').
_GROUPED_EXPERT_KEY = re.compile(r"^(?P<head>.+\.experts\.)(?P<linear>linear_fc[12])\."
                                 r"(?P<param>weight|bias)(?P<expert>\d+)$")


# (index, size) of each axis a checkpoint prepends to a TP1 tensor (layer, then expert).
Axes = tuple[tuple[int, int], ...]


class CheckpointLayoutError(ValueError):
    """The layout tables and the checkpoint form disagree (a bug, not bad input)."""


@dataclass(frozen=True)
class CkptTensor:
    """One TP1·PP1 Megatron tensor as a chunk of a checkpoint tensor.

    key: the checkpoint (ShardedTensor) key. layer: its index on the prepended layer axis, or
    None for tensors outside the decoder layers. expert: its index on the expert axis (after
    the layer axis) for a routed expert's tensor, else None. local: its TP1 shape and HF
    pieces. aliases: other keys the same tensor is stored under (module docstring).
    """

    key: str
    layer: int | None
    num_layers: int
    local: LocalTensor
    expert: int | None = None
    num_experts: int = 0
    aliases: tuple[str, ...] = ()

    @property
    def axes(self) -> Axes:
        """(index, size) of each axis the checkpoint prepends to the TP1 tensor."""
        layer = () if self.layer is None else ((self.layer, self.num_layers),)
        return layer + (() if self.expert is None else ((self.expert, self.num_experts),))

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key, *self.aliases)

    def stored_forms(self) -> list[tuple[str, Axes]]:
        """Every (key, prepended axes) a checkpoint may hold this tensor under: the stacked
        keys, then the per-layer keys of a non_homogeneous_layers=True checkpoint
        ('decoder.layers.<l>.<name>', without the layer axis)."""
        forms = [(key, self.axes) for key in self.keys]
        if self.layer is not None:
            for key in self.keys:
                head, rest = key.split("layers.", 1)
                forms.append((f"{head}layers.{self.layer}.{rest}", self.axes[1:]))
        return forms

    def stored_form(self, reader: "ChunkReader") -> tuple[str, Axes] | None:
        """The first of `stored_forms` that `reader`'s checkpoint holds, or None."""
        return next(((key, axes) for key, axes in self.stored_forms()
                     if reader.tensor_metadata(key) is not None), None)

    @property
    def per_layer_key(self) -> str | None:
        """The key a non_homogeneous_layers=True checkpoint stores this layer's tensor under."""
        if self.layer is None:
            return None
        head, rest = self.key.split("layers.", 1)
        return f"{head}layers.{self.layer}.{rest}"

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.axes) + self.local.shape

    @property
    def chunk_offsets(self) -> tuple[int, ...]:
        return tuple(i for i, _ in self.axes) + (0,) * len(self.local.shape)

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        return (1,) * len(self.axes) + self.local.shape


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
        return list(dict.fromkeys(key for t in self.tensors for key in t.keys))

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
    from megatron.core.dist_checkpointing.mapping import ShardedObject  # lazy: megatron

    tp1 = megatron_shards(spec, ParallelConfig(), layer_spec=CHECKPOINT_SPELLING)
    local = megatron_shards(spec, ParallelConfig(), layer_spec="local")
    keys_map = _local_spec_keys_map(spec)
    tensors = []
    for (te_name, t), local_name in zip(tp1.ranks[0].items(), local.ranks[0]):
        key, axes = _stored_key(te_name, spec)
        local_key, _ = _stored_key(_apply_keys_map(local_name, keys_map), spec)
        aliases = () if local_key == key else (local_key,)
        layer, expert = (axes + [None, None])[:2]
        tensors.append(CkptTensor(key, layer, spec.layers, t, expert, spec.num_experts or 0,
                                  aliases))
    objects = [ShardedObject(key, None, shape, offset, replica_id=0).unique_key
               for key, shape, offset in _extra_state_objects(spec)]
    return CkptLayout(spec, tp1, tuple(tensors), tuple(objects))


@dataclass(frozen=True)
class AdapterLayout:
    """A LoRA checkpoint's adapters on a layout's weights (`layouts.lora`): `tp1` the TP1
    adapter tensors as pieces of PEFT's HF tensors, `tensors` the same as checkpoint tensors
    (stored as the weights they adapt are: layers stacked, or per layer)."""

    tp1: ShardMap
    tensors: tuple[CkptTensor, ...]


def adapter_layout(layout: CkptLayout, rank: int, targets: Iterable[str]) -> AdapterLayout:
    """The adapters of rank `rank` that `targets` (LoRAConfig.targets) put on `layout`."""
    tp1 = lora_shards(layout.tp1, rank, targets)
    tensors = []
    for name, local in tp1.ranks[0].items():
        key, axes = _stored_key(name, layout.spec)
        tensors.append(CkptTensor(key, axes[0] if axes else None, layout.spec.layers, local))
    return AdapterLayout(tp1, tuple(tensors))


def _stored_key(name: str, spec: ModelSpec) -> tuple[str, list[int]]:
    """A TP1 state-dict name → (checkpoint key, indices on the axes prepended to it)."""
    m = _LAYER_KEY.match(name)
    if not m:
        return name, []
    key, axes = m["head"] + m["rest"], [int(m["layer"])]
    e = _EXPERT_KEY.match(key)
    if e:
        key, axes = f"{e['head']}experts.{e['rest']}", axes + [int(e["expert"])]
    g = _GROUPED_EXPERT_KEY.match(key)
    if g:
        key = f"{g['head']}experts.{g['linear']}.{g['param']}"
        axes = axes + [int(g["expert"])]
    return key, axes


def _local_spec_keys_map(spec: ModelSpec) -> dict[str, str]:
    """The local layer spec's `sharded_state_dict_keys_map` (layer-relative name prefixes),
    read from megatron-core for this model's spec."""
    from mcore_rl.models.gpt import layer_spec  # lazy: megatron

    return dict(layer_spec("local", spec).submodules.sharded_state_dict_keys_map or {})


def _apply_keys_map(name: str, keys_map: dict[str, str]) -> str:
    """TransformerLayer.sharded_state_dict's prefix renaming, on a layer's tensor name."""
    m = _LAYER_KEY.match(name)
    if not m:
        return name
    rest = m["rest"]
    for old, new in keys_map.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    return f"{m['head']}{m['layer']}.{rest}"


def _extra_state_objects(spec: ModelSpec) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(stacked key, global shape, offset) of the ShardedObject of every TP-parallel linear:
    one per layer, and per layer and expert for the routed experts' linears. Read from the
    local spec's modules: the TE spec's linears are named the same except TEGroupedMLP's, which
    store their extra state per expert under SequentialMLP's keys too."""
    out = []
    for module in extra_state_modules(spec, "local"):
        key, axes = _stored_key(module.format(layer=0, expert=0) + "._extra_state", spec)
        if len(axes) == 1:
            out += [(key, (spec.layers,), (layer,)) for layer in range(spec.layers)]
        else:
            out += [(key, (spec.layers, spec.num_experts), (layer, expert))
                    for layer in range(spec.layers) for expert in range(spec.num_experts)]
    return out
