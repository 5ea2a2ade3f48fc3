"""The reward model's Ray workers (one Megatron rank each) and the driver-side group that
starts them, scores under a deadline, and names late ranks."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_rl.config import ConfigError
from mcore_rl.launch.logs import configure_process_logs
from mcore_rl.launch.ray_runtime import init_local_ray
from mcore_rl.launch.watchdog import WatchdogTimeout, arm_stack_dump, dump_stacks
from mcore_rl.parallel.groups import join_worker_world, leave_worker_world
from mcore_rl.resharding import host_store
from mcore_rl.reward_model.config import RewardModelConfig, RewardModelError
from mcore_rl.reward_model.scoring import (
    check_score_inputs,
    load_reward_model,
    pad_sequences,
    score_batch,
)
from mcore_rl.reward_model.weights import check_reward_model_dir


@dataclass(frozen=True)
class RewardRankSpec:
    """What every reward-model rank of a run is built from, handed to each rank whole; a
    rank reads its own device by rank.

    timeout_s: the workers' collective timeout (the run's deadlines.reward_model_s).
    layer_spec: megatron's layer spec, as the run resolved it (`ResolvedRun.layer_spec`).
    stack_dir: where each rank dumps its stacks on SIGUSR1 (the watchdog). devices: each
    rank's torch device ("cpu" or "cuda:<i>", made the current CUDA device); empty: all
    "cpu"."""

    cfg: RewardModelConfig
    timeout_s: float
    layer_spec: str = "local"
    stack_dir: str | None = None
    devices: tuple[str, ...] = ()

    def device(self, rank: int) -> str:
        return self.devices[rank] if self.devices else "cpu"


class RewardWorker:
    """One Megatron rank of the reward model. Methods return plain, picklable values."""

    def __init__(self, rank: int, world_size: int, store_address: tuple[str, int],
                 spec: RewardRankSpec):
        """Rank `rank` of the reward model's world (its store at `store_address`)."""
        if spec.stack_dir:  # the run directory: stacks for the watchdog, library logs

            configure_process_logs(Path(spec.stack_dir).parent, f"reward{rank}")
            self._stack_file = arm_stack_dump(spec.stack_dir, f"reward_rank{rank}")
        self.rank = rank
        groups = join_worker_world(rank, world_size, store_address, spec.cfg.parallel,
                                   timeout_s=spec.timeout_s, device=spec.device(rank))
        self.model = load_reward_model(spec.cfg, groups, layer_spec=spec.layer_spec)

    def score(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
        """Scores [n] on one rank (tp 0, last stage, dp 0), a host tensor; None on the
        others."""
        scores = score_batch(self.model, tokens, lengths)
        return None if scores is None else scores.cpu()  # to the driver, which may have no GPU

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> bool:
        leave_worker_world()
        return True


class RewardModelGroup:
    """The reward workers, started and driven from the controller process.

    The checkpoint and grid are checked here first (a bad directory fails before any worker
    starts). The workers' gloo world meets at a TCPStore on `host` (the driver's address).
    """

    def __init__(self, cfg: RewardModelConfig, *, timeout_s: float, host: str = "127.0.0.1",
                 stack_dir: str | Path | None = None, placement=None,
                 devices: Sequence[str] = ("cpu",), layer_spec: str = "local"):
        """timeout_s: deadline of start-up and of each `score` call, and the workers'
        collective timeout (a run passes its deadlines.reward_model_s). placement: the run's `launch.placement.RayPlacement`; reward rank r then shares
        the device (and node) of actor rank r mod the actor's world, as the reference model
        does. None: wherever Ray puts it. devices: the torch device of each actor rank
        (`ResolvedRun.actor_devices`); reward rank r computes on devices[r mod len(devices)].
        layer_spec: the run's (`ResolvedRun.layer_spec`)."""
        import ray  # lazy: ray

        if not cfg.enabled:
            raise ConfigError("enabled", False, "RewardModelGroup needs an enabled reward model")
        self.cfg, self.stack_dir, self.timeout_s = cfg, stack_dir, timeout_s
        self.spec = check_reward_model_dir(cfg.hf_dir)
        try:
            cfg.parallel.check_model(self.spec)
        except ConfigError as err:
            raise err.under("parallel") from None
        init_local_ray(num_cpus=max(2, os.cpu_count() or 2))
        world = cfg.parallel.world_size
        self._store = host_store(host, world_size=world + 1, timeout_s=timeout_s)
        remote_cls = ray.remote(num_cpus=0)(RewardWorker)
        spec = RewardRankSpec(cfg, timeout_s, layer_spec=layer_spec,
                              stack_dir=str(stack_dir) if stack_dir else None,
                              devices=tuple(devices[r % len(devices)] for r in range(world)))
        self.workers = []
        for rank in range(world):
            options = {}
            if placement is not None:
                slot = placement.plan.actor[rank % len(placement.plan.actor)]
                options = placement.options_for_node(slot.node)
            self.workers.append(remote_cls.options(**options).remote(
                rank, world, (host, self._store.port), spec))
        self.pids: list[int] = []
        self.pids = self._call("pid", phase="reward-startup")

    def _call(self, method: str, *args, phase: str, timeout_s: float | None = None) -> list:
        """`method` on every worker under a deadline; past it, the error names the late ranks
        (and the workers' stack dumps when `stack_dir` is set)."""
        import ray  # lazy: ray

        deadline = self.timeout_s if timeout_s is None else timeout_s
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=deadline)
        if pending:
            late = [f"reward rank {i}" for i, ref in enumerate(refs) if ref in pending]
            stacks = (dump_stacks({f"reward_rank{i}": pid for i, pid in enumerate(self.pids)},
                                  self.stack_dir) if self.stack_dir and self.pids else [])
            raise WatchdogTimeout(phase, deadline, late, stacks)
        return ray.get(refs)

    def score(self, prompts: list[list[int]], responses: list[list[int]], pad_id: int, *,
              timeout_s: float | None = None) -> torch.Tensor:
        """Reward-model score [n] (fp32) of each prompt + response (token ids)."""
        tokens, lengths = pad_sequences(prompts, responses, pad_id)
        if tokens.shape[0] == 0:
            return torch.zeros(0)
        if tokens.shape[1] > self.spec.max_positions:
            raise RewardModelError(f"prompts + responses: longest row has {tokens.shape[1]} "
                                   f"tokens, the reward model's max_position_embeddings is "
                                   f"{self.spec.max_positions}")
        check_score_inputs(tokens, lengths, self.spec.vocab)  # on the driver: clear, early
        outs = self._call("score", tokens, lengths, phase="reward-score", timeout_s=timeout_s)
        return next(out for out in outs if out is not None)

    def shutdown(self) -> None:
        """Stop the workers (their groups, then the processes); Ray itself stays up."""
        import ray  # lazy: ray

        try:
            ray.wait([w.shutdown.remote() for w in self.workers],
                     num_returns=len(self.workers), timeout=10.0)
        finally:
            for worker in self.workers:
                ray.kill(worker)
            self.workers = []
