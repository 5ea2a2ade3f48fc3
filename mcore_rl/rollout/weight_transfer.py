"""The shard-only weight sync as a vLLM weight-transfer backend (`vllm_plugin.BACKEND`).

vLLM builds one `WeightTransferEngine` per worker when it loads the model
(`Worker.load_model` → `WeightTransferEngineFactory.create_engine(config, vllm_config,
self.device, model)`; the CPU worker inherits it) and drives it through
`LLM.init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update` and `shutdown_weight_transfer_engine`, one collective RPC each
(sync_client.py makes those calls). So the engine computes on the device and the model that
vLLM's worker holds: inside an engine whose CUDA_VISIBLE_DEVICES is narrowed, TP rank t is
`cuda:t`, whatever the node's physical index.

  init   join the sync group (`SyncChannels`) as sync rank `first_sync_rank + worker rank`;
         then check that the sync plan writes exactly this rank's parameters (`expected`: an
         uncovered one would keep stale weights — garbage after a level-2 wake)
  update receive this rank's shards of a plan (or a reference to a plan sent before) by the
         engine's transport and install each in place as it lands (install.py), then compare
         the digests of what was installed with what the senders sent (every sync, every
         rank: resharding/digest.py); or install
         tensors passed in the call itself (one-rank engines in the caller's process). With
         `adapter` (a PEFT config), what arrives is the policy's LoRA adapter, whole tensors
         with PEFT names, kept as `adapter`: vLLM's finish_weight_update drops every adapter
         (they were merged against the old base), so the caller installs it after that
         (`WorkerExtension.install_policy_adapter`, lora.py) — after a base update too
  finish nothing: the shards are installed already
  shutdown leave the sync group (before it is formed again)

None of these raises. A worker RPC that raises leaves the other workers' replies queued in
vLLM's MultiprocExecutor and the next `collective_rpc` reads a stale one; so each call records
its outcome, and `WorkerExtension.weight_transfer_outcome` returns it — an error included —
for the caller to check.
"""

from __future__ import annotations

import functools
import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine,
                                                   WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from mcore_rl.resharding.channels import SyncChannels, engine_transport
from mcore_rl.resharding.copy_service import SyncError
from mcore_rl.resharding.plan_cache import PlanCache
from mcore_rl.resharding.stats import SyncStats
from mcore_rl.rollout.install import (install_from_iterator, rank_shapes, receive_target,
                                      worker_device)
from mcore_rl.rollout.lora import ReceivedAdapter, check_adapter


@dataclass
class ShardInitInfo(WeightTransferInitInfo):
    """spec: the sync group (`SyncGroupSpec`); first_sync_rank: this engine's TP rank 0;
    devices: the run plan's device per TP rank, checked against the worker's own (None: the
    engine runs on the host). expected: per TP rank, the vLLM parameters (name → per-rank
    shape) the sync plan writes on it, checked both ways against the rank's model once it
    has joined (None: not checked)."""

    spec: Any
    first_sync_rank: int
    devices: tuple[str, ...] | None = None
    expected: tuple[dict, ...] | None = None


@dataclass
class ShardUpdateInfo(WeightTransferUpdateInfo):
    """One of: `plan` (a `Plan`, or the `PlanRef` of one sent to this group before), received
    over the sync group; `tensors`, `(vLLM name, per-rank tensor)` pairs passed in the call.
    dtype: the wire dtype; timeout_s: the receive deadline; verify: take part in the plan
    check (every rank of the group does). adapter: the PEFT config (`EngineLoRA.peft_config`)
    of a LoRA adapter sent instead of weights. corrupt: fault injection for tests —
    `(sync rank, vLLM name)`: that rank flips the lowest bit of that tensor's first byte as
    it installs it (the digest comparison must catch it)."""

    plan: Any = None
    tensors: list | None = None
    dtype: str = "float32"
    timeout_s: float = 120.0
    verify: bool = True
    adapter: dict | None = None
    corrupt: tuple | None = None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


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


