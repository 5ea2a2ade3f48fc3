"""The actor role: one Ray actor per Megatron rank, driven by the single controller.

Each worker joins the actor's own gloo/NCCL world, builds megatron-core's groups for the grid
and the model chunks (weights streamed from the HF directory: each rank reads only its own
slices), and then runs what the controller asks: supervised steps, log-prob passes, policy
updates, and weight sync sends. Batches arrive whole; each worker keeps its DP slice and cuts
it into micro batches (the pipeline needs equal shapes).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from mcore_rl.algorithms import AlgorithmConfig
from mcore_rl.config.dtypes import torch_dtype
from mcore_rl.config.seeds import derive_seed
from mcore_rl.launch.logs import configure_process_logs
from mcore_rl.launch.startup_gc import gc_paused
from mcore_rl.launch.watchdog import arm_stack_dump, maybe_stall
from mcore_rl.layouts import materialize_rank, megatron_shards
from mcore_rl.megatron.config import LoRAConfig, TrainConfig
from mcore_rl.megatron.packing import (forward_micro_rows, pack, plan_for_grid, response_window,
                                       unpack, valid_lengths)
from mcore_rl.megatron.role_checkpoint import load_role, save_role, saved_base_model
from mcore_rl.models.hf_weights import SafetensorsWeights
from mcore_rl.models.kernels import resolve_kernels
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel import ParallelConfig
from mcore_rl.parallel.groups import Axis, join_worker_world, leave_worker_world
from mcore_rl.resharding import Plan, SyncGroupSpec
from mcore_rl.resharding.channels import SyncChannels
from mcore_rl.resharding.plan_cache import PlanCache, PlanRef
from mcore_rl.rollout.batches import mini_batches


@dataclass(frozen=True)
class ActorRankSpec:
    """What every actor rank of a run is built from: derived once from the resolved run by the
    driver's handle (`rl.actor_ranks.actor_rank_spec`) and handed to each rank whole; a rank
    reads its own device and slot by rank.

    train: the config the actor is built and warmed up with (the warm-up's;
    `reset_optimizer` hands it RL's); critic_train: the critic's (PPO), when one is colocated
    on each rank. reference: a frozen reference policy too (with LoRA, the base with
    the adapters off: no model of its own). seed: megatron's weight init and RNG tracker of
    every model here (the run's `derive_seed(seed, "train")`). layer_spec: megatron's layer
    spec of every model here, as the run resolved it (`ResolvedRun.layer_spec`: "local" or
    "te"); it also names the tensors loaded and sent. fused_kernels / overlap_grad_reduce /
    compiled_fusions: the run plan's, for every trainer here; each fused kernel is turned on
    only where its provider imports in the rank's process (`ActorWorker.fused_kernels` says
    which, and why). lora: adapters on the actor (`actor.lora`; off with rank 0): the base is
    frozen and the weights sent to the engines are merged per shard. lora_from_start: the
    adapters are there from the start (no full-model warm-up: the base never gets grad
    buffers or optimizer states); otherwise they are added when RL starts
    (`reset_optimizer`). routing_replay: the MoE routers can record and replay their experts
    (`algorithm.routing_replay`, megatron/routing_replay.py). release_cache: after each update
    the caching allocator gives its free blocks back to the device — where engines share the
    rank's GPU (the run plan's `release_trainer_cache`), so their KV cache wakes into the
    memory the plan's rollout phase counts as free. stack_dir: where each rank dumps its
    stacks on SIGUSR1 (the watchdog). inject_stall: fault injection for watchdog tests
    ("<phase>@rank<r>"). devices: each rank's torch device (`ResolvedRun.actor_devices`;
    empty: all "cpu"); a CUDA device becomes the current one before anything is allocated.
    slots: each rank's device index on its node (the placement plan; reported by `where`)."""

    model: ModelSpec
    parallel: ParallelConfig
    train: TrainConfig
    hf_dir: str
    timeout_s: float = 600.0
    critic_train: TrainConfig | None = None
    reference: bool = False
    seed: int = derive_seed(0, "train")
    layer_spec: str = "local"
    fused_kernels: bool = False
    overlap_grad_reduce: bool = False
    compiled_fusions: bool = False
    lora: LoRAConfig | None = None
    lora_from_start: bool = True
    routing_replay: bool = False
    release_cache: bool = False
    stack_dir: str | None = None
    inject_stall: str | None = None
    devices: tuple[str, ...] = ()
    slots: tuple[int | None, ...] = ()

    def device(self, rank: int) -> str:
        return self.devices[rank] if self.devices else "cpu"

    def slot(self, rank: int) -> int | None:
        return self.slots[rank] if self.slots else None

    @property
    def logits_bytes(self) -> float:
        """A micro batch's fp32 logits on one TP rank: the largest tensor a step allocates
        anew (what `join_worker_world` sizes the host allocator's choice by)."""
        rows = (self.train.micro_batch_size or 1) * (self.train.seq_len or 0)
        return 4.0 * rows * self.model.vocab / self.parallel.tp

    @property
    def kernels(self) -> dict:
        """The run plan's kernel intent, as `setup_trainer` / `build_gpt_model` take it."""
        return dict(layer_spec=self.layer_spec, fused_kernels=self.fused_kernels,
                    overlap_grad_reduce=self.overlap_grad_reduce,
                    compiled_fusions=self.compiled_fusions)


