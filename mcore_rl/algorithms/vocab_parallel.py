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
    def forward(ctx, logits: Tensor, target: Tensor,
                tp_group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
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
        sums = torch.stack([exp.sum(-1),
                            torch.where(owned, target_logit, torch.zeros_like(target_logit)),
                            (exp.unsqueeze(-2) @ shifted.unsqueeze(-1)).squeeze(-1).squeeze(-1)])
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
            grad.scatter_add_(-1, local_target.unsqueeze(-1),
                              (grad_logp * owned.to(grad.dtype)).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None


def vocab_parallel_log_probs_and_entropy(
        logits: Tensor, target: Tensor, *,
        tp_group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
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


__all__ = ["log_probs_and_entropy", "vocab_parallel_log_probs_and_entropy"]
