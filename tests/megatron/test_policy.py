"""Policy and critic updates on a fixed batch through megatron-core's schedules (TP2 on two
gloo ranks): the losses must go down, and both ranks must report identical metrics."""

import pytest
import torch

from mcore_rl.algorithms import AlgorithmConfig
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.megatron.config import OptimizerConfig, TrainConfig
from tests.support.batches import fixed_batch


def updates_on_fixed_batch(rank, world_size):
    from mcore_rl.parallel.groups import init_training_groups
    from mcore_rl.megatron.value import (ValueBatch, attach_value_head, compute_values,
                                         value_update)
    from mcore_rl.megatron.train import MicroBatch, setup_trainer
    from mcore_rl.megatron.policy import PolicyBatch, compute_logprobs, policy_update

    spec = get_preset("micro")
    groups = init_training_groups(ParallelConfig(tp=2))
    # lr small enough that no token reaches the clip bound (where the surrogate is flat)
    # within three steps
    train = TrainConfig(micro_batch_size=4, num_micro_batches=2, seq_len=12,
                        optimizer=OptimizerConfig(lr=1e-4, clip_grad=1.0))
    algo = AlgorithmConfig(clip_c=None)
    tokens, labels, mask, adv = fixed_batch(spec)
    mbs = [slice(0, 4), slice(4, 8)]

    actor = setup_trainer(spec, groups, train)
    old = compute_logprobs(actor, [MicroBatch(tokens[r], labels[r], mask[r]) for r in mbs])
    old_logp = torch.cat(old)
    pg = []
    for _ in range(3):
        batches = [PolicyBatch(tokens[r], labels[r], mask[r], old_logp[r], adv[r]) for r in mbs]
        pg.append(policy_update(actor, batches, algo))
    new_logp = torch.cat(compute_logprobs(actor, [MicroBatch(tokens[r], labels[r], mask[r])
                                                  for r in mbs]))
    # positive-advantage rows gained probability, negative ones lost it
    delta = ((new_logp - old_logp) * mask).sum(-1)
    critic = setup_trainer(spec, groups, train, load_weights=lambda chunks: attach_value_head(
        chunks, spec.hidden, groups.is_last_stage))
    returns = torch.linspace(-1, 1, 8).unsqueeze(-1).expand(8, 12) * mask
    zeros = torch.zeros(8, 12)
    vf = [value_update(critic, [ValueBatch(tokens[r], labels[r], mask[r], zeros[r], returns[r])
                                for r in mbs], AlgorithmConfig(value_clip=None))
          for _ in range(3)]
    values = torch.cat(compute_values(critic, [MicroBatch(tokens[r], labels[r], mask[r])
                                               for r in mbs]))
    # rollout correction: per-token weights scale the policy-gradient term; at the first
    # update of a batch (ratio 1) the token-mean loss is sum(-A * w) / tokens
    weights = torch.rand(8, 12, generator=torch.Generator().manual_seed(1)) * 2 * mask
    old_logp = torch.cat(compute_logprobs(actor, [MicroBatch(tokens[r], labels[r], mask[r])
                                                  for r in mbs]))
    weighted = policy_update(actor, [PolicyBatch(tokens[r], labels[r], mask[r], old_logp[r],
                                                 adv[r], is_weights=weights[r]) for r in mbs],
                             algo)
    return {"weighted_pg": weighted["pg_loss"],
            "weighted_expected": float((-adv * weights * mask).sum() / mask.sum()),
            "pg": [m["pg_loss"] for m in pg], "delta": delta.tolist(),
            "vf": [m["vf_loss"] for m in vf], "values_mean": float(values.mean())}


def test_policy_and_value_losses_decrease_on_a_fixed_batch():
    results = run_on_ranks(updates_on_fixed_batch, 2, timeout_s=300)
    assert results[0] == results[1]  # TP ranks agree on every global metric
    pg, delta, vf = results[0]["pg"], results[0]["delta"], results[0]["vf"]
    assert pg[0] > pg[1] > pg[2], pg
    assert all(d > 0 for d in delta[0::2]) and all(d < 0 for d in delta[1::2]), delta
    assert vf[0] > vf[1] > vf[2], vf
    assert abs(results[0]["weighted_pg"] - results[0]["weighted_expected"]) < 1e-5, results[0]


