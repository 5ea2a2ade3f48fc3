"""Sequence packing by a token budget: pack/unpack units, then on gloo ranks packed passes
against the padded (unpacked) ones on the same rows — log-probs, one policy update (grad norm,
losses, updated weights) — and each loss_agg mode's pg_loss against `policy_loss` over the whole
mini-batch in one process."""

import pytest
import torch

from mcore_rl.algorithms import AlgorithmConfig, policy_loss
from mcore_rl.config import ConfigError
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.megatron.config import OptimizerConfig, TrainConfig
from mcore_rl.megatron.packing import (block_causal_mask, pack, per_sequence, plan_packing,
                                      segment_positions, unpack, valid_lengths)

# --- pure units -------------------------------------------------------------------------------


def test_ffd_respects_the_budget_and_restores_row_order():
    lengths = [5, 9, 3, 9, 7, 1, 4, 8]
    plan = plan_packing(lengths, 12, seq_len=10)
    assert sorted(r for b in plan.bins for r in b) == list(range(8))  # every row exactly once
    assert all(sum(lengths[r] for r in b) <= 12 for b in plan.bins)
    # first-fit-decreasing, ties by row index: 9(1) 9(3) 8(7) 7(4) 5(0) 4(6) 3(2) 1(5)
    assert plan.bins == ((1, 2), (3, 5), (7, 6), (4, 0))
    assert plan.row_lens == (12, 10, 12, 12) and plan.efficiency == 1.0
    assert plan.padded_efficiency == sum(lengths) / 80
    rows = torch.arange(80).reshape(8, 10) + 1
    packed = pack({"tokens": rows, "x": rows.float()}, plan)
    assert [p["tokens"].shape for p in packed] == [(1, t) for t in plan.row_lens]
    # each segment's length, as host integers: the rows' kept tokens, then the padding tail
    assert [p["segment_lengths"] for p in packed] == [(9, 3), (9, 1), (8, 4), (7, 5)]
    for p in packed:
        assert p["segment_lengths"] == tuple(torch.bincount(p["segment_ids"][0]).tolist())
    assert torch.equal(packed[0]["tokens"][0, :9], rows[1, :9])
    back = unpack([p["x"] for p in packed], plan)
    keep = torch.arange(10) < torch.tensor(lengths).unsqueeze(1)
    assert torch.equal(back, torch.where(keep, rows.float(), 0.0))


def test_shape_rules_for_the_grid():
    # sequence parallel (multiple=2), pipeline (common length), interleaved (bins multiple 2)
    # first fit gives [5+4, 3] (common T 10); spreading onto the least-loaded bin [5, 4+3]
    plan = plan_packing([5, 4, 3], 9, seq_len=6, multiple=2, common_length=True,
                        bins_multiple=2)
    assert plan.bins == ((0,), (1, 2)) and plan.row_lens == (8, 8)
    plan = plan_packing([5, 4, 3], 6, seq_len=6, bins_multiple=2)
    assert plan.bins == ((0,), (1,), (2,), ()) and plan.row_lens == (5, 4, 3, 1)
    packed = pack({"tokens": torch.ones(3, 6, dtype=torch.long)}, plan)
    assert packed[3]["tokens"].tolist() == [[0]]  # the filler is padding only
    assert [p["segment_lengths"] for p in packed] == [(5,), (4,), (3,), (1,)]
    tailed = plan_packing([5, 4, 3], 9, seq_len=6, multiple=2)  # T 9 → 10 and 3 → 4
    assert [p["segment_lengths"] for p in pack({"t": torch.ones(3, 6)}, tailed)] == [
        (5, 4, 1), (3, 1)]
    assert unpack([p["tokens"] for p in packed], plan).sum() == 12


def test_oversize_row_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"row 2: 9 valid tokens exceed "
                                         r"max_tokens_per_micro_batch=8"):
        plan_packing([3, 8, 9], 8, seq_len=10)


def test_block_causal_mask_positions_and_per_sequence_rows():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2]])
    mask = block_causal_mask(seg)
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    # brute force: query i sees key j iff j <= i and same segment
    want = torch.tensor([[not (j <= i and seg[0, i] == seg[0, j]) for j in range(6)]
                         for i in range(6)])
    assert torch.equal(mask[0, 0], want)
    assert segment_positions(seg, (3, 2, 1)).tolist() == [[0, 1, 2, 0, 1, 0]]
    x = torch.arange(1.0, 7.0).unsqueeze(0).requires_grad_()
    assert per_sequence(x, None) is x
    with pytest.raises(ValueError, match="needs its segment lengths"):
        per_sequence(x, seg)
    rows = per_sequence(x, seg, (3, 2, 1))
    assert rows.tolist() == [[1, 2, 3], [4, 5, 0], [6, 0, 0]]
    rows.sum().backward()
    assert x.grad.tolist() == [[1.0] * 6]


