"""The IPC copy service (colocated refit) on real processes: same plan, same checks, same
receiver API as point to point, with the bytes going through one shared staging buffer per
training rank (shared memory on CPU, CUDA IPC on GPU).

GPU checks (marker `gpu`, at the end): the same table with device "cuda" on the one GPU —
(a) planner + transport moving CUDA tensors between processes (p2p rows: gloo carries them
through host bounce buffers; NCCL refuses two ranks on one GPU), (b) the CUDA-IPC refit,
bit-exact, staging ≤ one bucket. Only torch and our resharding code (no vLLM/Ray/TE on the
GPU machine). Their CPU twin is `test_ipc_refit_is_exact_with_one_bucket_of_staging`.

All rows run in ONE launch: each row forms its own sync group (a fresh prefix) over the first
T + D processes; the others sit that row out.
"""

import os
import stat
import time

import pytest
import torch

from gpu_twins import gpu_marks
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.layouts import hf_shards, materialize_rank, megatron_shards, vllm_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import SyncGroupSpec, SyncStats, build_plan
from mcore_rl.resharding.channels import SyncChannels
from mcore_rl.resharding.ipc_copy import staging_layout
from mcore_rl.resharding.shared_staging import SharedStaging, open_handle

MICRO = get_preset("micro")  # 4 heads, 2 kv heads, head_dim 32, 4 layers, vocab 250
BUCKET = 64 << 10

# id: (training grid, vLLM TP, engines, per-engine transports, wire dtype)
CASES = {
    # colocated TP2 -> TP2: trainer rank d and inference rank d share a device
    "tp2 -> tp2 ipc": (ParallelConfig(tp=2), 2, 1, ("ipc",), torch.float32),
    # the colocated controller's shape: TP2 -> two TP1 engines (dim-1 slices packed)
    "tp2 -> tp1 x2 ipc": (ParallelConfig(tp=2), 1, 2, ("ipc", "ipc"), torch.float32),
    # one engine colocated, one not: a training rank serves both, by their transports
    "tp2 -> tp1 x2 ipc+p2p": (ParallelConfig(tp=2), 1, 2, ("ipc", "p2p"), torch.float32),
    # bf16 on the wire from fp32 parameters: converted while written into the staging buffer
    "tp2 -> tp2 ipc bf16": (ParallelConfig(tp=2), 2, 1, ("ipc",), torch.bfloat16),
    # point to point through the same channels (on GPU: CUDA tensors over gloo, bounced
    # through host buffers — NCCL refuses two ranks on the one GPU)
    "tp2 -> tp1 x2 p2p": (ParallelConfig(tp=2), 1, 2, ("p2p", "p2p"), torch.float32),
    # MoE (row in MOE_EP): a colocated EP2 actor refits vLLM expert parallel (each inference
    # rank whole experts, vLLM's placement) — the GPU deployment of rollout.expert_parallel
    "moe ep2 -> tp2 ep ipc": (ParallelConfig(dp=2, ep=2), 2, 1, ("ipc",), torch.float32),
}
MAX_RANKS = max(p.world_size + tp * e for p, tp, e, _, _ in CASES.values())
MOE = get_preset("micro-moe")  # Qwen3-MoE, 4 experts
MOE_EP = {"moe ep2 -> tp2 ep ipc"}  # rows on MOE with the vLLM side expert parallel


def hf_reference(seed=7, spec=MICRO):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_shards(spec).hf_shapes.items()}


def colocated_device(device, rank, num_src):
    """Trainer rank d and inference rank d on device d (one GPU: all on cuda:0)."""
    if device == "cpu":
        return "cpu"
    return f"cuda:{(rank if rank < num_src else rank - num_src) % torch.cuda.device_count()}"


