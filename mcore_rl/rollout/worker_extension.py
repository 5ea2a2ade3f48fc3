"""Code that runs inside every vLLM worker (one per TP rank): joining the weight-sync group,
describing the rank's parameters and installing received shards.

`WorkerExtension` is passed to vLLM as `worker_extension_cls`; vLLM appends it to its worker
class's bases, so its methods are callable through `LLM.collective_rpc(name, ...)` and `self`
is the vLLM worker (`self.rank`: rank within the engine = TP rank; `self.model_runner`).
Every method **returns** `{"ok": False, "err": ...}` instead of raising: a worker RPC that
raises leaves the other workers' replies queued in vLLM's MultiprocExecutor, and the next
`collective_rpc` would read a stale reply. The caller (engine.py) checks every reply.

Installing on CPU: vLLM repacks unquantized linear weights at load time into a kernel format
and replaces `layer.weight` by an empty tensor (`numel() == 0`), so a plain `param.copy_`
cannot work. For such a parameter we set a fresh `nn.Parameter` holding the per-rank tensor
and call the module's own `quant_method.process_weights_after_loading(module)`, which packs
it again exactly as at load. Modules that keep their weight (embedding, LM head, fallback
linears) are copied in place and repacked too (the LM head computes from a packed copy).
Memory stays bounded: each tensor is installed (and packed, freeing the unpacked copy) as it
arrives, nothing is accumulated.

Per-rank layouts (vLLM's, what `mcore_rl.layouts.vllm_shards` describes), rank r of t:
  qkv_proj.weight  [q_r; k_r; v_r]   (q_r: heads/t heads; k_r, v_r: kv_heads/t heads, or the
                                      replicated head r // (t / kv_heads) when t > kv_heads)
  o_proj.weight    [hidden, heads·head_dim / t]          gate_up_proj.weight [gate_r; up_r]
  down_proj.weight [hidden, ffn / t]                     norms: whole on every rank
  embed_tokens / lm_head [padded_vocab / t, hidden]      (vocab padded to a multiple of 64)
"""

from __future__ import annotations

import functools
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from mcore_rl.rollout.moe_install import MoEInstaller, moe_logical_shape


def never_raise(method: Callable[..., dict]) -> Callable[..., dict]:
    """Turn any exception of a worker RPC into `{"ok": False, "err": ...}`."""

    @functools.wraps(method)
    def wrapper(self, *args: Any, **kwargs: Any) -> dict:
        try:
            reply = method(self, *args, **kwargs)
            return {"ok": True, "rank": getattr(self, "rank", None), **reply}
        except BaseException as err:  # noqa: BLE001 — must never propagate into vLLM
            return {"ok": False, "rank": getattr(self, "rank", None),
                    "err": f"{type(err).__name__}: {err}",
                    "trace": traceback.format_exc(limit=8)}

    return wrapper


