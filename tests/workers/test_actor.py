"""An actor rank's policy update on real gloo ranks (the Ray worker's class, DP2, without Ray):
a step's mini-batches in one call train exactly as one call per mini-batch did — the same
reports and the same weights, bit for bit — so the controller waits once per step."""

import os

import pytest
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
    from mcore_rl.rollout.batches import dp_slice, mini_batches
    from mcore_rl.workers.actor import ActorRankSpec, ActorWorker

    released = []  # the CUDA caching allocator's releases (no CUDA here: counted)
    torch.cuda.empty_cache = lambda: released.append(1)
    train = TrainConfig(micro_batch_size=2, seq_len=12,
                        optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0))
    worker = ActorWorker(rank, world_size, ("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"])),
                         ActorRankSpec(SPEC, ParallelConfig(dp=2), train, str(model_dir),
                                       timeout_s=120.0, release_cache=one_call))
    before = worker.weights_digest()
    batch, algo = policy_batch(), AlgorithmConfig(clip_c=None)
    dp_rank = worker.dp_rank()  # each rank gets its DP slice's rows, as the controller sends
    if one_call:
        reports = worker.update(dp_slice(batch, 2, dp_rank, 2), algo, 2)
    else:
        reports = [worker.update(dp_slice(mini, 2, dp_rank), algo)[0]
                   for mini in mini_batches(batch, 2)]
    return {"reports": reports, "before": before, "after": worker.weights_digest(),
            "released": len(released)}


def test_a_steps_mini_batches_in_one_call_train_as_one_call_each(tmp_path):
    model_dir = make_hf_model_dir(SPEC, tmp_path / "micro", seed=0)
    one = run_on_ranks(update_ranks, 2, str(model_dir), True, init_default_group=False,
                       timeout_s=300)
    each = run_on_ranks(update_ranks, 2, str(model_dir), False, init_default_group=False,
                        timeout_s=300)
    for rank in range(2):
        # N4: the run plan's release_trainer_cache (engines on the rank's GPU) gives the
        # update's cached peak back once per update call, and changes no number
        assert (one[rank]["released"], each[rank]["released"]) == (1, 0)
        assert len(one[rank]["reports"]) == 2
        assert one[rank]["after"] != one[rank]["before"]  # two optimizer steps moved it
        assert one[rank]["reports"] == each[rank]["reports"], rank
        assert one[rank]["after"] == each[rank]["after"], rank
    first, second = one[0]["reports"]
    assert first["pg_loss"] != second["pg_loss"]  # two different mini-batches
    assert first["update_tokens"] == second["update_tokens"] == 8 * 6  # 8 rows each


def fused_intent_rank(rank, world_size, model_dir):
    """An actor rank (actor, critic and reference) handed the GPU plan's intent — fused
    kernels on — on a node without TransformerEngine or apex (this CPU machine)."""
    import dataclasses

    from megatron.core import tensor_parallel

    from mcore_rl.parallel.groups import Axis
    from mcore_rl.workers.actor import ActorRankSpec, ActorWorker

    train = TrainConfig(micro_batch_size=2, seq_len=12, optimizer=OptimizerConfig(lr=1e-3))
    worker = ActorWorker(rank, world_size, ("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"])),
                         ActorRankSpec(SPEC, ParallelConfig(), train, str(model_dir),
                                       timeout_s=120.0, critic_train=train, reference=True,
                                       fused_kernels=True))
    before = worker.weights_digest()
    reports = worker.update(policy_batch(n=4), AlgorithmConfig(clip_c=None))
    configs = {"actor": worker.trainer.config, "critic": worker.critic.config,
               "reference": worker.reference.model[0].config}
    # what megatron-core does with the intent as it stands: the output layer (its own
    # ColumnParallelLinear, under every layer spec) raises without apex's module
    try:
        tensor_parallel.ColumnParallelLinear(
            SPEC.hidden, 32, config=dataclasses.replace(configs["actor"],
                                                        gradient_accumulation_fusion=True),
            init_method=lambda w: None, bias=False, tp_group=worker.groups.group(Axis.TP))
        megatron_raised = None
    except RuntimeError as err:
        megatron_raised = str(err)
    return {"kernels": worker.fused_kernels(), "reports": reports, "before": before,
            "after": worker.weights_digest(), "megatron_raised": megatron_raised,
            "switches": {role: (c.apply_rope_fusion, c.gradient_accumulation_fusion)
                         for role, c in configs.items()}}


@pytest.mark.fast  # (the fast tier: scripts/test.sh -m fast)
def test_an_actor_rank_builds_without_the_fused_kernels_its_node_lacks(tmp_path):
    """N1: the plan asks every GPU run's trainers for apex's weight-grad accumulation; a rank
    whose node lacks apex's fused_weight_gradient_mlp_cuda turns it off before it builds (it
    would raise in megatron's output layer), builds actor, critic and reference, trains, and
    reports what it turned on and why. (CPU twin of a GPU node without TE or apex: the rank
    resolves against its own process, whatever the driver's plan says.)"""
    import importlib.util

    apex_here = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    model_dir = make_hf_model_dir(SPEC, tmp_path / "micro", seed=0)
    (out,) = run_on_ranks(fused_intent_rank, 1, str(model_dir), init_default_group=False,
                          timeout_s=300)
    kernels = {k["field"]: k for k in out["kernels"]}
    grad, rope = kernels["gradient_accumulation_fusion"], kernels["apply_rope_fusion"]
    assert (grad["wanted"], grad["on"]) == (True, apex_here)
    assert (rope["wanted"], rope["on"]) == (
        True, importlib.util.find_spec("transformer_engine") is not None)
    for role, switches in out["switches"].items():  # every model of the rank, as reported
        assert switches == (rope["on"], grad["on"]), role
    assert out["after"] != out["before"]  # the update ran
    assert len(out["reports"]) == 1
    if not apex_here:  # this machine (CI) is the node without apex
        assert "apex's fused_weight_gradient_mlp_cuda is not installed" in grad["reason"]
        assert "without it every linear" in grad["reason"]
        assert "fused_weight_gradient_mlp_cuda" in out["megatron_raised"]
