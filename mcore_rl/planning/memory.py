"""Per-device memory of an RL run, estimated from its run config (as a `SizedRun`: the
`RLConfig`, its resolved device and allocation, the model's shapes) before anything is launched.

Roles and what each rank holds (P = parameters on the rank, see `mcore_stage_params`):
  actor, critic  weights, grads, (bf16) fp32 main params and main-grad copies, Adam m and v,
                 saved activations of the micro batches in flight, logits (last stage)
  reference      weights; forward only (logits of one micro batch on the last stage)
  rollout        one vLLM TP rank: weights / tp, KV cache, activation peak of one engine step
  weight sync    the actor's staging (a colocated rank's shared IPC buffer: one bucket; a
                 point-to-point sender's two staging slots: two buckets) and a point-to-point
                 engine rank's two receive slots, kept from sync to sync (`sync_buffers`);
                 an engine's are outside vLLM's gpu_memory_utilization budget
Devices and phases: a training device holds all training roles of one (pp stage, tp rank, dp
rank) at once; its peak is over the phases "actor train", "critic train" and "forward"
(reference / old log-probs). Disaggregated rollout devices hold one engine rank. Colocated,
every device also holds one engine rank: all of it during "rollout", and during the training
phases nothing when `rollout.enable_sleep` (vLLM sleep frees weights and KV cache; GPU
only — on CPU sleep is a no-op, so the engine stays whole). The trainer reduces gradients in
fp32 (`TRAINER_GRAD_DTYPE`). Every device also keeps `cluster.reserve_gib` for what is not
modelled (CUDA context, NCCL buffers, allocator fragmentation, transient workspaces) — except
a disaggregated engine sized by gpu_memory_utilization, whose budget already covers its own.

Bytes per parameter of the training states (`state_bytes_per_param`) reproduce the table of
Megatron-Core's distributed-optimizer guide (docs.nvidia.com/megatron-core/developer-guide,
"Distributed Optimizer"), d = data-parallel size:
    param / grad dtype          no dist-opt   dist-opt
    bf16 (fp16) / bf16 (fp16)   20            4 + 16/d
    bf16 (fp16) / fp32          18            6 + 12/d
    fp32 / fp32                 16            8 + 8/d
(tests/planning/test_memory.py checks every stage of a llama3-70b grid against these.)

Activations: `mcore_rl.planning.activations` (Korthikanti et al. 2022, Table 2, term by term).

Validated on CPU (megatron-core 0.16.1 over gloo, micro model, local kernels;
tests/planning/test_measured.py and `python -m mcore_rl.planning.measure`): weights + grads +
main params + Adam states equal the tensor bytes megatron allocates (to < 0.01 %) for TP, SP,
PP, VPP, DP, distributed optimizer, fp32 and bf16; activations equal the peak of live
saved-for-backward bytes during megatron's no-pipelining / 1F1B / interleaved schedules within
0.2 % (no and selective recompute) and 3.4 % (full recompute). Not validated: the TE kernels
(flash attention, fused norms: GPU only), bf16 grads (the trainer reduces in fp32), vLLM's
activation peak (a coarse estimate), workspaces and fragmentation (in the reserve).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mcore_rl.config import ConfigError
from mcore_rl.config.dtypes import dtype_bytes
from mcore_rl.layouts.expert_placement import vllm_local_experts
from mcore_rl.layouts.shards import VLLM_VOCAB_PADDING
from mcore_rl.megatron.config import LORA_HEAD, TrainConfig
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.planning.activations import (
    ActivationModel,
    in_flight_layers,
    layer_activation_bytes,
    layer_activation_terms,
    recompute_workspace,
)
from mcore_rl.planning.sized import TRAINER_GRAD_DTYPE, GiB, SizedRun
from mcore_rl.resharding.fp8 import BLOCK as FP8_BLOCK
from mcore_rl.resharding.fp8 import SCALE_BYTES as FP8_SCALE_BYTES
from mcore_rl.rollout.config import RolloutConfig
from mcore_rl.runconfig.resolve import SYNC_BUCKET_MB

# --- parameters per rank ----------------------------------------------------------------------


def mcore_layer_params(spec: ModelSpec, tp: int, ep: int = 1, etp: int | None = None) -> int:
    """Parameters of one decoder layer on one Megatron TP rank: qkv [(q + 2kv)/tp, h] (+ bias),
    proj [h, q/tp], fc1 [2·ffn/tp, h], fc2 [h, ffn/tp], two norms [h] (replicated), q/k norms
    [head_dim] (Qwen3). A MoE layer instead of fc1/fc2: the router [experts, h] (replicated)
    and this EP rank's experts/ep experts, each split over expert-TP `etp` (default tp)."""
    qkv_out = spec.q_dim + 2 * spec.kv_dim
    qkv = spec.hidden * qkv_out + (qkv_out if spec.qkv_bias else 0)
    norms = 2 * spec.hidden + (2 * spec.head_dim if spec.qk_norm else 0)
    if spec.is_moe:
        experts = spec.routed_experts // ep * 3 * spec.expert_ffn * spec.hidden // (etp or tp)
        return (
            (qkv + spec.q_dim * spec.hidden) // tp
            + experts
            + spec.routed_experts * spec.hidden
            + norms
        )
    return (qkv + spec.q_dim * spec.hidden + 3 * spec.ffn * spec.hidden) // tp + norms