def run_case(rank, case_index, parallel, infer_tp, engines, transports, dtype, *,
             device="cpu", syncs=2, timeout_s=30.0, prefix="ipc", moe_ep=False):
    """One row on this process: `syncs` syncs over one `SyncChannels` (the staging buffer is
    made once and reused; the second sync sends different weights). Returns plain values."""
    model = MOE if moe_ep else MICRO
    src = megatron_shards(model, parallel)
    dst = vllm_shards(model, infer_tp, engines, expert_parallel=moe_ep)
    plan = build_plan(src, dst, bucket_bytes=BUCKET, element_size=dtype.itemsize)
    if rank >= plan.world_size:
        return None
    spec = SyncGroupSpec("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"]),
                         f"{prefix}{case_index}/", plan.world_size, timeout_s=timeout_s,
                         transports=transports)
    here = colocated_device(device, rank, plan.num_src)
    if here != "cpu":
        torch.cuda.set_device(here)
    channels = SyncChannels.join(spec, rank, here)
    out = {"role": "src" if rank < plan.num_src else "dst", "syncs": []}
    from mcore_rl.resharding import ipc_copy

    layouts, computed = [], ipc_copy.staging_layout  # counted: once per plan, not per sync
    ipc_copy.staging_layout = lambda p: layouts.append(1) or computed(p)
    try:
        for n in range(syncs):
            hf = hf_reference(seed=7 + n, spec=model)
            channels.verify(plan)
            if rank < plan.num_src:
                local = {k: v.to(here) for k, v in
                         materialize_rank(src, rank, hf.__getitem__).items()}
                stats = channels.send(plan, local, dtype=dtype, timeout_s=timeout_s)
                ipc = channels._services.get("ipc")
                staging = ipc._staging if ipc is not None else None
                out["syncs"].append({
                    "stats": stats, "staging_bytes": staging.nbytes if staging else 0,
                    "staging_handle": staging.handle() if staging else None,
                    "staging_file_left": bool(staging and staging.path
                                              and os.path.exists(staging.path))})
                continue
            engine = (rank - plan.num_src) // infer_tp
            expected = materialize_rank(dst, rank - plan.num_src, hf.__getitem__, dtype)
            stats = SyncStats()
            received = dict(channels.receive(plan, transports[engine], dtype=dtype,
                                             timeout_s=timeout_s, stats=stats))
            out["syncs"].append({
                "stats": stats.as_dict(), "transport": transports[engine],
                "devices": sorted({str(t.device) for t in received.values()}),
                "missing": sorted(set(expected) - set(received)),
                "extra": sorted(set(received) - set(expected)),
                "mismatched": sorted(k for k in expected if k in received and not torch.equal(
                    expected[k], received[k].cpu()))})
    finally:
        ipc_copy.staging_layout = computed
        channels.close()
    out["layouts"] = len(layouts)
    out["expected_staging"] = staging_layout(plan)[1].get(rank, 0)
    return out


def run_table(rank, world_size, device="cpu"):
    out = {}
    for i, (case_id, case) in enumerate(CASES.items()):
        try:
            out[case_id] = run_case(rank, i, *case, device=device, moe_ep=case_id in MOE_EP)
        except Exception as err:  # recorded per row so one broken row doesn't hide the rest
            out[case_id] = {"role": "error", "error": f"{type(err).__name__}: {err}"}
    if device == "cpu":
        out["stall"] = stall_mid_stream(rank)
    return out


def check_case(results, case_id, device="cpu"):
    """The assertions of one row, shared by the CPU twin and the GPU test."""
    parallel, infer_tp, engines, transports, dtype = CASES[case_id]
    results = [r for r in results if r is not None]
    errors = [r["error"] for r in results if r["role"] == "error"]
    assert not errors, errors
    dst = [r for r in results if r["role"] == "dst"]
    assert len(dst) == infer_tp * engines
    for r in dst:
        for sync in r["syncs"]:
            assert not sync["missing"] and not sync["extra"] and not sync["mismatched"], sync
            assert sync["devices"] == [device if device == "cpu" else "cuda:0"]
            if sync["transport"] == "ipc":  # copied straight out of the sender's buffer
                assert sync["stats"]["peak_extra_bytes"] == 0
    for r in (r for r in results if r["role"] == "src"):
        first, second = r["syncs"]
        for sync in r["syncs"]:
            stats = sync["stats"]
            assert stats["bytes_sent"] == sum(stats.get(f"bytes_sent_{t}", 0)
                                              for t in set(transports)) > 0
            assert all(stats.get(f"bytes_sent_{t}", 0) > 0 for t in transports)
            if "ipc" not in transports:
                # p2p: two rounds in flight, at most a bucket of staging each
                assert sync["staging_bytes"] == 0 and stats["peak_extra_bytes"] <= 2 * BUCKET
                continue
            # one staging buffer of at most one bucket: the largest round this rank sends
            assert 0 < sync["staging_bytes"] == r["expected_staging"] <= BUCKET
            # ipc's one buffer, plus p2p's two rounds in flight when some engines use p2p
            assert stats["peak_extra_bytes"] <= (3 if "p2p" in transports else 1) * BUCKET
            assert not sync["staging_file_left"]  # unlinked once the receivers mapped it
        # the staging buffer is made once and reused (on CUDA: the same handle)
        assert first["staging_handle"] == second["staging_handle"]
        # N13: the plan's staging layout is computed once, not once per sync
        assert r["layouts"] == ("ipc" in transports)
    assert all(r["layouts"] <= 1 for r in results)


