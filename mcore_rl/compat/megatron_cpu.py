"""Run megatron-core 0.16.1 on CPU: the only place mcore-rl adapts megatron-core to a machine
without CUDA.

megatron-core hard-codes CUDA in ~250 places (device="cuda" literals, torch.cuda.current_device(),
the CUDA RNG tracker, `.type() == 'torch.cuda.FloatTensor'` asserts). On CPU, `apply()` installs
the smallest set of shims that made TP, PP, VPP, SP, DP and the distributed optimizer match the
one-process model (tests/compat shows each one is still needed and still applied). On GPU only
`WITHOUT_TE` is applied: a gap megatron-core has without TransformerEngine whatever the device
(the local spec on a GPU). Each shim is written against megatron-core `MEGATRON_CORE_VERSION`;
`apply()` refuses any other version instead of patching code it was not checked against.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

MEGATRON_CORE_VERSION = "0.16.1"

# Shims of megatron-core bugs without TransformerEngine on any device (applied on GPU too)
WITHOUT_TE = ("moe_router_gemm",)

# Marks a function installed by this module, so `apply()` can tell it already ran.
_SHIM_ATTR = "_mcore_rl_cpu_shim"


class MegatronVersionError(RuntimeError):
    """The installed megatron-core is not the version these shims were written for."""


# --- device literals --------------------------------------------------------------------------


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for torch calls made in this thread.

    For megatron-core 0.16.1's `device="cuda"` literals (schedules' token counters, grad
    buffers, grad scalers, optimizer scalars and clip_grads), `.cuda()` and `.to("cuda")`.
    Installed only when CUDA is unavailable, where any CUDA device would fail anyway, so the
    rewrite can only turn an error into the CPU equivalent.

    Limit: torch pops a function mode while the mode handles a call, and `Tensor.backward` /
    `torch.autograd.backward` are such calls — so the mode is *not* active inside backward
    passes. Megatron's autograd functions allocate there with `torch.cuda.current_device()`,
    which is why that function is redirected to the CPU device itself (`_current_device`), and
    activation recompute rebuilds the causal mask there (`_default_causal_mask`).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


def _install_cuda_to_cpu_mode() -> bool:
    if any(isinstance(m, CudaToCpuMode) for m in _get_current_function_mode_stack()):
        return False
    # Entered for good: megatron calls run for the life of the process, in this thread.
    CudaToCpuMode().__enter__()
    return True


def _current_device() -> torch.device:
    """Stands in for torch.cuda.current_device(). Megatron only passes its result as a device
    (`device=`, `.to(device=)`, `.cuda(...)`) on the paths mcore-rl runs, so the CPU device
    works everywhere, including inside backward passes where CudaToCpuMode is not active."""
    return torch.device("cpu")


def _default_causal_mask(sq: int) -> torch.Tensor:
    """transformer.utils.get_default_causal_mask (0.16.1) on the CPU. Upstream builds it with
    device="cuda"; CudaToCpuMode covers forward passes, but activation recompute rebuilds the
    mask inside the backward pass, where the mode is not active."""
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


# --- `.type()` asserts in the optimizer -------------------------------------------------------


class CudaTypeNamesMode(TorchFunctionMode):
    """Inside it, `tensor.type()` reports CPU tensors under their CUDA name
    ('torch.FloatTensor' → 'torch.cuda.FloatTensor'), so megatron's dtype checks written as
    type-name comparisons accept CPU parameters. Scoped to the functions wrapped below."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            return result.replace("torch.", "torch.cuda.", 1) if ".cuda." not in result else result
        return result


