"""What one weight sync of a resolved run moves, by engine and transport: the real plan (the
one `rl.weight_sync` builds: the actor's layout, the engines', the run's node of every
sync rank) walked with the transport rule the channels obey (`SyncGroupSpec.pair_transport`:
an engine's IPC only from its own node). `mcore-rl explain` prints it; nothing is started.

Per engine: `ipc_bytes` (CUDA IPC / shared memory), `p2p_bytes` (the sync group), and of
those `network_bytes` (from another node). `cross_node_ipc_bytes`: IPC bytes whose source is
on another node — 0 by construction (such a handle could not be opened there); reported so a
regression shows.
"""

from __future__ import annotations

from mcore_rl.config import ConfigError
from mcore_rl.config.dtypes import torch_dtype
from mcore_rl.layouts import megatron_shards, vllm_fp8_names, vllm_shards
from mcore_rl.layouts.lora import lora_shards, whole_adapters
from mcore_rl.layouts.shards import LayoutError
from mcore_rl.models.spec import ModelSpec
from mcore_rl.planning.sized import resolve_model
from mcore_rl.resharding import build_plan
from mcore_rl.resharding.fp8 import fp8_wire_bytes, tensor_units, with_fp8
from mcore_rl.resharding.planner import Plan, PlanError
from mcore_rl.resharding.sync_group import sync_group_spec
from mcore_rl.runconfig import RLConfig
from mcore_rl.runconfig.resolve import ResolvedRun


def sync_plan(cfg: RLConfig, run: ResolvedRun, spec: ModelSpec, engines: int | None = None) -> Plan:
    """The plan of one sync from the actor's layout to the first `engines` engines' (default
    all) — the one the controller's weight sync builds (rl/weight_sync.py)."""

    engines = len(run.engine_devices) if engines is None else engines
    actor = megatron_shards(spec, cfg.actor, layer_spec=run.layer_spec)
    inference = vllm_shards(spec, cfg.rollout.tp, engines, expert_parallel=run.expert_parallel)
    plan = build_plan(
        actor,
        inference,
        bucket_bytes=int(run.sync_bucket_mb * (1 << 20)),
        element_size=torch_dtype(cfg.wire_dtype).itemsize,
        nodes=run.sync_nodes(engines),
        devices=run.sync_devices(engines),
    )
    scheme = cfg.rollout.quantization
    if scheme is not None:  # the senders quantize (all, or what lies on the block grid)
        plan = with_fp8(plan, inference, vllm_fp8_names(spec).__contains__, scheme)
    return plan


def adapter_sync_plan(
    cfg: RLConfig, run: ResolvedRun, spec: ModelSpec, engines: int | None = None
) -> Plan:
    """The plan of one adapter sync (`actor.lora.sync: adapter`): the actor's LoRA adapters,
    each held as its linear's shard is (`layouts.lora_shards`), to every engine rank whole
    (vLLM's LoRA layers cut their own slices)."""

    engines = len(run.engine_devices) if engines is None else engines
    lora = cfg.actor.lora
    adapters = lora_shards(
        megatron_shards(spec, cfg.actor, layer_spec=run.layer_spec), lora.rank, lora.targets
    )
    return build_plan(
        adapters,
        whole_adapters(adapters, cfg.rollout.tp * engines),
        bucket_bytes=int(run.sync_bucket_mb * (1 << 20)),
        element_size=torch_dtype(cfg.wire_dtype).itemsize,
        nodes=run.sync_nodes(engines),
        devices=run.sync_devices(engines),
    )


def sync_traffic(run: ResolvedRun, plan: Plan) -> dict:
    """Bytes per engine and transport of `plan` under `run`'s transports and nodes (module
    docstring), as plain JSON values."""

    spec = sync_group_spec(run, host="", port=0, prefix="", timeout_s=1.0)
    nodes, tp = run.sync_nodes(), max(1, plan.num_dst // max(1, len(run.engine_devices)))
    engines = [{"ipc_bytes": 0, "p2p_bytes": 0, "network_bytes": 0} for _ in run.engine_devices]
    pairs: dict[tuple[int, int], str] = {}
    cross_node_ipc = 0
    for rnd in plan.rounds:
        for t in rnd:
            pair = (t.src_rank, t.dst_rank)
            if pair not in pairs:
                pairs[pair] = spec.pair_transport(plan, *pair)
            nbytes = t.numel * plan.element_size
            cross = nodes[t.src_rank] != nodes[t.dst_rank]
            row = engines[(t.dst_rank - plan.num_src) // tp]
            if pairs[pair] == "ipc":
                row["ipc_bytes"] += nbytes
                cross_node_ipc += nbytes * cross
            else:
                row["p2p_bytes"] += nbytes
                row["network_bytes"] += nbytes * cross
    return {
        "engines": engines,
        "cross_node_ipc_bytes": cross_node_ipc,
        "ipc_bytes": sum(e["ipc_bytes"] for e in engines),
        "p2p_bytes": sum(e["p2p_bytes"] for e in engines),
        "network_bytes": sum(e["network_bytes"] for e in engines),
    }


def fp8_sync(cfg: RLConfig, run: ResolvedRun, spec: ModelSpec, plan: Plan) -> dict | None:
    """With `rollout.quantization`, what one sync of `plan` moves under that FP8 scheme
    (`resharding.fp8.fp8_wire_bytes`) and how it compares with the sync unquantized: the
    scheme, the byte counts, `ratio` (FP8 / unquantized) and `sender_share` (of the FP8
    tensors' elements, those the trainer ranks quantize). None without quantization."""

    scheme = cfg.rollout.quantization
    if scheme is None:
        return None
    names = vllm_fp8_names(spec)
    # every engine's logical tensors are the same: one engine's layout names them all
    engine = vllm_shards(spec, cfg.rollout.tp, 1, expert_parallel=run.expert_parallel)
    units = tensor_units(engine, plan.num_src, names.__contains__)
    wire = fp8_wire_bytes(
        plan, names.__contains__, element_size=plan.element_size, scheme=scheme, units=units
    )
    return {"scheme": scheme, **wire}


def explain_traffic(cfg: RLConfig, run: ResolvedRun) -> dict:
    """The keys `mcore-rl explain` adds to its JSON: `sync_traffic` (per engine and in all)
    and `cross_node_ipc_bytes`; both None, with `sync_traffic_error`, when the model cannot be
    sized here (no preset and no config.json) or the layouts do not connect. With LoRA's
    adapter sync, `adapter_sync_traffic`: what each step's sync moves (`sync_traffic` is then
    the base's, sent once per sync group when a warm-up changed it). With
    `rollout.quantization`, `fp8_sync` (`fp8_sync`)."""

    try:
        spec = resolve_model(cfg.model.planning_model(), "model.hf_dir")
        plan = sync_plan(cfg, run, spec)
        traffic = sync_traffic(run, plan)
        adapters = (
            sync_traffic(run, adapter_sync_plan(cfg, run, spec))
            if cfg.actor.lora.syncs_adapters
            else None
        )
    except (ConfigError, LayoutError, PlanError) as err:
        return {"sync_traffic": None, "cross_node_ipc_bytes": None, "sync_traffic_error": str(err)}
    return {
        "sync_traffic": traffic,
        "cross_node_ipc_bytes": traffic["cross_node_ipc_bytes"],
        "adapter_sync_traffic": adapters,
        "fp8_sync": fp8_sync(cfg, run, spec, plan),
    }


__all__ = ["adapter_sync_plan", "explain_traffic", "fp8_sync", "sync_plan", "sync_traffic"]
