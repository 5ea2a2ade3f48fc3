"""Device twins of the trainer's GPU path (see tests/device_twin.py): the RL loss step, packing
(and an actor rank's packed micro batches), the critic's value head, the actor's digest and
train-lm's batches and device."""

from __future__ import annotations

import types

import pytest
import torch

from device_twin import TWIN, assert_on_twin, twin
from mcore_rl.algorithms import AlgorithmConfig
from mcore_rl.megatron import packing
from mcore_rl.megatron.value import ValueBatch, _value_loss, attach_value_head
from mcore_rl.megatron.policy import PolicyBatch, _policy_loss

pytestmark = [pytest.mark.device_twin, pytest.mark.fast]

B, S, VOCAB = 2, 5, 13  # padded to 16 over tp=2: rank 1 holds ids 8..15, three of them padding


def _fake_trainer(tp_rank: int = 0):
    """What `logp_and_entropy` reads of a MegatronTrainer (tp=1: no process group)."""
    groups = types.SimpleNamespace(rank_in=lambda axis: tp_rank,
                                   config=types.SimpleNamespace(tp=1))
    return types.SimpleNamespace(spec=types.SimpleNamespace(vocab=VOCAB), groups=groups)


def _policy_batch(kl: bool) -> PolicyBatch:
    g = torch.Generator().manual_seed(0)
    mask = twin(torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32))
    old = -torch.rand(B, S, generator=g)
    old[0, 1] = float("nan")  # π_old from the update's own forward
    return PolicyBatch(tokens=twin(torch.randint(0, VOCAB, (B, S), generator=g)),
                       labels=twin(torch.randint(0, VOCAB, (B, S), generator=g)),
                       response_mask=mask, old_logp=twin(old),
                       advantages=twin(torch.randn(B, S, generator=g)),
                       ref_logp=twin(-torch.rand(B, S, generator=g)) if kl else None,
                       is_weights=mask if kl else None)


@pytest.mark.parametrize("kl", [False, True], ids=["kl_off", "kl_loss"])
def test_policy_loss_step(kl):
    """rl_step._policy_loss: with the KL term off its report stacked a CPU zero (kl_sum)."""
    algo = AlgorithmConfig(kl_coeff=0.1 if kl else 0.0, entropy_coeff=0.01, clip_c=3.0)
    logits = twin(torch.randn(B, S, 16)).requires_grad_()
    loss, weight, report = _policy_loss(_policy_batch(kl), algo, _fake_trainer(1), logits)
    loss.backward()
    assert_on_twin(loss, weight, report["policy"], report["logp_moved"], logits.grad)


def test_policy_loss_step_on_the_logit_window():
    """The update's loss at its response positions only (`PolicyBatch.cropped`, the window
    `packing.response_window` reads from the host mask): every tensor stays on the device."""
    host_mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    lo, hi = packing.response_window(host_mask)
    batch = _policy_batch(True).cropped(lo, hi)
    logits = twin(torch.randn(B, hi - lo, 16)).requires_grad_()
    loss, weight, report = _policy_loss(batch, AlgorithmConfig(kl_coeff=0.1, clip_c=3.0),
                                        _fake_trainer(1), logits)
    loss.backward()
    assert (lo, hi) == (1, 5) and batch.labels.shape == (B, hi - lo)
    assert_on_twin(loss, weight, report["policy"], batch.response_mask, logits.grad)


def test_sequence_rows_of_a_packed_row():
    """packing.per_sequence's offsets were a CPU arange (its pure piece: `sequence_rows`;
    bincount, the host sync before it, has no meta kernel)."""
    x = twin(torch.arange(7, dtype=torch.float32).unsqueeze(0)).requires_grad_()
    rows = packing.sequence_rows(x, twin(torch.tensor([3, 2, 2])), 3)
    rows.sum().backward()
    assert_on_twin(rows, x.grad)


def test_valid_lengths_on_device():
    """packing.valid_lengths compared a CPU arange with the mask."""
    assert_on_twin(packing.valid_lengths(twin(torch.tensor([[1, 1, 0], [0, 0, 0]]))))