def test_thd_params_cumulative_lengths():
    """The GPU (TE, THD) form of a packed row: cu_seqlens over the segments and the tail."""
    from mcore_rl.megatron.packing import thd_params

    # two sequences and a 1-token padding tail (segment ids [[0, 0, 0, 1, 1, 1, 1, 2]])
    params = thd_params((3, 4, 1), device="cpu")
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 3, 7, 8] and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_kv is params.cu_seqlens_q
    assert params.max_seqlen_q == params.max_seqlen_kv == 4


def test_valid_lengths_and_config():
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 0]])
    assert valid_lengths(mask).tolist() == [3, 5, 1]
    assert TrainConfig(seq_len=16, max_tokens_per_micro_batch=16).max_tokens_per_micro_batch
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch.*>= seq_len=16"):
        TrainConfig(seq_len=16, max_tokens_per_micro_batch=15)


# --- on gloo ranks ----------------------------------------------------------------------------

S = 16  # padded row length
BUDGET = 24
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# 8 rows: prompt of 4 tokens, then the response; row length = prompt + response - 1 labels.
# DP rank 0 gets rows 0-3 (FFD: 2 micro batches), DP rank 1 rows 4-7 (3 micro batches).
LENGTHS = [16, 8, 8, 16, 16, 12, 12, 10]


