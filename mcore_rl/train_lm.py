"""`mcore-rl train-lm`: train a preset model on a synthetic next-token task through
megatron-core on a local gloo grid — the smallest end-to-end run of the training stack.

The task: every sequence walks a fixed random permutation of the vocabulary from a random
start (next token = perm[token]), so the loss can fall from ln(vocab) towards 0 in a few dozen
steps. Without WORLD_SIZE in the environment the command spawns `actor.world_size` local
ranks itself; under torchrun/srun (WORLD_SIZE, RANK, MASTER_ADDR/PORT set) each process is a
rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from mcore_rl.config import ConfigError, load_config, require_at_least, to_dict
from mcore_rl.config.seeds import STREAM_BITS, USE_THE_RUN_SEED, derive_seed, mix
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.megatron.config import OptimizerConfig, TrainConfig, check_model_fits_parallel
from mcore_rl.models.presets import PRESETS, get_preset
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.groups import (
    Axis,
    default_backend,
    destroy_training_groups,
    init_training_groups,
)


@dataclass(frozen=True, kw_only=True)
class LMOptimizerConfig(OptimizerConfig):
    """train-lm's optimizer: `OptimizerConfig` with its own learning rate.

    lr: peak learning rate; 1e-3, not an RL actor's 1e-6: train-lm trains a small preset from
        its random init.
    """

    lr: float = 1e-3


@dataclass(frozen=True, kw_only=True)
class LMTrainConfig(TrainConfig):
    """train-lm's training step: a `TrainConfig` with its own batch shape set, since train-lm
    derives nothing (an RL run derives micro_batch_size and seq_len).

    micro_batch_size / num_micro_batches / seq_len: per step and DP rank, 2 micro batches of
        4 sequences of 32 tokens.
    optimizer: see LMOptimizerConfig.
    """

    micro_batch_size: int | None = 4
    num_micro_batches: int = 2
    seq_len: int | None = 32
    optimizer: LMOptimizerConfig = field(default_factory=LMOptimizerConfig)


@dataclass(frozen=True, kw_only=True)
class LMRunConfig:
    """model: a preset name (mcore_rl.models.presets). steps: optimizer steps.
    seed: the run's one seed: the permutation the synthetic task walks and its batches
        (stream "data") and megatron's init (stream "train"; `mcore_rl.config.seeds`)."""

    model: str = "micro"
    steps: int = 30
    seed: int = 0
    actor: ParallelConfig = field(default_factory=ParallelConfig)
    train: LMTrainConfig = field(default_factory=LMTrainConfig)

    MOVED: ClassVar[dict[str, str]] = {
        "task_seed": USE_THE_RUN_SEED.format(stream="data"),
        "parallel": "actor (the training grid, named as in the RL run config: actor.tp, "
                    "actor.pp, actor.dp, ...)"}

    def __post_init__(self) -> None:
        require_at_least(self, 0, "seed")
        if self.model not in PRESETS:
            raise ConfigError("model", self.model, f"unknown preset; known: "
                                                   f"{', '.join(sorted(PRESETS))}")
        require_at_least(self, 1, "steps")
        for name in ("micro_batch_size", "seq_len"):
            if getattr(self.train, name) is None:
                raise ConfigError(f"train.{name}", None, "train-lm needs it set (>= 1)")
        check_model_fits_parallel(get_preset(self.model), self.actor, self.train)


