"""One vLLM rollout engine: token ids in, sampled token ids + log-probs out, and the engine side
of the shard-to-shard weight sync.

Process layout (vLLM reads its settings from the process environment, so the engine sets them
before starting vLLM; one live engine per process):
  tp == 1  vLLM in-process: the engine core and the one worker run in the caller's process
           (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `distributed_executor_backend="uni"`).
  tp  > 1  the engine core in-process, one worker process per TP rank (vLLM's mp executor);
           on CPU each rank's OpenMP threads are pinned (`VLLM_CPU_OMP_THREADS_BIND`).
On CPU the model is fp32 and the KV cache has a fixed size (`kv_cache_gib`, passed as
`kv_cache_memory_bytes`; the legacy integer-GiB `VLLM_CPU_KVCACHE_SPACE` would override it
and is removed from the environment). Side effects on the host process of an in-process
(tp == 1) engine, from vLLM's CPU worker: torch is set to 1 thread and `torch.set_num_threads`
becomes a no-op for the rest of the process; `vllm.envs` caches env reads (we clear that cache
before each engine starts).

Deadlines: worker RPCs (sync, describe) and every Ray call (ray_engines.py) have one; an
in-process `generate()` cannot be interrupted — run engines in Ray actors to bound it.

Log-probs: vLLM 0.32's `logprobs_mode` defaults to (and we pin) "raw_logprobs": the
log-softmax of the model's logits *before* temperature, penalties, top-k and top-p. That is
what HF `transformers` gives (`log_softmax(model(ids).logits)`), i.e. what the trainer
recomputes; with temperature != 1 or top-k/top-p it is *not* the distribution the token was
drawn from ("processed_logprobs" would be). The trainer must use the same definition.

Seeds: with `SamplingConfig.seed = s`, prompt i of a call (global index `first_index + i`)
uses seed `s + (first_index + i) * n`, and vLLM gives its j-th sample seed `+ j`; so the
result of a prompt does not depend on how prompts are batched or spread over engines.

Weight sync (see worker_extension.py for the worker side): the trainer hosts the sync group's
store; `start_join_sync_group` / `finish_join_sync_group` bracket the trainer's own join;
`begin_sync(plan)` starts the workers' receive-and-install RPC in a thread and returns at once
(the RPC blocks until the trainer's sends arrive, so the two must overlap); `finish_sync()`
waits for it, checks each rank installed exactly the plan's names, and resets the prefix cache.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Literal, Mapping, Sequence

import torch

from mcore_rl.config import ConfigError
from mcore_rl.config.dtypes import DtypeName, normalize_dtype_fields

WORKER_EXTENSION = "mcore_rl.rollout.worker_extension.WorkerExtension"
GiB = 1 << 30


class RolloutError(RuntimeError):
    """An engine failed, died or missed a deadline. Names the engine, the phase ("start-up",
    "generate", "sync", ...) and, when known, the worker (TP rank)."""

    def __init__(self, engine: int, phase: str, detail: str, rank: int | None = None):
        self.engine, self.phase, self.rank, self.detail = engine, phase, rank, detail
        where = f"rollout engine {engine}" + (f" tp rank {rank}" if rank is not None else "")
        super().__init__(f"{where}, {phase}: {detail}")

    def __reduce__(self):  # crosses process boundaries (Ray) with its fields intact
        return (type(self), (self.engine, self.phase, self.detail, self.rank))


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """vLLM rollout engines.

    tp: tensor-parallel size of each engine (vLLM's mp executor when > 1).
    engines: data-parallel engines (each in its own Ray actor, see ray_engines.py).
    max_model_len: prompt + response tokens per sequence.
    max_num_seqs: sequences batched per step (vLLM's default when None).
    max_num_batched_tokens: tokens scheduled per engine step, which sizes vLLM's activation peak
        (vLLM's default when None: it depends on the device, see
        `mcore_rl.planning.sized.vllm_batch_defaults`; CPU: 4096). On CPU keep it >= the prompt
        tokens of one generate call: vLLM 0.32 fails a seeded request whose prefill is split
        over steps ("CPU Generator does not use offset").
    block_size: KV-cache block (tokens); prefix caching reuses whole blocks. vLLM's default
        when None (128 on CPU).
    dtype: model dtype ("float32" on CPU; GPUs usually "bfloat16"; "fp32"/"bf16"/"fp16"
        accepted).
    gpu_memory_utilization: GPU only — fraction of GPU memory vLLM may take.
    kv_cache_gib: CPU only — KV cache size per worker.
    enforce_eager: no CUDA graphs / torch.compile (required on CPU).
    enable_prefix_caching: reuse KV of shared prompt prefixes (reset after every sync).
    enable_sleep: GPU only — `sleep()` frees weights/KV for colocated training; a no-op on CPU.
    sleep_level: vLLM sleep level (1: offload weights to host, 2: discard them — the next
        weight sync must then restore every tensor).
    seed: vLLM's engine seed (unseeded sampling); per-request seeds come from SamplingConfig.
    cpu_threads_bind: CPU only, tp > 1 — `VLLM_CPU_OMP_THREADS_BIND` ("0|1": rank 0 on core 0,
        rank 1 on core 1); "" splits this process's allowed cores evenly over the TP ranks.
    cpus_per_engine: Ray CPUs reserved per engine actor.
    host_ip: address vLLM and Ray bind to (`VLLM_HOST_IP`); loopback for one machine.
    mode: when the engines generate relative to training (`mcore_rl.trainer.async_rollout`):
        "sync" (on-policy: each step generates its batch on the weights just synced),
        "one_step" (step n+1's batch is generated while step n trains: staleness 1) or
        "async" (batches are generated up to max_staleness steps ahead). one_step and async
        keep the engines awake during training, so not with enable_sleep.
    max_staleness: async only — k: a batch generated on weight version v trains at a version
        <= v + k (>= 0; one_step is 1, sync 0).
    partial_chunk_tokens: one_step / async only — partial rollouts
        (`mcore_rl.trainer.partial_rollout`): a batch ahead is generated at most this many new
        tokens per weight version, the weights are synced between chunks, and an unfinished
        sample continues from its prefix on the new weights; every token records the version
        that produced it. null (default): each batch is generated whole on one version.
    """

    tp: int = 1
    engines: int = 1
    max_model_len: int = 1024
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    dtype: DtypeName = "float32"
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    enable_sleep: bool = False
    sleep_level: int = 1
    seed: int = 0
    cpu_threads_bind: str = ""
    cpus_per_engine: float = 1.0
    host_ip: str = "127.0.0.1"
    mode: Literal["sync", "one_step", "async"] = "sync"
    max_staleness: int = 2
    partial_chunk_tokens: int | None = None

    #: keys that moved out of this section (the loader names their new place)
    MOVED: ClassVar[dict[str, str]] = {
        "start_timeout_s": "set deadlines.startup_s (an engine's start-up wait)",
        "call_timeout_s": "set deadlines.engine_call_s (standalone: the engine's "
                          "call_timeout_s argument)"}

    @property
    def staleness_bound(self) -> int:
        """How many updates older than the trainer a batch may be (sync 0, one_step 1)."""
        return {"sync": 0, "one_step": 1}.get(self.mode, self.max_staleness)

    def __post_init__(self) -> None:
        for name in ("tp", "engines", "max_model_len"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", self.max_num_seqs, "must be >= 1 (or null)")
        if self.max_num_batched_tokens is not None and \
                self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("max_num_batched_tokens", self.max_num_batched_tokens,
                              f"must be >= max_model_len={self.max_model_len} (or null)")
        if self.block_size is not None and (self.block_size < 16 or self.block_size % 16):
            raise ConfigError("block_size", self.block_size,
                              "must be a multiple of 16 (CPU prefers multiples of 32)")
        normalize_dtype_fields(self, "dtype")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization", self.gpu_memory_utilization,
                              "must be in (0, 1]")
        if not self.kv_cache_gib > 0:
            raise ConfigError("kv_cache_gib", self.kv_cache_gib, "must be > 0")
        if self.sleep_level not in (1, 2):
            raise ConfigError("sleep_level", self.sleep_level, "allowed values: 1, 2")
        if self.seed < 0:
            raise ConfigError("seed", self.seed, "must be >= 0")
        if self.cpus_per_engine < 0:
            raise ConfigError("cpus_per_engine", self.cpus_per_engine, "must be >= 0")
        if self.mode not in ("sync", "one_step", "async"):
            raise ConfigError("mode", self.mode, "allowed values: sync, one_step, async")
        if self.max_staleness < 0:
            raise ConfigError("max_staleness", self.max_staleness, "must be >= 0")
        if self.partial_chunk_tokens is not None and self.partial_chunk_tokens < 1:
            raise ConfigError("partial_chunk_tokens", self.partial_chunk_tokens,
                              "must be >= 1 new tokens per chunk (or null: no partial rollouts)")
        if self.partial_chunk_tokens is not None and self.mode == "sync":
            raise ConfigError("partial_chunk_tokens", self.partial_chunk_tokens,
                              "partial rollouts continue generations across weight syncs; "
                              "mode=sync never syncs during a generation: set mode to "
                              "one_step or async, or partial_chunk_tokens to null")
        if self.mode != "sync" and self.enable_sleep:
            raise ConfigError("mode", self.mode, "overlaps generation with training, so the "
                              "engines cannot sleep during training (enable_sleep=true): use "
                              "one or the other")
        if self.cpu_threads_bind and self.cpu_threads_bind not in ("auto", "nobind") \
                and len(self.cpu_threads_bind.split("|")) != self.tp:
            raise ConfigError("cpu_threads_bind", self.cpu_threads_bind,
                              f"needs one '|'-separated core list per TP rank (tp={self.tp})")


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to sample one call's responses.

    temperature: 0 = greedy. top_p in (0, 1]; top_k: 0 = off. max_tokens: response cap.
    stop_token_ids: extra ids that end a response (kept in it); the model's
        generation_config.json `eos_token_id` always stops too.
    n: samples per prompt (a GRPO group). seed: None = unseeded; else see the module doc.
    logprobs: return each sampled token's raw log-prob (see the module doc).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError("temperature", self.temperature, "must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError("top_k", self.top_k, "must be >= 0 (0 = off)")
        if self.max_tokens < 1:
            raise ConfigError("max_tokens", self.max_tokens, "must be >= 1")
        if self.n < 1:
            raise ConfigError("n", self.n, "must be >= 1")
        if self.seed is not None and self.seed < 0:
            raise ConfigError("seed", self.seed, "must be >= 0 (or null)")
        if any(t < 0 for t in self.stop_token_ids):
            raise ConfigError("stop_token_ids", self.stop_token_ids, "ids must be >= 0")

    def prompt_seed(self, index: int) -> int | None:
        """Seed of prompt `index` (global index within the batch); None when unseeded."""
        return None if self.seed is None else self.seed + index * self.n


@dataclass(frozen=True)
class Completion:
    """One sampled response. `logprobs[t]` is the raw log-prob of `token_ids[t]` (empty when
    not requested). finish_reason: "stop" (EOS / stop id, which ends `token_ids`), "length"
    (max_tokens or max_model_len) or "abort". versions: partial rollouts only — per token, the
    weight version that produced it (`logprobs[t]` is under that version); else empty."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    versions: tuple[int, ...] = ()


@dataclass
class RankSync:
    """What one worker did in a sync: names installed, bytes received, seconds spent."""

    rank: int
    sync_rank: int
    names: list[str]
    bytes_received: int
    peak_extra_bytes: int
    seconds: float
    install_seconds: float


@dataclass
class SyncReport:
    engine: int
    ranks: list[RankSync] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "seconds": self.seconds,
                "ranks": [{k: v for k, v in r.__dict__.items() if k != "names"}
                          | {"tensors": len(r.names)} for r in self.ranks]}


def _allowed_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))