class ShardTransferEngine(WeightTransferEngine[ShardInitInfo, ShardUpdateInfo]):
    """One vLLM worker's side of the weight sync (module doc)."""

    init_info_cls = ShardInitInfo
    update_info_cls = ShardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.worker_rank = int(vllm_config.parallel_config.rank)
        self.channels: SyncChannels | None = None
        self.sync_rank: int | None = None
        self.plans = PlanCache()  # the plans sent to this group, by fingerprint
        self.outcomes: dict[str, dict[str, Any]] = {}
        self.adapter: ReceivedAdapter | None = None  # the policy's LoRA adapter, last received

    def _record(self, call: str, work) -> None:
        """Run `work()` and keep its result (or its error) as the outcome of `call`."""
        self.outcomes.pop(call, None)
        try:
            self.outcomes[call] = {"ok": True, **work()}
        except BaseException as err:  # noqa: BLE001 — must never propagate into vLLM
            self.outcomes[call] = {"ok": False, "err": f"{type(err).__name__}: {err}",
                                   "trace": traceback.format_exc(limit=8)}

    # ------------------------------------------------------------------ the API's calls

    def parse_init_info(self, init_dict: dict[str, Any]) -> ShardInitInfo | dict:
        try:
            return super().parse_init_info(init_dict)
        except ValueError as err:  # reported by init_transfer_engine
            return {"error": str(err)}

    def init_transfer_engine(self, init_info: ShardInitInfo | dict) -> None:
        self._record("init", lambda: self._join(init_info))

    def start_weight_update(self) -> None:
        self.outcomes.pop("update", None)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._record("update", lambda: self._update(update_info))

    def receive_weights(self, update_info: ShardUpdateInfo) -> dict[str, Any]:
        if update_info.tensors is not None:
            start = time.perf_counter()
            names = self._install(update_info, update_info.tensors)
            return {"names": names, "seconds": time.perf_counter() - start}
        return self._receive_plan(update_info)

    def finish_weight_update(self) -> None:
        """Nothing to do: every shard was installed in place as it landed."""

    def shutdown(self) -> None:
        channels, self.channels, self.sync_rank = self.channels, None, None
        if channels is not None:
            try:
                channels.close()
            except Exception:  # noqa: BLE001 — the group is being abandoned anyway
                pass

    # ------------------------------------------------------------------ the work

    def _join(self, info: ShardInitInfo | dict) -> dict[str, Any]:
        if isinstance(info, dict):
            raise ValueError(info["error"])
        if self.channels is not None:
            raise RuntimeError("already in a sync group (shutdown_weight_transfer_engine "
                               "first)")
        resolved = info.devices[self.worker_rank] if info.devices else "cpu"
        device = worker_device(resolved, self.device, self.worker_rank)
        sync_rank = info.first_sync_rank + self.worker_rank
        self.channels = SyncChannels.join(info.spec, sync_rank, device)
        self.sync_rank = sync_rank
        if info.expected is not None:  # after joining: a refusal leaves no peer waiting
            problem = coverage_problem(info.expected[self.worker_rank],
                                       rank_shapes(self.model))
            if problem:
                raise ValueError(f"sync rank {sync_rank}: {problem}")
        return {"sync_rank": sync_rank, "device": device}

    def _update(self, update_dict: dict[str, Any]) -> dict[str, Any]:
        result = self.receive_weights(self.parse_update_info(update_dict))
        if self.device.type == "cuda":  # NCCL receives and IPC copies may still be queued
            torch.cuda.synchronize(self.device)
        return result

    def _receive_plan(self, info: ShardUpdateInfo) -> dict[str, Any]:
        """Receive this rank's shards of the plan by its engine's transport (the sync group
        spec's: p2p sends, or the colocated trainer ranks' shared staging buffers) and install
        each as it lands; the receive ends with the digest comparison (`SyncChannels.receive`).
        Checks that the plan's tensors and shapes for this rank are this model's — inside the
        group's plan check, so that a rank they do not fit fails every rank at once."""
        if self.channels is None:
            raise RuntimeError("not in a sync group (init_weight_transfer_engine first)")
        channels, sync_rank = self.channels, self.sync_rank
        plan = self.plans.resolve(info.plan)  # the plan, or a reference to one sent before
        want = plan.dst_shapes.get(sync_rank)
        problem = None if want else "the plan has nothing for this rank"
        if want and info.adapter is None:  # an adapter's tensors are checked as installed
            problem = _shape_problem(want, rank_shapes(self.model))
        start = time.perf_counter()
        if info.verify:
            channels.verify(plan, problem)
        elif problem:
            raise ValueError(f"sync rank {sync_rank}: {problem}")
        stats, waiting = SyncStats(), [time.perf_counter() - start]  # not installing
        transport = engine_transport(channels.spec, plan, sync_rank)
        # weights go straight into the parameters they replace where those can take them
        # (an adapter is kept whole elsewhere)
        into = None if info.adapter is not None else functools.partial(receive_target,
                                                                        self.model)
        received = items = channels.receive(plan, transport, dtype=_dtype(info.dtype),
                                            timeout_s=info.timeout_s, stats=stats, into=into)
        if info.corrupt is not None and info.corrupt[0] == sync_rank:
            items = _flip_first_bit(received, info.corrupt[1])
        try:
            names = self._install(info, _timed(items, waiting), channels.installed)
        except SyncError:
            raise  # the transport or the comparison failed: every rank knows already
        except Exception as err:
            received.close()  # its transport state is dropped now, not when it is collected
            try:  # the bytes came but did not install: no peer waits for this rank's digests
                channels.fail(plan, f"{type(err).__name__}: {err}")
            except SyncError:
                pass
            raise
        seconds = time.perf_counter() - start
        return {"sync_rank": sync_rank, "names": names, "seconds": seconds,
                "install_seconds": seconds - waiting[0],
                "digest_seconds": stats.digest_seconds,
                "compare_seconds": stats.compare_seconds,
                "bytes_received": stats.bytes_received,
                "bytes_in_place": stats.bytes_in_place,
                "peak_extra_bytes": stats.peak_extra_bytes, "transport": transport,
                "transports": channels.transports_used(plan)}

    def _install(self, info: ShardUpdateInfo, items: Iterable, installed=None) -> list[str]:
        """Weights are installed each as it lands; an adapter is kept whole (copied: a
        received tensor may be a view of transport memory the next round reuses).
        installed(name, tensor): told where each weight now lives (its digest is taken
        there)."""
        if info.adapter is None:
            return install_from_iterator(self.model, items, installed=installed)
        tensors = {n: t.clone() for n, t in items}
        check_adapter(self.model, tensors, int(info.adapter["r"]))
        self.adapter = ReceivedAdapter(tensors, dict(info.adapter))
        return sorted(tensors)


