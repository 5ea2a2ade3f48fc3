"""Read-only RPCs added to every vLLM worker (one per TP rank): the rank's parameter shapes, and
the outcome of the last weight-transfer call (weight_transfer.py records it; vLLM's API calls
return nothing).

`WorkerExtension` is passed to vLLM as `worker_extension_cls`; vLLM appends it to its worker
class's bases, so its methods are callable through `LLM.collective_rpc(name, ...)` and `self`
is the vLLM worker (`self.rank`: rank within the engine = TP rank; `self.model_runner`).
Every method **returns** `{"ok": False, "err": ...}` instead of raising: a worker RPC that
raises leaves the other workers' replies queued in vLLM's MultiprocExecutor, and the next
`collective_rpc` would read a stale reply. The caller (engine.py) checks every reply.
"""

from __future__ import annotations

import functools
import traceback
from typing import Any, Callable

from mcore_rl.rollout.install import rank_shapes
from mcore_rl.rollout.lora import install_adapter


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


class WorkerExtension:
    """Methods added to every vLLM worker (vLLM refuses to start if a name clashes with one of
    its worker's own)."""

    @never_raise
    def describe_shards(self) -> dict:
        """This rank's parameter names and per-rank shapes, in vLLM's layout."""
        return {"shapes": rank_shapes(self.model_runner.get_model())}

    @never_raise
    def weight_transfer_outcome(self, call: str) -> dict:
        """What the weight-transfer engine's last `call` ("init" or "update") did on this rank,
        with `ok` False and the error it met when it failed."""
        engine = getattr(self, "weight_transfer_engine", None)
        outcomes = getattr(engine, "outcomes", None)
        if outcomes is None:
            raise RuntimeError("this worker has no mcore-rl weight-transfer engine "
                               "(weight_transfer_config was not passed to vLLM)")
        if call not in outcomes:
            raise RuntimeError(f"the weight-transfer engine's {call!r} did not run")
        return dict(outcomes[call])  # its "ok" replaces never_raise's

    @never_raise
    def end_weight_update(self) -> dict:
        """End this worker's weight-update session if one is still open (vLLM's
        `finish_weight_update`, which raises when none is): after an `update_weights` that
        raised before reaching the workers, vLLM keeps the session open and refuses the next
        `start_weight_update`. vLLM 0.32 keeps that state in `Worker._weight_update_active`
        (gpu_worker.py, inherited by the CPU worker)."""
        active = bool(getattr(self, "_weight_update_active", False))
        if active:
            self.finish_weight_update()
        return {"ended": active}

    @never_raise
    def install_policy_adapter(self) -> dict:
        """Install the LoRA adapter the weight-transfer engine last received as the engine's
        adapter (again after a base update: vLLM's finish_weight_update drops adapters)."""
        adapter = getattr(getattr(self, "weight_transfer_engine", None), "adapter", None)
        if adapter is None:
            raise RuntimeError("no LoRA adapter was received by this worker")
        return {"names": install_adapter(self.model_runner.get_model(), adapter.tensors,
                                         adapter.peft)}

__all__ = ["WorkerExtension", "never_raise"]
