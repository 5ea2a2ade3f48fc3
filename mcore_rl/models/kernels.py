"""megatron-core's fused kernels: which the run plan asks for, which this process can run, and
why — decided where the model is built.

The run plan states the intent (`planning.resolve.ResolvedRun`): `fused_kernels` (the te layer
spec on GPU, or `train.fused_kernels`) asks for the kernels TransformerEngine and apex provide,
`compiled_fusions` (`train.compile`) for the ones megatron compiles with torch.compile. Each
kernel has a provider that must import in the process that builds the model, and megatron-core
fails without it: `TransformerConfig` refuses `apply_rope_fusion` without TE's fused RoPE
(megatron/core/transformer/transformer_config.py), and every model's output layer — megatron's
own `tensor_parallel.ColumnParallelLinear`, under the te spec too — raises in its constructor
when `gradient_accumulation_fusion` is set and apex's `fused_weight_gradient_mlp_cuda` does not
import (megatron/core/tensor_parallel/layers.py). The driver cannot see the packages of the
actor ranks' nodes, so every model build resolves the intent against its own process
(`resolve_kernels`, called by `models.gpt.transformer_config_from_spec` in the rank), turns on
only what its providers give it, and each actor rank reports its decisions
(`ActorWorker.fused_kernels`). `mcore-rl explain` shows the same decisions for this machine, and
preflight says what a missing provider costs.

`KERNELS` is the table: each row is one `TransformerConfig` switch, who asks for it, its
provider, and what running without it costs. This module imports nothing heavy: the probes
import their provider when first asked, once per process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

AskedBy = Literal["fused", "compiled", "never"]


@dataclass(frozen=True)
class Provider:
    """What a kernel needs in the building process: `what` (for people), `fix` (how to get
    it), `probe(device)`: None when it is there, else why not (one line)."""

    what: str
    fix: str
    probe: Callable[[str], str | None]


@dataclass(frozen=True)
class Kernel:
    """One megatron switch. asked_by: "fused" (the plan's `fused_kernels`), "compiled"
    (`compiled_fusions`) or "never"; provider: a `PROVIDERS` key (None: never on); cost: what
    the run pays without it (for "never": why it stays off)."""

    field: str
    asked_by: AskedBy
    provider: str | None
    cost: str


@dataclass(frozen=True)
class KernelDecision:
    """A kernel as one process resolved it: asked for by the plan (`wanted`), turned on
    (`on`), why (`why`: its provider, what is missing, or why the plan leaves it off) and, for
    one asked for but off, what that costs (`cost`)."""

    field: str
    wanted: bool
    on: bool
    why: str
    cost: str = ""

    @property
    def reason(self) -> str:
        """The decision in one line: "on: ...", "off: ...; without it ..."."""
        if self.on:
            return f"on: {self.why}"
        return f"off: {self.why}" + (f"; without it {self.cost}" if self.cost else "")

    def as_dict(self) -> dict:
        return {"field": self.field, "wanted": self.wanted, "on": self.on,
                "reason": self.reason}


def _import_failure(what: str, err: BaseException) -> str:
    """`what` and why it does not import, in one line."""
    if isinstance(err, ModuleNotFoundError) and err.name:
        return f"{what} is not installed (no module {err.name})"
    return f"{what} does not import ({' '.join(f'{type(err).__name__}: {err}'.split())[:160]})"


@functools.cache
def _te_rope(device: str) -> str | None:
    """TransformerEngine's fused RoPE, as megatron finds it (rope_utils imports it from
    megatron.core.extensions.transformer_engine; None there makes TransformerConfig refuse
    apply_rope_fusion)."""
    try:
        # lazy: transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # ImportError, or TE's own errors when CUDA libraries are missing
        return _import_failure("TransformerEngine", err)
    from megatron.core.models.common.embeddings import rope_utils  # lazy: megatron

    if rope_utils.fused_apply_rotary_pos_emb is None:
        return "the installed TransformerEngine has no fused RoPE megatron-core can use"
    return None


@functools.cache
def _apex_wgrad(device: str) -> str | None:
    """apex's CUDA extension, imported as megatron imports it (tensor_parallel/layers.py)."""
    try:
        # lazy: fused_weight_gradient_mlp_cuda
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except Exception as err:
        return _import_failure("apex's fused_weight_gradient_mlp_cuda", err)
    return None


@functools.cache
def _torch_compile(device: str) -> str | None:
    """What megatron's jit_fuser (torch.compile, inductor) needs to compile for `device`:
    Triton on CUDA, a C++ compiler on the host."""
    if device.startswith("cuda"):
        from torch.utils._triton import has_triton  # lazy: torch

        return None if has_triton() else "Triton (torch.compile's CUDA backend) is not importable"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # lazy: torch

        get_cpp_compiler()
    except Exception as err:
        return f"torch.compile finds no C++ compiler ({type(err).__name__})"
    return None