def mcore_stage_params(
    spec: ModelSpec, parallel: ParallelConfig, stage: int, head: Literal["lm", "value"] = "lm"
) -> int:
    """Parameters on one TP rank of pipeline stage `stage`: its layers, the embedding
    [V_pad/tp, h] on stage 0, final norm and output head on the last stage. With tied
    embeddings megatron keeps a copy of the embedding on the last stage when pp > 1. The
    critic's value head is [1, h]."""
    tp = parallel.tp
    counts = parallel.stage_layer_counts(spec.layers)
    vocab_rows = spec.mcore_padded_vocab(tp) // tp
    n = counts[stage] * mcore_layer_params(spec, tp, parallel.ep, parallel.expert_tp)
    if stage == 0:
        n += vocab_rows * spec.hidden
    if stage == parallel.pp - 1:
        n += spec.hidden
        if head == "value":
            n += spec.hidden
        elif not spec.tied_embeddings or parallel.pp > 1:
            n += vocab_rows * spec.hidden
    return n


def lora_stage_params(
    spec: ModelSpec, parallel: ParallelConfig, stage: int, rank: int, targets: tuple[str, ...]
) -> int:
    """LoRA adapter parameters on one TP rank of pipeline stage `stage`: per adapted linear
    r·(in + out) with the linear's split side divided by TP (column-parallel: B's rows;
    row-parallel: A's columns) — `megatron.lora`; the output layer's (a column linear over
    the padded vocabulary) on the last stage."""
    tp, q, kv = parallel.tp, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    shapes = {
        "linear_qkv": (spec.hidden, (q + 2 * kv) // tp),  # (A's columns, B's rows)
        "linear_proj": (q // tp, spec.hidden),
        "linear_fc1": (spec.hidden, 2 * spec.ffn // tp),
        "linear_fc2": (spec.ffn // tp, spec.hidden),
    }
    per_layer = sum(rank * sum(shapes[t]) for t in targets if t != LORA_HEAD)
    n = parallel.stage_layer_counts(spec.layers)[stage] * per_layer
    if LORA_HEAD in targets and stage == parallel.pp - 1:
        n += rank * (spec.hidden + spec.mcore_padded_vocab(tp) // tp)
    return n


def vllm_kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    """vLLM splits kv heads over TP, or replicates them when tp > kv heads."""
    return max(spec.kv_heads // tp, 1)


def vllm_rank_params(spec: ModelSpec, tp: int, expert_parallel: bool = False) -> int:
    """Parameters on one vLLM TP rank (kv heads replicated when tp > kv heads; vocab padded to
    a multiple of 64, then split): its linear and expert weights (`vllm_rank_fp8_params`),
    the q/k/v biases and norms, and the embedding and LM head rows."""
    q = spec.q_dim // tp
    kv = vllm_kv_heads_per_rank(spec, tp) * spec.head_dim
    bias = (q + 2 * kv) if spec.qkv_bias else 0
    norms = 2 * spec.hidden + (2 * spec.head_dim if spec.qk_norm else 0)
    vocab_rows = -(-spec.vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING // tp
    heads = 1 if spec.tied_embeddings else 2
    return (
        vllm_rank_fp8_params(spec, tp, expert_parallel)
        + spec.layers * (bias + norms)
        + heads * vocab_rows * spec.hidden
        + spec.hidden
    )


def vllm_rank_fp8_params(spec: ModelSpec, tp: int, expert_parallel: bool = False) -> int:
    """The linear and expert weights on one vLLM TP rank — what vLLM's online FP8 stores in one
    byte (the layout tables' `Side.fp8`): every layer's qkv, o, MLP (or experts and router)
    weights; not biases, norms, embeddings or the LM head. expert_parallel: the busiest
    rank's whole experts (rank 0: vLLM's linear placement gives the remainder to the first
    ranks)."""
    q = spec.q_dim // tp
    kv = vllm_kv_heads_per_rank(spec, tp) * spec.head_dim
    layer = spec.hidden * (q + 2 * kv) + q * spec.hidden
    if spec.is_moe and expert_parallel:  # whole experts on each rank; router replicated
        experts = len(vllm_local_experts(spec.routed_experts, tp, 0))
        layer += experts * 3 * spec.expert_ffn * spec.hidden + spec.routed_experts * spec.hidden
    elif spec.is_moe:  # vLLM: every expert on every rank, each split over TP; router replicated
        layer += spec.routed_experts * (3 * spec.expert_ffn * spec.hidden // tp + spec.hidden)
    else:
        layer += 3 * spec.ffn * spec.hidden // tp
    return spec.layers * layer


# one fp32 scale per 128×128 block of an FP8 weight (block-wise FP8); per tensor: a few floats
FP8_SCALE_BYTES_PER_PARAM = {
    "fp8_per_block": FP8_SCALE_BYTES / math.prod(FP8_BLOCK),
    "fp8_per_tensor": 0.0,
}


def engine_weight_bytes(spec: ModelSpec, r: RolloutConfig) -> tuple[float, str]:
    """One engine rank's weights in bytes, and how they are stored: in rollout.dtype, or
    with rollout.quantization the FP8 tensors at one byte per element plus their scales."""
    n, width = vllm_rank_params(spec, r.tp, r.expert_parallel), dtype_bytes(r.dtype)
    if r.quantization is None:
        return n * width, f"{r.dtype}, {_g(n)} params (1/{r.tp} of the model)"
    n8 = vllm_rank_fp8_params(spec, r.tp, r.expert_parallel)
    scales = n8 * FP8_SCALE_BYTES_PER_PARAM[r.quantization]
    return (
        n8 + scales + (n - n8) * width,
        f"{r.quantization}: {_g(n8)} params in FP8, {_g(n - n8)} in {r.dtype} "
        f"(1/{r.tp} of the model)",
    )


def kv_bytes_per_token(spec: ModelSpec, tp: int, dtype_bytes: int) -> int:
    """KV cache per token on one vLLM TP rank: 2 (k and v) · layers · kv heads per rank ·
    head_dim · dtype bytes."""
    return 2 * spec.layers * vllm_kv_heads_per_rank(spec, tp) * spec.head_dim * dtype_bytes


# --- training states --------------------------------------------------------------------------


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each training state on one rank."""

    weights: float
    grads: float
    main_params: float
    main_grads: float
    adam: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.main_params + self.main_grads + self.adam


def state_bytes_per_param(
    dtype: str, grad_dtype: str, distributed_optimizer: bool, dp: int
) -> StateBytes:
    """Megatron's training states per parameter (see the module doc for the published table).

    weights in `dtype`; the DDP grad buffer in `grad_dtype`; with 16-bit weights the optimizer
    keeps fp32 main params, and, when the grads are 16-bit too, an fp32 copy of them as the
    main params' grads (`main_param.grad = main_grad.float()`); Adam keeps m and v in fp32.
    The distributed optimizer shards the fp32 states over the dp ranks (ZeRO-1).
    """
    p, g = dtype_bytes(dtype), dtype_bytes(grad_dtype)
    if g < p:
        raise ValueError(f"grad_dtype={grad_dtype} narrower than dtype={dtype}")
    share = 1 / dp if distributed_optimizer else 1.0
    mixed = p < 4
    return StateBytes(
        weights=p,
        grads=g,
        main_params=4 * share if mixed else 0.0,
        main_grads=4 * share if mixed and g < 4 else 0.0,
        adam=8 * share,
    )


# --- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Component:
    """One line of a rank's memory. `resident`: held for the whole run (weights, states, KV);
    otherwise only during the role's own phase (activations, logits)."""

    name: str
    bytes: float
    detail: str
    resident: bool = True


@dataclass(frozen=True)
class RankMemory:
    """What one rank of a role holds. `where`: which rank ("pp stage 0/4", "engine tp rank")."""

    role: str
    where: str
    components: tuple[Component, ...]

    @property
    def total(self) -> float:
        return sum(c.bytes for c in self.components)

    @property
    def resident(self) -> float:
        return sum(c.bytes for c in self.components if c.resident)

    @property
    def transient(self) -> float:
        return sum(c.bytes for c in self.components if not c.resident)


@dataclass(frozen=True)
class Phase:
    name: str
    parts: tuple[tuple[str, float], ...]  # (what, bytes)

    @property
    def total(self) -> float:
        return sum(b for _, b in self.parts)


@dataclass(frozen=True)
class DeviceMemory:
    """One kind of device (its worst pipeline stage) and its phases."""

    device: str
    phases: tuple[Phase, ...]

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)


@dataclass(frozen=True)
class Suggestion:
    """A change of the shape (as CLI overrides) and the worst device's peak it gives."""

    knob: str
    overrides: tuple[str, ...]
    peak_bytes: float
    fits: bool
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    run: SizedRun
    roles: tuple[RankMemory, ...]
    devices: tuple[DeviceMemory, ...]
    notes: tuple[str, ...] = ()
    suggestions: tuple[Suggestion, ...] = ()

    @property
    def device_bytes(self) -> float:
        return self.run.cluster.device_gib * GiB

    @property
    def worst(self) -> DeviceMemory:
        return max(self.devices, key=lambda d: d.peak.total)

    @property
    def peak_bytes(self) -> float:
        return self.worst.peak.total

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.device_bytes


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _g(n: float) -> str:
    return f"{n / 1e9:.3g}e9" if n >= 1e7 else f"{n:,.0f}"


def activation_model(run: SizedRun, train: TrainConfig) -> ActivationModel:
    par = run.cfg.actor
    return ActivationModel.for_kernels(
        run.kernels,
        act_bytes=dtype_bytes(train.dtype),
        tp=par.tp,
        sequence_parallel=par.sequence_parallel,
        recompute=train.recompute,
    )


def last_stage_terms(
    spec: ModelSpec,
    seq: int,
    micro_batch: int,
    model: ActivationModel,
    head: Literal["lm", "value"] = "lm",
) -> dict[str, float]:
    """What the last stage keeps after its layers, per micro batch: the final norm, the output
    layer's input and, for an LM head, the fp32 logits megatron's vocab-parallel cross entropy
    keeps ([s·b, V_pad/tp]); plus, not kept but alive while the loss is formed, the output
    layer's own logits in act dtype."""
    s, b, B, t = seq, micro_batch, model.act_bytes, model.tp
    sp = t if model.sequence_parallel else 1
    h = spec.hidden
    norm = (8 * s * b * h + 4 * s * b) if model.norm == "composite" else B * s * b * h
    terms = {"final norm, head input": (norm + B * s * b * h) / sp}
    if head == "lm":
        rows = spec.mcore_padded_vocab(t) // t
        terms["logits (fp32, kept)"] = 4 * s * b * rows
        terms["logits (transient)"] = B * s * b * rows
    return terms


# The actor's loss (megatron/policy.py: log-prob and entropy over this rank's vocabulary,
# forward and backward) as fp32 [s·b, V/tp] buffers at its peak, beyond the output layer's own
# logits: the chunked computation (`chunked_log_probs_and_entropy`) holds the logits' gradient in
# their dtype and two fp32 chunks; rounded up from what a GPU measured
# (`scripts/gpu_check.sh`, actor.memory.policy_loss).
POLICY_LOSS_FP32_ROWS = 1


_SYNC_DETAIL = {
    "colocated": "one bucket, the shared IPC buffer",
    "disaggregated": "two buckets of point-to-point staging",
}


def sync_buffers(run: SizedRun) -> tuple[float, float]:
    """The weight sync's buffers kept between syncs, bytes: (per actor rank, per engine rank).
    Colocated (IPC): the actor rank's shared staging buffer of one bucket, the engine rank
    copying straight out of it; otherwise (point to point) two staging slots of a bucket on
    each side (`resharding.copy_service.P2PCopy`: round k + 1 posted before round k is done)."""

    mb = run.cfg.sync.bucket_mb
    bucket = (SYNC_BUCKET_MB[run.device] if mb is None else mb) * (1 << 20)
    if run.cluster.placement == "colocated":
        return bucket, 0.0
    return 2 * bucket, 2 * bucket


def fp8_sync_sources(run: SizedRun, stage: int) -> tuple[tuple[str, float], ...]:
    """An FP8 sync's sender side (`resharding/fp8.quantized_sources`,
    `block_quantized_sources`): a one-byte copy of the actor rank's shards it sends quantized
    — at most its parameters of stage `stage` — and, block-wise, their block scales, held
    while it sends, after training has freed its activations."""
    n = mcore_stage_params(run.spec, run.cfg.actor, stage, "lm")
    per_param = 1 + FP8_SCALE_BYTES_PER_PARAM[run.cfg.rollout.quantization or "fp8_per_tensor"]
    return (("FP8 sync sources (1 byte per parameter, at most)", float(n) * per_param),)


def role_train(run: SizedRun, role: str) -> TrainConfig:
    """The TrainConfig a training role runs with: the critic its own, the actor and the
    reference the run's `train`."""
    return run.cfg.critic_train if role == "critic" else run.cfg.train


def training_rank(run: SizedRun, spec: ModelSpec, role: str, stage: int) -> RankMemory:
    """One TP rank of pipeline stage `stage` of a training role ("actor", "critic",
    "reference"), all on the actor's grid."""
    t, par = role_train(run, role), run.cfg.actor
    head: Literal["lm", "value"] = "value" if role == "critic" else "lm"
    n = mcore_stage_params(spec, par, stage, head)
    where = f"pp stage {stage}/{par.pp}"
    states = state_bytes_per_param(
        t.dtype, TRAINER_GRAD_DTYPE, par.use_distributed_optimizer, par.dp
    )
    comps = [Component("weights", n * states.weights, f"{t.dtype}, {_g(n)} params")]
    lora = run.cfg.actor.lora
    if role == "actor" and lora.enabled:  # the base is frozen: states for the adapters only
        n = lora_stage_params(spec, par, stage, lora.rank, lora.targets)
        comps.append(
            Component("LoRA adapters", n * states.weights, f"rank {lora.rank}, {_g(n)} params")
        )
    s, b = t.seq_len, t.micro_batch_size
    act = activation_model(run, t)
    last = stage == par.pp - 1
    tail = last_stage_terms(spec, s, b, act, head) if last else {}
    if role == "actor" and last:  # the policy loss instead of the LM loss's kept fp32 logits
        tail["policy loss (fp32 vocab rows)"] = POLICY_LOSS_FP32_ROWS * tail.pop(
            "logits (fp32, kept)"
        )
    if role == "reference":  # forward only: nothing kept; one micro batch's logits at a time
        if last:
            logits = tail.get("logits (fp32, kept)", 0) + tail.get("logits (transient)", 0)
            comps.append(
                Component("logits", logits, f"1 micro batch, [s·b, V/tp] {t.dtype} + fp32", False)
            )
        return RankMemory(role, where, tuple(comps))
    comps += _optimizer_components(n, states, par)
    if role == "actor":
        staging = sync_buffers(run)[0]
        comps.append(
            Component(
                "weight-sync staging",
                staging,
                f"{_mib(staging)}: {_SYNC_DETAIL[run.cluster.placement]}",
            )
        )
    comps += _activation_components(run, spec, t, act, role, stage, tail)
    return RankMemory(role, where, tuple(comps))


def _optimizer_components(n: int, states: StateBytes, par: ParallelConfig) -> list[Component]:
    """The grads and optimizer states of `n` trained parameters."""
    shard = f", sharded over dp={par.dp}" if par.use_distributed_optimizer and par.dp > 1 else ""
    comps = [Component("grads", n * states.grads, f"{TRAINER_GRAD_DTYPE} DDP grad buffer")]
    if states.main_params:
        comps.append(Component("main params", n * states.main_params, f"fp32{shard}"))
    if states.main_grads:
        comps.append(Component("main grads", n * states.main_grads, f"fp32 copy{shard}"))
    comps.append(Component("adam m, v", n * states.adam, f"2 × fp32{shard}"))
    return comps


def _activation_components(
    run: SizedRun,
    spec: ModelSpec,
    t: TrainConfig,
    act: ActivationModel,
    role: str,
    stage: int,
    tail: dict[str, float],
) -> list[Component]:
    """A training rank's transient memory: the micro batches' activations in flight, the last
    stage's `tail` (logits and loss), the routing an update replays, and the workspace the
    backward rematerializes."""
    par, s, b = run.cfg.actor, t.seq_len, t.micro_batch_size
    per_layer = layer_activation_bytes(spec, s, b, act)
    m = int(run.num_micro_batches(t)) or 1
    layers = in_flight_layers(par, spec.layers, stage, m)
    comps = [
        Component(
            "activations",
            layers * per_layer,
            f"{layers} layer-micro-batches × {_mib(per_layer)} ({t.recompute} recompute, "
            f"{run.kernels} kernels{', SP' if par.sequence_parallel else ''})",
            False,
        )
    ]
    comps += [
        Component(name, value, "last stage, 1 micro batch", False) for name, value in tail.items()
    ]
    if role == "actor" and spec.is_moe and run.cfg.algorithm.routing_replay != "none":
        comps.append(routing_component(run, spec))
    work = recompute_workspace(spec, s, b, act)
    logits = sum(tail.values())
    if work - logits > 1 << 20:  # rematerialized in backward, after the loss freed the logits
        comps.append(
            Component(
                "recompute workspace",
                max(work - logits, 0.0),
                f"{_mib(work)} rematerialized per layer in backward"
                + (f", minus the {_mib(logits)} of logits freed by then" if logits else ""),
                False,
            )
        )
    return comps


def routing_component(run: SizedRun, spec: ModelSpec) -> Component:
    """The experts an update replays (`algorithm.routing_replay`): int16 [rows, s, layers, k]
    for one mini-batch's DP slice, on the device while it trains."""
    rows = run.global_batch // run.cfg.actor.dp
    s, k = run.cfg.train.seq_len, spec.top_k
    return Component(
        "MoE routing (replay)",
        2.0 * rows * s * spec.layers * k,
        f"int16 [{rows} rows, s {s}, {spec.layers} layers, top-{k}]",
        False,
    )


def rollout_rank(run: SizedRun, spec: ModelSpec) -> tuple[RankMemory, list[str]]:
    """One vLLM TP rank: weights, activation peak of one step, KV cache — on GPU what is left
    of gpu_memory_utilization · device, on CPU rollout.kv_cache_gib (what the engine is
    given); a sequence is rollout.max_model_len tokens."""
    r = run.cfg.rollout
    notes = []
    B = dtype_bytes(r.dtype)
    weights, stored = engine_weight_bytes(spec, r)
    tok, seqs, seq_len = run.max_num_batched_tokens, run.max_num_seqs, r.max_model_len
    vocab = -(-spec.vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    # Coarse: hidden states, qkv, MLP intermediates of one step's tokens, plus the sampler's
    # fp32 logits and probabilities of max_num_seqs rows over the whole (gathered) vocab.
    act = tok * (4 * spec.hidden + (spec.q_dim + 2 * spec.kv_dim + 3 * spec.ffn) // r.tp) * B
    act += 2 * 4 * min(seqs, tok) * vocab
    per_tok = kv_bytes_per_token(spec, r.tp, B)
    want_tokens = seqs * seq_len
    util = run.gpu_memory_utilization
    if util is None:
        kv = r.kv_cache_gib * GiB
        what = f"rollout.kv_cache_gib={r.kv_cache_gib:g}"
    else:
        kv = util * run.cluster.device_gib * GiB - weights - act
        what = f"rest of {util:g} × {run.cluster.device_gib:g} GiB"
    tokens = max(kv, 0) // per_tok
    kv_detail = f"{what}: {tokens:,.0f} tokens × {per_tok:,} B"
    if kv <= 0:
        notes.append(
            f"rollout: gpu_memory_utilization={util:g} leaves no KV cache "
            f"({_gib(kv)}) after weights {_gib(weights)}"
        )
    elif tokens < seq_len:
        notes.append(
            f"rollout: the KV cache holds {tokens:,.0f} tokens, less than one "
            f"sequence of rollout.max_model_len={seq_len}: vLLM refuses to start"
        )
    elif tokens < want_tokens:
        notes.append(
            f"rollout: the KV cache holds {tokens / seq_len:.1f} full sequences < "
            f"rollout.max_num_seqs={seqs} (vLLM preempts; slower)"
        )
    kv = max(kv, 0)
    comps: tuple[Component, ...] = (
        Component("weights", weights, stored),
        Component("activations", act, f"one step of {tok} tokens + sampler logits (estimate)"),
        Component("kv cache", kv, kv_detail),
    )
    receive = sync_buffers(run)[1]
    if receive:  # outside vLLM's own budget
        comps += (
            Component(
                "weight-sync receive",
                receive,
                f"{_mib(receive)}: two buckets of point-to-point receive slots",
            ),
        )
    return RankMemory("rollout", f"engine tp rank (tp={r.tp})", comps), notes


def reward_rank(run: SizedRun) -> RankMemory:
    """The reward model's worst rank: weights of its fullest pipeline stage (a [1, h] head
    instead of the LM head) and, while it scores, one micro batch of train.seq_len tokens
    through one layer plus its head input — forward only, nothing kept. Its ranks share the
    training devices (reward rank r on the device of actor rank r mod the actor's world)."""
    rm, spec = run.cfg.reward_model, run.reward_spec
    assert spec is not None, "reward_rank: the run has no reward model"
    par = rm.parallel
    stage_params = [mcore_stage_params(spec, par, stage, "value") for stage in range(par.pp)]
    n = max(stage_params)
    width = dtype_bytes(rm.dtype)
    act = ActivationModel.for_kernels(
        run.kernels, act_bytes=width, tp=par.tp, sequence_parallel=False, recompute="none"
    )
    s, b = run.cfg.train.seq_len, rm.micro_batch_size
    forward = layer_activation_bytes(spec, s, b, act) + sum(
        last_stage_terms(spec, s, b, act, "value").values()
    )
    return RankMemory(
        "reward model",
        f"pp stage {stage_params.index(n)}/{par.pp}",
        (
            Component("weights", n * width, f"{rm.dtype}, {_g(n)} params"),
            Component("forward", forward, f"1 micro batch of {b}, 1 layer + head input", False),
        ),
    )


def _stage_memory(
    run: SizedRun,
    stage: int,
    roles_on: list[str],
    rollout: RankMemory,
    reward: RankMemory | None,
    asleep: float,
    reserve: tuple[str, float],
) -> tuple[dict[str, RankMemory], DeviceMemory]:
    """Pipeline stage `stage`'s ranks and its device's phases: each role's states resident
    throughout, its activations in its own phase; on a shared device the engine asleep while
    the trainers work and awake for the rollout."""
    colocated = run.cluster.placement == "colocated"
    ranks = {role: training_rank(run, run.spec, role, stage) for role in roles_on}
    if reward is not None:
        ranks["reward model"] = reward
    resident = tuple((f"{role} states", r.resident) for role, r in ranks.items())
    phases = []
    if reward is not None:
        # scoring runs before the engines sleep: a colocated engine is awake then
        awake = (("rollout engine", rollout.total),) if colocated else ()
        phases.append(
            Phase(
                "reward scoring",
                resident + (("reward model forward", reward.transient),) + awake + (reserve,),
            )
        )
    for role, name in (
        ("actor", "actor train"),
        ("critic", "critic train"),
        ("reference", "forward (reference / old log-probs)"),
    ):
        if role not in ranks:
            continue
        parts = resident + ((f"{role} activations", ranks[role].transient),)
        if colocated:
            parts += (("rollout asleep", asleep),)
        phases.append(Phase(name, parts + (reserve,)))
    if run.cfg.rollout.quantization is not None and "actor" in ranks:
        phases.append(
            Phase(
                "weight sync",
                resident
                + fp8_sync_sources(run, stage)
                + ((("rollout asleep", asleep),) if colocated else ())
                + (reserve,),
            )
        )
    if colocated:
        phases.append(Phase("rollout", resident + (("rollout engine", rollout.total), reserve)))
    label = "shared device" if colocated else "training device"
    par = run.cfg.actor
    return ranks, DeviceMemory(f"{label}, pp stage {stage}/{par.pp}", tuple(phases))


def plan_memory(run: SizedRun) -> MemoryPlan:
    """Every role's per-rank memory and every device's phases (worst pipeline stage)."""
    spec = run.spec
    par = run.cfg.actor
    colocated = run.cluster.placement == "colocated"
    try:
        par.check_model(spec)
    except ConfigError as err:  # named as the run config names the grid
        raise err.under("actor") from None
    roles_on = (
        ["actor"] + (["critic"] if run.critic else []) + (["reference"] if run.reference else [])
    )
    reserve = ("reserve", run.cluster.reserve_gib * GiB)
    rollout, notes = rollout_rank(run, spec)
    if run.device == "cpu" and run.cfg.rollout.enable_sleep and colocated:
        notes.append(
            "rollout.enable_sleep has no effect on CPU (vLLM sleep is a no-op): planned as awake"
        )
    asleep = 0.0 if run.engine_sleeps else rollout.total
    reward = reward_rank(run) if run.reward_spec is not None else None
    per_stage = [
        _stage_memory(run, stage, roles_on, rollout, reward, asleep, reserve)
        for stage in range(par.pp)
    ]
    worst_ranks, worst_dev = max(per_stage, key=lambda x: x[1].peak.total)
    devices = [worst_dev]
    if not colocated:
        # With gpu_memory_utilization vLLM's own budget covers its CUDA context and
        # non-torch memory; a fixed-size KV cache does not.
        parts = (("rollout engine", rollout.total),) + (
            (reserve,) if run.gpu_memory_utilization is None else ()
        )
        devices.append(DeviceMemory("rollout device", (Phase("rollout", parts),)))
    return MemoryPlan(
        run=run,
        roles=tuple(worst_ranks.values()) + (rollout,),
        devices=tuple(devices),
        notes=tuple(notes),
    )


__all__ = [
    "POLICY_LOSS_FP32_ROWS",
    "ActivationModel",
    "Component",
    "DeviceMemory",
    "MemoryPlan",
    "Phase",
    "RankMemory",
    "StateBytes",
    "Suggestion",
    "in_flight_layers",
    "kv_bytes_per_token",
    "last_stage_terms",
    "layer_activation_bytes",
    "layer_activation_terms",
    "mcore_layer_params",
    "mcore_stage_params",
    "plan_memory",
    "recompute_workspace",
    "role_train",
    "state_bytes_per_param",
    "sync_buffers",
    "vllm_rank_params",
]
