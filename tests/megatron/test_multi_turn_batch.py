"""Training on multi-turn sequences, on gloo ranks (TP2, micro preset), through the real
policy update: observation tokens never reach the loss, and a multi-turn batch (loss masks with
holes) packs, unpacks and trains exactly as its padded rows do.

The observation test separates the two roles of an observation token. As a *target* (its label
position, mask 0) it must not matter: changing only those labels leaves loss, grad norm and the
updated weights bit-identical. As an *input* it conditions the later model tokens, so changing
only the observation inputs must change them — and, as a control that the comparison can fail,
the same label change with the observation mask turned on changes the loss too."""

import torch

from mcore_rl.algorithms import AlgorithmConfig
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.megatron.config import OptimizerConfig, TrainConfig
from mcore_rl.rollout.batches import build_batch

S = 24  # row length
# (prompt, [(segment length, is_model), ...]): model turn, observation, model turn (+EOS)
ROWS = [(4, [(5, 1), (4, 0), (3, 1)]), (3, [(6, 1), (5, 0), (4, 1)]), (5, [(3, 1)]),
        (4, [(4, 1), (3, 0), (2, 1), (3, 0), (2, 1)])]


def multi_turn_batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts, responses, masks = [], [], []
    for prompt_len, segments in ROWS:
        prompts.append(torch.randint(4, vocab, (prompt_len,), generator=g).tolist())
        mask = [m for n, m in segments for _ in range(n)]
        responses.append(torch.randint(4, vocab, (len(mask),), generator=g).tolist())
        masks.append(mask)
    batch = build_batch(prompts, responses, S, 3, masks)
    # observation positions among the labels (mask 0, inside the continuation)
    obs = torch.zeros(len(ROWS), S, dtype=torch.bool)
    for i, (prompt_len, _) in enumerate(ROWS):
        for k, m in enumerate(masks[i]):
            if not m:
                obs[i, prompt_len - 1 + k] = True
    return batch, obs