def permutation_batch(vocab: int, *, task_seed: int, step: int, sequences: int,
                      seq_len: int) -> torch.Tensor:
    """[sequences, seq_len + 1] walks of the task permutation; the same for every rank."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(task_seed))
    gen = torch.Generator().manual_seed(mix(task_seed, step, bits=STREAM_BITS))
    walk = torch.empty(sequences, seq_len + 1, dtype=torch.long)
    walk[:, 0] = torch.randint(0, vocab, (sequences,), generator=gen)
    for t in range(seq_len):
        walk[:, t + 1] = perm[walk[:, t]]
    return walk


def _micro_batches(cfg: LMRunConfig, step: int, dp_rank: int,
                   device: torch.device | str = "cpu"):
    """This DP rank's slice of the step's global batch, as MicroBatch objects on `device`
    (the model's)."""
    from mcore_rl.megatron.train import MicroBatch  # lazy: megatron

    t = cfg.train
    per_rank = t.num_micro_batches * t.micro_batch_size
    walks = permutation_batch(get_preset(cfg.model).vocab,
                              task_seed=derive_seed(cfg.seed, "data"), step=step,
                              sequences=per_rank * cfg.actor.dp, seq_len=t.seq_len)
    mine = walks[dp_rank * per_rank:(dp_rank + 1) * per_rank].to(device)
    return [MicroBatch(tokens=mb[:, :-1], labels=mb[:, 1:],
                       loss_mask=torch.ones(mb[:, 1:].shape, device=mb.device))
            for mb in mine.split(t.micro_batch_size)]


# Warnings megatron-core 0.16.1 prints on every CPU run, about kernels that do not exist here.
_CPU_NOISE = (r"(Transformer Engine and )?Apex (is|are) not installed", r"full scope is deprecated",
              r"When using async grad allreduce", r"`torch\.distributed\.\w+` is deprecated")


def _quiet_cpu_warnings() -> None:
    for message in _CPU_NOISE:
        warnings.filterwarnings("ignore", message=message)
    # "Implicit initialization of Rerun State Machine!": megatron's fault-tolerance hook.
    logging.getLogger("megatron.core.rerun_state_machine").setLevel(logging.ERROR)


def rank_device(rank: int) -> int | None:
    """This process's CUDA device on its node when the job trains over NCCL (torchrun/srun on
    GPUs: LOCAL_RANK, else the rank), None over gloo (CPU; the locally spawned ranks, which
    join a gloo world). The backend is `default_backend()`'s, the one place it is chosen."""
    backend = dist.get_backend() if dist.is_initialized() else default_backend()
    if backend != "nccl":
        return None
    return int(os.environ.get("LOCAL_RANK", rank))


def run_rank(rank: int, world: int, cfg: LMRunConfig) -> list[dict]:
    """Train on this rank; global rank 0 prints one line per step. Returns the step log."""
    _quiet_cpu_warnings()
    from mcore_rl.megatron.train import setup_trainer, train_step  # lazy: megatron

    device = rank_device(rank)
    if device is not None:  # before NCCL or megatron allocate anything on the device
        torch.cuda.set_device(device)
    groups = init_training_groups(cfg.actor,
                                  device="cpu" if device is None else f"cuda:{device}")
    trainer = setup_trainer(get_preset(cfg.model), groups, cfg.train,
                            seed=derive_seed(cfg.seed, "train"))
    on = next(trainer.unwrapped()[0].parameters()).device  # where the batches run
    dp_rank, log = groups.rank_in(Axis.DP), []
    for step in range(cfg.steps):
        lr = trainer.optimizer.param_groups[0]["lr"]  # the lr this step trains with
        start = time.perf_counter()
        result = train_step(trainer, _micro_batches(cfg, step, dp_rank, on))
        entry = {"step": step + 1, "loss": result.loss, "grad_norm": result.grad_norm,
                 "lr": lr, "ms": 1000 * (time.perf_counter() - start)}
        log.append(entry)
        if rank == 0:
            print(f"step {entry['step']:3d}/{cfg.steps}  loss {entry['loss']:7.4f}  "
                  f"grad_norm {entry['grad_norm']:7.3f}  lr {entry['lr']:.2e}  "
                  f"{entry['ms']:6.0f} ms", flush=True)
    destroy_training_groups()
    return log


def run(cfg: LMRunConfig) -> list[dict]:
    """Under torchrun/srun: this process is one rank. Otherwise spawn the grid locally."""
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != cfg.actor.world_size:
            raise ConfigError("actor", to_dict(cfg.actor),
                              f"needs {cfg.actor.world_size} ranks, the job has {world}")
        return run_rank(int(os.environ["RANK"]), world, cfg)

    return run_on_ranks(run_rank, cfg.actor.world_size, cfg, timeout_s=900)[0]


def _main(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(LMRunConfig, args.config, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    p = cfg.actor
    leader = os.environ.get("RANK", "0") == "0"
    if leader:
        print(f"train-lm: {cfg.model} on tp={p.tp} pp={p.pp} vpp={p.vpp} dp={p.dp} "
              f"({p.world_size} ranks), {cfg.steps} steps, {cfg.train.dtype}", flush=True)
    log = run(cfg)
    if log and leader:
        print(f"loss {log[0]['loss']:.4f} -> {log[-1]['loss']:.4f}", flush=True)
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train-lm", help="train a preset model on a synthetic next-token task (Megatron-Core)",
        description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--config", help="YAML file (configs/lm_micro.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="a.b=value",
                        help="override config fields, e.g. actor.tp=1 actor.pp=2")
    parser.set_defaults(func=_main)
