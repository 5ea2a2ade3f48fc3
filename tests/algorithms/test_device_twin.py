"""Device twins of the algorithm library (see tests/device_twin.py): every function that the
trainer runs on device tensors creates its own tensors on its inputs' device."""

from __future__ import annotations

import types

import pytest
import torch

from mcore_rl.algorithms import advantages as adv
from mcore_rl.algorithms import losses, rollout_correction, vocab_parallel
from device_twin import TWIN, assert_on_twin, twin

pytestmark = [pytest.mark.device_twin, pytest.mark.fast]

B, T = 4, 6


def _mask():
    return twin(torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1],
                              [0, 0, 0, 0, 0, 0], [1, 0, 1, 1, 0, 0]], dtype=torch.float32))


def _logp(seed: int):
    return twin(-torch.rand(B, T, generator=torch.Generator().manual_seed(seed)))


def test_policy_loss_metrics_on_device():
    """pg_clipfrac_lower without dual-clip was a CPU zero (losses.py, `torch.zeros(())`)."""
    for clip_c in (None, 3.0):
        loss, metrics = losses.policy_loss(_logp(0).requires_grad_(), _logp(1), _logp(2),
                                           _mask(), clip_c=clip_c, is_weights=_mask())
        loss.backward()
        assert_on_twin(loss, *metrics.values())


def test_value_loss_metrics_on_device():
    """vf_clipfrac without clipping was a CPU zero (losses.py, `torch.zeros(())`)."""
    for clip in (None, 0.2):
        loss, metrics = losses.value_loss(_logp(0), _logp(1), _logp(2), _mask(), clip=clip)
        assert_on_twin(loss, *metrics.values())


@pytest.mark.parametrize("estimator", losses.KL_ESTIMATORS)
def test_kl_terms_on_device(estimator):
    kl, metrics = losses.kl_loss(_logp(0), _logp(1), _mask(), coeff=0.1, estimator=estimator)
    rewards, penalty = losses.kl_penalty_rewards(_logp(2), _logp(0), _logp(1), _mask(),
                                                 coeff=0.1, estimator=estimator)
    entropy, ent_metrics = losses.entropy_bonus(_logp(3), _mask(), coeff=0.01)
    assert_on_twin(kl, *metrics.values(), rewards, *penalty.values(), entropy,
                   *ent_metrics.values())


def test_log_probs_and_entropy_reference_on_device():
    logits = twin(torch.randn(B, T, 16)).requires_grad_()
    target = twin(torch.randint(0, 16, (B, T)))
    logp, entropy = vocab_parallel.log_probs_and_entropy(logits, target)
    (logp.sum() + entropy.sum()).backward()
    assert_on_twin(logp, entropy, logits.grad)


@pytest.fixture
def tp_rank_1_of_2(monkeypatch):
    """vocab_parallel's collectives stubbed out, as TP rank 1 of 2 (placement only)."""
    fake_dist = types.SimpleNamespace(get_rank=lambda group: 1, get_world_size=lambda group: 2,
                                      all_reduce=lambda t, op=None, group=None: None,
                                      ReduceOp=torch.distributed.ReduceOp)
    monkeypatch.setattr(vocab_parallel, "dist", fake_dist)


def test_vocab_parallel_log_probs_and_entropy_on_device(tp_rank_1_of_2):
    """The TP>1 autograd function, forward and backward, on TP rank 1 of 2 (the collectives
    stubbed out: placement only)."""
    for dtype in (torch.float32, torch.bfloat16):
        logits = twin(torch.randn(B, T, 8)).to(dtype).requires_grad_()
        target = twin(torch.randint(0, 16, (B, T)))
        logp, entropy = vocab_parallel.vocab_parallel_log_probs_and_entropy(
            logits, target, tp_group=object())
        (logp.sum() + entropy.sum()).backward()
        assert_on_twin(logp, entropy, logits.grad)


@pytest.mark.parametrize("vocab", [16, 13, 5], ids=["no-padding", "padding", "all-padding"])
def test_chunked_log_probs_and_entropy_on_device(tp_rank_1_of_2, vocab):
    """The chunked path (the actor's: policy.logp_and_entropy), forward and backward in chunks
    of 2 tokens, on TP rank 1 of 2 holding ids 8-15: part or all of them padding (the
    collectives stubbed out: placement only)."""
    for dtype in (torch.float32, torch.bfloat16):
        for with_entropy in (True, False):  # the loss's entropy term, or none (coefficient 0)
            logits = twin(torch.randn(B, T, 8)).to(dtype).requires_grad_()
            target = twin(torch.randint(0, vocab, (B, T)))
            logp, entropy = vocab_parallel.chunked_log_probs_and_entropy(
                logits, target, vocab=vocab, tp_group=object(), chunk_tokens=2)
            (logp.sum() + entropy.sum() if with_entropy else logp.sum()).backward()
            assert_on_twin(logp, entropy, logits.grad)


def test_gae_and_reinforce_pp_on_device():
    scores = twin(torch.tensor([1.0, 0.0, 0.5, 2.0]))
    rewards = adv.outcome_to_token_rewards(scores, _mask())
    out = [rewards, *adv.gae_advantages(rewards, _logp(0), _mask(), gamma=0.99, lam=0.95),
           *adv.reinforce_pp_advantages(rewards, _mask(), gamma=0.99),
           adv.masked_whiten(_logp(1), _mask()), adv.last_token_index(_mask())]
    assert_on_twin(*out)


def test_group_estimators_on_device(monkeypatch):
    """GRPO and RLOO. On meta, `torch.unique` (the one host sync, `group_index`) cannot run:
    its result is given in the prompt ids' place."""
    group_ids = torch.tensor([7, 7, 3, 3])
    if TWIN.type == "meta":
        inverse, n_groups = adv.group_index(group_ids)
        monkeypatch.setattr(adv, "group_index", lambda ids: (twin(inverse), n_groups))
    scores = twin(torch.tensor([1.0, 0.0, 0.5, 0.5]))
    for norm_by_std in (True, False):
        assert_on_twin(adv.grpo_advantages(scores, twin(group_ids), _mask(),
                                           norm_by_std=norm_by_std))
    assert_on_twin(adv.rloo_advantages(scores, twin(group_ids), _mask()))


@pytest.mark.parametrize("level", rollout_correction.MIS_LEVELS)
def test_rollout_correction_weights_on_device(level):
    tis = rollout_correction.tis_weights(_logp(0), _logp(1), _mask(), clip=2.0)
    mis = rollout_correction.mis_mask(_logp(0), _logp(1), _mask(), low=0.5, high=2.0,
                                      level=level)
    assert_on_twin(tis, mis)