def test_pack_unpack_and_model_inputs_on_device():
    """packing.pack built segment_ids on the CPU next to device rows."""
    plan = packing.plan_packing([3, 2, 4], 6, seq_len=4)
    rows = {"tokens": twin(torch.randint(0, 9, (3, 4))),
            "response_mask": twin(torch.ones(3, 4))}
    packed = packing.pack(rows, plan)
    config = types.SimpleNamespace(transformer_impl="local")
    for mb in packed:
        assert_on_twin(*(v for k, v in mb.items() if k != "segment_lengths"),
                       packing.block_causal_mask(mb["segment_ids"]))
    unpacked = packing.unpack([mb["response_mask"] for mb in packed], plan)
    plain = packing.model_inputs(types.SimpleNamespace(tokens=rows["tokens"]), config)
    assert_on_twin(unpacked, plain["input_ids"], plain["position_ids"])


def test_packed_model_inputs_and_per_sequence_rows_take_the_host_lengths():
    """N15: a packed micro batch's positions, THD parameters (the TE spec's cu_seqlens and
    longest segment) and per-sequence rows come from its host segment lengths, not from a
    bincount and `int(max)` on the device (a host sync per micro batch; on meta, an error:
    bincount has no meta kernel)."""
    from mcore_rl.megatron.train import MicroBatch

    plan = packing.plan_packing([3, 2, 4], 6, seq_len=4)
    rows = {"tokens": twin(torch.randint(0, 9, (3, 4))), "labels": twin(torch.zeros(3, 4)),
            "loss_mask": twin(torch.ones(3, 4))}
    for mb in (MicroBatch(**p) for p in packing.pack(rows, plan)):
        for impl in ("local", "transformer_engine"):
            inputs = packing.model_inputs(mb, types.SimpleNamespace(transformer_impl=impl))
            assert_on_twin(inputs["input_ids"], inputs["position_ids"])
        thd = inputs["packed_seq_params"]
        assert_on_twin(thd.cu_seqlens_q)
        assert thd.max_seqlen_q == max(mb.segment_lengths)
        x = twin(torch.ones(mb.tokens.shape)).requires_grad_()
        out = packing.per_sequence(x, mb.segment_ids, mb.segment_lengths)
        out.sum().backward()
        assert_on_twin(out, x.grad)
        assert out.shape == (len(mb.segment_lengths), max(mb.segment_lengths))


def test_actor_packs_its_rows_on_the_model_device_planning_on_the_host():
    """N15: an actor rank's packed micro batches are on the model's device, and the packing
    plan comes from the rows' host copy (on the device, reading the lengths back would be a
    host sync — on meta, an error)."""
    from mcore_rl.megatron.config import TrainConfig
    from mcore_rl.megatron.train import MicroBatch
    from mcore_rl.parallel import ParallelConfig
    from mcore_rl.workers.actor import ActorWorker

    rank = types.SimpleNamespace(_model_device=lambda: TWIN, parallel=ParallelConfig(),
                                 train_cfg=TrainConfig(micro_batch_size=2, seq_len=4,
                                                       max_tokens_per_micro_batch=6))
    rows = {"tokens": torch.randint(0, 9, (3, 4)), "labels": torch.randint(0, 9, (3, 4)),
            "loss_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])}
    batches, plan = ActorWorker._micro(rank, rows, MicroBatch, mask="loss_mask")
    assert plan is not None and list(plan.lengths) == [3, 2, 4]
    assert len(batches) == 2
    for mb in batches:
        assert_on_twin(mb.tokens, mb.labels, mb.loss_mask)


class _Chunk(torch.nn.Module):
    """The last pipeline chunk as far as `attach_value_head` looks: parameters and config."""

    def __init__(self, hidden: int, device, sequence_parallel: bool = False):
        super().__init__()
        self.config = types.SimpleNamespace(sequence_parallel=sequence_parallel)
        self.norm = torch.nn.Parameter(torch.ones(hidden, device=device))


@pytest.mark.parametrize("bias", [True, False], ids=["critic", "reward_model"])
def test_value_head_on_the_chunk_device(bias):
    """critic.attach_value_head built the head on the CPU whatever the chunk's device."""
    chunk = _Chunk(8, TWIN)
    attach_value_head([chunk], 8, is_last_stage=True, bias=bias)
    head = chunk.output_layer
    values, _ = head(twin(torch.randn(S, B, 8)))
    assert_on_twin(*head.parameters(), values)


def test_sequence_parallel_value_head_needs_the_tp_group():
    """Under SP the head gathers its values over TP (tests/megatron/test_value_sp.py): it needs
    the group, and its parameters are marked for finalize_model_grads' TP all-reduce."""
    with pytest.raises(ValueError, match="tp_group"):
        attach_value_head([_Chunk(8, TWIN, sequence_parallel=True)], 8, is_last_stage=True)
    chunk, group = _Chunk(8, TWIN, sequence_parallel=True), object()
    attach_value_head([chunk], 8, is_last_stage=True, tp_group=group)
    assert chunk.output_layer.sequence_parallel_group is group
    assert all(p.sequence_parallel for p in chunk.output_layer.parameters())
    assert_on_twin(*chunk.output_layer.parameters())


def test_value_loss_step():
    mask = twin(torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32))
    batch = ValueBatch(tokens=twin(torch.zeros(B, S, dtype=torch.long)), labels=mask.long(),
                       response_mask=mask, old_values=twin(torch.randn(B, S)),
                       returns=twin(torch.randn(B, S)))
    for clip in (None, 0.2):
        values = twin(torch.randn(B, S, 1)).requires_grad_()
        loss, tokens, report = _value_loss(batch, AlgorithmConfig(value_clip=clip), values)
        loss.backward()
        assert_on_twin(loss, tokens, report["value"], values.grad)


