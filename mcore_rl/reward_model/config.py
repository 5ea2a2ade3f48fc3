"""The reward model's config: which checkpoint, its grid, its dtype, its weight in the reward."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from mcore_rl.config import ConfigError, require_at_least
from mcore_rl.config.dtypes import DtypeName, normalize_dtype_fields
from mcore_rl.models.presets import PRESETS
from mcore_rl.parallel import ParallelConfig


class RewardModelError(ValueError):
    """The reward-model checkpoint or a scoring batch is not what the role can use."""


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """The optional reward model and its Megatron grid.

    enabled: score rollouts with the model (False: rule rewards only; the other fields are
        then unused).
    hf_dir: HF `*ForSequenceClassification` checkpoint directory with num_labels=1
        (config.json + safetensors holding `score.weight` [1, hidden]).
    parallel: the reward workers' grid (tp, pp, dp; world size tp * pp * dp), sequence
        parallel or not (the score head gathers its scores over TP); no vpp.
    micro_batch_size: sequences per forward micro batch on each DP rank (a batch is padded
        with dummy rows to a multiple of dp * micro_batch_size).
    dtype: "float32" or "bfloat16" weights and activations (scores are returned in fp32).
    coeff: weight of the model score in the reward: reward = rule reward + coeff * score.
    preset: a planner preset of the model's shapes (`mcore_rl.models.presets`): preflight
        sizes the reward model from it when hf_dir is not on this machine (as model.preset).
    """

    enabled: bool = False
    hf_dir: str | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 4
    dtype: DtypeName = "float32"
    coeff: float = 1.0
    preset: str | None = None

    #: keys that moved out of this section (the loader names their new place)
    MOVED: ClassVar[dict[str, str]] = {
        "timeout_s": "set deadlines.reward_model_s (standalone: RewardModelGroup's timeout_s "
                     "argument)"}

    def __post_init__(self) -> None:
        if self.enabled and not self.hf_dir:
            raise ConfigError("hf_dir", self.hf_dir, "the reward model is enabled: set the HF "
                                                     "*ForSequenceClassification directory")
        require_at_least(self, 1, "micro_batch_size")
        normalize_dtype_fields(self, "dtype", allowed=("float32", "bfloat16"))
        if not math.isfinite(self.coeff):
            raise ConfigError("coeff", self.coeff, "must be a finite number")
        if self.parallel.vpp is not None:
            raise ConfigError("parallel.vpp", self.parallel.vpp, "not supported for the "
                              "forward-only reward model: use null")

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
