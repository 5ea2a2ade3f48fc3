"""The reward-model role: an HF sequence classifier scored on Megatron, as its own worker group.

A reward model is an HF `<Family>ForSequenceClassification` checkpoint with num_labels=1: the
decoder plus `score.weight` [1, hidden] (no bias, no LM head). Its reward for a sequence is the
score head's output at the sequence's last real token — what HF's
`AutoModelForSequenceClassification(...).logits[:, 0]` returns with right padding and
`pad_token_id` set. We take the last token from explicit lengths (as verl does) rather than
from the pad id: the two agree unless a real token equals the pad id (pad = eos), where HF
would score an earlier token.

On Megatron the decoder is built from `ModelSpec.from_hf_dir` and each rank streams only its
slices from the safetensors (the layout table's `score.weight` row puts the head on the last
stage's output layer, replicated on every TP rank: the last stage's hidden states are complete
on every TP rank without sequence parallelism). Scoring is forward only, through megatron's
schedule, in fixed-shape padded micro batches; rows are split over DP.

The controller combines it with the rule reward as `rule + coeff * score`
(`RewardModelConfig.coeff`). Driver side: `RewardModelGroup(cfg, host=...)`,
`.score(prompts, responses, pad_id) -> Tensor[n]`, `.shutdown()`.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from mcore_rl.config import ConfigError
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel import ParallelConfig
from mcore_rl.trainer.config import DTYPES

SCORE_TENSOR = "score.weight"  # HF's GenericForSequenceClassification.score (bias=False)


class RewardModelError(ValueError):
    """The reward-model checkpoint or a scoring batch is not what the role can use."""


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """The optional reward model and its Megatron grid.

    enabled: score rollouts with the model (False: rule rewards only; the other fields are
        then unused).
    hf_dir: HF `*ForSequenceClassification` checkpoint directory with num_labels=1
        (config.json + safetensors holding `score.weight` [1, hidden]).
    parallel: the reward workers' grid (tp, pp, dp; world size tp * pp * dp). No sequence
        parallelism (the head reads complete hidden states) and no vpp.
    micro_batch_size: sequences per forward micro batch on each DP rank (a batch is padded
        with dummy rows to a multiple of dp * micro_batch_size).
    dtype: "fp32" or "bf16" weights and activations (scores are returned in fp32).
    coeff: weight of the model score in the reward: reward = rule reward + coeff * score.
    timeout_s: deadline of start-up and of each `score` call, and the workers' collective
        timeout.
    preset: a planner preset of the model's shapes (`mcore_rl.models.presets`): preflight
        sizes the reward model from it when hf_dir is not on this machine (as model.preset).
    """

    enabled: bool = False
    hf_dir: str | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 4
    dtype: Literal["fp32", "bf16"] = "fp32"
    coeff: float = 1.0
    timeout_s: float = 600.0
    preset: str | None = None

    def __post_init__(self) -> None:
        if self.enabled and not self.hf_dir:
            raise ConfigError("hf_dir", self.hf_dir, "the reward model is enabled: set the HF "
                                                     "*ForSequenceClassification directory")
        if self.micro_batch_size < 1:
            raise ConfigError("micro_batch_size", self.micro_batch_size, "must be >= 1")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", self.dtype, f"must be one of {', '.join(DTYPES)}")
        if not math.isfinite(self.coeff):
            raise ConfigError("coeff", self.coeff, "must be a finite number")
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s", self.timeout_s, "must be > 0")
        if self.parallel.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel", True, "the score head reads "
                              "complete hidden states on each TP rank: turn it off")
        if self.parallel.vpp is not None:
            raise ConfigError("parallel.vpp", self.parallel.vpp, "not supported for the "
                              "forward-only reward model: use null")
        from mcore_rl.models.presets import PRESETS

        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError("preset", self.preset,
                              f"unknown preset; known: {', '.join(sorted(PRESETS))}")

    def planning_model(self) -> str:
        """What preflight sizes the reward model from: hf_dir when its config.json is here,
        else the preset."""
        if self.hf_dir and (Path(self.hf_dir) / "config.json").is_file():
            return self.hf_dir
        if self.preset is not None:
            return self.preset
        raise ConfigError("reward_model.hf_dir", self.hf_dir, "has no config.json on this "
                          "machine: set reward_model.preset to size the run without it")


# --- the checkpoint ---------------------------------------------------------------------------


def _weights_file(hf_dir: Path) -> Path:
    index = hf_dir / "model.safetensors.index.json"
    return index if index.is_file() else hf_dir / "model.safetensors"


def check_reward_model_dir(hf_dir: str | Path) -> ModelSpec:
    """The spec of a usable reward checkpoint: a sequence classifier with num_labels=1 whose
    safetensors hold `score.weight` [1, hidden]. Errors name the file and field or tensor."""
    from mcore_rl.models.hf_weights import SafetensorsWeights

    hf_dir = Path(hf_dir)
    spec = ModelSpec.from_hf_dir(hf_dir)
    config_file = hf_dir / "config.json"
    if spec.num_labels is None:
        raise RewardModelError(f"{config_file}: architectures=[{spec.architecture!r}] is a "
                               "causal LM; a reward model must be a *ForSequenceClassification "
                               "checkpoint (score head [1, hidden])")
    if spec.num_labels != 1:
        raise RewardModelError(f"{config_file}: num_labels={spec.num_labels} (id2label has "
                               f"{spec.num_labels} entries); a reward model needs num_labels=1 "
                               "(one scalar score per sequence)")
    weights = SafetensorsWeights(hf_dir)
    if SCORE_TENSOR not in weights:
        raise RewardModelError(f"{_weights_file(hf_dir)}: no tensor {SCORE_TENSOR!r} (the "
                               f"reward head [1, {spec.hidden}] of a sequence classifier)")
    shape = weights.shape(SCORE_TENSOR)
    if shape != (1, spec.hidden):
        raise RewardModelError(f"{_weights_file(hf_dir)}: tensor {SCORE_TENSOR!r} has shape "
                               f"{shape}, expected (1, {spec.hidden})")
    return spec


# --- the Megatron side --------------------------------------------------------------------------


@dataclass(frozen=True)
class ScoreBatch:
    """One micro batch: tokens [b, s] right-padded, lengths [b] (real tokens per row)."""

    tokens: torch.Tensor
    lengths: torch.Tensor

    # what megatron_train._check_micro_batches compares shapes of
    @property
    def labels(self) -> torch.Tensor:
        return self.tokens

    @property
    def loss_mask(self) -> torch.Tensor:
        return (torch.arange(self.tokens.shape[1]) < self.lengths.unsqueeze(1)).float()


@dataclass
class RewardModel:
    """This rank's model chunks (the last stage's output layer is the score head)."""

    spec: ModelSpec
    chunks: list[torch.nn.Module]
    groups: object  # ParallelGroups
    micro_batch_size: int


def load_reward_model(cfg: RewardModelConfig, groups, spec: ModelSpec | None = None, *,
                      layer_spec: str = "local") -> RewardModel:
    """Build this rank's chunks for `groups`' grid with megatron's `layer_spec` (the run's) and
    stream its slices of the checkpoint (embedding on stage 0, decoder layers of its stage,
    final norm and score head on the last stage; TP-split and named as the actor's)."""
    from mcore_rl.layouts import materialize_rank, megatron_shards
    from mcore_rl.models.gpt import build_gpt_model, load_chunks
    from mcore_rl.models.hf_weights import SafetensorsWeights
    from mcore_rl.trainer.critic import attach_value_head

    spec = spec or check_reward_model_dir(cfg.hf_dir)
    parallel, dtype = groups.config, DTYPES[cfg.dtype]
    chunks = build_gpt_model(spec, parallel, groups, params_dtype=dtype, layer_spec=layer_spec)
    # HF's score head has no bias; strict loading then checks every tensor arrived
    attach_value_head(chunks, spec.hidden, groups.is_last_stage, bias=False)
    weights = SafetensorsWeights(cfg.hf_dir)
    shards = megatron_shards(spec, parallel, layer_spec=layer_spec)
    load_chunks(chunks, materialize_rank(shards, groups.rank, weights.__getitem__, dtype),
                parallel.vpp)
    for chunk in chunks:
        chunk.eval().requires_grad_(False)
    return RewardModel(spec, chunks, groups, cfg.micro_batch_size)


def check_score_inputs(tokens: torch.Tensor, lengths: torch.Tensor, vocab: int) -> None:
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise RewardModelError(f"tokens: expected a [n, s] torch.long tensor, got "
                               f"{tuple(tokens.shape)} {tokens.dtype}")
    if lengths.shape != (tokens.shape[0],) or lengths.dtype != torch.long:
        raise RewardModelError(f"lengths: expected a [{tokens.shape[0]}] torch.long tensor, "
                               f"got {tuple(lengths.shape)} {lengths.dtype}")
    bad = ((lengths < 1) | (lengths > tokens.shape[1])).nonzero().flatten()
    if len(bad):
        raise RewardModelError(f"lengths[{int(bad[0])}]={int(lengths[bad[0]])}: must be in "
                               f"[1, {tokens.shape[1]}] (the padded length)")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise RewardModelError(f"tokens: ids must be in [0, {vocab}), got "
                               f"[{int(tokens.min())}, {int(tokens.max())}]")


def score_batch(model: RewardModel, tokens: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor | None:
    """Scores [n] (fp32) of right-padded rows: the head's output at token lengths[i] - 1.

    Collective over the reward world (every rank gets the same tokens). Rows are padded with
    dummy rows to dp * k * micro_batch_size; DP rank d scores its contiguous block; the last
    stage all-gathers the blocks over DP. Returns the [n] scores on the rank at (tp 0, last
    stage, dp 0), None elsewhere.
    """
    from mcore_rl.parallel.groups import Axis
    from mcore_rl.trainer.megatron_train import _run_schedule
    from mcore_rl.trainer.packing import model_inputs

    groups, mbs = model.groups, model.micro_batch_size
    check_score_inputs(tokens, lengths, model.spec.vocab)
    n, dp = tokens.shape[0], groups.config.dp
    per_dp = max(1, -(-n // (dp * mbs))) * mbs
    # dummy rows: one pad token (id 0), scored and dropped
    tokens = torch.cat([tokens, tokens.new_zeros(per_dp * dp - n, tokens.shape[1])])
    lengths = torch.cat([lengths, lengths.new_ones(per_dp * dp - n)])
    start = groups.rank_in(Axis.DP) * per_dp
    batches = [ScoreBatch(tokens[i:i + mbs], lengths[i:i + mbs])
               for i in range(start, start + per_dp, mbs)]

    def collect(lengths, values, non_loss_data=False):
        # last stage only: values [b, s, 1] (batch first); take each row's last real token
        return values[torch.arange(len(lengths)), lengths - 1, 0].float()

    def step(data_iterator, chunk):
        batch = next(data_iterator)
        # unpacked rows: causal attention, so a right-padded row's real tokens never see its pads
        out = chunk(**model_inputs(batch, chunk.config))
        return out, functools.partial(collect, batch.lengths)

    with torch.no_grad():
        out = _run_schedule(model.chunks, groups, batches, forward_step=step,
                            forward_only=True, collect_non_loss_data=True)
    if not groups.is_last_stage:
        return None
    mine = torch.cat(out)
    if dp > 1:
        parts = [torch.empty_like(mine) for _ in range(dp)]
        dist.all_gather(parts, mine, group=groups.group(Axis.DP))
        mine = torch.cat(parts)
    if groups.rank_in(Axis.TP) != 0 or groups.rank_in(Axis.DP) != 0:
        return None
    return mine[:n]


def pad_sequences(prompts: list[list[int]], responses: list[list[int]],
                  pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt + response per row, right-padded with pad_id: (tokens [n, s], lengths [n])."""
    if len(prompts) != len(responses):
        raise RewardModelError(f"prompts: {len(prompts)} rows but responses: "
                               f"{len(responses)} rows")
    rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
    for i, row in enumerate(rows):
        if not row:
            raise RewardModelError(f"prompts[{i}] + responses[{i}]: empty sequence")
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    tokens = torch.full((len(rows), int(lengths.max()) if rows else 0), pad_id,
                        dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return tokens, lengths


# --- the Ray worker and the driver-side group ------------------------------------------------


class RewardWorker:
    """One Megatron rank of the reward model. Methods return plain, picklable values."""

    def __init__(self, rank: int, world_size: int, store_address: tuple[str, int],
                 cfg: RewardModelConfig, stack_dir: str | None = None,
                 device: int | None = None, layer_spec: str = "local"):
        """device: this rank's device on its node (on GPU, the current CUDA device).
        layer_spec: megatron's layer spec, as the run resolved it (`ResolvedRun.layer_spec`)."""
        from mcore_rl.launch.watchdog import arm_stack_dump
        from mcore_rl.parallel.groups import join_worker_world

        if stack_dir:  # the run directory: stacks for the watchdog, library logs (quiet console)
            from mcore_rl.launch.logs import configure_process_logs

            configure_process_logs(Path(stack_dir).parent, f"reward{rank}")
            self._stack_file = arm_stack_dump(stack_dir, f"reward_rank{rank}")
        self.rank = rank
        groups = join_worker_world(rank, world_size, store_address, cfg.parallel,
                                   timeout_s=cfg.timeout_s, device=device)
        self.model = load_reward_model(cfg, groups, layer_spec=layer_spec)

    def score(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
        """Scores [n] on one rank (tp 0, last stage, dp 0); None on the others."""
        return score_batch(self.model, tokens, lengths)

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> bool:
        from mcore_rl.parallel.groups import leave_worker_world

        leave_worker_world()
        return True


class RewardModelGroup:
    """The reward workers, started and driven from the controller process.

    The checkpoint and grid are checked here first (a bad directory fails before any worker
    starts). The workers' gloo world meets at a TCPStore on `host` (the driver's address).
    """

    def __init__(self, cfg: RewardModelConfig, *, host: str = "127.0.0.1",
                 stack_dir: str | Path | None = None, placement=None,
                 layer_spec: str = "local"):
        """placement: the run's `launch.placement.RayPlacement`; reward rank r then shares
        the device (and node) of actor rank r mod the actor's world, as the reference model
        does. None: wherever Ray puts it. layer_spec: the run's (`ResolvedRun.layer_spec`)."""
        import ray

        from mcore_rl.resharding import host_store
        from mcore_rl.rollout.ray_engines import init_local_ray

        if not cfg.enabled:
            raise ConfigError("enabled", False, "RewardModelGroup needs an enabled reward model")
        self.cfg, self.stack_dir = cfg, stack_dir
        self.spec = check_reward_model_dir(cfg.hf_dir)
        try:
            cfg.parallel.check_model(self.spec)
        except ConfigError as err:
            raise err.under("parallel") from None
        init_local_ray(num_cpus=max(2, os.cpu_count() or 2))
        world = cfg.parallel.world_size
        self._store = host_store(host, world_size=world + 1, timeout_s=cfg.timeout_s)
        remote_cls = ray.remote(num_cpus=0)(RewardWorker)
        self.workers = []
        for rank in range(world):
            options, device = {}, None
            if placement is not None:
                slot = placement.plan.actor[rank % len(placement.plan.actor)]
                options, device = placement.options_for_node(slot.node), slot.device
            self.workers.append(remote_cls.options(**options).remote(
                rank, world, (host, self._store.port), cfg,
                str(stack_dir) if stack_dir else None, device, layer_spec))
        self.pids: list[int] = []
        self.pids = self._call("pid", phase="reward-startup")

    def _call(self, method: str, *args, phase: str, timeout_s: float | None = None) -> list:
        """`method` on every worker under a deadline; past it, the error names the late ranks
        (and the workers' stack dumps when `stack_dir` is set)."""
        import ray

        from mcore_rl.launch.watchdog import WatchdogTimeout, dump_stacks

        deadline = self.cfg.timeout_s if timeout_s is None else timeout_s
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
        import ray

        try:
            ray.wait([w.shutdown.remote() for w in self.workers],
                     num_returns=len(self.workers), timeout=10.0)
        finally:
            for worker in self.workers:
                ray.kill(worker)
            self.workers = []
