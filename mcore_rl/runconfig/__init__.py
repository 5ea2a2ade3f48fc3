"""The run's config on its own floor: `RLConfig` composes the components' configs (each owned
by its component, below this package) and the sections no component owns (`sections`), and
`resolve.resolve_run` decides what the config means on the machines it runs on (device,
layer spec, sync backend, transports: a `ResolvedRun`). Planning, rl/ and run/ read both from
here, above it. Nothing here starts a process."""

from mcore_rl.runconfig.config import (
    DEMO_MAX_POSITIONS,
    DEMO_VOCAB,
    DERIVED_MICRO_BATCH_TOKENS,
    LENGTH_DEFAULT,
    CriticOptimizerConfig,
    CriticTrainConfig,
    DeadlineConfig,
    ModelConfig,
    RLConfig,
    WarmupConfig,
    derived_micro_batch,
)
from mcore_rl.runconfig.sections import (
    INJECT_PHASES,
    WANDB_INSTALL,
    CheckpointConfig,
    EvalConfig,
    GenerationsConfig,
    LoggingConfig,
    RecoveryConfig,
    SyncConfig,
    WandbConfig,
    no_wandb,
    wandb_installed,
)

__all__ = [
    "DEMO_MAX_POSITIONS",
    "DEMO_VOCAB",
    "DERIVED_MICRO_BATCH_TOKENS",
    "INJECT_PHASES",
    "LENGTH_DEFAULT",
    "WANDB_INSTALL",
    "CheckpointConfig",
    "CriticOptimizerConfig",
    "CriticTrainConfig",
    "DeadlineConfig",
    "EvalConfig",
    "GenerationsConfig",
    "LoggingConfig",
    "ModelConfig",
    "RLConfig",
    "RecoveryConfig",
    "SyncConfig",
    "WandbConfig",
    "WarmupConfig",
    "derived_micro_batch",
    "no_wandb",
    "wandb_installed",
]
