"""Small fixed RL batches shared by the megatron update tests."""

import torch


def fixed_batch(spec, n=8, s=12, seed=0):
    """n rows of s tokens: (tokens, labels, loss mask over the last half, advantages of
    alternating sign on the masked tokens)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab, (n, s + 1), generator=g)
    mask = torch.zeros(n, s)
    mask[:, 6:] = 1.0
    adv = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).unsqueeze(-1).expand(n, s) * mask
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask, adv.contiguous()
