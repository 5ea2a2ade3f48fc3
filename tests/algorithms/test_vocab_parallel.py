"""Vocab-parallel log-probs and entropy: hand-computed TP=1 case, and TP2 on real gloo ranks
against the gathered fp32 CPU reference (values and gradients) — with the shards on the CPU,
and as a GPU check with both ranks' shards on cuda:0 (gloo all-reduces CUDA tensors; NCCL
would refuse two ranks on one device)."""

import functools
import math

import pytest
import torch
import torch.distributed as dist
from gpu_twins import device_params, join_world, spawn_env

from mcore_rl.algorithms import log_probs_and_entropy, vocab_parallel_log_probs_and_entropy
from mcore_rl.algorithms.vocab_parallel import chunked_log_probs_and_entropy
from mcore_rl.launch.spawn import run_on_ranks

TOL = 1e-5


def test_reference_hand_computed():
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)]])  # p = [.25, .25, .5]
    logp, ent = vocab_parallel_log_probs_and_entropy(logits, torch.tensor([2]), tp_group=None)
    torch.testing.assert_close(logp, torch.tensor([math.log(0.5)]))
    # H = -(2 * .25 ln .25 + .5 ln .5) = 1.5 ln 2
    torch.testing.assert_close(ent, torch.tensor([1.5 * math.log(2.0)]))


def test_reference_is_accurate_for_large_logits():
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(4, 12, generator=gen) + 1e3  # fp32 ulp at 1e3 is 6e-5
    target = torch.arange(4)
    logp, ent = log_probs_and_entropy(logits, target)
    exact = torch.log_softmax(logits.double(), dim=-1)
    assert (logp - exact[torch.arange(4), target]).abs().max() <= TOL
    assert (ent - (-(exact.exp() * exact).sum(-1))).abs().max() <= TOL


def _chunked(shard, target, *, tp_group, vocab, chunk_tokens):
    return chunked_log_probs_and_entropy(shard, target, vocab=vocab, tp_group=tp_group,
                                         chunk_tokens=chunk_tokens)


def _case(rank, tp_group, full, target, use_entropy=True, dtype=torch.float32, device="cpu",
          fn=vocab_parallel_log_probs_and_entropy, vocab=None):
    """Errors of one TP rank's outputs and logits-shard gradient (computed on `device`, by
    `fn`) vs the gathered reference (fp32, CPU) over the first `vocab` ids (the rest: padding,
    whose gradient must be 0)."""
    vocab = vocab or full.shape[-1]
    vocab_shard = full.shape[-1] // dist.get_world_size(tp_group)
    shard = full[..., rank * vocab_shard:(rank + 1) * vocab_shard].to(dtype).to(device)
    untouched = shard.clone()
    shard.requires_grad_()
    gen = torch.Generator().manual_seed(1)
    w_logp, w_ent = torch.randn(target.shape, generator=gen), torch.randn(target.shape,
                                                                          generator=gen)
    logp, ent = fn(shard, target.to(device), tp_group=tp_group)
    on_device = str(logp.device)
    loss = (w_logp.to(device) * logp + (w_ent.to(device) * ent if use_entropy else 0)).sum()
    loss.backward()
    logp, ent = logp.detach().cpu(), ent.detach().cpu()

    ref_in = full[..., :vocab].to(dtype).float().clone().requires_grad_()
    ref_logp, ref_ent = log_probs_and_entropy(ref_in, target)
    ((w_logp * ref_logp + (w_ent * ref_ent if use_entropy else 0)).sum()).backward()
    padded = torch.zeros(full.shape)
    padded[..., :vocab] = ref_in.grad
    ref_grad = padded[..., rank * vocab_shard:(rank + 1) * vocab_shard]
    return {"logp": (logp - ref_logp).abs().max().item(),
            "ent": (ent - ref_ent).abs().max().item(),
            "grad": (shard.grad.float().cpu() - ref_grad).abs().max().item(),
            "grad_dtype": str(shard.grad.dtype),
            "input_untouched": bool(torch.equal(shard.detach(), untouched)),
            "logp_values": logp.tolist(), "device": on_device}