def ragged_batch(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(LENGTHS)
    keep = torch.arange(S) < torch.tensor(LENGTHS).unsqueeze(1)
    tokens = torch.where(keep, torch.randint(1, spec.vocab, (n, S), generator=g), 0)
    labels = torch.where(keep, torch.randint(1, spec.vocab, (n, S), generator=g), 0)
    mask = (keep & (torch.arange(S) >= 3)).float()
    adv = torch.randn(n, 1, generator=g).expand(n, S) * mask
    return tokens, labels, mask, adv.contiguous(), torch.randn(n, S, generator=g) * 0.3


def correction_weights_of(mask):
    """Rollout-correction weights (as TIS / MIS give them: >= 0, some 0) that must travel
    with their tokens through packing."""
    g = torch.Generator().manual_seed(7)
    return (torch.rand(mask.shape, generator=g) * 2 * (torch.rand(mask.shape, generator=g) > 0.2)
            * mask)


def _batches(tensors, rows, cls, packed, parallel, mbs=2):
    from mcore_rl.megatron.packing import pack, plan_for_grid, valid_lengths

    mine = {k: v[rows] for k, v in tensors.items()}
    if not packed:
        n = mine["tokens"].shape[0]
        return [cls(**{k: v[i:i + mbs] for k, v in mine.items()}) for i in range(0, n, mbs)], None
    plan = plan_for_grid(valid_lengths(mine["response_mask" if "response_mask" in mine
                                            else "loss_mask"]),
                         BUDGET, seq_len=S, parallel=parallel)
    return [cls(**p) for p in pack(mine, plan)], plan


def _flat_weights(trainer):
    return torch.cat([p.detach().flatten().clone() for c in trainer.unwrapped()
                      for p in c.parameters()])


def packed_vs_padded(rank, world_size, parallel):
    from mcore_rl.parallel.groups import Axis, init_training_groups
    from mcore_rl.megatron.train import MicroBatch, setup_trainer
    from mcore_rl.megatron.packing import unpack
    from mcore_rl.megatron.policy import PolicyBatch, compute_logprobs, policy_update

    spec = get_preset("micro")
    groups = init_training_groups(parallel)
    train = TrainConfig(micro_batch_size=2, num_micro_batches=2, seq_len=S,
                        max_tokens_per_micro_batch=BUDGET,
                        # adam_eps = lr: Adam's step lr·g/(|g|+eps) is ~g for tiny grads
                        # instead of ±lr (which turned 1e-9 grad noise into 1e-4 weight
                        # differences), so the weight check sees the grads' agreement
                        optimizer=OptimizerConfig(lr=1e-3, adam_eps=1e-3, clip_grad=1e9))
    tokens, labels, mask, adv, noise = ragged_batch(spec)
    dp, dp_rank = parallel.dp, groups.rank_in(Axis.DP)
    per = len(LENGTHS) // dp
    mine = slice(dp_rank * per, (dp_rank + 1) * per)
    every = slice(0, len(LENGTHS))
    fwd = {"tokens": tokens, "labels": labels, "loss_mask": mask}
    out = {"last": groups.is_last_stage}

    # log-probs: padded fixed micro batches vs packed, on all rows (no DP comm in a forward)
    actor = setup_trainer(spec, groups, train)
    padded, _ = _batches(fwd, every, MicroBatch, False, parallel)
    packed, plan = _batches(fwd, every, MicroBatch, True, parallel)
    ref = compute_logprobs(actor, padded)
    got = compute_logprobs(actor, packed)
    if groups.is_last_stage:
        ref = torch.cat(ref)
        keep = unpack([torch.ones(t) for t in plan.row_lens], plan) > 0
        out["logp_diff"] = float((unpack(got, plan) - ref)[keep].abs().max())
        out["logp"] = ref.tolist()  # plain lists: tensors do not outlive the spawned rank
    out["pack_efficiency"], out["pad_efficiency"] = plan.efficiency, plan.padded_efficiency
    logp = torch.tensor(out["logp"]) if "logp" in out else torch.zeros(len(LENGTHS), S)
    # old log-probs off the current policy so ratios differ from 1 and some clip
    policy = {"tokens": tokens, "labels": labels, "response_mask": mask,
              "old_logp": (logp + noise) * mask, "advantages": adv,
              "is_weights": correction_weights_of(mask)}
    for agg in AGGS:
        algo = AlgorithmConfig(clip_c=None, loss_agg=agg, entropy_coeff=0.01)
        runs = {}
        for is_packed in (False, True):
            trainer = setup_trainer(spec, groups, train)  # same seed: same initial weights
            before = _flat_weights(trainer)
            batches, plan = _batches(policy, mine, PolicyBatch, is_packed, parallel)
            metrics = policy_update(trainer, batches, algo)
            runs[is_packed] = (metrics, _flat_weights(trainer), len(batches))
        (m0, w0, _), (m1, w1, n_packed) = runs[False], runs[True]
        out[agg] = {"padded": m0, "packed": m1, "weight_diff": float((w0 - w1).abs().max()),
                    "weight_change": float((w0 - before).abs().max()),
                    "micro_batches": n_packed}
    # padding removed at step 0 and nothing asked for torch.compile: nothing was compiled
    # (a compiled entropy kernel is what hangs such runs elsewhere)
    from torch._dynamo.utils import counters

    out["compiled_frames"] = sum(counters["frames"].values())
    return out


def reference_pg(result, agg):
    """policy_loss over the whole mini-batch in one process (weights before the update)."""
    spec = get_preset("micro")
    tokens, labels, mask, adv, noise = ragged_batch(spec)
    logp = torch.tensor(result["logp"])
    pg, _ = policy_loss(logp, (logp + noise) * mask, adv, mask, clip_eps_low=0.2,
                        clip_eps_high=0.2, clip_c=None, agg=agg,
                        is_weights=correction_weights_of(mask))
    return float(pg)


@pytest.mark.parametrize("parallel", [
    ParallelConfig(tp=2, sequence_parallel=True),  # TP2 + SP: packed rows rounded to even T
    ParallelConfig(pp=2),                          # PP2: one common T per call
    ParallelConfig(dp=2),                          # DP2: ranks run 2 vs 3 packed micro batches
    ParallelConfig(pp=2, vpp=2),                   # interleaved: 5 bins re-spread over 6
], ids=["tp2-sp", "pp2", "dp2", "pp2vpp2"])
def test_packed_passes_equal_padded(parallel):
    results = run_on_ranks(packed_vs_padded, 2, parallel, timeout_s=600)
    last = next(r for r in results if r["last"])
    assert last["logp_diff"] < 1e-5, last["logp_diff"]
    assert last["pack_efficiency"] > last["pad_efficiency"]
    for agg in AGGS:
        padded, packed = last[agg]["padded"], last[agg]["packed"]
        for key in ("pg_loss", "loss", "grad_norm", "clip_frac", "entropy", "update_tokens"):
            assert abs(padded[key] - packed[key]) < 1e-5 * max(1.0, abs(padded[key])), (
                agg, key, padded[key], packed[key])
        assert last[agg]["weight_diff"] < 1e-5 < last[agg]["weight_change"], (agg, last[agg])
        assert abs(packed["pg_loss"] - reference_pg(last, agg)) < 1e-5, agg
        assert 0 < packed["clip_frac"] < 1  # the ratios are not all 1: clipping is exercised
    assert len({r["token-mean"]["packed"]["pg_loss"] for r in results}) == 1  # ranks agree
    assert all(r["compiled_frames"] == 0 for r in results)
    if parallel.dp == 2:
        assert sorted(r["token-mean"]["micro_batches"] for r in results) == [2, 3]
    if parallel.vpp:
        assert last["token-mean"]["micro_batches"] == 6
    # the three aggregations are different numbers on this ragged batch
    assert len({round(last[a]["packed"]["pg_loss"], 6) for a in AGGS}) == 3


def test_forward_micro_rows_takes_the_forward_size_only_when_it_splits_the_rows():
    from mcore_rl.megatron.packing import forward_micro_rows

    flat, vpp = ParallelConfig(tp=2), ParallelConfig(pp=2, vpp=2)
    rows = lambda n, f, grid=flat: forward_micro_rows(  # noqa: E731
        n, micro_batch_size=4, forward_micro_batch_size=f, parallel=grid)
    assert rows(256, None) == 4  # unset: the training micro batch
    assert rows(256, 256) == 256 and rows(256, 128) == 128
    assert rows(16, 256) == 16  # capped at the rows there are
    assert rows(300, 256) == 4  # 256 does not split 300 rows
    assert rows(16, 16, vpp) == 4  # one micro batch: interleaving needs a multiple of pp
    assert rows(16, 8, vpp) == 8
    with pytest.raises(ConfigError, match="forward_micro_batch_size"):
        TrainConfig(forward_micro_batch_size=0)