def _with_cuda_type_names(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with CudaTypeNamesMode():
            return fn(*args, **kwargs)

    setattr(wrapper, _SHIM_ATTR, True)
    return wrapper


# --- CUDA RNG tracker -------------------------------------------------------------------------


def _get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    """tensor_parallel.random._get_cuda_rng_state on CPU: the CPU generator is the device's."""
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    """tensor_parallel.random._set_cuda_rng_state on CPU."""
    torch.set_rng_state(new_state)


def _tracker_add(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add (0.16.1, non-cudagraph branch) with the state seeded on a
    private CPU generator: upstream calls torch.cuda.get_rng_state / manual_seed directly."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


# --- torch norm with sequence parallelism -----------------------------------------------------


def _torch_norm_new(original_new: Callable) -> Callable:
    """WrappedTorchNorm.__new__ that accepts sequence_parallel.

    The local (non-TE) spec's norm asserts `not config.sequence_parallel`. With SP each TP rank
    normalizes its own sequence slice, so its weight gradient is partial: marking the weight
    `sequence_parallel` makes finalize_model_grads all-reduce it over TP, as TE/apex norms do.
    """

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        sp = config.sequence_parallel
        if sp:
            config = copy.copy(config)  # shallow: no __post_init__ re-validation
            config.sequence_parallel = False
        norm = original_new(cls, config, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sp
        return norm

    setattr(new, _SHIM_ATTR, True)
    return staticmethod(new)


def _preload_without_cuda_sync(original: staticmethod) -> staticmethod:
    """dist_checkpointing's async writer copies tensors to host with non_blocking=True and then
    calls torch.cuda.synchronize(), which raises without CUDA. On CPU the copy is a no-op:
    run it blocking, which skips the synchronize."""
    fn = original.__func__

    def preload_tensors(write_buckets, non_blocking=True):
        return fn(write_buckets, non_blocking=False)

    return staticmethod(_mark(preload_tensors))


# --- mixture-of-experts layers ---------------------------------------------------------------


def _define_te_general_gemm(moe_utils: Any) -> bool:
    """moe_utils imports `te_general_gemm` from TransformerEngine inside a try block and, when
    TE is missing, never defines the name; RouterGatingLinearFunction (the router's linear) then
    reads it and raises NameError. Defined as None it takes its own torch.mm path."""
    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


class _NoStream:
    """Stands in for the alltoall dispatcher's class-level CUDA side stream on CPU, where no
    copy is asynchronous; marks the dispatcher as shimmed."""


def _alltoall_init(original: Callable) -> Callable:
    """MoEAlltoAllTokenDispatcher.__init__ (0.16.1) creates `torch.cuda.Stream()` for its
    device-to-host copies unless the class already holds one: give it a CPU placeholder."""

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        cls = type(self)
        if cls.cuda_dtoh_stream is None:
            cls.cuda_dtoh_stream = _NoStream()
        original(self, *args, **kwargs)

    return _mark(init)


def _alltoall_dtoh_and_synchronize(original: Callable) -> Callable:
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize (0.16.1) moves the split sizes to
    the host on a side stream (`torch.cuda.current_stream()`, `torch.cuda.stream`, an event)
    and synchronizes later. On CPU there is nothing to move or wait for; what remains is the
    conversion upstream does on the way: the three split-size tensors become numpy arrays
    (all_to_all_single takes sequences of ints, not tensors). Upstream's
    maybe_move_tensor_to_cpu skips CPU tensors entirely, numpy conversion included."""

    def dtoh(self, point: str, tokens_per_expert: torch.Tensor | None = None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    return _mark(dtoh)


# --- installation -----------------------------------------------------------------------------


def _mark(fn: Callable) -> Callable:
    setattr(fn, _SHIM_ATTR, True)
    return fn


def _replace(owner: Any, name: str, make: Callable[[Callable], Any]) -> bool:
    """Set owner.name = make(original) unless a shim is already there."""
    current = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    target = current.__func__ if isinstance(current, (staticmethod, classmethod)) else current
    if getattr(target, _SHIM_ATTR, False):
        return False
    setattr(owner, name, make(current))
    return True


def check_version(installed: str | None = None) -> None:
    """Refuse any megatron-core but the one the shims were written against."""
    if installed is None:
        import megatron.core  # lazy: megatron

        installed = megatron.core.__version__
    if installed != MEGATRON_CORE_VERSION:
        raise MegatronVersionError(
            f"megatron-core {installed} is installed, but mcore_rl.compat's CPU shims were "
            f"written and tested for {MEGATRON_CORE_VERSION}; re-check each shim "
            f"(tests/compat) against the new version before changing MEGATRON_CORE_VERSION")


def _installers() -> dict[str, Callable[[], bool]]:
    """Shim name → installer (returns False when already installed), in dependency order:
    later shims' code paths also need the earlier ones."""
    # lazy: megatron
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.fusions import fused_softmax  # lazy: megatron
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer  # lazy: megatron
    from megatron.core.tensor_parallel import random as tp_random  # lazy: megatron
    from megatron.core.transformer import torch_norm  # lazy: megatron
    from megatron.core.transformer import utils as transformer_utils  # lazy: megatron
    from megatron.core.transformer.moe import moe_utils  # lazy: megatron

    # lazy: megatron
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    return {
        "cuda_to_cpu_mode": _install_cuda_to_cpu_mode,
        "current_device": lambda: _replace(torch.cuda, "current_device",
                                           lambda _: _mark(_current_device)),
        # fused_softmax imported it by name: replace both references.
        "default_causal_mask": lambda: any([
            _replace(transformer_utils, "get_default_causal_mask",
                     lambda _: _mark(_default_causal_mask)),
            _replace(fused_softmax, "get_default_causal_mask",
                     lambda _: _mark(_default_causal_mask))]),
        "rng_get_state": lambda: _replace(tp_random, "_get_cuda_rng_state",
                                          lambda _: _mark(_get_rng_state)),
        "rng_set_state": lambda: _replace(tp_random, "_set_cuda_rng_state",
                                          lambda _: _mark(_set_rng_state)),
        "rng_tracker_add": lambda: _replace(tp_random.CudaRNGStatesTracker, "add",
                                            lambda _: _mark(_tracker_add)),
        "fp16_optimizer_type_check": lambda: _replace(
            optimizer.Float16OptimizerWithFloat16Params, "__init__", _with_cuda_type_names),
        "distrib_optimizer_type_check": lambda: _replace(
            distrib_optimizer.DistributedOptimizer, "_build_model_and_main_param_groups",
            lambda cm: classmethod(_with_cuda_type_names(cm.__func__))),
        # optimizer.py imported it by name: replace both references.
        "clip_grad_type_check": lambda: any([
            _replace(clip_grads, "clip_grad_by_total_norm_fp32", _with_cuda_type_names),
            _replace(optimizer, "clip_grad_by_total_norm_fp32", _with_cuda_type_names)]),
        "torch_norm_sequence_parallel": lambda: _replace(
            torch_norm.WrappedTorchNorm, "__new__", lambda sm: _torch_norm_new(sm.__func__)),
        "checkpoint_preload_sync": lambda: _replace(
            FileSystemWriterAsync, "preload_tensors", _preload_without_cuda_sync),
        "moe_router_gemm": lambda: _define_te_general_gemm(moe_utils),
        "moe_alltoall_streams": lambda: any([
            _replace(MoEAlltoAllTokenDispatcher, "__init__", _alltoall_init),
            _replace(MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize",
                     _alltoall_dtoh_and_synchronize)]),
    }


def apply(only: list[str] | None = None) -> list[str]:
    """Install the CPU shims (all, or the names in `only`), idempotently. Returns the names of
    the shims installed by this call."""
    check_version()
    installers = _installers()
    unknown = sorted(set(only or ()) - set(installers))
    if unknown:
        raise KeyError(f"unknown CPU shims {unknown}; known: {', '.join(installers)}")
    return [name for name, install in installers.items()
            if (only is None or name in only) and install()]
