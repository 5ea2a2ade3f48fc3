"""`mcore-rl bench sync`: the streaming resharding transport against the gather-then-broadcast
baseline, on the same model, ranks and buckets, in one launch.

Ranks: training ranks 0..T-1 (Megatron layout of the `actor` grid), inference ranks T..T+D-1
(vLLM layout, `rollout.engines` engines of `rollout.tp` ranks). Weights come from an HF
directory (read lazily, each rank only its own slices) or are made on the fly from a preset's
shapes.
`transport`: "p2p" (sends on the sync group) or "ipc" (colocated: inference rank d shares
training rank d's device and copies out of its shared staging buffer). `device`: "cpu", or
"cuda" (rank devices as a colocated / disaggregated placement would give them; NCCL for p2p
and the baseline).

The baseline does what the seed trainers do, and lives only here: every training shard is
gathered onto training rank 0, which assembles whole HF tensors (the whole model in one rank's
memory), then broadcasts each whole tensor to every inference rank, which cuts out its shard.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import psutil
import torch
import torch.distributed as dist

from mcore_rl.bench.link_model import LinkModel, project_baseline, project_transport
from mcore_rl.bench.sync_link import LinkBaseline, byte_matrix
from mcore_rl.config import ConfigError, require_above, require_at_least, require_one_of
from mcore_rl.config.dtypes import DtypeName, normalize_dtype_fields, torch_dtype
from mcore_rl.launch.slurm import launch_ranks
from mcore_rl.layouts import (ShardMap, materialize_rank, megatron_shards, vllm_fp8_names,
                              vllm_shards)
from mcore_rl.layouts.layout import box_numel, box_slices
from mcore_rl.models.hf_weights import RandomWeights, SafetensorsWeights
from mcore_rl.models.presets import PRESETS, get_preset
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import Plan, SyncGroupSpec, SyncStats, build_plan, join_sync_group
from mcore_rl.resharding.channels import SyncChannels
from mcore_rl.resharding.fp8 import (block_scale_name, fp8_wire_bytes, quantize_blocks,
                                     quantize_with_scale, scale_name, sender_quantized,
                                     tensor_scale, tensor_units, weight_amax, with_fp8)


@dataclass(frozen=True, kw_only=True)
class InferenceGrid:
    """The vLLM side (`rollout.*`, the run config's names). tp: tensor-parallel size of each
    engine. engines: how many engines. expert_parallel: vLLM expert parallelism (each inference
    rank holds whole experts, vLLM's placement, instead of a 1/tp slice of every expert; MoE
    models only). quantization: the engines' FP8 scheme ("fp8_per_tensor", "fp8_per_block",
    the run config's `rollout.quantization`): the report adds what the FP8 sync moves
    (`fp8_sync`) and, plan_only, its projected time; measured, the same plan synced with the
    FP8 weights quantized inside it, alternating with the unquantized sync repeat by repeat
    (`fp8`, `fp8_speedup`: unquantized time / FP8 time)."""

    tp: int = 1
    engines: int = 1
    expert_parallel: bool = False
    quantization: Literal["fp8_per_tensor", "fp8_per_block"] | None = None

    #: old spellings (the loader names their new place)
    MOVED: ClassVar[dict[str, str]] = {"ep": "rollout.expert_parallel"}

    def __post_init__(self) -> None:
        require_at_least(self, 1, "tp", "engines")


@dataclass(frozen=True, kw_only=True)
class SyncSettings:
    """The weight sync's settings a bench sync takes, named as the run config's `sync`
    section: bucket_mb, the transport bucket; dtype, the wire dtype (float32 | bfloat16)."""

    bucket_mb: float = 64.0
    dtype: DtypeName = "float32"

    def __post_init__(self) -> None:
        normalize_dtype_fields(self, "dtype", allowed=("float32", "bfloat16"))
        require_above(self, 0, "bucket_mb")


@dataclass(frozen=True, kw_only=True)
class SyncBenchConfig:
    """`mcore-rl bench sync a.b=c ...`. The grid and sync keys are the run config's
    (`RLConfig`) names.

    model: preset name (micro, micro-moe, tiny, llama3-70b, qwen3-30b-a3b, ...) or HF model
        directory.
    actor: the training grid (actor.tp, actor.pp, actor.vpp, actor.dp, actor.ep, actor.etp;
        etp * ep must divide tp * dp).
    rollout: the vLLM side (rollout.tp, rollout.engines, rollout.expert_parallel).
    sync: the run config's `sync` names — sync.bucket_mb: transport bucket; sync.dtype:
        float32 | bfloat16 (fp32/bf16 accepted).
    baseline: baselines also run, a list of: "gather" (gather every shard to training rank 0,
        which broadcasts whole tensors), "link" (the plan's byte matrix as plain sends on the
        same group, `sync_link.py`; the report gains `link_efficiency` = link time / sync time).
    check: compare every received shard bit for bit with the reference.
    repeats: timed repetitions (median reported); untimed: repetitions before them (a run
        syncs every step: the first sync of a process pays one-off costs).
    timeout_s: every send/recv deadline. seed: the random weights of a preset.
    transport: "p2p" (sends on the sync group) or "ipc" (colocated: inference rank d on
        training rank d's device copies out of shared staging buffers).
    device: where the ranks' tensors live ("cuda": NCCL for p2p and the baseline).
    plan_only: plan from shapes only (any size) and project times with `link_model`; moves no
        data.
    link_model: the cluster `plan_only` projects onto (gpus_per_node, intra_node_gbs,
        inter_node_gbs, latency_s; see link_model.py).
    """

    model: str = "tiny"
    actor: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: InferenceGrid = field(default_factory=InferenceGrid)
    sync: SyncSettings = field(default_factory=SyncSettings)
    baseline: tuple[Literal["gather", "link"], ...] = ()
    check: bool = False
    repeats: int = 1
    untimed: int = 0
    timeout_s: float = 300.0
    seed: int = 0
    transport: Literal["p2p", "ipc"] = "p2p"
    device: Literal["cpu", "cuda"] = "cpu"
    plan_only: bool = False
    link_model: LinkModel = field(default_factory=LinkModel)

    #: the bench's old spellings, now the run config's (the loader names their new place)
    MOVED: ClassVar[dict[str, str]] = {
        "train": "actor (the run config's name: actor.tp, actor.pp, ...)",
        "infer": "rollout (rollout.tp, rollout.engines, rollout.expert_parallel)",
        "bucket_mb": "sync.bucket_mb",
        "dtype": "sync.dtype",
        "sync_bucket_mb": "sync.bucket_mb",
        "sync_dtype": "sync.dtype",
        "warmup": "untimed (`warmup` is the supervised warm-up)"}

    def __post_init__(self):
        require_one_of(self, "transport", ("p2p", "ipc"))
        require_one_of(self, "device", ("cpu", "cuda"))
        require_at_least(self, 1, "repeats")
        require_at_least(self, 0, "untimed")
        require_above(self, 0, "timeout_s")
        if (self.rollout.quantization is not None and not self.plan_only
                and self.sync.dtype != "bfloat16"):
            raise ConfigError("sync.dtype", self.sync.dtype,
                              f"rollout.quantization={self.rollout.quantization} quantizes the "
                              "weights as the engines load them: set sync.dtype=bf16")
        unknown = [b for b in self.baseline if b not in ("gather", "link")]
        if unknown:
            raise ConfigError("baseline", list(self.baseline), "allowed values: gather, link")
        inference_ranks = self.rollout.tp * self.rollout.engines
        if self.transport == "ipc" and inference_ranks > self.actor.world_size:
            raise ConfigError("transport", self.transport,
                              f"ipc is colocated (inference rank d on training rank d's "
                              f"device): {inference_ranks} inference ranks need at most "
                              f"{self.actor.world_size} training ranks' devices")

    @property
    def gather_baseline(self) -> bool:
        return "gather" in self.baseline

    @property
    def link_baseline(self) -> bool:
        return "link" in self.baseline

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def rank_device(self, rank: int) -> str:
        """Sync rank `rank`'s device: colocated for ipc, one device per rank for p2p."""
        if self.device == "cpu":
            return "cpu"
        train = self.actor.world_size
        slot = rank - train if self.transport == "ipc" and rank >= train else rank
        return f"cuda:{slot % torch.cuda.device_count()}"

    @property
    def bucket_bytes(self) -> int:
        return int(self.sync.bucket_mb * (1 << 20))


def resolve_model(model: str) -> ModelSpec:
    """A preset name or an HF model directory."""
    if model in PRESETS:
        return get_preset(model)
    if Path(model).is_dir():
        return ModelSpec.from_hf_dir(model)
    raise ConfigError("model", model, f"neither a preset ({', '.join(sorted(PRESETS))}) "
                     "nor an HF model directory")


def make_plan(cfg: SyncBenchConfig, spec: ModelSpec) -> tuple[ShardMap, ShardMap, Plan]:
    try:  # a grid that does not fit the model, named as the user wrote it (actor.tp=3)
        cfg.actor.check_model(spec)
    except ConfigError as err:
        raise err.under("actor") from None
    src = megatron_shards(spec, cfg.actor)
    dst = inference_shards(cfg, spec)
    element_size = torch_dtype(cfg.sync.dtype).itemsize
    return src, dst, build_plan(src, dst, bucket_bytes=cfg.bucket_bytes,
                                element_size=element_size)


def inference_shards(cfg: SyncBenchConfig, spec: ModelSpec) -> ShardMap:
    return vllm_shards(spec, cfg.rollout.tp, cfg.rollout.engines,
                       expert_parallel=cfg.rollout.expert_parallel)


def rollout_label(cfg: SyncBenchConfig) -> str:
    rollout = cfg.rollout
    fp8 = f" {rollout.quantization}" if rollout.quantization else ""
    return f"tp{rollout.tp}{' ep' if rollout.expert_parallel else ''} x{rollout.engines}{fp8}"


def _weights(cfg: SyncBenchConfig, src: ShardMap):
    if Path(cfg.model).is_dir():
        return SafetensorsWeights(cfg.model)
    return RandomWeights(src.hf_shapes, seed=cfg.seed)


def _barrier(group: dist.ProcessGroup, device: str = "cpu") -> None:
    group.allreduce([torch.zeros(1, device=device)]).wait()


def rank_main(rank: int, world_size: int, cfg: SyncBenchConfig) -> dict:
    """One process of the benchmark. Returns this rank's measurements."""
    model = resolve_model(cfg.model)
    src, dst, plan = make_plan(cfg, model)
    dtype = torch_dtype(cfg.sync.dtype)
    weights = _weights(cfg, src)
    port = int(os.environ["MCORE_RL_STORE_PORT"])
    # the rendezvous store: rank 0's (the local launcher's on one machine, srun's first node)
    host = os.environ.get("MCORE_RL_STORE_HOST", "127.0.0.1")
    is_src = rank < plan.num_src
    device = cfg.rank_device(rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    local = (_to(materialize_rank(src, rank, weights.__getitem__, dtype), device)
             if is_src else None)
    expected = (materialize_rank(dst, rank - plan.num_src, weights.__getitem__, dtype)
                if cfg.check and not is_src else None)
    out: dict = {"rank": rank, "role": "train" if is_src else "infer",
                 "rss_bytes": psutil.Process().memory_info().rss}
    spec = SyncGroupSpec(host, port, "ours/", world_size, cfg.timeout_s, backend=cfg.backend,
                         transports=(cfg.transport,) * cfg.rollout.engines,
                         actor_ranks=plan.num_src)
    channels = SyncChannels.join(spec, rank, device)
    channels.verify(plan)
    gloo_control = channels.control is not channels.bulk or channels.spec.backend == "gloo"
    barrier = (channels.control, "cpu") if gloo_control else (channels.bulk, device)
    runs = {"ours": lambda i: _ours_once(plan, channels, local, dtype, cfg)}
    checks = {}
    if cfg.rollout.quantization is not None:  # the same plan, its FP8 weights quantized in it
        fp8_plan = with_fp8(plan, dst, vllm_fp8_names(model).__contains__,
                            cfg.rollout.quantization)
        channels.verify(fp8_plan)
        runs["fp8"] = lambda i: _ours_once(fp8_plan, channels, local, dtype, cfg)
        checks["fp8"] = fp8_check
    if cfg.link_baseline:  # alternates with ours, repeat by repeat: both see the same machine load
        link = LinkBaseline(plan, channels.bulk, rank, device=device, timeout_s=cfg.timeout_s)
        runs["link"] = lambda i: (link.run(), None)
    try:
        out.update(_repeat(cfg, barrier, runs, expected, checks))
        if cfg.gather_baseline:
            out.update(_repeat(cfg, barrier, {"baseline": lambda i: _baseline_once(
                plan, src, dst, rank, local, dtype, cfg, host, port, i)}, expected))
    finally:
        channels.close()
    return out


def _to(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return tensors if device == "cpu" else {k: v.to(device) for k, v in tensors.items()}


def _repeat(cfg, barrier, runs: dict, expected, checks: dict | None = None) -> dict:
    """Time each of `runs` (name → once(i)) `cfg.repeats` times, the runs alternating within
    each repeat. A run that returns received shards is checked against `expected`: equal bit
    for bit, or by `checks[name](expected, received)` (the names that fail)."""
    walls = {name: [] for name in runs}
    last: dict = {}
    for i in range(cfg.untimed + cfg.repeats):
        for name, once in runs.items():
            last.pop(name, None)  # the previous run's shards go before the next arrive
            _barrier(*barrier)
            start = time.perf_counter()
            last[name] = once(i)
            if i >= cfg.untimed:
                walls[name].append(time.perf_counter() - start)
    results = {}
    for name, (stats, received) in last.items():
        result = {"wall_s": walls[name],
                  **(stats if isinstance(stats, dict) else stats.as_dict())}
        if expected is not None and received is not None:
            if name in (checks or {}):
                result["check_failures"] = checks[name](expected, received)
                results[name] = result
                continue
            bad = sorted(k for k in expected if k not in received
                         or not torch.equal(expected[k], received[k].cpu()))
            bad += sorted(set(received) - set(expected))
            result["check_failures"] = bad
        results[name] = result
    return results


def fp8_check(expected: dict[str, torch.Tensor], received: dict[str, torch.Tensor]) -> list:
    """The names an FP8 sync delivered otherwise than its arithmetic says, from this engine
    rank's BF16 shards (`expected`): a weight its senders quantized block-wise is
    `quantize_blocks` of its shard, scales included; one quantized per tensor is its shard
    cast with the scale delivered (one per expert of a stacked tensor), a scale no smaller
    than the shard's own amax gives (the MAX with the other ranks' shards is the tests'); the
    rest, FP8 weights the engine rank quantizes included, arrive as they are."""
    bad = []
    for name, want in expected.items():
        got = received.get(name)
        if got is None:
            bad.append(name)
        elif got.dtype != torch.uint8:
            bad += [] if torch.equal(want, got.cpu()) else [name]
        elif block_scale_name(name) in received:
            q, scales = quantize_blocks(want)
            same = torch.equal(received[block_scale_name(name)].cpu(), scales)
            bad += [] if same and torch.equal(q.view(torch.uint8), got.cpu()) else [name]
        else:
            scale = received[scale_name(name)].cpu()  # [1], or one per local expert
            matrices = list(want) if want.dim() == 3 else [want]
            own = tensor_scale(torch.stack([weight_amax(m) for m in matrices]))
            q = quantize_with_scale(want, scale.reshape(-1, *[1] * (want.dim() - 1)))
            ok = torch.equal(q.view(torch.uint8), got.cpu()) and bool((scale >= own).all())
            bad += [] if ok else [name]
    scale_names = {scale_name(n) for n in expected} | {block_scale_name(n) for n in expected}
    return sorted(bad + [n for n in received if n not in expected and n not in scale_names])


def _ours_once(plan, channels, local, dtype, cfg):
    if local is not None:
        return channels.send(plan, local, dtype=dtype, timeout_s=cfg.timeout_s), None
    stats = SyncStats()
    received = dict(channels.receive(plan, cfg.transport, dtype=dtype,
                                     timeout_s=cfg.timeout_s, stats=stats))
    return stats, received


def _baseline_once(plan, src, dst, rank, local, dtype, cfg, host, port, attempt):
    """Gather every shard to training rank 0, assemble whole tensors, broadcast each whole
    tensor to the inference ranks, which cut their shards out of it. Tensors live on each rank's
    device (NCCL carries them with --device cuda)."""
    stats, device = SyncStats(), cfg.rank_device(rank)
    gathered = None
    if rank < plan.num_src:
        gathered = _gather_to_rank0(src, rank, local, dtype, cfg, host, port, plan.num_src,
                                    stats, attempt)
        if rank != 0:
            return stats, None
    # rank 0 + inference ranks form the broadcast group
    bcast_rank = 0 if rank == 0 else rank - plan.num_src + 1
    group = join_sync_group(SyncGroupSpec(host, port, f"bcast{attempt}/", plan.num_dst + 1,
                                          cfg.timeout_s, backend=cfg.backend), bcast_rank)
    received = None if rank == 0 else {}
    my_tensors = None if rank == 0 else dst.ranks[rank - plan.num_src]
    for name in sorted(src.hf_shapes):
        if name not in dst.hf_shapes:
            continue  # e.g. the tied output-layer copy: vLLM has no such tensor
        if rank == 0:
            full = gathered[name]
        else:
            full = torch.empty(src.hf_shapes[name], dtype=dtype, device=device)
            stats.hold(full.numel() * full.element_size())
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([full], opts).wait()
        nbytes = full.numel() * full.element_size()
        if rank == 0:
            stats.bytes_sent += nbytes * plan.num_dst
        else:
            stats.bytes_received += nbytes
            _cut_shards(my_tensors, name, full, received, dtype, device)
            stats.release(nbytes)
    return stats, received


def _gather_senders(src) -> dict[int, list[str]]:
    """Per training rank, the local tensors it sends to rank 0: those holding a piece of an HF
    tensor that no lower rank holds. DP replicas send nothing; with experts spread over
    expert-DP, the expert-DP replica 0 ranks send the experts (a DP replica 0 rank may not
    hold them)."""
    seen: set = set()
    senders: dict[int, list[str]] = {}
    for rank in sorted(src.ranks):
        for key, tensor in sorted(src.ranks[rank].items()):
            pieces = {(p.hf_name, repr(p.hf_box)) for p in tensor.pieces}
            if not pieces <= seen:
                senders.setdefault(rank, []).append(key)
                seen |= pieces
    return senders


def _gather_to_rank0(src, rank, local, dtype, cfg, host, port, num_src, stats, attempt):
    """Every piece of the model goes once to rank 0 (from the lowest rank holding it), which
    assembles whole HF tensors from the pieces (the whole model ends up on rank 0)."""
    device = cfg.rank_device(rank)
    group = join_sync_group(SyncGroupSpec(host, port, f"gather{attempt}/", num_src,
                                          cfg.timeout_s, backend=cfg.backend), rank)
    senders = _gather_senders(src)
    if rank != 0:
        for key in senders.get(rank, []):
            tensor = local[key].contiguous()
            group.send([tensor], 0, 0).wait()
            stats.bytes_sent += tensor.numel() * tensor.element_size()
        return None
    full = {name: torch.zeros(shape, dtype=dtype, device=device)
            for name, shape in src.hf_shapes.items()}
    stats.hold(sum(t.numel() * t.element_size() for t in full.values()))
    for holder, keys in sorted(senders.items()):
        tensors = local if holder == 0 else {}
        for key in keys:
            if holder != 0:
                buf = torch.empty(src.ranks[holder][key].shape, dtype=dtype, device=device)
                stats.hold(buf.numel() * buf.element_size())
                group.recv([buf], holder, 0).wait()
                stats.bytes_received += buf.numel() * buf.element_size()
                tensors[key] = buf
            for piece in src.ranks[holder][key].pieces:
                full[piece.hf_name][box_slices(piece.hf_box)] = \
                    tensors[key][box_slices(piece.local_box)]
        if holder != 0:
            stats.release(sum(t.numel() * t.element_size() for t in tensors.values()))
    return full


def _cut_shards(my_tensors, name, full, received, dtype, device="cpu"):
    for key, local in my_tensors.items():
        for piece in local.pieces:
            if piece.hf_name == name:
                if key not in received:
                    received[key] = torch.zeros(local.shape, dtype=dtype, device=device)
                received[key][box_slices(piece.local_box)] = full[box_slices(piece.hf_box)]
    for key, local in my_tensors.items():  # all-padding shards
        if not local.pieces and key not in received:
            received[key] = torch.zeros(local.shape, dtype=dtype, device=device)


def summarize(cfg: SyncBenchConfig, spec: ModelSpec, plan: Plan, per_rank: list[dict]) -> dict:
    """Fold per-rank results into the report (the JSON line the CLI prints last)."""
    def fold(which: str) -> dict:
        runs = [max(r[which]["wall_s"][i] for r in per_rank) for i in range(cfg.repeats)]
        failures = {r["rank"]: r[which]["check_failures"] for r in per_rank
                    if r[which].get("check_failures")}
        return {
            "check": ("pass" if not failures else "fail") if cfg.check else "not run",
            "check_failures": failures,
            "wall_s": statistics.median(runs),
            "wall_s_runs": runs,
            "bytes_sent": {r["rank"]: r[which]["bytes_sent"] for r in per_rank},
            "bytes_received": {r["rank"]: r[which]["bytes_received"] for r in per_rank},
            "peak_extra_bytes": {r["rank"]: r[which]["peak_extra_bytes"] for r in per_rank},
            # every sync is verified (resharding/digest.py), the last run's: the slowest rank's
            # time digesting what it sent or received, and the comparison's own time (the rank
            # that reached it last waited least)
            "digest_s": max(r[which].get("digest_seconds", 0.0) for r in per_rank),
            "compare_s": min(r[which].get("compare_seconds", 0.0) for r in per_rank),
        }

    ours = fold("ours")
    train_peaks = [v for r, v in ours["peak_extra_bytes"].items() if r < plan.num_src]
    dst = inference_shards(cfg, spec)
    report = {
        "transport": cfg.transport, "device": cfg.device,
        "max_train_peak_extra_bytes": max(train_peaks),
        "model": cfg.model, "params": spec.num_params(),
        "model_bytes": spec.num_params() * plan.element_size,
        "actor": actor_label(cfg.actor),
        "rollout": rollout_label(cfg), "sync_bucket_mb": cfg.sync.bucket_mb,
        "sync_dtype": cfg.sync.dtype, "rounds": len(plan.rounds), **ours,
        "max_peak_extra_bytes": max(ours["peak_extra_bytes"].values()),
        "rss_bytes": {r["rank"]: r["rss_bytes"] for r in per_rank},
        **_ideal(plan, dst),
    }
    report["sync_gbs_per_receiver"] = _gbs(report["bytes_received"], ours["wall_s"])
    report["digest_share"] = (ours["digest_s"] + ours["compare_s"]) / ours["wall_s"]
    if cfg.rollout.quantization is not None:
        report.update(_fp8_report(cfg, spec, plan, fold("fp8"), ours))
    if cfg.link_baseline:
        report.update(_link_report(plan, fold("link"), ours))
    if cfg.gather_baseline:
        base = fold("baseline")
        report["baseline"] = base
        report["speedup_vs_baseline"] = base["wall_s"] / ours["wall_s"]
        report["baseline_max_peak_extra_bytes"] = max(base["peak_extra_bytes"].values())
        if cfg.check:
            report["check"] = "pass" if ours["check"] == base["check"] == "pass" else "fail"
    return report


def _fp8_report(cfg: SyncBenchConfig, spec: ModelSpec, plan: Plan, fp8: dict,
                ours: dict) -> dict:
    """The FP8 sync's figures beside the unquantized one's: its fold, `fp8_speedup` (the
    unquantized median over the FP8 one), the plan's byte counts (`fp8_sync`) and the bytes
    its senders measured; `check` passes only where both syncs' do."""
    wire = _fp8_wire(cfg, spec, inference_shards(cfg, spec), plan)
    out = {"quantization": cfg.rollout.quantization, "fp8": fp8, "fp8_sync": wire,
           "fp8_speedup": ours["wall_s"] / fp8["wall_s"],
           "fp8_bytes_sent": sum(fp8["bytes_sent"].values())}
    if cfg.check:
        out["check"] = "pass" if ours["check"] == fp8["check"] == "pass" else "fail"
    return out


def _gbs(bytes_received: dict, wall_s: float) -> float:
    """GB/s into the busiest receiver (every receiver gets about the same here)."""
    return max(bytes_received.values(), default=0) / wall_s / 1e9


def _link_report(plan: Plan, link: dict, ours: dict) -> dict:
    """The link baseline's figures and `link_efficiency` = link time / sync time (medians;
    per repeat too, since the two alternate and share each moment's load)."""
    matrix = byte_matrix(plan)
    return {
        "link": {**link, "check": "not applicable (no shards)", "byte_matrix": {f"{s}->{d}": n for (s, d), n in sorted(matrix.items())}},
        "link_gbs_per_receiver": _gbs(link["bytes_received"], link["wall_s"]),
        "link_efficiency": link["wall_s"] / ours["wall_s"],
        "link_efficiency_runs": [a / b for a, b in zip(link["wall_s_runs"],
                                                       ours["wall_s_runs"])],
    }


def run_sync_bench(cfg: SyncBenchConfig) -> dict:
    """Launch T + D local processes (or, under srun/torchrun, run this task's rank), run the
    benchmark, return the report."""
    spec = resolve_model(cfg.model)
    _, _, plan = make_plan(cfg, spec)  # fail on bad input before any process starts
    per_rank = launch_ranks(rank_main, plan.world_size, cfg, init_default_group=False,
                            timeout_s=cfg.timeout_s + 120)
    report = summarize(cfg, spec, plan, per_rank)
    report["config"] = asdict(cfg)
    return report


def plan_only_report(cfg: SyncBenchConfig) -> dict:
    """Plan on shapes alone (any model size) and project both transports' times on
    `cfg.link_model`."""
    link = cfg.link_model
    spec = resolve_model(cfg.model)
    src, dst, plan = make_plan(cfg, spec)
    received = plan.bytes_received()
    sent = plan.bytes_sent()
    return {
        "model": cfg.model, "params": spec.num_params(),
        "model_bytes": spec.num_params() * plan.element_size,
        "actor": actor_label(cfg.actor),
        "rollout": rollout_label(cfg), "sync_bucket_mb": cfg.sync.bucket_mb,
        "sync_dtype": cfg.sync.dtype, "rounds": len(plan.rounds),
        "transfers": sum(len(r) for r in plan.rounds),
        "assumptions": link.describe(),
        "projected_s": project_transport(plan, link),
        "baseline_projected_s": project_baseline(plan, src, cfg.actor, link),
        "max_rank_bytes_received": max(received.values()),
        "max_rank_bytes_sent": max(sent.values()),
        "baseline_rank0_bytes": sum(_numel(s) for s in src.hf_shapes.values())
        * plan.element_size,
        "bytes_received": received, "bytes_sent": sent,
        **_ideal(plan, dst),
        **_fp8_projection(cfg, spec, dst, plan, link),
    }


def _fp8_projection(cfg: SyncBenchConfig, spec, dst: ShardMap, plan: Plan, link) -> dict:
    """With rollout.quantization: the FP8 sync's bytes (`resharding.fp8.fp8_wire_bytes`) and
    its projected time, each quantized transfer at one byte per element (scales, a few bytes
    per tensor or block, are left out of the time)."""
    scheme = cfg.rollout.quantization
    if scheme is None:
        return {}
    flags = sender_quantized(plan, vllm_fp8_names(spec).__contains__, scheme=scheme)
    quantized = {id(t) for rnd, fs in zip(plan.rounds, flags) for t, f in zip(rnd, fs) if f}
    wire = _fp8_wire(cfg, spec, dst, plan, flags)
    return {
        "quantization": scheme,
        "fp8_sync": wire,
        "fp8_projected_s": project_transport(
            plan, link, lambda t: t.numel * (1 if id(t) in quantized else plan.element_size)),
    }


def _fp8_wire(cfg: SyncBenchConfig, spec: ModelSpec, dst: ShardMap, plan: Plan,
              flags: list[list[bool]] | None = None) -> dict:
    """What one sync of `plan` moves under `rollout.quantization` (`fp8_wire_bytes`)."""
    is_fp8 = vllm_fp8_names(spec).__contains__
    return fp8_wire_bytes(plan, is_fp8, element_size=plan.element_size,
                          scheme=cfg.rollout.quantization,
                          units=tensor_units(dst, plan.num_src, is_fp8), flags=flags)


def actor_label(actor: ParallelConfig) -> str:
    label = f"tp{actor.tp} pp{actor.pp} vpp{actor.vpp or 1} dp{actor.dp}"
    return label + (f" ep{actor.ep} etp{actor.expert_tp}" if actor.ep > 1 or actor.etp else "")


def _ideal(plan: Plan, dst: ShardMap) -> dict:
    """What each inference rank would receive if it got its own shards and nothing else (its
    vLLM-form tensors, padding excluded), beside what the plan sends it."""
    ideal = {plan.num_src + r: sum(box_numel(p.hf_box) for t in tensors.values()
                                   for p in t.pieces) * plan.element_size
             for r, tensors in dst.ranks.items()}
    received = plan.bytes_received()
    return {"ideal_rank_bytes": max(ideal.values()),
            "received_over_ideal": max(received.get(r, 0) / max(b, 1) for r, b in ideal.items())}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
