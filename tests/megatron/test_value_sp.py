"""The critic under sequence parallelism (TP2 on two gloo ranks): the value head runs on each
rank's sequence shard and gathers the values over TP, its weight and bias gradients are summed
over TP by finalize_model_grads. Same init, same batch: the values, the value loss, the grad
norm and the updated head equal TP2 without SP."""

import torch

from mcore_rl.algorithms import AlgorithmConfig
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.megatron.config import OptimizerConfig, TrainConfig

# name: grid — both on the same two ranks, one after the other
GRIDS = {
    "tp2": ParallelConfig(tp=2),                           # head sees whole sequences
    "tp2_sp": ParallelConfig(tp=2, sequence_parallel=True),  # head sees s/2 tokens, gathers
}
UPDATES = 3


def _batch(vocab: int, n: int = 8, s: int = 12):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, s + 1), generator=g)
    mask = torch.zeros(n, s)
    mask[:, 5:] = 1.0
    returns = torch.randn(n, s, generator=g) * mask
    old_values = torch.randn(n, s, generator=g) * 0.1 * mask
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask, old_values, returns


def _head(model) -> torch.nn.Module:
    return model[-1].module.output_layer  # DDP(GPTModel) on the last stage


def critic_on_grids(rank, world_size):
    """Per grid: values before and after UPDATES critic updates, each update's metrics and
    the head's weight and bias after them."""
    from mcore_rl.parallel.groups import Axis, init_training_groups
    from mcore_rl.megatron.value import (ValueBatch, attach_value_head, compute_values,
                                         value_update)
    from mcore_rl.megatron.train import MicroBatch, setup_trainer

    spec = get_preset("micro")
    train = TrainConfig(micro_batch_size=4, num_micro_batches=2, seq_len=12,
                        optimizer=OptimizerConfig(lr=1e-4, clip_grad=1.0))
    tokens, labels, mask, old_values, returns = _batch(spec.vocab)
    rows = [slice(0, 4), slice(4, 8)]
    out = {}
    for name, parallel in GRIDS.items():
        groups = init_training_groups(parallel)

        def load(chunks):
            attach_value_head(chunks, spec.hidden, groups.is_last_stage,
                              tp_group=groups.group(Axis.TP))
            # a nonzero head, the same on every rank: the values' gradient reaches the body
            # from the first update (a zero head passes it none)
            head = chunks[-1].output_layer
            with torch.no_grad():
                g = torch.Generator().manual_seed(3)
                head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.1)
                head.bias.fill_(0.05)

        critic = setup_trainer(spec, groups, train, load_weights=load, seed=11)
        head = _head(critic.model)
        marked = [getattr(p, "sequence_parallel", False) for p in head.parameters()]

        def values():
            return torch.cat(compute_values(critic, [MicroBatch(tokens[r], labels[r], mask[r])
                                                     for r in rows])).tolist()

        before = values()
        metrics = [value_update(critic, [ValueBatch(tokens[r], labels[r], mask[r],
                                                    old_values[r], returns[r]) for r in rows],
                                AlgorithmConfig(value_clip=None))
                   for _ in range(UPDATES)]
        out[name] = {"before": before, "after": values(), "metrics": metrics,
                     "weight": head.weight.detach().flatten().tolist(),
                     "bias": head.bias.detach().tolist(), "marked": marked}
    return out


def _close(got, ref, what: str, tol: float = 1e-5) -> None:
    """Within tol, relative to the reference's largest magnitude when it exceeds 1."""
    got, ref = torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    diff = float((got - ref).abs().max())
    assert diff < tol * max(1.0, float(ref.abs().max())), \
        f"{what}: max |SP - no SP| = {diff:.2e}"


def test_sequence_parallel_critic_equals_tp2():
    results = run_on_ranks(critic_on_grids, 2, timeout_s=300)
    for rank, got in enumerate(results):
        ref, sp = got["tp2"], got["tp2_sp"]
        assert ref["marked"] == [False, False] and sp["marked"] == [True, True]
        # the test has power: values vary over tokens and the updates move them
        assert torch.tensor(ref["before"]).std() > 0.05
        assert float((torch.tensor(ref["after"]) - torch.tensor(ref["before"])).abs().max()) \
            > 1e-2
        assert torch.tensor(sp["before"]).shape == (8, 12)  # every token, on every TP rank
        _close(sp["before"], ref["before"], f"rank {rank} values before")
        _close(sp["after"], ref["after"], f"rank {rank} values after {UPDATES} updates")
        assert ref["metrics"][-1]["vf_loss"] < ref["metrics"][0]["vf_loss"]
        for key in ("vf_loss", "critic_grad_norm"):
            _close([m[key] for m in sp["metrics"]], [m[key] for m in ref["metrics"]],
                   f"rank {rank} {key}")
        _close(sp["weight"], ref["weight"], f"rank {rank} head weight")
        _close(sp["bias"], ref["bias"], f"rank {rank} head bias")
    # TP ranks agree: the same values and the same head
    assert results[0]["tp2_sp"] == results[1]["tp2_sp"]
