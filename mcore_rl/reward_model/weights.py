"""The reward checkpoint: an HF `*ForSequenceClassification` directory with num_labels=1 and a
`score.weight` [1, hidden] head, checked before any worker starts."""

from __future__ import annotations

from pathlib import Path

from mcore_rl.models.spec import ModelSpec
from mcore_rl.reward_model.config import RewardModelError

SCORE_TENSOR = "score.weight"  # HF's GenericForSequenceClassification.score (bias=False)


def _weights_file(hf_dir: Path) -> Path:
    index = hf_dir / "model.safetensors.index.json"
    return index if index.is_file() else hf_dir / "model.safetensors"


def check_reward_model_dir(hf_dir: str | Path) -> ModelSpec:
    """The spec of a usable reward checkpoint: a sequence classifier with num_labels=1 whose
    safetensors hold `score.weight` [1, hidden]. Errors name the file and field or tensor."""
    from mcore_rl.models.hf_weights import SafetensorsWeights  # lazy: torch

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