class _DeviceTensor:
    """Stands in for a CUDA tensor on meta (whose .cpu() cannot copy): `.numpy()` raises
    unless `.cpu()` came first, as torch does for a CUDA tensor."""

    def __init__(self, on_host: bool = False):
        self.on_host = on_host

    def detach(self):
        return self

    def contiguous(self):
        return self

    def cpu(self):
        return _DeviceTensor(on_host=True)

    def view(self, dtype):
        return self

    def numpy(self):
        if not self.on_host:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use "
                            "Tensor.cpu() to copy the tensor to host memory first.")
        return torch.zeros(4, dtype=torch.uint8).numpy()


def test_actor_weights_digest_of_device_tensors():
    """ActorWorker.weights_digest called .numpy() on device tensors."""
    from mcore_rl.workers.actor import ActorWorker

    worker = ActorWorker.__new__(ActorWorker)
    tensors = ({"w": _DeviceTensor()} if TWIN.type == "meta"
               else {"w": twin(torch.ones(2, 3))})
    worker.local_tensors = lambda: tensors
    assert len(worker.weights_digest()) == 64


def test_train_lm_batches_on_the_model_device():
    """train-lm built its micro batches on the CPU whatever the model's device."""
    from mcore_rl.train_lm import LMRunConfig, _micro_batches

    for mb in _micro_batches(LMRunConfig(), 0, 0, TWIN):
        assert_on_twin(mb.tokens, mb.labels, mb.loss_mask)


def test_train_lm_rank_device(monkeypatch):
    """train-lm under torchrun on GPUs: each rank makes its LOCAL_RANK current (it made none,
    so every rank's NCCL and model went to cuda:0); over gloo it selects nothing."""
    from mcore_rl import train_lm as lm

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(lm, "default_backend", lambda: "nccl")
    assert lm.rank_device(7) == 3
    monkeypatch.setattr(lm, "default_backend", lambda: "gloo")
    assert lm.rank_device(7) is None


@pytest.fixture
def one_rank_world():
    """A one-rank gloo world: megatron's TP mappings want a real group (of size 1 here)."""
    import torch.distributed as dist

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if mine:
        dist.destroy_process_group()


def _twin_linear(out_features: int, in_features: int, group, fused_norm: bool = False):
    """What a LoRAAdapter reads of megatron's linear on one rank (tp=1), on the twin device."""
    config = types.SimpleNamespace(sequence_parallel=False, normalization="RMSNorm",
                                   layernorm_zero_centered_gamma=False, layernorm_epsilon=1e-5)
    linear = torch.nn.Module()
    linear.weight = torch.nn.Parameter(twin(torch.randn(out_features, in_features)),
                                       requires_grad=False)
    linear.tp_group = group
    linear.config = config
    if fused_norm:
        linear.layer_norm_weight = torch.nn.Parameter(twin(torch.ones(in_features)))
    return linear