def _threads_bind(cfg: RolloutConfig) -> str:
    if cfg.cpu_threads_bind:
        return cfg.cpu_threads_bind
    cores = _allowed_cores()
    per = max(1, len(cores) // cfg.tp)
    return "|".join(",".join(str(cores[(r * per + i) % len(cores)]) for i in range(per))
                    for r in range(cfg.tp))


def configure_vllm_env(cfg: RolloutConfig, on_cpu: bool) -> None:
    """Set the environment vLLM reads (process-wide; call before creating the engine)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # a multi-node launcher sets each node's own address; one machine uses cfg.host_ip
    os.environ["VLLM_HOST_IP"] = os.environ.get("MCORE_RL_NODE_IP") or cfg.host_ip
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # engines load local folders only
    if on_cpu:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override kv_cache_memory_bytes
        if cfg.tp > 1:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _threads_bind(cfg)
    try:  # vLLM caches env reads once an engine has started; a new engine must re-read them
        from vllm import envs
        envs.disable_envs_cache()
    except ImportError:  # pragma: no cover
        pass


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


class RolloutEngine:
    """A vLLM `LLM` with mcore-rl's generation API, checked worker RPCs and weight sync.

    engine_index: this engine's index among the data-parallel engines (for error messages and
    sync ranks). call_timeout_s: deadline of every worker RPC and of the sync's receives that
    is not given per call (a run passes its deadlines.engine_call_s). Start-up time is in
    `startup_s`.
    """

    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, *, call_timeout_s: float,
                 engine_index: int = 0):
        if not call_timeout_s > 0:
            raise ConfigError("call_timeout_s", call_timeout_s, "must be > 0 seconds")
        self.cfg, self.index, self.call_timeout_s = cfg, engine_index, call_timeout_s
        self.on_cpu = _on_cpu()
        self._sync_thread: threading.Thread | None = None
        self._sync_result: dict[str, Any] = {}
        self._sync_plan = None
        self._first_sync_rank: int | None = None
        self._lock = threading.Lock()
        if not (Path(model_dir) / "config.json").is_file():
            raise RolloutError(engine_index, "start-up", f"{model_dir}: no config.json")
        start = time.perf_counter()
        configure_vllm_env(cfg, self.on_cpu)
        try:
            from vllm import LLM
            self.llm = LLM(**self._llm_kwargs(str(model_dir)))
        except Exception as err:
            raise RolloutError(engine_index, "start-up",
                               f"vLLM failed to start: {type(err).__name__}: {err}") from err
        self.startup_s = time.perf_counter() - start

    def _llm_kwargs(self, model_dir: str) -> dict[str, Any]:
        cfg = self.cfg
        kwargs: dict[str, Any] = dict(
            model=model_dir, tensor_parallel_size=cfg.tp, dtype=cfg.dtype, seed=cfg.seed,
            max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            distributed_executor_backend="uni" if cfg.tp == 1 else "mp",
            worker_extension_cls=WORKER_EXTENSION,
            skip_tokenizer_init=True,  # token ids in, token ids out
            logprobs_mode="raw_logprobs",
        )
        if cfg.max_num_seqs is not None:
            kwargs["max_num_seqs"] = cfg.max_num_seqs
        if cfg.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
        if cfg.block_size is not None:
            kwargs["block_size"] = cfg.block_size
        if self.on_cpu:
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * GiB)
        else:  # pragma: no cover - GPU only
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = cfg.enable_sleep
        return kwargs

    # ---------------------------------------------------------------- generation

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 first_index: int = 0) -> list[list[Completion]]:
        """Sample `sampling.n` responses for every prompt (token ids). Returns, in prompt
        order, each prompt's responses in sample order. `first_index`: global index of
        `prompts[0]` (seeds depend on it, see the module doc)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_idle("generate")
        limit = self.cfg.max_model_len - 1
        requests = []
        for i, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if not ids or len(ids) > limit:
                raise RolloutError(self.index, "generate",
                                   f"prompt {first_index + i} has {len(ids)} tokens; must have "
                                   f"1..{limit} (max_model_len={self.cfg.max_model_len})")
            requests.append(TokensPrompt(prompt_token_ids=ids))
        params = [SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=sampling.prompt_seed(first_index + i),
            logprobs=0 if sampling.logprobs else None, detokenize=False)
            for i in range(len(requests))]
        if not requests:
            return []
        with self._lock:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [[_completion(c, sampling.logprobs)
                 for c in sorted(out.outputs, key=lambda c: c.index)] for out in outputs]

    def reset_prefix_cache(self) -> None:
        """Drop cached KV (it was computed with the previous weights)."""
        if not self.llm.reset_prefix_cache():
            raise RolloutError(self.index, "sync", "reset_prefix_cache() refused "
                                                   "(requests still running?)")

    def sleep(self) -> None:
        """GPU with enable_sleep: free weights (level 2) or offload them (level 1) and the KV
        cache while training runs. A no-op on CPU (vLLM's CPU worker has no sleep mode)."""
        if self.cfg.enable_sleep and not self.on_cpu:  # pragma: no cover - GPU only
            self.llm.sleep(level=self.cfg.sleep_level)

    def wake_up(self) -> None:
        if self.cfg.enable_sleep and not self.on_cpu:  # pragma: no cover - GPU only
            self.llm.wake_up()

    # ---------------------------------------------------------------- worker RPCs

    def call_workers(self, method: str, *args: Any, phase: str,
                     timeout_s: float | None = None, **kwargs: Any) -> list[dict[str, Any]]:
        """`collective_rpc` to every worker's extension method; every reply must say ok (the
        methods never raise, see worker_extension.py). Raises RolloutError naming the rank."""
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        try:
            replies = self.llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
        except Exception as err:
            raise RolloutError(self.index, phase,
                               f"{method} RPC failed: {type(err).__name__}: {err}") from err
        return self._check_replies(method, phase, replies)

    def _check_replies(self, method: str, phase: str, replies: list[Any]) -> list[dict]:
        if len(replies) != self.cfg.tp:
            raise RolloutError(self.index, phase,
                               f"{method}: {len(replies)} replies from {self.cfg.tp} workers")
        for rank, reply in enumerate(replies):
            if not isinstance(reply, dict) or not reply.get("ok"):
                err = reply.get("err") if isinstance(reply, dict) else repr(reply)
                raise RolloutError(self.index, phase, f"{method} failed: {err}", rank=rank)
        return replies

    def describe_shards(self) -> list[dict[str, tuple[int, ...]]]:
        """Per TP rank: vLLM parameter name → per-rank shape (packed CPU linears report their
        logical `(out_per_rank, in_per_rank)`)."""
        replies = self.call_workers("describe_shards", phase="describe")
        return [{name: tuple(shape) for name, shape in r["shapes"].items()} for r in replies]

    def check_shapes(self, expected: Sequence[Mapping[str, Sequence[int]]]) -> None:
        """Compare `describe_shards()` with what a plan / shard map expects per TP rank
        (e.g. `[plan.dst_shapes[first_sync_rank + r] for r in range(tp)]`)."""
        actual = self.describe_shards()
        if len(expected) != len(actual):
            raise RolloutError(self.index, "describe",
                               f"expected shapes for {len(expected)} ranks, engine has "
                               f"{len(actual)}")
        for rank, (want, have) in enumerate(zip(expected, actual)):
            problems = _diff_shapes({k: tuple(v) for k, v in want.items()}, have)
            if problems:
                raise RolloutError(self.index, "describe", problems, rank=rank)

    # ---------------------------------------------------------------- weight sync

    def start_join_sync_group(self, spec, first_sync_rank: int,
                              devices: tuple[str, ...] | None = None) -> None:
        """Every worker starts joining the sync group `spec` (a `SyncGroupSpec`) as sync rank
        `first_sync_rank + tp_rank` in a background thread; returns at once. The trainer then
        joins (rank 0 blocks until everyone is in) and calls `finish_join_sync_group`.
        devices: per TP rank, its device (the resolved run's `engine_devices[e]`)."""
        self.call_workers("start_join_sync_group", spec, first_sync_rank, devices,
                          phase="sync")
        self._first_sync_rank = first_sync_rank

    def finish_join_sync_group(self, timeout_s: float | None = None) -> None:
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        self.call_workers("finish_join_sync_group", timeout, phase="sync",
                          timeout_s=timeout + 10.0)

    def leave_sync_group(self) -> None:
        """Shut the workers' sync-group handles down (after a failed sync: re-form the group
        with a new prefix)."""
        self.call_workers("leave_sync_group", phase="sync")
        self._first_sync_rank = None

    def begin_sync(self, plan, *, dtype: torch.dtype = torch.float32, verify: bool = True,
                   timeout_s: float | None = None) -> None:
        """Start every worker's receive-and-install of its shards (`install_shards`) in a
        thread and return at once; the trainer's sends must run while it is in flight.
        verify: workers take part in `verify_plan` (the trainer ranks must call it too)."""
        self._check_idle("sync")
        if self._first_sync_rank is None:
            raise RolloutError(self.index, "sync", "begin_sync before start_join_sync_group")
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        result: dict[str, Any] = {}
        dtype_name = str(dtype).removeprefix("torch.")

        def run() -> None:
            try:
                result["replies"] = self.llm.collective_rpc(
                    "install_shards", timeout=timeout + 10.0,
                    args=(plan,), kwargs={"dtype": dtype_name, "timeout_s": timeout,
                                          "verify": verify})
            except BaseException as err:  # noqa: BLE001 — reported by finish_sync
                result["error"] = f"{type(err).__name__}: {err}"

        self._sync_plan, self._sync_result = plan, result
        self._sync_started = time.perf_counter()
        self._sync_timeout = timeout
        self._sync_thread = threading.Thread(target=run, daemon=True,
                                             name=f"mcore-rl-sync-engine{self.index}")
        self._sync_thread.start()

    def finish_sync(self, timeout_s: float | None = None) -> SyncReport:
        """Wait for `begin_sync`'s RPC; check that each rank installed exactly the plan's names
        for its sync rank; reset the prefix cache. Raises RolloutError naming the engine, the
        rank and the missing / unexpected names."""
        if self._sync_thread is None:
            raise RolloutError(self.index, "sync", "finish_sync without begin_sync")
        timeout = self._sync_timeout + 20.0 if timeout_s is None else timeout_s
        self._sync_thread.join(timeout)
        if self._sync_thread.is_alive():
            raise RolloutError(self.index, "sync", f"install_shards still running after "
                                                   f"{timeout:.0f} s (engine is stuck)")
        plan, result = self._sync_plan, self._sync_result
        self._sync_thread = None
        if "error" in result:
            raise RolloutError(self.index, "sync", f"install_shards RPC failed: "
                                                   f"{result['error']}")
        replies = self._check_replies("install_shards", "sync", result["replies"])
        report = SyncReport(self.index)
        for rank, reply in enumerate(replies):
            expected = plan.expected_names(reply["sync_rank"])
            got = set(reply["names"])
            if got != expected:
                raise RolloutError(self.index, "sync", _names_problem(expected, got), rank=rank)
            report.ranks.append(RankSync(
                rank, reply["sync_rank"], reply["names"], reply["bytes_received"],
                reply["peak_extra_bytes"], reply["seconds"], reply["install_seconds"]))
        self.reset_prefix_cache()
        report.seconds = time.perf_counter() - self._sync_started
        return report

    def install_tensors(self, items: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Install full per-rank tensors passed in the call itself, then reset the prefix
        cache. TP=1 only (the one rank's shard is the whole model): with TP > 1 every rank
        must receive only its own shard, through `begin_sync` / `finish_sync`."""
        if self.cfg.tp != 1:
            raise RolloutError(self.index, "sync", "install_tensors is for tp=1; use "
                                                   "begin_sync/finish_sync with tp > 1")
        self._check_idle("sync")
        reply, = self.call_workers("install_tensors", list(items), phase="sync")
        self.reset_prefix_cache()
        return reply["names"]

    def _check_idle(self, phase: str) -> None:
        if self._sync_thread is not None:
            raise RolloutError(self.index, phase, "a weight sync is in flight "
                                                  "(call finish_sync first)")

    def shutdown(self) -> None:
        """Stop the engine (and its TP worker processes)."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            self.llm = None


def _completion(output: Any, with_logprobs: bool) -> Completion:
    ids = tuple(int(t) for t in output.token_ids)
    lps: tuple[float, ...] = ()
    if with_logprobs:
        entries = 0 if output.logprobs is None else len(output.logprobs)
        if entries != len(ids):
            raise RuntimeError(f"vLLM returned {entries} log-prob entries for {len(ids)} tokens")
        lps = tuple(float(pos[tok].logprob) for pos, tok in zip(output.logprobs, ids))
    return Completion(ids, lps, str(output.finish_reason))


def _names_problem(expected: set[str], got: set[str]) -> str:
    missing, extra = sorted(expected - got), sorted(got - expected)
    parts = []
    if missing:
        parts.append(f"{len(missing)} expected tensors not installed: {missing[:5]}"
                     + (" ..." if len(missing) > 5 else ""))
    if extra:
        parts.append(f"{len(extra)} unexpected tensors installed: {extra[:5]}"
                     + (" ..." if len(extra) > 5 else ""))
    return "; ".join(parts)


def _diff_shapes(want: Mapping[str, tuple[int, ...]],
                 have: Mapping[str, tuple[int, ...]]) -> str:
    problems = []
    missing = sorted(set(want) - set(have))
    if missing:
        problems.append(f"vLLM has no parameters {missing[:5]}")
    unexpected = sorted(set(have) - set(want))
    if unexpected:
        problems.append(f"vLLM parameters not in the plan: {unexpected[:5]}")
    wrong = [f"{n}: vLLM {have[n]} vs plan {want[n]}" for n in sorted(set(want) & set(have))
             if tuple(have[n]) != tuple(want[n])]
    if wrong:
        problems.append("shape mismatch: " + "; ".join(wrong[:5]))
    return "; ".join(problems)


__all__ = ["Completion", "RankSync", "RolloutConfig", "RolloutEngine", "RolloutError",
           "SamplingConfig", "SyncReport", "configure_vllm_env"]