def logical_shape(module: nn.Module, leaf: str, param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's per-rank shape. A CPU-packed linear weight is empty; its shape is then
    `(output_size_per_partition, input_size_per_partition)` of the layer. Fused MoE experts:
    the logical (unpadded, unpacked) per-rank shape (`moe_install`)."""
    moe_shape = moe_logical_shape(module, leaf)
    if moe_shape is not None:
        return moe_shape
    if param.numel() == 0 and leaf == "weight" and hasattr(module, "output_size_per_partition"):
        return (int(module.output_size_per_partition), int(module.input_size_per_partition))
    if param.numel() == 0 and leaf == "weight" and hasattr(module, "output_size"):
        return (int(module.output_size), int(module.input_size))  # ReplicatedLinear (MoE gate)
    return tuple(param.shape)


def rank_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter of this rank's model → its per-rank shape (vLLM names)."""
    out = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        out[name] = logical_shape(model.get_submodule(module_name), leaf, param)
    return out


def _quant_owners(model: nn.Module) -> dict[int, list[nn.Module]]:
    """id(parameter) → modules that hold it and repack it (tied weights have two)."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        if getattr(module, "quant_method", None) is None:
            continue
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(module)
    return owners


@torch.no_grad()
def install_from_iterator(model: nn.Module,
                          items: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Install `(vllm_param_name, per_rank_tensor)` items into this rank's model, each as it
    arrives, repacking every module whose weight changed; returns the sorted names installed.

    Each item must be one whole per-rank parameter (shape = `rank_shapes(model)[name]`).
    Raises ValueError for an unknown name, a wrong shape or a name given twice. The caller
    resets the prefix cache afterwards (it lives in the scheduler, not in the worker).
    """
    owners = _quant_owners(model)
    experts = MoEInstaller()       # fused MoE layers repack once both their tensors are in
    installed: set[str] = set()
    for name, tensor in items:
        if name in installed:
            raise ValueError(f"{name}: received twice")
        module_name, _, leaf = name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise ValueError(f"{name}: no such module in the vLLM model") from None
        param = module._parameters.get(leaf)
        if param is None:
            raise ValueError(f"{name}: no such parameter in the vLLM model")
        expected = logical_shape(module, leaf, param)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, this rank holds "
                             f"{expected}")
        if experts.accepts(module, leaf):
            experts.add(name, module, leaf, tensor)
            installed.add(name)
            continue
        if param.numel() == 0 and tensor.numel() > 0:  # CPU-packed: weight was replaced
            fresh = tensor.detach().to(device=param.device, dtype=param.dtype, copy=True)
            setattr(module, leaf, nn.Parameter(fresh, requires_grad=False))
            repack = [module]
        else:
            param.copy_(tensor)
            repack = owners.get(id(param), [])
        if leaf == "weight":  # biases are read at call time; weights are packed copies
            for owner in repack:
                owner.quant_method.process_weights_after_loading(owner)
        installed.add(name)
        del tensor
    experts.finish()
    return sorted(installed)


def _timed(items: Iterable, spent: list[float]) -> Iterator:
    """Yield from `items`, adding the time spent waiting for each item to `spent[0]`."""
    iterator = iter(items)
    while True:
        start = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            spent[0] += time.perf_counter() - start
            return
        spent[0] += time.perf_counter() - start
        yield item


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


def worker_device(resolved: str, held, tp_rank: int) -> str:
    """The device a vLLM worker assembles shards on: the one it holds itself (`Worker.device`,
    vLLM's cuda:<local rank> within the engine's narrowed CUDA_VISIBLE_DEVICES), which must be
    the resolved run's `engine_devices[e][tp_rank]`. A disagreement (a run that addresses the
    node's physical device index, or a CPU run on a CUDA worker) raises naming both."""
    want = torch.device(resolved)
    have = torch.device(held) if held is not None else torch.device("cpu")
    if want.type == "cuda" and want.index is None:
        want = torch.device("cuda", 0)
    if want != have:
        raise RuntimeError(f"engine TP rank {tp_rank}: the resolved run gives it {resolved}, "
                           f"but vLLM's worker holds {have} — the plan and the process's "
                           "visible devices disagree")
    return str(have)