class ActorWorker:
    """One Megatron rank of the actor. Methods return plain, picklable values."""

    @gc_paused()  # megatron's import and the model build: mcore_rl/launch/startup_gc.py
    def __init__(self, rank: int, world_size: int, store_address: tuple[str, int],
                 spec: ActorRankSpec):
        """Rank `rank` of the actor's world (its store at `store_address`): the actor always;
        a critic (PPO) and a frozen reference policy where `spec` asks for them."""
        if spec.stack_dir:  # the run directory: stacks for the watchdog, library logs
            configure_process_logs(Path(spec.stack_dir).parent, f"rank{rank}")
            self._stack_file = arm_stack_dump(spec.stack_dir, f"rank{rank}")
        self.inject_stall, self.release_cache = spec.inject_stall, spec.release_cache
        self.slot, self.device = spec.slot(rank), spec.device(rank)
        self.groups = join_worker_world(rank, world_size, store_address, spec.parallel,
                                        timeout_s=spec.timeout_s, device=self.device,
                                        largest_step_bytes=spec.logits_bytes)
        self.rank, self.spec, self.parallel = rank, spec.model, spec.parallel
        self.hf_dir = spec.hf_dir
        self.base_model = spec.hf_dir  # the HF model the frozen base equals (a LoRA ckpt's)
        self.layer_spec = spec.layer_spec
        self.shards = megatron_shards(spec.model, spec.parallel, layer_spec=spec.layer_spec)
        self._kernel_intent = (spec.fused_kernels, spec.compiled_fusions)
        self.lora = spec.lora if spec.lora is not None and spec.lora.enabled else None
        self.lora_attached = self.lora is not None and spec.lora_from_start
        self.train_cfg = spec.train
        weights = SafetensorsWeights(spec.hf_dir)  # opened for the builds only
        self.trainer = self._build_actor(spec, weights)
        self.critic = (self._build_critic(spec, weights)
                       if spec.critic_train is not None else None)
        self.reference_is_base = spec.reference and self.lora is not None
        self.reference = (self._build_reference(spec, weights)
                          if spec.reference and not self.reference_is_base else None)
        self.sync_group = None
        self._plans = PlanCache()  # the sync plans sent to this rank, by fingerprint

    def _load(self, chunks, weights: SafetensorsWeights, dtype: str) -> None:
        """This rank's slices of the HF `weights` into `chunks`."""
        from mcore_rl.models.gpt import load_chunks  # lazy: megatron

        load_chunks(chunks, materialize_rank(self.shards, self.rank, weights.__getitem__,
                                             torch_dtype(dtype)), self.parallel.vpp)

    def _build_actor(self, spec: ActorRankSpec, weights: SafetensorsWeights):
        """The actor's trainer (LoRA adapters attached where they start with the run); each
        model build turns on only the fused kernels whose providers import here
        (models.kernels), which `fused_kernels()` reports."""
        from mcore_rl.megatron.train import setup_trainer  # lazy: megatron

        trainer = setup_trainer(spec.model, self.groups, spec.train,
                                load_weights=lambda chunks: self._load(chunks, weights,
                                                                       spec.train.dtype),
                                seed=spec.seed, lora=self.lora if self.lora_attached else None,
                                **spec.kernels)
        if spec.routing_replay:
            from mcore_rl.megatron.routing_replay import install_replay  # lazy: megatron

            install_replay(trainer.unwrapped())
        return trainer

    def _build_critic(self, spec: ActorRankSpec, weights: SafetensorsWeights):
        """The critic's trainer: initialized from the policy's weights, then a fresh value
        head."""
        from mcore_rl.megatron.train import setup_trainer  # lazy: megatron
        from mcore_rl.megatron.value import attach_value_head  # lazy: megatron

        def load_critic(chunks):
            self._load(chunks, weights, spec.train.dtype)
            attach_value_head(chunks, spec.model.hidden, self.groups.is_last_stage,
                              tp_group=self.groups.group(Axis.TP))

        return setup_trainer(spec.model, self.groups, spec.critic_train,
                             load_weights=load_critic, seed=spec.seed, **spec.kernels)

    def _build_reference(self, spec: ActorRankSpec, weights: SafetensorsWeights):
        """The frozen reference policy: the starting weights with the actor's numerics."""
        from mcore_rl.megatron.value import FrozenModel  # lazy: megatron
        from mcore_rl.models.gpt import build_gpt_model  # lazy: megatron

        chunks = build_gpt_model(spec.model, spec.parallel, self.groups,
                                 params_dtype=torch_dtype(spec.train.dtype), seed=spec.seed,
                                 layer_spec=spec.layer_spec, fused_kernels=spec.fused_kernels,
                                 compiled_fusions=spec.compiled_fusions)
        self._load(chunks, weights, spec.train.dtype)
        for chunk in chunks:
            chunk.eval().requires_grad_(False)
        return FrozenModel(spec.model, chunks, self.groups)

    # --- batches ----------------------------------------------------------------------------

    def _micro(self, tensors: dict[str, torch.Tensor], cls, *, train: TrainConfig | None = None,
               mask: str | None = None, windowed: bool = False):
        """This DP rank's rows (`tensors`: the controller sends each DP slice its own,
        `rollout.batches.dp_slice`) as micro batches of `cls`, and the PackPlan: packed by
        `train.max_tokens_per_micro_batch` if set (each row's valid length ends at the last
        nonzero of `tensors[mask]`; mask None keeps rows whole), else None and fixed micro
        batches of micro_batch_size rows; `windowed`: each fixed one with the positions of
        `tensors[mask]`'s nonzeros (`logit_window`: where a pass computes logits)."""
        train = train or self.train_cfg
        # batches arrive from the controller on the host; the model's device is where they run
        on = self._model_device()
        mine = {k: v.to(on) for k, v in tensors.items()}
        n, s = mine["tokens"].shape
        if train.max_tokens_per_micro_batch is not None:
            # from the host copy: the plan is made on the host, so no device sync for it
            lengths = valid_lengths(tensors[mask]) if mask else [s] * n
            plan = plan_for_grid(lengths, train.max_tokens_per_micro_batch, seq_len=s,
                                 parallel=self.parallel)
            return [cls(**packed) for packed in pack(mine, plan)], plan
        mbs = train.micro_batch_size
        if n % mbs:
            raise ValueError(f"{n} sequences per DP rank do not split into micro batches of "
                             f"micro_batch_size={mbs}")
        return [cls(**{k: v[i:i + mbs] for k, v in mine.items()},
                    **({"logit_window": response_window(tensors[mask][i:i + mbs])}
                       if windowed and mask else {}))
                for i in range(0, n, mbs)], None

    def _forward_train(self, train: TrainConfig | None, n: int) -> TrainConfig:
        """`train` whose micro_batch_size is the forward-only passes' for this DP slice's `n`
        rows (`packing.forward_micro_rows`); packed passes are unchanged."""
        train = train or self.train_cfg
        if train.max_tokens_per_micro_batch is not None:
            return train
        size = forward_micro_rows(n, micro_batch_size=train.micro_batch_size,
                                  forward_micro_batch_size=train.forward_micro_batch_size,
                                  parallel=self.parallel)
        return replace(train, micro_batch_size=size)

    def _model_device(self) -> torch.device:
        """Where this rank's actor parameters live (its placed CUDA device, or the CPU)."""
        return next(self.trainer.unwrapped()[0].parameters()).device

    @staticmethod
    def _packing_metrics(plan) -> dict:
        """This DP rank's packing: real tokens / tokens run, and the same for padded rows."""
        if plan is None:
            return {}
        return {"pack_efficiency": plan.efficiency,
                "pad_efficiency": plan.padded_efficiency, "micro_batches": len(plan.bins)}

    # --- passes -----------------------------------------------------------------------------

    def sft_step(self, rows: dict[str, torch.Tensor]) -> dict:
        """One supervised step on this DP slice's rows (tokens, labels, loss_mask)."""
        maybe_stall("warmup", f"rank{self.rank}", self.inject_stall)
        from mcore_rl.megatron.train import MicroBatch, train_step  # lazy: megatron

        batches, _ = self._micro(rows, MicroBatch, mask="loss_mask")
        return asdict(train_step(self.trainer, batches))

    def _forward_batches(self, rows: dict[str, torch.Tensor], train: TrainConfig | None = None):
        """This DP slice's rows (tokens, labels, optionally response_mask and routing) as the
        forward-only passes' micro batches, and the PackPlan (None: fixed rows).
        `response_mask` bounds the valid tokens (without it rows are packed whole);
        `routing` [n, s, layers, k]: the experts the pass replays."""
        from mcore_rl.megatron.train import MicroBatch  # lazy: megatron

        response_mask = rows.get("response_mask")
        labels = rows["labels"]
        batch = {"tokens": rows["tokens"], "labels": labels,
                 "loss_mask": torch.ones_like(labels) if response_mask is None else response_mask}
        if rows.get("routing") is not None:
            batch["routing"] = rows["routing"]
        return self._micro(batch, MicroBatch, train=self._forward_train(train, len(labels)),
                           mask=None if response_mask is None else "loss_mask", windowed=True)

    @staticmethod
    def _rows(out: list[torch.Tensor], plan) -> torch.Tensor:
        """Per-micro-batch outputs back to this slice's rows [n, s, ...] (packed ones
        unpacked, zeros after each row's valid tokens), on the host for the controller."""
        if plan is not None:
            return unpack(out, plan).cpu()
        return torch.cat(out).cpu()

    def _forward_only(self, fn, model, rows: dict[str, torch.Tensor],
                      train: TrainConfig | None = None) -> torch.Tensor | None:
        """Run a forward-only pass over this DP slice's rows; the last stage's TP rank 0
        returns the [n, s] result (others return None: the controller takes one copy per DP
        slice)."""
        batches, plan = self._forward_batches(rows, train)
        out = fn(model, batches)
        if out is None or self.groups.rank_in(Axis.TP) != 0:
            return None
        return self._rows(out, plan)

    def logprobs(self, rows: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The actor's log-probs of the labels (old log-probs). With `response_mask` packed
        passes skip each row's padding (0 there). routing [n, s, layers, k]: the experts the
        MoE layers use (the rollout's, `algorithm.routing_replay: rollout`)."""
        maybe_stall("old_logprob", f"rank{self.rank}", self.inject_stall)
        from mcore_rl.megatron.policy import compute_logprobs  # lazy: megatron

        return self._forward_only(compute_logprobs, self.trainer, rows)

    def logprobs_and_routing(self, rows: dict[str, torch.Tensor]) -> dict:
        """The old log-probs (as `logprobs`) and, recorded in the same pass, the experts this
        rank's MoE routers chose for every token: `routing` [n, s, layers, k] (int16; -1 in
        the layers of other pipeline stages) from TP rank 0 of every stage, `logp` from the
        last stage's; `dp`: the slice they cover (`algorithm.routing_replay: old`)."""
        maybe_stall("old_logprob", f"rank{self.rank}", self.inject_stall)
        from mcore_rl.megatron.policy import compute_logprobs  # lazy: megatron
        from mcore_rl.megatron.routing_replay import flip_counts  # lazy: megatron

        batches, plan = self._forward_batches(rows)
        routing: list[torch.Tensor] = []
        out = compute_logprobs(self.trainer, batches, routing_out=routing)
        flip_counts(self.trainer.unwrapped())  # the update's counts start at this pass's end
        tp0 = self.groups.rank_in(Axis.TP) == 0
        return {"dp": self.groups.rank_in(Axis.DP),
                "logp": self._rows(out, plan) if out is not None and tp0 else None,
                "routing": self._rows(routing, plan) if tp0 else None}

    def ref_logprobs(self, rows: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The frozen reference policy's log-probs of the labels."""
        from mcore_rl.megatron.policy import compute_logprobs  # lazy: megatron

        if self.reference_is_base:  # LoRA: the base is the reference
            from mcore_rl.megatron.lora import adapters_disabled  # lazy: megatron

            with adapters_disabled(self.trainer.unwrapped()):
                return self._forward_only(compute_logprobs, self.trainer, rows)
        if self.reference is None:
            raise RuntimeError(f"actor rank {self.rank}: no reference model on this worker")
        return self._forward_only(compute_logprobs, self.reference, rows)

    def values(self, rows: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The critic's values V(state before label t), [n, s]."""
        from mcore_rl.megatron.value import compute_values  # lazy: megatron

        critic = self._critic()
        return self._forward_only(compute_values, critic, rows, train=critic.train)

    def update(self, batch: dict[str, torch.Tensor], algo: AlgorithmConfig,
               mini_batches: int = 1) -> list[dict]:
        """The policy update: this DP slice's rows of the step's batch (`dp_slice` with
        `mini_batches`) cut into `mini_batches` equal, contiguous mini-batches, one optimizer
        step each, in order. One call per step, not per mini-batch: the batch
        crosses once and the controller waits once (a Ray round trip per mini-batch adds up on
        small batches). Returns each mini-batch's report."""
        maybe_stall("update_actor", f"rank{self.rank}", self.inject_stall)
        from mcore_rl.megatron.policy import PolicyBatch, policy_update  # lazy: megatron

        reports = self._each_mini_batch(batch, mini_batches, PolicyBatch, self.trainer,
                                        policy_update, algo, windowed=True)
        self._release_cached_memory()
        return reports

    def critic_update(self, batch: dict[str, torch.Tensor], algo: AlgorithmConfig,
                      mini_batches: int = 1) -> list[dict]:
        """The critic's value update, cut and reported as `update`'s."""
        maybe_stall("update_critic", f"rank{self.rank}", self.inject_stall)
        from mcore_rl.megatron.value import ValueBatch, value_update  # lazy: megatron

        reports = self._each_mini_batch(batch, mini_batches, ValueBatch, self._critic(),
                                        value_update, algo)
        self._release_cached_memory()
        return reports

    def _release_cached_memory(self) -> None:
        if self.release_cache:  # the run plan's: only where engines share a CUDA device
            torch.cuda.empty_cache()

    def _critic(self):
        if self.critic is None:
            raise RuntimeError(f"actor rank {self.rank}: no critic on this worker")
        return self.critic

    def _each_mini_batch(self, batch: dict[str, torch.Tensor], count: int, cls, role,
                         update, algo: AlgorithmConfig, windowed: bool = False) -> list[dict]:
        """`update(role, micro batches, algo)` (one optimizer step) on each of `count`
        mini-batches of `batch` — this rank's rows of each, cut into `role`'s micro batches of
        `cls` (`windowed`: with their response positions, `_micro`); each one's report with
        its packing."""
        if "routing" in batch:  # the update's counts: not the π_old pass's
            from mcore_rl.megatron.routing_replay import flip_counts  # lazy: megatron

            flip_counts(role.unwrapped())
        reports = []
        for mini in mini_batches(batch, count):
            micro, plan = self._micro(mini, cls, train=role.train, mask="response_mask",
                                      windowed=windowed)
            reports.append({**update(role, micro, algo), **self._packing_metrics(plan),
                            **self._routing_counts(role, "routing" in mini)})
        return reports

    @staticmethod
    def _routing_counts(role, replayed: bool) -> dict:
        """This rank's replay counts of the pass (megatron/routing_replay.py): choices that
        differed from the replayed ones, and choices replayed (summed over ranks by the
        controller)."""
        if not replayed:
            return {}
        from mcore_rl.megatron.routing_replay import flip_counts  # lazy: megatron

        flips, replayed, seen = flip_counts(role.unwrapped())
        return {"routing_flips_local": float(flips), "routing_replayed_local": float(replayed),
                "routing_seen_local": float(seen)}

    def reset_optimizer(self, train: TrainConfig) -> bool:
        """A fresh optimizer and LR schedule (e.g. RL after the supervised warm-up)."""
        from mcore_rl.megatron.schedule import configure_schedule  # lazy: megatron

        # lazy: megatron
        from mcore_rl.megatron.train import add_lora, build_optimizer, build_scheduler

        dtype = torch_dtype(train.dtype)
        trainer = self.trainer
        if self.lora is not None and not self.lora_attached:  # RL starts after a warm-up
            add_lora(trainer, self.lora)
            self.lora_attached = True
        trainer.optimizer = build_optimizer(trainer.model, train.optimizer, dtype, self.groups)
        trainer.scheduler = build_scheduler(trainer.optimizer, train.optimizer)
        trainer.train = train
        configure_schedule(trainer.config, trainer.model, trainer.optimizer)
        self.train_cfg = train
        return True

    def dp_rank(self) -> int:
        """The DP slice of the batch this rank works on."""
        return self.groups.rank_in(Axis.DP)

    def dp_rank_of_output(self) -> int | None:
        """Which DP slice this rank's `logprobs` output covers (None: it returns nothing)."""
        if self.groups.is_last_stage and self.groups.rank_in(Axis.TP) == 0:
            return self.groups.rank_in(Axis.DP)
        return None

    # --- weight sync ------------------------------------------------------------------------

    def join_sync_group(self, spec: SyncGroupSpec, device: str = "cpu") -> bool:
        """Join the weight-sync world. device: this rank's device from the resolved run
        (`actor_devices[rank]`): where IPC staging lives for colocated engines."""
        self.sync_group = SyncChannels.join(spec, self.rank, device)
        return True

    def leave_sync_group(self) -> bool:
        """Shut this rank's sync-group handles down: a member died, so the group is broken for
        everyone and the controller forms a new one (rl/recovery.py)."""
        group, self.sync_group = self.sync_group, None
        if group is None:
            return True
        try:
            group.close()
        except Exception:  # noqa: BLE001 — a group that lost a member may not shut down cleanly
            return False  # it is dropped either way
        return True

    def local_tensors(self, merged: bool = True) -> Mapping[str, torch.Tensor]:
        """This rank's parameters keyed as `megatron_shards` names them (the run's layer spec);
        `_extra_state` entries are not weights and are never synced. With LoRA and `merged`:
        the policy's weights, each adapted one merged on this shard (`lora.MergedWeights`);
        without `merged`: the frozen base and the adapters (`<linear>.lora.lora_a|b`)."""
        out, adapted = {}, {}
        prefix = "model{v}." if self.parallel.vpp is not None else ""
        for v, chunk in enumerate(self.trainer.unwrapped()):
            for name, tensor in chunk.state_dict(keep_vars=True).items():
                if not name.endswith("_extra_state"):
                    out[prefix.format(v=v) + name] = tensor.detach()
            if self.lora is not None:
                from mcore_rl.megatron.lora import lora_linears  # lazy: megatron

                adapted.update({f"{prefix.format(v=v)}{name}.weight": linear
                                for name, linear in lora_linears([chunk])})
        if self.lora is None or not merged:
            return out
        from mcore_rl.megatron.lora import MergedWeights  # lazy: megatron

        return MergedWeights(out, adapted)

    def send_weights(self, plan: Plan | PlanRef, dtype: str = "float32",
                     timeout_s: float = 120.0, merged: bool = True) -> dict:
        """Stream this rank's shards to the inference ranks (the plan says which bytes go
        where), to each engine by its transport. Returns this rank's transport stats
        (`bytes_sent_ipc` / `bytes_sent_p2p`: bytes by transport). merged: with LoRA, the
        plan's weights are the policy's merged ones; False: the base's, or the adapters
        themselves (`local_tensors`)."""
        if self.sync_group is None:
            raise RuntimeError(f"actor rank {self.rank}: join_sync_group was not called")
        wire = torch_dtype(dtype)
        plan = self._plans.resolve(plan)  # sent whole once per sync group, then by reference
        maybe_stall("sync", f"rank{self.rank}", self.inject_stall)
        self.sync_group.verify(plan)
        return self.sync_group.send(plan, self.local_tensors(merged), dtype=wire,
                                    timeout_s=timeout_s)

    # --- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, ckpt_dir: str) -> bool:
        """Actor (and critic) model + optimizer + schedule + RNG into ckpt_dir (collective)."""
        save_role(self.trainer, Path(ckpt_dir) / "actor", self.rank, base_model=self.base_model)
        if self.critic is not None:
            save_role(self.critic, Path(ckpt_dir) / "critic", self.rank)
        return True

    def load_checkpoint(self, ckpt_dir: str) -> bool:
        load_role(self.trainer, Path(ckpt_dir) / "actor", self.rank)
        self.base_model = saved_base_model(Path(ckpt_dir) / "actor") or self.base_model
        if self.critic is not None:
            load_role(self.critic, Path(ckpt_dir) / "critic", self.rank)
        return True

    def set_base_model(self, hf_dir: str) -> bool:
        """The HF model the actor's base now equals (the warm-up's export): what a LoRA
        checkpoint records as its adapters' base."""
        self.base_model = hf_dir
        return True

    def export_weights(self) -> dict[str, torch.Tensor]:
        """A copy of this rank's actor parameters (megatron_shards keys), for checks that
        rebuild HF tensors with `layouts.assemble_hf` on small models."""
        return {k: v.detach().clone() for k, v in self.local_tensors().items()}

    def weights_digest(self) -> str:
        """sha256 of this rank's actor parameters (resume tests compare runs bit for bit)."""
        digest = hashlib.sha256()
        for key, tensor in sorted(self.local_tensors().items()):
            digest.update(key.encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy()
                          .tobytes())
        return digest.hexdigest()

    def fused_kernels(self) -> list[dict]:
        """This rank's fused kernels: each one the plan asked for (`wanted`), whether the
        actor's model runs it (`on`, read from the config it was built with) and why
        (`models.kernels.resolve_kernels` in this process, on this node)."""
        fused, compiled = self._kernel_intent
        config = self.trainer.config
        return [{**d.as_dict(), "on": bool(getattr(config, d.field))}
                for d in resolve_kernels(fused, compiled, device=self.device)]

    def pid(self) -> int:
        return os.getpid()

    def where(self) -> dict:
        """Node, placement group and device of this rank (placement checks)."""
        import ray  # lazy: ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "slot": self.slot, "device": self.device,
                "placement_group": context.get_placement_group_id()}

    def shutdown(self) -> bool:
        leave_worker_world()
        return True