def update_with_old_logp_from_its_own_forward(rank, world_size):
    from mcore_rl.parallel.groups import init_training_groups
    from mcore_rl.megatron.train import MicroBatch, setup_trainer
    from mcore_rl.megatron.policy import PolicyBatch, compute_logprobs, policy_update

    spec = get_preset("micro")
    groups = init_training_groups(ParallelConfig(tp=2))
    train = TrainConfig(micro_batch_size=4, num_micro_batches=2, seq_len=12,
                        optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0))
    algo = AlgorithmConfig(clip_c=None)
    tokens, labels, mask, adv = fixed_batch(spec, seed=3)
    mbs = [slice(0, 4), slice(4, 8)]
    results = {}
    for name, first_rows_from_update in (("pass", False), ("update", True)):
        actor = setup_trainer(spec, groups, train, seed=5)  # the same weights both times
        before = torch.cat(compute_logprobs(actor, [MicroBatch(tokens[r], labels[r], mask[r])
                                                    for r in mbs]))
        old_logp = before.clone()
        if first_rows_from_update:  # what the controller sends for its first mini-batch
            old_logp[mbs[0]] = float("nan")
        # two mini-batches, one optimizer step each, as the controller's update runs them
        reports = [policy_update(actor, [PolicyBatch(tokens[r], labels[r], mask[r], old_logp[r],
                                                     adv[r])], algo) for r in mbs]
        results[name] = {"reports": reports, "logp": torch.cat(compute_logprobs(
            actor, [MicroBatch(tokens[r], labels[r], mask[r]) for r in mbs]))}
    same_logp = torch.allclose(results["pass"]["logp"], results["update"]["logp"], atol=1e-5)
    return {"same_logp": same_logp, "finite": bool(results["update"]["logp"].isfinite().all()),
            "moved": float((results["update"]["logp"] - before).abs().max()),
            **{f"{name}_{key}": [r[key] for r in results[name]["reports"]]
               for name in results for key in ("pg_loss", "ppo_kl", "grad_norm")}}


def test_the_first_mini_batch_old_logp_from_the_update_forward_trains_like_a_forward_pass():
    """NaN old log-probs (AlgorithmConfig.old_logprob_from_update): π_old is the update's own
    forward, detached — the same weights a forward-only pass would have run, so two updates
    move the policy as with the pass's log-probs (TP2)."""
    seen = run_on_ranks(update_with_old_logp_from_its_own_forward, 2, timeout_s=300)[0]
    assert seen["finite"] and seen["same_logp"], seen
    assert seen["moved"] > 1e-3  # the updates did change the policy
    for key in ("pg_loss", "ppo_kl", "grad_norm"):
        for a, b in zip(seen[f"pass_{key}"], seen[f"update_{key}"]):
            assert abs(a - b) <= 1e-5 + 1e-4 * abs(a), (key, seen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_padding_logits_are_left_out_without_a_copy(dtype):
    """N17: megatron's padded vocabulary ids are left out of the actor's log-probs and entropy
    (`logp_and_entropy`: the chunked path) without an fp32 copy of the logits with the padding
    masked: the values and gradients of the real columns alone, zero gradient on padding, the
    logits untouched."""
    import types

    from mcore_rl.algorithms import log_probs_and_entropy
    from mcore_rl.megatron.policy import logp_and_entropy

    vocab, padded = 19, 24  # megatron pads the vocabulary to a multiple of 8 · tp
    trainer = types.SimpleNamespace(spec=types.SimpleNamespace(vocab=vocab),
                                    groups=types.SimpleNamespace(config=types.SimpleNamespace(tp=1)))
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 3, padded, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (2, 3), generator=g)
    before = logits.detach().clone()
    logp, entropy = logp_and_entropy(trainer, logits, labels)
    weights = torch.randn(2, 2, 3, generator=g)
    ((weights[0] * logp + weights[1] * entropy).sum()).backward()
    assert torch.equal(logits.detach(), before)
    real = logits.detach()[..., :vocab].float().requires_grad_()
    want_logp, want_entropy = log_probs_and_entropy(real, labels)
    ((weights[0] * want_logp + weights[1] * want_entropy).sum()).backward()
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: the gradient is rounded on the way out
    torch.testing.assert_close(logits.grad[..., :vocab].float(), real.grad, rtol=0, atol=tol)
    assert not logits.grad[..., vocab:].any() and logits.grad.dtype == dtype


