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
(`RewardModelConfig.coeff`). Driver side: `RewardModelGroup(cfg, timeout_s=..., host=...)`,
`.score(prompts, responses, pad_id) -> Tensor[n]`, `.shutdown()`.
"""

from mcore_rl.reward_model.weights import SCORE_TENSOR, check_reward_model_dir
from mcore_rl.reward_model.config import RewardModelConfig, RewardModelError
from mcore_rl.reward_model.scoring import (RewardModel, ScoreBatch, check_score_inputs,
                                           load_reward_model, pad_sequences, score_batch)
from mcore_rl.reward_model.workers import RewardModelGroup, RewardWorker

__all__ = ["SCORE_TENSOR", "RewardModel", "RewardModelConfig", "RewardModelError",
           "RewardModelGroup", "RewardWorker", "ScoreBatch", "check_reward_model_dir",
           "check_score_inputs", "load_reward_model", "pad_sequences", "score_batch"]
