"""An actor rank's policy update on real gloo ranks (the Ray worker's class, DP2, without Ray):
a step's mini-batches in one call train exactly as one call per mini-batch did — the same
reports and the same weights, bit for bit — so the controller waits once per step."""

import os

import torch

from mcore_rl.algorithms import AlgorithmConfig
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.hf_factory import make_hf_model_dir
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.megatron.config import OptimizerConfig, TrainConfig

SPEC = get_preset("micro")


def policy_batch(n=16, s=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SPEC.vocab, (n, s + 1), generator=g)
    mask = torch.zeros(n, s)
    mask[:, 6:] = 1.0
    adv = torch.randn(n, 1, generator=g).expand(n, s) * mask
    # NaN π_old: the update's own forward (as under rollout_correction bypass)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "response_mask": mask, "old_logp": torch.full((n, s), float("nan")),
            "advantages": adv.contiguous()}


def update_ranks(rank, world_size, model_dir, one_call):
    from mcore_rl.workers.actor import ActorWorker
    from mcore_rl.rollout.batches import mini_batches

    train = TrainConfig(micro_batch_size=2, seq_len=12,
                        optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0))
    worker = ActorWorker(rank, world_size, ("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"])),
                         SPEC, ParallelConfig(dp=2), train, str(model_dir), timeout_s=120.0)
    before = worker.weights_digest()
    batch, algo = policy_batch(), AlgorithmConfig(clip_c=None)
    if one_call:
        reports = worker.update(batch, algo, 2)
    else:
        reports = [worker.update(mini, algo)[0] for mini in mini_batches(batch, 2)]
    return {"reports": reports, "before": before, "after": worker.weights_digest()}


def test_a_steps_mini_batches_in_one_call_train_as_one_call_each(tmp_path):
    model_dir = make_hf_model_dir(SPEC, tmp_path / "micro", seed=0)
    one = run_on_ranks(update_ranks, 2, str(model_dir), True, init_default_group=False,
                       timeout_s=300)
    each = run_on_ranks(update_ranks, 2, str(model_dir), False, init_default_group=False,
                        timeout_s=300)
    for rank in range(2):
        assert len(one[rank]["reports"]) == 2
        assert one[rank]["after"] != one[rank]["before"]  # two optimizer steps moved it
        assert one[rank]["reports"] == each[rank]["reports"], rank
        assert one[rank]["after"] == each[rank]["after"], rank
    first, second = one[0]["reports"]
    assert first["pg_loss"] != second["pg_loss"]  # two different mini-batches
    assert first["update_tokens"] == second["update_tokens"] == 8 * 6  # 8 rows each