def update_with_and_without_the_logit_window(rank, world_size, sequence_parallel):
    from mcore_rl.megatron.packing import response_window
    from mcore_rl.megatron.policy import PolicyBatch, compute_logprobs, policy_update
    from mcore_rl.megatron.train import MicroBatch, setup_trainer
    from mcore_rl.parallel.groups import init_training_groups

    spec = get_preset("micro")
    groups = init_training_groups(ParallelConfig(tp=2, sequence_parallel=sequence_parallel))
    train = TrainConfig(micro_batch_size=4, num_micro_batches=2, seq_len=12,
                        optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0))
    algo = AlgorithmConfig(clip_c=None, entropy_coeff=0.01)
    tokens, labels, _, _ = fixed_batch(spec, seed=4)
    mask = torch.zeros(8, 12)  # responses start and end at different positions per row
    for row, (start, stop) in enumerate([(3, 8), (5, 10), (4, 12), (6, 9)] * 2):
        mask[row, start:stop] = 1.0
    adv = torch.where(torch.arange(8) % 2 == 0, 1.0, -1.0).unsqueeze(-1) * mask
    rows = [slice(0, 4), slice(4, 8)]
    windows = [response_window(mask[r]) for r in rows]
    out = {"windows": windows}
    for windowed in (False, True):
        actor = setup_trainer(spec, groups, train, seed=5)  # the same weights both times
        micro = [MicroBatch(tokens[r], labels[r], mask[r]) for r in rows]
        old = torch.cat(compute_logprobs(actor, micro))
        logit_rows = []  # the positions the output layer computed logits for, per forward
        hook = actor.unwrapped()[0].output_layer.register_forward_hook(
            lambda _m, _a, out: logit_rows.append(out[0].shape[0]))
        report = policy_update(actor, [
            PolicyBatch(tokens[r], labels[r], mask[r], old[r], adv[r],
                        logit_window=w if windowed else None) for r, w in zip(rows, windows)],
            algo)
        hook.remove()
        out[windowed] = {"report": report, "rows": logit_rows,
                         "logp": torch.cat(compute_logprobs(actor, micro))}
    # a log-prob pass with the window: the same log-probs at the response tokens, 0 elsewhere
    windowed_pass = torch.cat(compute_logprobs(actor, [
        MicroBatch(tokens[r], labels[r], mask[r], logit_window=w) for r, w in zip(rows, windows)]))
    out["pass"] = {"same": bool(torch.allclose(windowed_pass * mask, out[True]["logp"] * mask,
                                               atol=1e-6)),
                   "zero_outside": bool(windowed_pass[:, :3].eq(0).all())  # the window: 3..12
                   if not sequence_parallel else None}
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_logits_only_where_responses_are_update_the_same(sequence_parallel):
    """The update's output layer and loss at the micro batch's response positions only
    (`PolicyBatch.logit_window`): the same losses, metrics, gradient norm and updated policy
    as over every position, at TP2 (with sequence parallelism the window is not applied); a
    log-prob pass's likewise (`MicroBatch.logit_window`: 0 outside the window)."""
    seen = run_on_ranks(update_with_and_without_the_logit_window, 2, sequence_parallel,
                        timeout_s=300)[0]
    assert seen["windows"] == [(3, 12), (3, 12)]
    full, windowed = seen[False], seen[True]
    # sequence-major logits [s, b, V/tp]: 9 of the 12 positions with the window, all 12
    # without (and with sequence parallelism, where the window is not applied)
    assert full["rows"] == [12, 12]
    assert windowed["rows"] == ([12, 12] if sequence_parallel else [9, 9])
    for key in ("pg_loss", "loss", "entropy", "ppo_kl", "clip_frac", "grad_norm"):
        a, b = full["report"][key], windowed["report"][key]
        assert abs(a - b) <= 1e-6 + 1e-5 * abs(a), (key, a, b)
    assert torch.allclose(full["logp"], windowed["logp"], atol=1e-6)
    assert full["report"]["grad_norm"] > 0
    # the old / reference log-prob pass takes the window too
    assert seen["pass"]["same"]
    assert seen["pass"]["zero_outside"] in ((None,) if sequence_parallel else (True,))
