"""LoRA adapters on Megatron's tensor-parallel linears, each rank holding only its shard.

An adapter adds `scale · B · A · x` (scale = alpha / rank) to a linear's output, B [out, r],
A [r, in]. Its two matrices are split over TP the way the linear's weight is, so no rank ever
needs another's weights:

  column-parallel (linear_qkv, linear_fc1): W rows split. A whole on every TP rank, B split
    by output rows exactly as W's rows (B's rows follow W's row layout: linear_qkv's query
    groups, linear_fc1's [gate_t; up_t]). z = A·x is the same on every rank; its gradient sums
    every rank's B_t-part (an all-reduce in the backward, megatron's
    `copy_to_tensor_model_parallel_region`).
  row-parallel (linear_proj, linear_fc2): W columns split. A split by input columns, B whole.
    z = Σ_t A_t·x_t (an all-reduce in the forward, `reduce_from_tensor_model_parallel_region`),
    then B·z on every rank.

With sequence parallelism the linears' inputs (column) and outputs (row) are sharded on the
sequence: the adapter gathers / reduce-scatters its rank-r activation z instead (megatron's
sequence-parallel mappings), and the whole matrix whose gradient then comes from a sequence
shard (A of a column adapter, B of a row adapter) is marked `sequence_parallel`, so megatron's
`finalize_model_grads` sums it over TP as it does the norms'.

Under the TransformerEngine layer spec linear_qkv and linear_fc1 are LayerNorm-fused linears
that take the layer's input before their norm: their adapter multiplies the norm's output, as
their weight does (`adapter_input`).

The adapter is a child module `lora` of the linear, applied by a forward hook: the linear's own
parameter names (what the layout tables, checkpoints and the weight sync name) do not change.
In a dist checkpoint the adapter is stored as its weight is: the split matrix with a TP axis
(linear_fc1's B chunked into [gate; up] by megatron's own SwiGLU factory), so a checkpoint
loads on any grid, as the model's do (the linear's `sharded_state_dict` is extended for it).
`merged_weight` gives W + scale·B·A on the rank's own shard — the shard of the merged weight,
with no gather. Initial A is drawn from a generator seeded by the layer's global number and the
linear's name over A's whole shape, then sliced: every grid starts from the same adapters.
B starts at zero, so a fresh adapter leaves the model unchanged.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Mapping
from typing import Iterator, Literal

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from mcore_rl.megatron.config import LORA_HEAD, LORA_TARGETS, LoRAConfig

# The linears of a decoder layer an adapter can sit on, and how megatron splits each over TP.
LINEARS: dict[str, Literal["column", "row"]] = {
    "self_attention.linear_qkv": "column", "self_attention.linear_proj": "row",
    "mlp.linear_fc1": "column", "mlp.linear_fc2": "row"}


# LoRAConfig.targets' short names → path inside a decoder layer
TARGETS = {path.rsplit(".", 1)[1]: path for path in LINEARS}
assert tuple(TARGETS) == LORA_TARGETS


class LoRAAdapter(torch.nn.Module):
    """The adapter of one linear on one TP rank (see the module docstring for the split)."""

    def __init__(self, linear: torch.nn.Module, kind: Literal["column", "row"],
                 spec: LoRAConfig, seed: int):
        super().__init__()
        self.kind, self.scale, self.dropout = kind, spec.scale, spec.dropout
        self.enabled = True
        # megatron's linears keep `tp_group`; its TransformerEngine wrappers `_tp_group`
        self.tp_group = linear.tp_group if hasattr(linear, "tp_group") else linear._tp_group
        self.sequence_parallel = bool(getattr(linear, "sequence_parallel",
                                              linear.config.sequence_parallel))
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        weight = linear.weight
        out_local, in_local = weight.shape
        in_full = in_local * tp if kind == "row" else in_local
        a_full = _kaiming_uniform((spec.rank, in_full), seed)
        if kind == "row":
            a_full = a_full[:, tp_rank * in_local:(tp_rank + 1) * in_local]
        self.lora_a = torch.nn.Parameter(a_full.to(weight.device, weight.dtype).contiguous())
        # B has W's local rows: a column linear's shard of them, a row linear's whole
        self.lora_b = torch.nn.Parameter(torch.zeros(out_local, spec.rank, device=weight.device,
                                                     dtype=weight.dtype))
        split, whole = ((self.lora_b, self.lora_a) if kind == "column"
                        else (self.lora_a, self.lora_b))
        set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)
        if self.sequence_parallel:
            whole.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        z = F.linear(x, self.lora_a)
        if self.kind == "column":
            z = (tensor_parallel.gather_from_sequence_parallel_region(z, group=self.tp_group)
                 if self.sequence_parallel
                 else tensor_parallel.copy_to_tensor_model_parallel_region(z, group=self.tp_group))
        else:
            z = (tensor_parallel.reduce_scatter_to_sequence_parallel_region(z, group=self.tp_group)
                 if self.sequence_parallel
                 else tensor_parallel.reduce_from_tensor_model_parallel_region(
                     z, group=self.tp_group))
        return F.linear(z, self.lora_b) * self.scale

    def sharded_state_dict(self, prefix: str, sharded_offsets: tuple, metadata: dict | None,
                           swiglu: bool) -> dict:
        """The adapter's sharded tensors, stored like its linear's weight (module docstring);
        `swiglu`: the linear is a gated MLP's fc1, whose rows megatron stores as [gate; up]."""
        split = {"lora_b": 0} if self.kind == "column" else {"lora_a": 1}
        out = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, split, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if swiglu:
            key = f"{prefix}lora_b"
            out[key] = apply_swiglu_sharded_factory(
                out[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
        return out

    def delta_weight(self) -> torch.Tensor:
        """scale · B · A on this rank's shard of the linear's weight (fp32)."""
        return (self.lora_b.float() @ self.lora_a.float()) * self.scale


def _kaiming_uniform(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """PEFT's default init of lora_A (kaiming-uniform, a = √5) from its own generator."""
    bound = 1.0 / math.sqrt(shape[1])  # gain·√(3/fan_in) with a = √5
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def adapter_input(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the adapter multiplies: the linear's input — or, for TransformerEngine's
    LayerNorm-fused linears (te spec: linear_qkv, linear_fc1 hold the layer's norm as
    `layer_norm_weight` and take the input before it), the norm's output, as the weight sees
    it: RMSNorm (the only normalization the model builder configures) computed in fp32."""
    weight = getattr(linear, "layer_norm_weight", None)
    if weight is None:
        return x
    config = linear.config
    if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
        raise ValueError(f"LoRA on a LayerNorm-fused linear: normalization "
                         f"{config.normalization!r} (zero-centered gamma "
                         f"{config.layernorm_zero_centered_gamma}); only RMSNorm is built here")
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon)
    return (normed * weight.float()).to(x.dtype)


def _apply_adapter(linear: torch.nn.Module, args: tuple, output):
    adapter = linear.lora
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter(adapter_input(linear, args[0])).to(out.dtype), bias


def _with_adapter_checkpoint(linear: torch.nn.Module, swiglu: bool) -> None:
    """The linear's `sharded_state_dict`, its adapter's entries stored by the adapter's split
    (megatron's linears treat every state-dict entry but weight and bias as TP-replicated)."""
    own = linear.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        out = {k: v for k, v in own(prefix, sharded_offsets, metadata).items()
               if not k.startswith(f"{prefix}lora.")}
        out.update(linear.lora.sharded_state_dict(f"{prefix}lora.", sharded_offsets, metadata,
                                                  swiglu))
        return out

    linear.sharded_state_dict = sharded_state_dict


def attach_lora(chunks: list[torch.nn.Module], spec: LoRAConfig) -> list[LoRAAdapter]:
    """Freeze every parameter of `chunks` and put an adapter on each target linear of every
    decoder layer (routed experts excluded) and, when targeted, on the output layer (a
    column-parallel linear whose rows are the padded vocabulary). Call after loading the base weights and before
    the DDP wrap, so the grad buffers and the optimizer hold the adapters only."""
    if not spec.enabled:
        raise ValueError(f"attach_lora: lora rank={spec.rank} is off")
    for chunk in chunks:
        chunk.requires_grad_(False)
    adapters = []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            for target in spec.targets:
                if target == LORA_HEAD:
                    continue
                linear = layer.get_submodule(TARGETS[target])
                seed = zlib.crc32(f"{layer.layer_number}.{target}".encode())
                adapters.append(_adapt(linear, LINEARS[TARGETS[target]], spec, seed,
                                       swiglu=target == "linear_fc1"
                                       and layer.config.gated_linear_unit))
        if LORA_HEAD in spec.targets and getattr(chunk, "post_process", False):
            _check_adaptable_head(chunk)
            adapters.append(_adapt(chunk.output_layer, "column", spec,
                                   zlib.crc32(LORA_HEAD.encode()), swiglu=False))
    return adapters


def _adapt(linear: torch.nn.Module, kind: Literal["column", "row"], spec: LoRAConfig,
           seed: int, *, swiglu: bool) -> LoRAAdapter:
    linear.lora = LoRAAdapter(linear, kind, spec, seed)
    # first of the linear's forward hooks: it adds to the output the linear computed, in the
    # layout the linear computed it (the output layer's is batch-major: models.gpt)
    linear.register_forward_hook(_apply_adapter, prepend=True)
    _with_adapter_checkpoint(linear, swiglu=swiglu)
    return linear.lora


def _check_adaptable_head(chunk: torch.nn.Module) -> None:
    """The output layer takes an adapter when it owns its weight and returns its TP rank's
    vocabulary shard (what a column adapter adds to)."""
    if chunk.share_embeddings_and_output_weights:
        raise ValueError(f"LoRA target {LORA_HEAD}: the model ties its output layer to the "
                         f"embedding; adapt the decoder linears only")
    if chunk.output_layer.gather_output:
        raise ValueError(f"LoRA target {LORA_HEAD}: the output layer gathers the vocabulary "
                         f"(parallel_output off); an adapter adds to a vocabulary shard")


def lora_linears(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name inside its chunk, linear) of every adapted linear."""
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(getattr(module, "lora", None), LoRAAdapter):
                yield name, module


def named_adapters(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, LoRAAdapter]]:
    """(grid-independent name, adapter) of every adapter in `chunks`:
    'decoder.layers.<global layer>.<linear path>.lora' (the layer numbered from 0 across the
    pipeline stages and VPP chunks, as HF numbers it) and 'output_layer.lora'."""
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            for path in LINEARS:
                try:
                    linear = layer.get_submodule(path)
                except AttributeError:  # a MoE layer's MLP is routed experts: no such linear
                    continue
                if isinstance(getattr(linear, "lora", None), LoRAAdapter):
                    yield f"decoder.layers.{layer.layer_number - 1}.{path}.lora", linear.lora
        head = getattr(chunk, "output_layer", None)
        if isinstance(getattr(head, "lora", None), LoRAAdapter):
            yield f"{LORA_HEAD}.lora", head.lora


def merged_weight(linear: torch.nn.Module) -> torch.Tensor:
    """W + scale·B·A on this rank's shard, in W's dtype (the merge happens in fp32)."""
    return (linear.weight.float() + linear.lora.delta_weight()).to(linear.weight.dtype)


class MergedWeights(Mapping):
    """A rank's weights as the engines need them: every adapted weight merged (`merged_weight`)
    and the adapters themselves left out — keyed as `tensors` (the rank's state-dict names).
    A merged weight is computed when asked and only the last `keep` are held, so a sync never
    holds a second copy of the model."""

    def __init__(self, tensors: dict[str, torch.Tensor], adapted: dict[str, torch.nn.Module],
                 keep: int = 2):
        self._tensors = {k: v for k, v in tensors.items() if ".lora." not in k}
        self._adapted, self._keep = adapted, keep
        self._recent: dict[str, torch.Tensor] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._adapted:
            return self._tensors[key]
        if key not in self._recent:
            if len(self._recent) >= self._keep:
                self._recent.pop(next(iter(self._recent)))
            with torch.no_grad():
                self._recent[key] = merged_weight(self._adapted[key])
        return self._recent[key]

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


@contextlib.contextmanager
def adapters_disabled(chunks: list[torch.nn.Module]):
    """The base model: every adapter of `chunks` off inside the block (the reference policy)."""
    adapters = [linear.lora for _, linear in lora_linears(chunks)]
    states = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, state in zip(adapters, states):
            a.enabled = state


__all__ = ["LINEARS", "LoRAAdapter", "MergedWeights", "TARGETS", "adapter_input",
           "adapters_disabled",
           "attach_lora", "lora_linears", "merged_weight", "named_adapters"]
