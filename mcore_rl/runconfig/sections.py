"""The sections of the run's config that no lower component owns: checkpoints, evaluation,
logging and engine recovery. They sit with `RLConfig` (config.py), below every package that
reads them (rl/, planning/, run/)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal

from mcore_rl.config import ConfigError, require_above, require_at_least
from mcore_rl.config.dtypes import DtypeName, normalize_dtype_fields


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """every: write a checkpoint every this many RL steps (0: none along the way). Whatever
        it is, a run always writes one after its last step (a finished run keeps what it
        trained: `mcore-rl export RUN_DIR OUT` turns it into an HF directory) and one when a
        signal stops it. The default, 50, is for a real 1-70B run (the defaults of RLConfig):
        a step takes minutes there, so at most ~50 steps of work are lost to a crash, while
        the save — model and Adam states, about 16 bytes a parameter, ~1 TB at 70B — runs a
        few times per thousand steps rather than every 10 (NeMo-RL's grpo_math_1B.yaml
        save_period; verl's ppo_trainer.yaml saves nothing unless trainer.save_freq is set).
        A stop is covered apart from it: SIGTERM, SIGUSR1 and Ctrl-C (SIGINT) save at the
        end of the step in progress.
    keep_last: keep this many newest complete checkpoints (0: keep all); older ones are
        removed once a newer one is complete. The default, 3 (NeMo-RL's keep_top_k), bounds
        the disk a long run fills, and still leaves earlier steps to go back to.
    stop_grace_s: after SIGTERM/SIGUSR1/SIGINT, seconds to reach the next safe point (end of
        the running step) and write the checkpoint; past it the run exits without one.
    inject_error: fault injection for tests: "save@step<k>" makes the save after step k fail
        as a full disk would, after the ranks wrote their shards. Leave null."""

    every: int = 50
    keep_last: int = 3
    stop_grace_s: float = 600.0
    inject_error: str | None = None

    def __post_init__(self) -> None:
        require_at_least(self, 0, "every", "keep_last")
        require_above(self, 0, "stop_grace_s")
        if self.inject_error is not None and not (
            self.inject_error.startswith("save@step")
            and self.inject_error.removeprefix("save@step").isdigit()
        ):
            raise ConfigError("inject_error", self.inject_error, 'expected "save@step<k>"')

    def due(self, step: int, last_step: int) -> bool:
        """Whether a checkpoint is written after `step`: every `every` steps, and always after
        the last one."""
        return step == last_step or (bool(self.every) and step % self.every == 0)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluation during RL on held-out prompts (rl/evaluation.py): `task.heldout_path` for a
    jsonl task (no file: no evaluation, and preflight says so), the held-out split of the
    built-in tasks.

    every: evaluate after every this many RL steps, and after the last (0: never).
    before_train: also evaluate the starting weights, before the first RL step (as step 0).
    max_prompts: held-out prompts per evaluation at most (the same ones every time).
    samples_per_prompt: k; with k > 1, `eval/pass@k` beside `eval/pass@1`.
    temperature: 0 = greedy (then k > 1 samples are all alike: raise it for pass@k).
    pass_threshold: a sample passes when its reward is at least this (exact-match rewards
        give 1 or 0).
    """

    every: int = 10
    before_train: bool = True
    max_prompts: int = 256
    samples_per_prompt: int = 1
    temperature: float = 0.0
    pass_threshold: float = 1.0

    def __post_init__(self) -> None:
        require_at_least(self, 0, "every", "temperature")
        require_at_least(self, 1, "max_prompts", "samples_per_prompt")

    def due(self, step: int, last_step: int) -> bool:
        """Whether an evaluation follows RL step `step` (0: before the first)."""
        if not self.every:
            return False
        if step == 0:
            return self.before_train
        return step % self.every == 0 or step == last_step


@dataclass(frozen=True, kw_only=True)
class GenerationsConfig:
    """Readable samples in RUN_DIR/generations.jsonl and TensorBoard's text tab.

    every: after every this many RL steps (0: never), `samples` of the step's samples (the
        first sample of each of its first prompts); each evaluation adds `samples` of its own.
    """

    every: int = 10
    samples: int = 4

    def __post_init__(self) -> None:
        require_at_least(self, 0, "every", "samples")

    def due(self, step: int) -> bool:
        return bool(self.every and self.samples) and step % self.every == 0


WANDB_INSTALL = "pip install 'mcore-rl[wandb]'"


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Weights & Biases logging of every step's metrics (the keys of metrics.jsonl), beside
    TensorBoard. Each phase (warm-up, RL) is its own wandb run named `name`/phase, grouped
    under `name` (TensorBoard's tb/warmup and tb/rl); its files go to RUN_DIR/wandb.
    project: the wandb project. name: the runs' group (null: the run directory's name).
    mode: "online" (needs `wandb login`), "offline" (synced later with `wandb sync`) or
    "disabled". Needs the wandb package (`pip install 'mcore-rl[wandb]'`)."""

    project: str
    name: str | None = None
    mode: Literal["online", "offline", "disabled"] = "online"

    def __post_init__(self) -> None:
        if not self.project:
            raise ConfigError("project", self.project, "must name a wandb project")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Where step metrics go besides RUN_DIR/metrics.jsonl, TensorBoard and the console.
    wandb: Weights & Biases (`WandbConfig`); null = off.
    generations: a few samples a person can read, in RUN_DIR/generations.jsonl and
        TensorBoard's text tab (`GenerationsConfig`)."""

    wandb: WandbConfig | None = None
    generations: GenerationsConfig = field(default_factory=GenerationsConfig)

    def __post_init__(self) -> None:
        if self.wandb is not None and not wandb_installed():
            raise no_wandb(self.wandb)


def wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


def no_wandb(cfg: WandbConfig) -> ConfigError:
    return ConfigError(
        "wandb", vars(cfg), f"wandb logging needs the wandb package: {WANDB_INSTALL}"
    )


INJECT_PHASES = ("gen", "sync")


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    """Restarting rollout engines that die (rollout.mode sync; see rl/recovery.py).

    max_engine_restarts: engine restarts the whole run may make (each engine restarted counts
        one); past them an engine failure writes a checkpoint and ends the run naming the
        engine. 0: never restart.
    restart_backoff_s: wait before the first restart of a failure; each further attempt at
        the same failure waits twice as long, at most restart_backoff_max_s.
    inject_kill: fault injection for tests: comma-separated "<phase>@<step>" — phase gen (as
        the step's first generate call starts) or sync (while the step's weight sync is in
        flight: engines receiving, trainer not yet sending) — SIGKILLs engine 0's processes
        then. Leave null.
    """

    max_engine_restarts: int = 3
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    inject_kill: str | None = None

    def __post_init__(self) -> None:
        require_at_least(self, 0, "max_engine_restarts", "restart_backoff_s")
        require_at_least(self, "restart_backoff_s", "restart_backoff_max_s")
        self.injected_kills()  # raises on a malformed inject_kill

    def injected_kills(self) -> set[tuple[str, int]]:
        """inject_kill as {(phase, step)}."""
        if self.inject_kill is None:
            return set()
        kills = set()
        for item in self.inject_kill.split(","):
            phase, _, step = item.strip().partition("@")
            if phase not in INJECT_PHASES or not step.isdigit() or int(step) < 1:
                raise ConfigError(
                    "inject_kill",
                    self.inject_kill,
                    'expected comma-separated "<gen|sync>@<step>", step >= 1',
                )
            kills.add((phase, int(step)))
        return kills

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt` (0, 1, ...) at restarting one failure."""
        return min(self.restart_backoff_s * 2**attempt, self.restart_backoff_max_s)


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """The weight sync, actor ranks → engines (rl/weight_sync.py over resharding/). Its
    deadline is `deadlines.sync_s`, with every other deadline of the run.

    bucket_mb: the bucket (the bytes one transfer round moves per sender); null: the run
        plan's default for the device — 16 on CPU, 512 on GPU (fewer, larger rounds of NCCL
        launches).
    dtype: the wire dtype — "auto" (bfloat16 when rollout.dtype is bfloat16, else float32),
        "float32" or "bfloat16" (half the bytes; the engines install the rounded weights into
        their own dtype); "fp32"/"bf16" are accepted.
    backend: the sync group's process-group backend, "nccl" (GPU) or "gloo" (CPU); null: the
        resolved device's own. nccl on a run that resolves to CPU is refused.
    """

    bucket_mb: float | None = None
    dtype: Literal["auto"] | DtypeName = "auto"
    backend: Literal["nccl", "gloo"] | None = None

    def __post_init__(self) -> None:
        require_above(self, 0, "bucket_mb", optional=True, note="null: the device's default")
        if self.dtype != "auto":
            normalize_dtype_fields(self, "dtype", allowed=("float32", "bfloat16"))


__all__ = [
    "CheckpointConfig",
    "EvalConfig",
    "GenerationsConfig",
    "INJECT_PHASES",
    "LoggingConfig",
    "RecoveryConfig",
    "SyncConfig",
    "WANDB_INSTALL",
    "WandbConfig",
    "no_wandb",
    "wandb_installed",
]
