"""The sync digest (resharding/digest.py): exact against a reference written with Python
integers, the same however a plan cuts a tensor into pieces (the senders' pieces add up to the
receiver's whole tensor, in the wire dtype), and changed by any corruption a sync could make —
one flipped bit anywhere in an element, a negated tensor, two swapped elements, a transpose.
One process, no process group: the comparison across ranks runs in every sync of the engine
and RL tests (tests/rollout/test_engine_tp2.py corrupts an install on purpose)."""

from __future__ import annotations

import pytest
import torch

from gpu_twins import device_params
from mcore_rl.layouts import hf_shards, materialize_rank, megatron_shards, vllm_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import build_plan, digest
from mcore_rl.resharding.digest import region_digest, tensor_digest
from mcore_rl.resharding.schedule import compile_schedule

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

MICRO = get_preset("micro")
MOE = MICRO.with_(family="qwen3_moe", architecture="Qwen3MoeForCausalLM", qk_norm=True,
                  num_experts=4, moe_ffn=64, experts_per_token=2)
WORD = 1 << 32


def _mix(u: int) -> int:
    """h of digest.py on a Python int (the unit, sign-extended to 32 bits)."""
    x = (u * digest._C1) % WORD
    return x ^ (x >> 15)


def reference(t: torch.Tensor) -> tuple[int, int]:
    """(Σ h(u_i), Σ i·h(u_i)) mod 2^32 over the tensor's units in row-major order."""
    unit = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}[t.element_size()]
    units = t.detach().cpu().contiguous().view(unit).reshape(-1).tolist()
    mixed = [_mix(u) for u in units]
    return sum(mixed) % WORD, sum(i * m for i, m in enumerate(mixed)) % WORD


def lanes(d: torch.Tensor) -> tuple[int, int]:
    return tuple(int(v) % WORD for v in d.cpu())


@pytest.mark.parametrize("device", device_params(
    "tests/resharding/test_digest.py::test_exact_against_python_integers[cpu]"))