class WorkerExtension:
    """Methods added to every vLLM worker. Attribute names are prefixed `_mrl_` so they never
    clash with vLLM's worker attributes (vLLM refuses to start if a method name does)."""

    def _mrl_model(self) -> nn.Module:
        return self.model_runner.get_model()

    @never_raise
    def start_join_sync_group(self, spec, first_sync_rank: int,
                              devices: tuple[str, ...] | None = None) -> dict:
        """Start joining the sync group as sync rank `first_sync_rank + self.rank` in a
        background thread (it blocks until every rank has joined); return at once.
        devices: this engine's per-TP-rank devices (the resolved run's `engine_devices[e]`:
        process-local, "cuda:t" for TP rank t; None: "cpu") — where shards are assembled and
        IPC buffers mapped. The device used is the one vLLM's worker holds, checked against
        the resolved one (`worker_device`)."""
        from mcore_rl.resharding.channels import SyncChannels

        if getattr(self, "_mrl_sync", None) is not None:
            raise RuntimeError("already in a sync group (leave_sync_group first)")
        state: dict[str, Any] = {"sync_rank": first_sync_rank + self.rank, "group": None,
                                 "error": None}
        device = worker_device(devices[self.rank] if devices else "cpu",
                               getattr(self, "device", None), self.rank)

        def join() -> None:
            try:
                state["group"] = SyncChannels.join(spec, state["sync_rank"], device)
            except BaseException:  # noqa: BLE001 — reported by finish_join_sync_group
                state["error"] = traceback.format_exc(limit=4)

        state["thread"] = threading.Thread(target=join, daemon=True,
                                           name=f"mcore-rl-join-sync-rank{state['sync_rank']}")
        self._mrl_sync = state
        state["thread"].start()
        return {"sync_rank": state["sync_rank"]}

    @never_raise
    def finish_join_sync_group(self, timeout_s: float) -> dict:
        state = getattr(self, "_mrl_sync", None)
        if state is None:
            raise RuntimeError("start_join_sync_group was not called")
        state["thread"].join(timeout_s)
        if state["thread"].is_alive():
            raise TimeoutError(f"sync rank {state['sync_rank']}: still joining the sync group "
                               f"after {timeout_s:.0f} s")
        if state["error"] is not None:
            self._mrl_sync = None
            raise RuntimeError(f"sync rank {state['sync_rank']}: joining failed: "
                               f"{state['error']}")
        return {"sync_rank": state["sync_rank"]}

    @never_raise
    def leave_sync_group(self) -> dict:
        state, self._mrl_sync = getattr(self, "_mrl_sync", None), None
        if state is not None and state.get("group") is not None:
            state["group"].close()
        return {}

    @never_raise
    def describe_shards(self) -> dict:
        """This rank's parameter names and per-rank shapes, in vLLM's layout."""
        return {"shapes": rank_shapes(self._mrl_model())}

    @never_raise
    def install_shards(self, plan, *, dtype: str = "float32", timeout_s: float = 120.0,
                       verify: bool = True) -> dict:
        """Receive this rank's shards of `plan` by this engine's transport (the sync group
        spec's: p2p sends, or the colocated trainer ranks' shared staging buffers) and install
        each as it lands. Checks up front that the plan's tensors and shapes for this rank are
        this model's; `verify`: take part in `verify_plan` first (the trainer ranks do too)."""
        from mcore_rl.resharding.channels import engine_transport
        from mcore_rl.resharding.plan_cache import PlanCache
        from mcore_rl.resharding.transport import SyncStats

        state = getattr(self, "_mrl_sync", None)
        if state is None or state.get("group") is None:
            raise RuntimeError("not in a sync group (start/finish_join_sync_group first)")
        group, sync_rank = state["group"], state["sync_rank"]
        if getattr(self, "_mrl_plans", None) is None:  # the plans sent here, by fingerprint
            self._mrl_plans = PlanCache()
        plan = self._mrl_plans.resolve(plan)  # the plan, or a reference to one sent before
        model = self._mrl_model()
        want = plan.dst_shapes.get(sync_rank)
        if not want:
            raise ValueError(f"the plan has nothing for sync rank {sync_rank}")
        have = rank_shapes(model)
        wrong = [f"{n}: plan {tuple(s)} vs vLLM {have.get(n)}" for n, s in sorted(want.items())
                 if have.get(n) != tuple(s)]
        if wrong:
            raise ValueError(f"sync rank {sync_rank}: the plan does not match this rank's "
                             f"parameters: {wrong[:5]}")
        start = time.perf_counter()
        if verify:
            group.verify(plan)
        stats, waiting = SyncStats(), [time.perf_counter() - start]  # not installing
        transport = engine_transport(group.spec, plan, sync_rank)
        items = group.receive(plan, transport, dtype=_dtype(dtype), timeout_s=timeout_s,
                              stats=stats)
        names = install_from_iterator(model, _timed(items, waiting))
        seconds = time.perf_counter() - start
        return {"sync_rank": sync_rank, "names": names, "seconds": seconds,
                "install_seconds": seconds - waiting[0],
                "bytes_received": stats.bytes_received,
                "peak_extra_bytes": stats.peak_extra_bytes, "transport": transport,
                "transports": group.transports_used(plan)}

    @never_raise
    def install_tensors(self, items: list[tuple[str, torch.Tensor]]) -> dict:
        """Install tensors passed in the RPC itself (tp=1 / in-process; see engine.py)."""
        start = time.perf_counter()
        names = install_from_iterator(self._mrl_model(), items)
        return {"names": names, "seconds": time.perf_counter() - start}


__all__ = ["WorkerExtension", "install_from_iterator", "logical_shape", "never_raise",
           "rank_shapes", "worker_device"]