def _tp2_checks(rank, world_size, device="cpu"):
    join_world(rank, world_size, device)
    case = functools.partial(_case, device=device)
    tp_group = dist.new_group(list(range(world_size)))
    gen = torch.Generator().manual_seed(0)
    full = 3 * torch.randn(2, 5, 12, generator=gen)  # [B, T, V], V/tp = 6
    target = torch.randint(0, 12, (2, 5), generator=gen)
    target[0, :2] = torch.tensor([0, 11])  # first id of rank 0's slice, last of rank 1's
    results = {
        "both_outputs": case(rank, tp_group, full, target),
        "logp_only": case(rank, tp_group, full, target, use_entropy=False),
        # exp() of unshifted logits would overflow: needs the all-reduced max shift
        "large_logits": case(rank, tp_group, full + 1e3, target),
        # one rank holds every row's max; the other's exp() terms are ~e^-60
        "max_on_rank1": case(rank, tp_group, full + 60.0 * (torch.arange(12) >= 6), target),
        "bf16_input": case(rank, tp_group, full, target, dtype=torch.bfloat16),
    }
    # the actor's chunked path (policy.logp_and_entropy) on the same cases, in chunks of 3
    # tokens, and with megatron's padded vocabulary: ids >= 10 (rank 1's last two) or >= 6
    # (all of rank 1's) are padding, left out
    for name, kwargs in [("both_outputs", {}), ("logp_only", {"use_entropy": False}),
                         ("bf16_input", {"dtype": torch.bfloat16}),
                         ("bf16_logp_only", {"dtype": torch.bfloat16, "use_entropy": False})]:
        chunked = functools.partial(_chunked, vocab=12, chunk_tokens=3)
        results[f"chunked_{name}"] = case(rank, tp_group, full, target, fn=chunked, **kwargs)
    for name, shift in (("large_logits", 1e3), ("max_on_rank1", 60.0 * (torch.arange(12) >= 6))):
        chunked = functools.partial(_chunked, vocab=12, chunk_tokens=3)
        results[f"chunked_{name}"] = case(rank, tp_group, full + shift, target, fn=chunked)
    for vocab in (10, 6):
        real = target % vocab
        chunked = functools.partial(_chunked, vocab=vocab, chunk_tokens=4)
        results[f"chunked_padding_{vocab}"] = case(rank, tp_group, full, real, fn=chunked,
                                                   vocab=vocab)
        results[f"chunked_padding_{vocab}_bf16"] = case(
            rank, tp_group, full, real, fn=chunked, vocab=vocab, dtype=torch.bfloat16)
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize("device", device_params(
    "tests/algorithms/test_vocab_parallel.py::test_tp2_matches_gathered_reference[cpu]"))
def test_tp2_matches_gathered_reference(device):
    per_rank = run_on_ranks(_tp2_checks, 2, device, init_default_group=False,
                            env=spawn_env(device))
    for rank, results in enumerate(per_rank):
        for name, r in results.items():
            assert r["device"] == ("cuda:0" if device == "cuda" else "cpu"), (rank, name)
            tol = 1e-2 if "bf16" in name else TOL  # bf16 grad is rounded on the way out
            assert r["logp"] <= TOL and r["ent"] <= TOL, (rank, name, r)
            assert r["grad"] <= tol, (rank, name, r)
            assert r["input_untouched"], (rank, name)
            assert r["grad_dtype"] == ("torch.bfloat16" if "bf16" in name
                                       else "torch.float32")
    for name in per_rank[0]:  # outputs are replicated over TP
        assert per_rank[0][name]["logp_values"] == per_rank[1][name]["logp_values"]


def test_the_chunk_fits_a_cpus_caches_and_a_gpus_kernels():
    """The default chunk: 4 MiB of fp32 on the host (a chunk's passes run in cache), 64 MiB on
    a device (the chunk only caps memory there) — the meta twin takes the device's."""
    from mcore_rl.algorithms.vocab_parallel import (CHUNK_BYTES, CHUNK_BYTES_CPU,
                                                    chunk_bytes_on, chunk_tokens_for)

    assert chunk_bytes_on(torch.device("cpu")) == CHUNK_BYTES_CPU == 4 << 20
    assert chunk_bytes_on(torch.device("meta")) == chunk_bytes_on(torch.device("cuda", 0)) \
        == CHUNK_BYTES == 64 << 20
    assert chunk_tokens_for(16384, CHUNK_BYTES_CPU) == 64