def _shape_problem(want: dict, have: dict) -> str | None:
    """Why a plan's tensors for this rank (`want`) are not this model's (`have`), or None."""
    wrong = [f"{n}: plan {tuple(s)} vs vLLM {have.get(n)}" for n, s in sorted(want.items())
             if have.get(n) != tuple(s)]
    if wrong:
        return f"the plan does not match this rank's parameters: {_some(wrong)}"
    return None


def coverage_problem(want: dict, have: dict) -> str | None:
    """Why a sync plan's tensors for a rank (`want`: name → shape) do not cover exactly the
    rank's parameters (`have`), one line, or None. A parameter the plan never writes keeps the
    weights the engine loaded (stale after the first update) and holds garbage after a
    level-2 sleep (vLLM discards the weights; only the sync restores them)."""
    want = {n: tuple(s) for n, s in want.items()}
    uncovered = sorted(set(have) - set(want))
    unknown = sorted(set(want) - set(have))
    wrong = [f"{n}: plan {want[n]} vs vLLM {tuple(have[n])}"
             for n in sorted(set(want) & set(have)) if want[n] != tuple(have[n])]
    parts = []
    if uncovered:
        parts.append(f"the sync plan never writes {len(uncovered)} vLLM parameters (stale "
                     f"weights; garbage after a level-2 wake): {_some(uncovered)}")
    if unknown:
        parts.append(f"the plan writes {len(unknown)} tensors this model lacks: "
                     f"{_some(unknown)}")
    if wrong:
        parts.append(f"shapes differ: {_some(wrong)}")
    return "; ".join(parts) or None


def _some(items: list[str], shown: int = 5) -> str:
    return f"{items[:shown]}" + (f" and {len(items) - shown} more" if len(items) > shown
                                 else "")


def _flip_first_bit(items: Iterable, name: str) -> Iterator:
    """Fault injection (`ShardUpdateInfo.corrupt`): `name`'s first byte has its lowest bit
    flipped before it is installed."""
    for key, tensor in items:
        if key == name:
            tensor.view(torch.uint8).view(-1)[:1].bitwise_xor_(1)
        yield key, tensor


__all__ = ["ShardInitInfo", "ShardTransferEngine", "ShardUpdateInfo", "coverage_problem"]