@pytest.mark.parametrize("kind", ["column", "row"])
def test_lora_adapter_forward_backward_and_merge_on_device(kind, one_rank_world):
    """megatron.lora: the adapter's A (initialised on the host) and B live on the weight's
    device; its output, its grads and the merged weight stay there."""
    from mcore_rl.megatron.config import LoRAConfig
    from mcore_rl.megatron.lora import LoRAAdapter, MergedWeights

    linear = _twin_linear(6, 4, one_rank_world)
    adapter = LoRAAdapter(linear, kind, LoRAConfig(rank=2, alpha=4.0), seed=1)
    out = adapter(twin(torch.randn(B, S, 4)))
    out.sum().backward()
    assert_on_twin(adapter.lora_a, adapter.lora_b, out, adapter.lora_a.grad,
                   adapter.lora_b.grad)
    linear.lora = adapter
    merged = MergedWeights({"w.weight": linear.weight, "w.lora.lora_a": adapter.lora_a},
                           {"w.weight": linear})
    assert list(merged) == ["w.weight"]
    assert_on_twin(merged["w.weight"])


def test_lora_adapter_input_of_a_layernorm_fused_linear_on_device():
    """megatron.lora.adapter_input: the RMSNorm the te spec fuses into qkv / fc1, recomputed
    for the adapter, on the input's device."""
    from mcore_rl.megatron.lora import adapter_input

    linear = _twin_linear(6, 4, None, fused_norm=True)
    assert_on_twin(adapter_input(linear, twin(torch.randn(B, S, 4))))


def test_routing_replay_hook_on_the_router_device():
    """A router's replay hook (megatron/routing_replay.py) on the router's device: the replayed
    experts arrive from the host (int16, -1 rows where none) and the flip counts stay on the
    device — no host sync per layer and micro batch."""
    from mcore_rl.megatron.routing_replay import LayerReplay

    tokens, experts, k = 6, 4, 2
    scores = twin(torch.rand(tokens, experts))
    hook = LayerReplay(layer=0)
    hook.mode, hook.training = "replay", True
    hook.target = torch.tensor([[1, 2]] * 4 + [[-1, -1]] * 2, dtype=torch.int16)
    with torch.no_grad():  # a checkpointed forward: queued for its recomputation
        probs, chosen = hook.get_replay_topk(scores, k, default_compute_topk=_topk)
    assert_on_twin(probs, chosen, hook.flips, hook.replayed, *hook.queued)
    assert chosen.shape == (tokens, k) and hook.seen == tokens
    probs, chosen = hook.get_replay_topk(scores, k, default_compute_topk=_topk)  # recomputed
    assert_on_twin(probs, chosen)
    assert not hook.queued


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def _chunk_devices(rank, world, device):
    """The devices of every parameter and buffer of a micro GPTModel built for a rank whose
    run plan put it on `device` (megatron's local spec, bf16, as the GPU check trains)."""
    from dataclasses import replace

    from mcore_rl.models.gpt import build_gpt_model
    from mcore_rl.models.presets import get_preset
    from mcore_rl.parallel import ParallelConfig
    from mcore_rl.parallel.groups import init_training_groups

    groups = replace(init_training_groups(ParallelConfig()), device=device)
    (chunk,) = build_gpt_model(get_preset("micro"), ParallelConfig(), groups,
                               params_dtype=torch.bfloat16)
    return sorted({t.device.type for t in [*chunk.parameters(), *chunk.buffers()]})


def test_a_built_model_is_wholly_on_the_ranks_device():
    """models.gpt.build_gpt_model left the local spec's torch norms (megatron's fallback
    without apex) on the host: a GPU rank's megatron optimizer then refused the CPU bf16
    parameters at setup (first seen on an H200, scripts/gpu_check.sh)."""
    from mcore_rl.launch.spawn import run_on_ranks

    (devices,) = run_on_ranks(_chunk_devices, 1, str(TWIN))
    assert devices == [TWIN.type]
