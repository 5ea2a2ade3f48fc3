"""Per-token log-prob of the target and entropy, from logits sharded over the vocabulary (TP).

Sharding: with tp ranks and full vocabulary V (divisible by tp, as megatron's output layer pads
it), TP rank r holds logits[..., r*V/tp : (r+1)*V/tp] — shape [..., V/tp] — and the full
`target` ids [...] (replicated). Outputs `log_probs`, `entropy` [...] are replicated on every
TP rank. The full vocabulary is never gathered: per token, two all-reduces over `tp_group`
(a MAX of the row max, then one SUM of three stacked numbers: sum exp, the target's logit, and
sum exp * logit).

Why not megatron-core's `tensor_parallel.vocab_parallel_cross_entropy` (0.16.1): it reads
megatron's *global* TP group and rank (an RL job holds a training and an inference grid, so we
take the group explicitly); it subtracts the max from fp32 logits *in place* (`.float()` is a
no-op on fp32, so the caller's logits are modified); and it gives no entropy. The maths below is
the same as its forward/backward, plus the entropy term.

Gradients: the backward needs no communication. The loss computed from the outputs is
replicated over TP, so every rank receives the same output gradients and returns the gradient of
its own vocab slice:
    d logp / d z_j = 1[j = target] - p_j
    d H    / d z_j = p_j * (E_p[z] - z_j)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def log_probs_and_entropy(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Reference on full (gathered) logits: logits [..., V], target [...] int.

    Returns (log p(target), entropy), both [...] float32, differentiable by plain autograd.
    Used at TP=1 and as the ground truth for the vocab-parallel version.
    """
    logits = logits.float()
    # Shift by the (constant) row max so E_p[logit] and log Z are small numbers: with logits
    # ~1e3, log Z - E_p[logit] would otherwise cancel away ~1e-4 of fp32 precision.
    shifted = logits - logits.detach().max(dim=-1, keepdim=True).values
    log_z = torch.logsumexp(shifted, dim=-1)
    target_logit = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = log_z - (torch.softmax(shifted, dim=-1) * shifted).sum(-1)
    return target_logit - log_z, entropy


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """forward(logits_shard [..., V/tp], target [...], tp_group) -> (logp [...], entropy [...])."""

    @staticmethod
    def forward(
        ctx, logits: Tensor, target: Tensor, tp_group: dist.ProcessGroup
    ) -> tuple[Tensor, Tensor]:
        shard = logits.shape[-1]
        start = dist.get_rank(tp_group) * shard
        z_max = logits.max(dim=-1).values.float()
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp_group)
        # Two shard-sized fp32 buffers at most (shifted, exp): the fp32 copy of bf16 logits is
        # shifted in place, fp32 logits (the caller's) get one new buffer, and the
        # sum of exp·shifted is a dot product (no third buffer for the product).
        if logits.dtype == torch.float32:
            shifted = logits - z_max.unsqueeze(-1)
        else:
            shifted = logits.float().sub_(z_max.unsqueeze(-1))
        exp = torch.exp(shifted)

        local_target = target - start
        owned = (local_target >= 0) & (local_target < shard)
        local_target = torch.where(owned, local_target, torch.zeros_like(local_target))
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        sums = torch.stack(
            [
                exp.sum(-1),
                torch.where(owned, target_logit, torch.zeros_like(target_logit)),
                (exp.unsqueeze(-2) @ shifted.unsqueeze(-1)).squeeze(-1).squeeze(-1),
            ]
        )
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
        sum_exp, target_logit, sum_exp_logit = sums.unbind(0)

        log_z = torch.log(sum_exp)  # of the shifted logits
        mean_logit = sum_exp_logit / sum_exp  # E_p[shifted logit]
        del exp
        ctx.save_for_backward(shifted, log_z, mean_logit, local_target, owned)
        ctx.input_dtype = logits.dtype
        ctx.set_materialize_grads(False)
        return target_logit - log_z, log_z - mean_logit

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        shifted, log_z, mean_logit, local_target, owned = ctx.saved_tensors
        probs = torch.exp(shifted - log_z.unsqueeze(-1))
        grad = torch.zeros_like(probs)
        if grad_entropy is not None:
            grad += probs * (mean_logit.unsqueeze(-1) - shifted) * grad_entropy.unsqueeze(-1)
        if grad_logp is not None:
            grad -= probs * grad_logp.unsqueeze(-1)
            grad.scatter_add_(
                -1, local_target.unsqueeze(-1), (grad_logp * owned.to(grad.dtype)).unsqueeze(-1)
            )
        return grad.to(ctx.input_dtype), None, None