PROVIDERS: dict[str, Provider] = {
    "te_rope": Provider("TransformerEngine's fused RoPE", "pip install .[gpu] on the node",
                        _te_rope),
    "apex_wgrad": Provider("apex's fused_weight_gradient_mlp_cuda",
                           "bash scripts/build_apex.sh on the node "
                           "(docs/getting-started/install.md)", _apex_wgrad),
    "torch_compile": Provider("torch.compile (Triton on CUDA, a C++ compiler on CPU)",
                              "Triton (CUDA) or a C++ compiler (CPU) on the node, or "
                              "train.compile=false", _torch_compile),
}

KERNELS: tuple[Kernel, ...] = (
    Kernel("apply_rope_fusion", "fused", "te_rope",
           "RoPE runs as separate PyTorch ops: several extra passes over q and k per layer"),
    Kernel("gradient_accumulation_fusion", "fused", "apex_wgrad",
           "every linear (TransformerEngine's too: one megatron switch) writes its weight "
           "gradient to a temporary, then adds it to the fp32 main grad: one more write and "
           "read of every weight gradient per micro batch"),
    Kernel("bias_activation_fusion", "compiled", "torch_compile",
           "SwiGLU runs as separate element-wise ops"),
    Kernel("bias_dropout_fusion", "compiled", "torch_compile",
           "bias-dropout-add runs as separate element-wise ops"),
    Kernel("masked_softmax_fusion", "never", None,
           "serves only megatron's unfused attention; the te spec runs TransformerEngine's "
           "fused attention"),
    Kernel("persist_layer_norm", "never", None,
           "apex's persistent LayerNorm; these models use RMSNorm"),
    Kernel("cross_entropy_loss_fusion", "never", None,
           "the loss is mcore-rl's vocab-parallel log-probs, not megatron's cross entropy"),
)

# why the plan does not ask for a kernel
UNASKED = {"fused": "the plan leaves them off (train.fused_kernels false, or the local layer "
                    "spec: no TransformerEngine)",
           "compiled": "train.compile is false: nothing is compiled unless asked",
           "never": ""}


def wanted_kernels(fused: bool, compiled: bool = False) -> dict[str, bool]:
    """What the plan asks for, switch by switch (before any provider is checked)."""
    asks = {"fused": fused, "compiled": compiled, "never": False}
    return {k.field: asks[k.asked_by] for k in KERNELS}


def provider_missing(device: str) -> dict[str, str | None]:
    """Each provider in this process for `device`: None when it is there, else why not."""
    return {key: p.probe(device) for key, p in PROVIDERS.items()}


def resolve_kernels(fused: bool, compiled: bool = False, *, device: str,
                    missing: Mapping[str, str | None] | None = None
                    ) -> tuple[KernelDecision, ...]:
    """Every kernel of `KERNELS`, on where the plan asks for it and its provider is there.
    `missing`: each provider's absence (`provider_missing`); None probes this process, only
    for the providers the plan asks for."""
    wanted = wanted_kernels(fused, compiled)
    decisions = []
    for k in KERNELS:
        if k.asked_by == "never":
            decisions.append(KernelDecision(k.field, False, False, k.cost))
        elif not wanted[k.field]:
            decisions.append(KernelDecision(k.field, False, False, UNASKED[k.asked_by]))
        else:
            provider = PROVIDERS[k.provider]
            why = missing[k.provider] if missing is not None else provider.probe(device)
            decisions.append(KernelDecision(k.field, True, why is None,
                                            provider.what if why is None else why,
                                            "" if why is None else k.cost))
    return tuple(decisions)


def kernel_switches(decisions: tuple[KernelDecision, ...]) -> dict[str, bool]:
    """The `TransformerConfig` fields of the decisions."""
    return {d.field: d.on for d in decisions}


def dropped(decisions: tuple[KernelDecision, ...]) -> list[KernelDecision]:
    """The kernels the plan asked for that this process could not turn on."""
    return [d for d in decisions if d.wanted and not d.on]


def dropped_on_ranks(per_rank: list[list[dict]]) -> list[str]:
    """One line per kernel the plan asked for that ranks left off (`per_rank[r]`: rank r's
    decisions as dicts, `ActorWorker.fused_kernels`), naming the ranks and why."""
    by_kernel: dict[tuple[str, str], list[int]] = {}
    for rank, decisions in enumerate(per_rank):
        for d in decisions:
            if d["wanted"] and not d["on"]:
                by_kernel.setdefault((d["field"], d["reason"]), []).append(rank)
    return [f"{field} {reason} (actor rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))} of {len(per_rank)})"
            for (field, reason), ranks in by_kernel.items()]


__all__ = ["KERNELS", "PROVIDERS", "Kernel", "KernelDecision", "Provider", "dropped",
           "dropped_on_ranks", "kernel_switches", "provider_missing", "resolve_kernels", "wanted_kernels"]