def _run(rank, world_size):
    from mcore_rl.parallel.groups import init_training_groups
    from mcore_rl.megatron.train import MicroBatch, setup_trainer
    from mcore_rl.megatron.packing import pack, plan_for_grid, unpack, valid_lengths
    from mcore_rl.megatron.policy import PolicyBatch, compute_logprobs, policy_update

    parallel = ParallelConfig(tp=2)
    groups = init_training_groups(parallel)
    spec = get_preset("micro")
    opt = OptimizerConfig(lr=1e-3, adam_eps=1e-3, clip_grad=1e9)
    padded_cfg = TrainConfig(micro_batch_size=2, num_micro_batches=2, seq_len=S, optimizer=opt)
    batch, obs = multi_turn_batch(spec.vocab)
    g = torch.Generator().manual_seed(1)
    # one advantage per row, on whatever tokens the loss mask of a run counts
    adv = torch.randn(len(ROWS), 1, generator=g).expand(len(ROWS), S)
    noise = torch.randn(len(ROWS), S, generator=g) * 0.3
    trainer = setup_trainer(spec, groups, padded_cfg)
    fwd = {"tokens": batch.tokens, "labels": batch.labels, "loss_mask": batch.mask}
    rows = [MicroBatch(**{k: v[i:i + 2] for k, v in fwd.items()}) for i in (0, 2)]
    logp = compute_logprobs(trainer, rows)
    logp = torch.cat(logp)
    out = {}

    def update(tokens, labels, mask, *, packed=False):
        train = padded_cfg if not packed else TrainConfig(
            micro_batch_size=2, num_micro_batches=2, seq_len=S, optimizer=opt,
            max_tokens_per_micro_batch=S + 8)
        t = setup_trainer(spec, groups, train)  # same seed: the same initial weights
        policy = {"tokens": tokens, "labels": labels, "response_mask": mask,
                  "old_logp": (logp + noise) * mask, "advantages": (adv * (mask > 0)).contiguous()}
        if packed:
            plan = plan_for_grid(valid_lengths(mask), S + 8, seq_len=S, parallel=parallel)
            micro = [PolicyBatch(**p) for p in pack(policy, plan)]
        else:
            micro = [PolicyBatch(**{k: v[i:i + 2] for k, v in policy.items()}) for i in (0, 2)]
        metrics = policy_update(t, micro, AlgorithmConfig(clip_c=None, entropy_coeff=0.01))
        weights = torch.cat([p.detach().flatten() for c in t.unwrapped() for p in c.parameters()])
        return metrics, weights

    other = torch.randint(4, spec.vocab, batch.labels.shape, generator=g)
    new_targets = torch.where(obs, other, batch.labels)
    # the observation *inputs*: token t+1 is observation iff label t is
    obs_inputs = torch.zeros_like(obs)
    obs_inputs[:, 1:] = obs[:, :-1]
    new_inputs = torch.where(obs_inputs, other, batch.tokens)
    base = update(batch.tokens, batch.labels, batch.mask)
    runs = {"targets": update(batch.tokens, new_targets, batch.mask),
            "inputs": update(new_inputs, batch.labels, batch.mask),
            "packed": update(batch.tokens, batch.labels, batch.mask, packed=True)}
    with_obs = batch.mask + obs.float()  # control: observations counted in the loss
    runs["control_base"] = update(batch.tokens, batch.labels, with_obs)
    runs["control_targets"] = update(batch.tokens, new_targets, with_obs)
    for name, (metrics, weights) in {"base": base, **runs}.items():
        out[name] = {"pg_loss": metrics["pg_loss"], "grad_norm": metrics["grad_norm"],
                     "update_tokens": metrics["update_tokens"],
                     "weight_diff": float((weights - base[1]).abs().max())}
    # pack/unpack a multi-turn batch exactly, and packed log-probs = padded ones
    plan = plan_for_grid(valid_lengths(batch.mask), S + 8, seq_len=S, parallel=parallel)
    packed = pack({**fwd, "logp": logp}, plan)
    keep = torch.arange(S) < torch.tensor(plan.lengths).unsqueeze(1)
    out["unpack_exact"] = all(
        torch.equal(unpack([p[k].float() for p in packed], plan), torch.where(keep, v, 0).float())
        for k, v in {**fwd, "logp": logp}.items())
    out["lengths"] = list(plan.lengths)
    packed_logp = compute_logprobs(trainer, [
        MicroBatch(**{k: p[k] for k in (*fwd, "segment_ids", "segment_lengths")})
        for p in packed])
    out["packed_logp_diff"] = float((unpack(packed_logp, plan) - logp)[keep].abs().max())
    return out


def test_observation_tokens_never_reach_the_loss_and_multi_turn_batches_pack():
    results = run_on_ranks(_run, 2, timeout_s=600)
    r = results[0]
    base = r["base"]
    # model tokens only: the policy update counts exactly the mask's tokens
    batch, obs = multi_turn_batch(get_preset("micro").vocab)
    assert base["update_tokens"] == float(batch.mask.sum()) > 0
    assert not (batch.mask.bool() & obs).any()
    # every row's valid length ends at its last model token (the EOS turn)
    assert r["lengths"] == [p - 1 + sum(n for n, _ in segs) for p, segs in ROWS]
    # targets of observation tokens: no effect at all
    assert r["targets"]["pg_loss"] == base["pg_loss"]
    assert r["targets"]["grad_norm"] == base["grad_norm"]
    assert r["targets"]["weight_diff"] == 0.0
    # observation tokens as inputs condition later model tokens: an effect
    assert abs(r["inputs"]["pg_loss"] - base["pg_loss"]) > 1e-4
    assert r["inputs"]["weight_diff"] > 1e-6
    # control: with observations counted in the loss the same target change shows
    assert r["control_base"]["update_tokens"] > base["update_tokens"]
    assert abs(r["control_targets"]["pg_loss"] - r["control_base"]["pg_loss"]) > 1e-4
    # packing a multi-turn batch: exact round trip, same log-probs and the same update
    assert r["unpack_exact"]
    assert r["packed_logp_diff"] < 1e-5, r["packed_logp_diff"]
    assert abs(r["packed"]["pg_loss"] - base["pg_loss"]) < 1e-5
    assert abs(r["packed"]["grad_norm"] - base["grad_norm"]) < 1e-5 * max(1, base["grad_norm"])
    assert r["packed"]["weight_diff"] < 1e-5
    assert results[1]["base"]["pg_loss"] == base["pg_loss"]  # ranks agree