# fp32 bytes of one chunk of [tokens, vocab shard] the chunked path works on at a time: on a
# GPU large enough that each pass's kernels stay busy (the chunk is there to cap memory); on
# a CPU small enough that a chunk's passes (max, shift, exp, sums) run in its caches
CHUNK_BYTES = 64 << 20
CHUNK_BYTES_CPU = 4 << 20


def chunk_tokens_for(vocab_shard: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one fp32 [tokens, vocab_shard] buffer is `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * max(vocab_shard, 1)))


def chunk_bytes_on(device: torch.device) -> int:
    """The chunk's fp32 bytes for logits on `device` (`CHUNK_BYTES`, `CHUNK_BYTES_CPU`)."""
    return CHUNK_BYTES_CPU if device.type == "cpu" else CHUNK_BYTES


class _ChunkedLogProbEntropy(torch.autograd.Function):
    """forward(logits [n, V/tp] any float dtype, target [n], real columns, first id, tp_group,
    chunk) -> (logp [n], entropy [n]) fp32. Only the caller's logits are kept for the
    backward; each pass works on `chunk` rows at a time in fp32, the padding columns (ids >=
    the vocabulary) never read."""

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        target: Tensor,
        real: int,
        start: int,
        tp_group: dist.ProcessGroup | None,
        chunk: int,
    ) -> tuple[Tensor, Tensor]:
        n, device = logits.shape[0], logits.device
        z_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
        for i in range(0, n, chunk):
            if real:
                z_max[i : i + chunk] = logits[i : i + chunk, :real].amax(-1).float()
        if tp_group is not None:
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp_group)
        local = target - start
        owned = (local >= 0) & (local < real)
        local = torch.where(owned, local, torch.zeros_like(local))
        sums = torch.zeros(3, n, dtype=torch.float32, device=device)
        for i in range(0, n, chunk):
            if not real:
                break
            # one new fp32 buffer whatever the logits' dtype (type promotion): never in place
            shifted = logits[i : i + chunk, :real] - z_max[i : i + chunk, None]
            exp = torch.exp(shifted)
            sums[0, i : i + chunk] = exp.sum(-1)
            sums[1, i : i + chunk] = shifted.gather(-1, local[i : i + chunk, None]).squeeze(-1)
            # Σ exp·shifted as a dot product: no third buffer of the chunk's size
            sums[2, i : i + chunk] = (exp.unsqueeze(-2) @ shifted.unsqueeze(-1)).view(-1)
            del shifted, exp
        sums[1] = torch.where(owned, sums[1], torch.zeros_like(sums[1]))
        if tp_group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
        log_z = torch.log(sums[0])  # of the shifted logits
        mean_logit = sums[2] / sums[0]  # E_p[shifted logit]
        ctx.save_for_backward(logits, z_max, log_z, mean_logit, local, owned)
        ctx.real, ctx.chunk = real, chunk
        ctx.set_materialize_grads(False)
        return sums[1] - log_z, log_z - mean_logit

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        logits, z_max, log_z, mean_logit, local, owned = ctx.saved_tensors
        real, chunk = ctx.real, ctx.chunk
        if not real:
            return torch.zeros_like(logits), None, None, None, None, None
        grad = torch.empty_like(logits)  # every real column is written below
        grad[:, real:].zero_()  # the padding columns' gradient is 0
        n = logits.shape[0]
        zeros = torch.zeros_like(z_max)
        g_logp = zeros if grad_logp is None else grad_logp
        g_ent = zeros if grad_entropy is None else grad_entropy
        # d/dz of g_logp·logp + g_ent·H = p·(g_ent·(E_p[s] - s) - g_logp) + g_logp·1[target],
        # s the shifted logit: p·(slope·s + offset), slope = -g_ent, offset = g_ent·E_p[s] - g_logp
        slope, offset = -g_ent, g_ent * mean_logit - g_logp
        for i in range(0, n, chunk):
            rows = slice(i, i + chunk)
            # the max first, then log Z: with logits ~1e3 their sum would lose fp32 precision
            shifted = logits[rows, :real] - z_max[rows, None]  # fp32 (type promotion)
            probs = torch.sub(shifted, log_z[rows, None]).exp_()
            # no entropy gradient (the loss has no entropy term): the coefficient is one
            # number per row, not a pass over the chunk
            coeff = (
                offset[rows, None]
                if grad_entropy is None
                else shifted.mul_(slope[rows, None]).add_(offset[rows, None])
            )
            out = grad[rows, :real]
            # fp32 logits: straight into the gradient; others: in fp32, then rounded once
            part = (
                torch.mul(probs, coeff, out=out) if out.dtype == probs.dtype else probs.mul_(coeff)
            )
            part.scatter_add_(
                -1, local[rows, None], (g_logp[rows] * owned[rows].to(g_logp.dtype))[:, None]
            )
            if part is not out:
                out.copy_(part)
            del shifted, probs, coeff, part
        return grad, None, None, None, None, None


def chunked_log_probs_and_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    vocab: int,
    tp_group: dist.ProcessGroup | None,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Log p(target) and entropy of the full softmax from this TP rank's vocabulary slice,
    never more than one chunk of [tokens, V/tp] in fp32 — forward or backward — where the
    unchunked path holds several of the whole [tokens, V/tp] (the fp32 copy, exp, and
    autograd's saved tensors and gradients).

    logits: [..., V/tp] this rank's slice of megatron's padded vocabulary (group rank r: ids
    [r·V/tp, (r+1)·V/tp)), any float dtype; ids >= `vocab` are padding and left out (as
    if their logits were -inf). target: [...] int64 ids in [0, vocab), the same on every TP
    rank. Returns (log_probs, entropy), [...] fp32, equal on every rank of `tp_group` (None or
    of size 1: not sharded); differentiable w.r.t. `logits` (gradient in their dtype, zero
    on padding). The logits are not modified. chunk_tokens: rows per chunk (default: one
    fp32 buffer of `chunk_bytes_on` the logits' device); the results do not depend on it.
    """
    shard = logits.shape[-1]
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    start = 0 if tp_group is None else dist.get_rank(tp_group) * shard
    real = max(0, min(shard, vocab - start))
    chunk = chunk_tokens or chunk_tokens_for(shard, chunk_bytes_on(logits.device))
    lead = target.shape
    logp, entropy = _ChunkedLogProbEntropy.apply(
        logits.reshape(-1, shard), target.reshape(-1), real, start, tp_group, chunk
    )
    return logp.view(lead), entropy.view(lead)


def vocab_parallel_log_probs_and_entropy(
    logits: Tensor, target: Tensor, *, tp_group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """Log p(target) and entropy of the full softmax from a TP rank's vocab slice.

    logits: [..., V/tp] this rank's contiguous vocab slice (group rank r: ids
    [r*V/tp, (r+1)*V/tp)), any float dtype (computed in fp32), finite (no -inf masking).
    target: [...] int64 ids in [0, V), the same on every TP rank (positions later masked out
    may hold any id in range). Returns (log_probs, entropy), [...] float32, equal on every TP
    rank; differentiable w.r.t. `logits` (gradient in the logits' dtype). `tp_group` None or
    of size 1 means the logits are not sharded (plain `log_probs_and_entropy`). Every rank of
    `tp_group` must call this with the same leading shape.
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return log_probs_and_entropy(logits, target)
    return _VocabParallelLogProbEntropy.apply(logits, target, tp_group)


__all__ = [
    "CHUNK_BYTES",
    "CHUNK_BYTES_CPU",
    "chunk_bytes_on",
    "chunk_tokens_for",
    "chunked_log_probs_and_entropy",
    "log_probs_and_entropy",
    "vocab_parallel_log_probs_and_entropy",
]