def test_exact_against_python_integers(device):
    """Integer arithmetic that wraps mod 2^32 is exact and the same on every device: the CUDA
    case checks that GPU kernels give the host's digest, bit for bit."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        t = torch.randn(19, 37, generator=g).to(dtype)
        t[0, 0], t[1, 1] = -0.0, float("inf")
        assert lanes(tensor_digest(t.to(device))) == reference(t), dtype
    assert lanes(tensor_digest(torch.tensor(3.5, device=device))) == \
        reference(torch.tensor([3.5]))  # a 0-dim tensor is one element


def test_blocks_do_not_change_the_digest(monkeypatch):
    """Regions are mixed in blocks (cache-sized on a CPU): any block size gives one digest."""
    t = torch.randn(23, 41)
    whole = lanes(tensor_digest(t))
    for block in (1, 7, 41, 64, 1000):
        monkeypatch.setitem(digest._BLOCK, "cpu", block)
        assert lanes(tensor_digest(t)) == whole, block
        assert lanes(tensor_digest(t.double())) == reference(t.double()), block


# (model, training grid, vLLM TP, wire dtype)
PIECES = {
    # fused [q; k; v] and [gate; up], padded vocabulary, kv heads split; fp32 wire
    "llama tp2pp2 -> tp2": (MICRO, ParallelConfig(tp=2, pp=2), 2, torch.float32),
    # the same, a bf16 wire from fp32 parameters (each piece cast as it is digested)
    "llama tp2pp2 -> tp2 bf16": (MICRO, ParallelConfig(tp=2, pp=2), 2, torch.bfloat16),
    # EP2 experts into vLLM's stacked w13 / w2: 3-D boxes, one expert each
    "qwen3-moe ep2 -> tp2": (MOE, ParallelConfig(dp=2, ep=2), 2, torch.float32),
}


@pytest.mark.parametrize("case", PIECES)
def test_pieces_sent_add_up_to_the_tensor_installed(case):
    """For every (inference rank, tensor), the digests of the pieces the training ranks send
    — taken from their own fp32 parameters, in the wire dtype, placed by the plan's
    destination boxes — sum to the digest of the tensor the receiver assembles."""
    spec, parallel, tp, wire = PIECES[case]
    src, dst = megatron_shards(spec, parallel), vllm_shards(spec, tp)
    plan = build_plan(src, dst, bucket_bytes=8 << 10,
                      element_size=torch.empty((), dtype=wire).element_size())
    g = torch.Generator().manual_seed(1)
    hf = {n: torch.randn(s, generator=g) for n, s in hf_shards(spec).hf_shapes.items()}
    sent: dict[tuple[int, str], list[int]] = {}
    for rank in range(plan.num_src):
        local = materialize_rank(src, rank, hf.__getitem__)
        schedule = compile_schedule(plan, rank, sending=True)
        for msgs, targets in zip(schedule.rounds, schedule.targets):
            for (peer, items), dests in zip(msgs, targets):
                for (key, slices, _), (dst_key, box) in zip(items, dests):
                    d = region_digest(local[key][slices], box,
                                      plan.dst_shapes[peer][dst_key], dtype=wire)
                    acc = sent.setdefault((peer, dst_key), [0, 0])
                    acc[:] = [(a + b) % WORD for a, b in zip(acc, lanes(d))]
    checked = 0
    for d_rank in range(plan.num_dst):
        received = materialize_rank(dst, d_rank, hf.__getitem__, wire)
        for key, tensor in received.items():
            assert tuple(sent.get((plan.num_src + d_rank, key), (0, 0))) == \
                lanes(tensor_digest(tensor)), key
            checked += 1
    assert checked == sum(len(s) for s in plan.dst_shapes.values())


def test_the_mix_is_a_bijection():
    """h never maps two units to one value — checked on every int16 unit, and on the int32
    unit an arithmetic (sign-filling) shift would confuse with 0 (the one that mixes to -1
    before the shift) — so one changed element always changes lane 0. The torch mix is the
    reference's on a sample."""
    assert len({_mix(u) for u in range(-(1 << 15), 1 << 15)}) == 1 << 16
    special = (WORD - 1) * pow(digest._C1 % WORD, -1, WORD) % WORD  # u · C1 ≡ -1
    pair = torch.tensor([0, special - WORD], dtype=torch.int64).to(torch.int32)
    assert lanes(tensor_digest(pair[:1]))[0] != lanes(tensor_digest(pair[1:]))[0]
    units = torch.arange(-(1 << 15), 1 << 15, 997, dtype=torch.int16)
    assert all(lanes(tensor_digest(u.reshape(1)))[0] == _mix(int(u)) for u in units)


def _one_bit(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    out = t.clone()
    out.view(torch.uint8).view(-1)[byte] ^= 1 << bit
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_corruption_changes_the_digest(dtype):
    t = torch.randn(16, 24).to(dtype)
    d = lanes(tensor_digest(t))
    size = t.element_size()
    element = 5 * 24 + 7
    # every bit of one element: mantissa, exponent and sign (a plain sum mod 2^32 of the bits
    # would miss an even number of sign flips)
    for byte in range(element * size, (element + 1) * size):
        for bit in range(8):
            assert lanes(tensor_digest(_one_bit(t, byte, bit))) != d, (byte, bit)
    assert lanes(tensor_digest(-t)) != d  # a negated tensor: every sign bit flipped
    assert lanes(tensor_digest(_one_bit(_one_bit(t, 0, 7), 2 * size, 7))) != d
    swapped = t.clone()
    swapped[3, 4], swapped[9, 1] = t[9, 1], t[3, 4]
    assert lanes(tensor_digest(swapped)) != d  # same values, other places
    square = t[:16, :16].contiguous()
    assert lanes(tensor_digest(square.t().contiguous())) != lanes(tensor_digest(square))
    assert lanes(tensor_digest(t.roll(1, dims=1))) != d  # shifted by one column
