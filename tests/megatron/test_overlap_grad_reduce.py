"""DP grad reduction overlapped with the backward (`overlap_grad_reduce`, on by the run plan on
GPU where dp > 1): on two gloo DP ranks over a PP2 grid (four ranks, so the pipeline schedule
starts each chunk's reduction through `grad_sync_func`), two policy updates with the overlap
must give the same grad norms and weights as without it, and the backward must really have handed
its grads to the reduction as they became ready (megatron's `register_grad_ready`). A NaN
gradient on one rank stops the next step on every rank before any weight moves."""

from dataclasses import replace

import torch

from mcore_rl.algorithms import AlgorithmConfig
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.megatron.config import OptimizerConfig, TrainConfig
from tests.support.batches import fixed_batch


def _flat(trainer) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for c in trainer.unwrapped()
                      for p in c.parameters()])


def updates_with_and_without_overlap(rank, world_size):
    from mcore_rl.parallel.groups import Axis, init_training_groups
    from mcore_rl.megatron.policy import PolicyBatch, policy_update
    from mcore_rl.megatron.train import setup_trainer

    spec = get_preset("micro")
    groups = init_training_groups(ParallelConfig(pp=2, dp=2))
    train = TrainConfig(micro_batch_size=2, num_micro_batches=2, seq_len=12,
                        optimizer=OptimizerConfig(lr=1e-3, adam_eps=1e-3, clip_grad=1e9))
    tokens, labels, mask, adv = fixed_batch(spec)
    mine = slice(4 * groups.rank_in(Axis.DP), 4 * groups.rank_in(Axis.DP) + 4)
    mbs = [slice(mine.start, mine.start + 2), slice(mine.start + 2, mine.stop)]
    batches = [PolicyBatch(tokens[r], labels[r], mask[r], torch.zeros(2, 12), adv[r])
               for r in mbs]
    out = {}
    for overlap in (False, True):
        trainer = setup_trainer(spec, groups, train, overlap_grad_reduce=overlap)
        assert trainer.model[0].ddp_config.overlap_grad_reduce is overlap
        ready = []  # megatron's backward hook: a param's grad is ready, start when all are
        for bucket_group in trainer.model[0].bucket_groups:
            hook = bucket_group.register_grad_ready
            bucket_group.register_grad_ready = lambda *a, _h=hook, **k: (ready.append(1),
                                                                         _h(*a, **k))[1]
        metrics = [policy_update(trainer, batches, AlgorithmConfig(clip_c=None))
                   for _ in range(2)]
        out[overlap] = {"grad_norm": [m["grad_norm"] for m in metrics],
                        "weights": _flat(trainer), "ready": len(ready)}
    # a NaN gradient on one DP rank (its advantages): every rank refuses the step before any
    # weight moves (megatron's per-bucket check is off: a host sync inside the overlap)
    assert not trainer.model[0].ddp_config.check_for_nan_in_grad
    poisoned = [replace(b, advantages=b.advantages * (float("nan") if groups.rank_in(Axis.DP)
                                                      else 1.0)) for b in batches]
    try:
        policy_update(trainer, poisoned, AlgorithmConfig(clip_c=None))
        refused = ""
    except FloatingPointError as err:
        refused = str(err)
    return {"grad_norm": (out[False]["grad_norm"], out[True]["grad_norm"]),
            "weight_diff": float((out[False]["weights"] - out[True]["weights"]).abs().max()),
            "ready": (out[False]["ready"], out[True]["ready"]), "refused": refused,
            "moved_by_nan": bool((_flat(trainer) != out[True]["weights"]).any())}


def test_overlapped_grad_reduce_trains_exactly_like_the_reduce_after_the_backward():
    results = run_on_ranks(updates_with_and_without_overlap, 4, timeout_s=300)
    for r in results:
        plain, overlapped = r["grad_norm"]
        assert plain == overlapped and plain[0] > 0
        assert r["weight_diff"] == 0.0
        # only with the overlap does the backward hand grads to the reduction as they come
        assert r["ready"][0] == 0 and r["ready"][1] > 0, r["ready"]
        assert "the gradient norm is nan" in r["refused"] and not r["moved_by_nan"], r