@pytest.fixture(scope="module")
def table():
    return run_on_ranks(run_table, MAX_RANKS, timeout_s=300, init_default_group=False)


@pytest.mark.parametrize("case_id", CASES)
def test_ipc_refit_is_exact_with_one_bucket_of_staging(table, case_id):
    check_case([r[case_id] for r in table], case_id)



def test_shared_staging_is_owner_only_and_unlinked():
    staging = SharedStaging(4096, "cpu", owner_rank=3)
    path = staging.path
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        peer = open_handle(staging.handle(), "cpu")
        staging.tensor[:8].view(torch.float32).copy_(torch.tensor([1.5, -2.0]))
        assert peer[:8].view(torch.float32).tolist() == [1.5, -2.0]  # the same bytes
        staging.unlink()
        assert not os.path.exists(path)
        staging.tensor[:4].view(torch.float32).fill_(3.0)  # the mapping outlives the name
        assert peer[:4].view(torch.float32).item() == 3.0
    finally:
        staging.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize("bad", [b'{"kind": "shm", "path": "/etc/passwd", "nbytes": 8}',
                                 b'{"kind": "pickle"}'])
def test_a_foreign_handle_is_refused(bad):
    with pytest.raises(ValueError):
        open_handle(bad, "cpu")


def stall_mid_stream(rank):
    """TP2 -> TP2 over IPC; training rank 1 stalls past the deadline after a few tensors.
    Returns the error this rank saw (None: no error)."""
    src, dst = megatron_shards(MICRO, ParallelConfig(tp=2)), vllm_shards(MICRO, 2)
    plan = build_plan(src, dst, bucket_bytes=16 << 10)
    if rank >= plan.world_size:
        return None
    spec = SyncGroupSpec("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"]), "stall/",
                         plan.world_size, timeout_s=4.0, transports=("ipc",))
    channels = SyncChannels.join(spec, rank)
    try:
        if rank < 2:
            local = materialize_rank(src, rank, hf_reference().__getitem__)
            if rank == 1:
                local = StallAfter(local, 3, seconds=8.0)
            channels.send(plan, local, dtype=torch.float32, timeout_s=4.0)
        else:
            for _ in channels.receive(plan, "ipc", dtype=torch.float32, timeout_s=4.0):
                pass
    except Exception as err:  # noqa: BLE001 — the test reads the message
        return f"{type(err).__name__}: {err}"
    finally:
        channels.close()
    return None


class StallAfter(dict):
    """Tensor lookup that sleeps once, after `n` lookups."""

    def __init__(self, tensors, n, seconds):
        super().__init__(tensors)
        self.left, self.seconds = n, seconds

    def __getitem__(self, key):
        self.left -= 1
        if self.left == -1:
            time.sleep(self.seconds)
        return super().__getitem__(key)


def test_a_stalled_ipc_sender_is_named_within_the_deadline(table):
    errors = [r["stall"] for r in table]
    # inference rank 3 (TP rank 1) gets everything from training rank 1, and names it; rank 2
    # receives nothing from it (its replicated norms come from its own TP rank, the planner's
    # matching source) and receives all it needs, but the sync is verified as a whole: it
    # fails at the digest comparison, within the deadline
    assert "SyncError" in errors[3], errors
    assert "receive from training rank 1 (tp1 pp0 dp0)" in errors[3], errors
    assert errors[2].startswith("SyncError: weight sync failed at digest exchange"), errors


# ------------------------------------------------------------------------------ GPU checks

CPU_TWIN = "tests/resharding/test_ipc_copy.py::test_ipc_refit_is_exact_with_one_bucket_of_staging"


@pytest.fixture(scope="module")
def cuda_table():
    return run_on_ranks(run_table, MAX_RANKS, "cuda", timeout_s=300, init_default_group=False)


@pytest.mark.parametrize("case_id", [pytest.param(c, marks=gpu_marks(CPU_TWIN))
                                     for c, v in CASES.items() if "ipc" not in v[3]])
def test_gpu_transport_moves_cuda_tensors_between_processes(cuda_table, case_id):
    check_case([r[case_id] for r in cuda_table], case_id, device="cuda")


@pytest.mark.parametrize("case_id", [pytest.param(c, marks=gpu_marks(CPU_TWIN))
                                     for c, v in CASES.items() if "ipc" in v[3]])
def test_gpu_cuda_ipc_refit_is_exact_with_one_bucket_of_staging(cuda_table, case_id):
    check_case([r[case_id] for r in cuda_table], case_id, device="cuda")
