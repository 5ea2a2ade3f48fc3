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

Nothing is compiled unless asked (`compile`): the engine starts and generates inside
`vllm_env.compiler_off`, so the helpers vLLM's sampler wraps in torch.compile run as written (on
CPU inductor would build a C++ kernel on the first generation); with CUDA graphs (GPU,
`enforce_eager` false) vLLM captures whole decode steps without compiling the model.
`cpu_threads` (CPU, tp 1) sets the engine's torch threads before vLLM starts.

Deadlines: worker RPCs (sync, describe) and every Ray call (ray_engines.py) have one; an
in-process `generate()` cannot be interrupted — run engines in Ray actors to bound it.

Log-probs: vLLM 0.32's `logprobs_mode` defaults to (and we pin) "raw_logprobs": the
log-softmax of the model's logits *before* temperature, penalties, top-k and top-p. That is
what HF `transformers` gives (`log_softmax(model(ids).logits)`), i.e. what the trainer
recomputes; with temperature != 1 or top-k/top-p it is *not* the distribution the token was
drawn from ("processed_logprobs" would be). The trainer must use the same definition.

Weight sync: through vLLM's weight-transfer API (sync_client.py, mixed into RolloutEngine), whose
backend in every worker is mcore-rl's (weight_transfer.py, registered by the
`vllm.general_plugins` entry point in vllm_plugin.py). Modules: `config.py` (RolloutConfig,
SamplingConfig and its seeds), `vllm_env.py` (the process environment vLLM reads),
`worker_extension.py` (read-only worker RPCs), `errors.py` (RolloutError).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from mcore_rl.config import ConfigError
from mcore_rl.launch.startup_gc import gc_paused
from mcore_rl.resharding.plan_cache import PlanCache
from mcore_rl.rollout.config import (
    RolloutConfig,
    SamplingConfig,
    engines_run_eager,
    engines_sleep_level,
)
from mcore_rl.rollout.errors import RolloutError
from mcore_rl.rollout.expert_parallel import engine_args as expert_parallel_args
from mcore_rl.rollout.lora import EngineLoRA, lora_request
from mcore_rl.rollout.sync_client import EngineSync
from mcore_rl.rollout.vllm_env import compiler_off, configure_vllm_env, model_inspected_in_process
from mcore_rl.rollout.vllm_plugin import BACKEND, plugin_missing

WORKER_EXTENSION = "mcore_rl.rollout.worker_extension.WorkerExtension"
GiB = 1 << 30


@dataclass(frozen=True)
class Completion:
    """One sampled response. `logprobs[t]` is the raw log-prob of `token_ids[t]` (empty when
    not requested). finish_reason: "stop" (EOS / stop id, which ends `token_ids`), "length"
    (max_tokens or max_model_len) or "abort". versions: partial rollouts only — per token, the
    weight version that produced it (`logprobs[t]` is under that version); else empty.
    routing (engines started with `routed_experts`): the experts the engine's MoE routers sent
    each position of prompt + token_ids to, int16 [positions, all layers, top-k], from the
    call's `routing_start` on; the last sampled token is never forwarded, so it has none. The
    batches a step trains on hold it from position 0 (multi-turn and partial rollouts join
    their calls' rows)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    versions: tuple[int, ...] = ()
    routing: torch.Tensor | None = field(default=None, compare=False, repr=False)


def _standalone_on_cpu() -> bool:
    """Whether an engine started outside a run (no run plan: tests, `bench rollout`) runs on
    the host: no CUDA here."""
    return not torch.cuda.is_available()


class RolloutEngine(EngineSync):
    """A vLLM `LLM` with mcore-rl's generation API, checked worker RPCs and weight sync.

    engine_index: this engine's index among the data-parallel engines (for error messages and
    sync ranks). call_timeout_s: deadline of every worker RPC and of the sync's receives that
    is not given per call (a run passes its deadlines.engine_call_s). seed: vLLM's engine seed
    (unseeded sampling only; per-request seeds come from SamplingConfig; a run passes
    `derive_seed(seed, "engine")`). device: "cpu" or "cuda", the device kind the run plan
    resolved (None: an engine outside a run, on CUDA where there is one). lora: the engine
    serves the policy's LoRA adapter, which weight syncs deliver (`begin_sync(adapter=True)`);
    once one has, every generation applies it. routed_experts: every completion carries the
    experts each token was routed to (`Completion.routing`; vLLM's
    `enable_return_routed_experts`, which needs its V2 model runner and prefix caching: GPU,
    MoE models; `algorithm.routing_replay: rollout`). Start-up time is in `startup_s`.
    """

    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, *, call_timeout_s: float,
                 engine_index: int = 0, seed: int = 0, device: str | None = None,
                 lora: EngineLoRA | None = None, routed_experts: bool = False):
        if not call_timeout_s > 0:
            raise ConfigError("call_timeout_s", call_timeout_s, "must be > 0 seconds")
        if seed < 0:
            raise ConfigError("seed", seed, "must be >= 0")
        self.cfg, self.index, self.call_timeout_s = cfg, engine_index, call_timeout_s
        self.seed, self.lora, self.routed_experts = seed, lora, routed_experts
        self.adapter_installed = False  # generations apply the adapter once one arrived
        self.on_cpu = _standalone_on_cpu() if device is None else not device.startswith("cuda")
        # a run's engines get the plan's choices in cfg (ResolvedRun.engine_config); an engine
        # outside a run takes the same rules for its device
        self.enforce_eager = engines_run_eager(cfg, "cpu" if self.on_cpu else "cuda")
        self.sleep_level = engines_sleep_level(cfg)
        self._sync_thread = None  # sync_client._Background: the update in flight
        self._join = None  # sync_client._Background: the sync-group join in flight
        self._sync_plan = None
        self._sync_adapter = False  # the sync in flight carries the LoRA adapter
        self._plans = PlanCache()  # the sync plans sent to this engine, by fingerprint
        self._first_sync_rank: int | None = None
        self._lock = threading.Lock()
        if not (Path(model_dir) / "config.json").is_file():
            raise RolloutError(engine_index, "start-up", f"{model_dir}: no config.json")
        missing = plugin_missing()  # the entry point, and VLLM_PLUGINS naming it
        if missing is not None:
            raise RolloutError(engine_index, "start-up", str(missing))
        start = time.perf_counter()
        configure_vllm_env(cfg, self.on_cpu, routed_experts)
        if self.on_cpu and cfg.in_process_threads is not None:
            # before vLLM's CPU worker starts: it then makes torch.set_num_threads a no-op
            torch.set_num_threads(cfg.in_process_threads)
        try:
            # two blocks: the imported heap is frozen before LLM() runs its five gc.collect()s
            with gc_paused():
                from vllm import LLM  # lazy: vllm
            with (gc_paused(), compiler_off(not cfg.compile),  # TP workers start in here
                  model_inspected_in_process(self.on_cpu)):
                self.llm = LLM(**self._llm_kwargs(str(model_dir)))
        except Exception as err:
            raise RolloutError(engine_index, "start-up",
                               f"vLLM failed to start: {type(err).__name__}: {err}") from err
        self.startup_s = time.perf_counter() - start

    def _llm_kwargs(self, model_dir: str) -> dict[str, Any]:
        cfg = self.cfg
        kwargs: dict[str, Any] = dict(
            model=model_dir, tensor_parallel_size=cfg.tp, dtype=cfg.dtype, seed=self.seed,
            max_model_len=cfg.max_model_len, enforce_eager=self.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            distributed_executor_backend="uni" if cfg.tp == 1 else "mp",
            worker_extension_cls=WORKER_EXTENSION,
            weight_transfer_config={"backend": BACKEND},
            skip_tokenizer_init=True,  # token ids in, token ids out
            logprobs_mode="raw_logprobs",
        )
        kwargs.update(expert_parallel_args(cfg.expert_parallel, on_cpu=self.on_cpu))
        if self.lora is not None:
            kwargs.update(self.lora.llm_kwargs())
        if self.routed_experts:
            kwargs["enable_return_routed_experts"] = True
        if not self.enforce_eager and not cfg.compile:
            # CUDA graphs without torch.compile: vLLM captures whole decode steps
            kwargs["compilation_config"] = {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"}
        if cfg.quantization is not None:  # vLLM's online FP8 (rollout/quantization.py)
            kwargs["quantization"] = cfg.quantization
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
                 first_index: int = 0,
                 routing_start: Sequence[int] | None = None) -> list[list[Completion]]:
        """Sample `sampling.n` responses for every prompt (token ids). Returns, in prompt
        order, each prompt's responses in sample order. `first_index`: global index of
        `prompts[0]` (seeds depend on it, see the module doc). routing_start (with
        `routed_experts`): per prompt, the positions whose experts the caller holds already
        (a continued episode or sample); its completions' routing starts there."""
        from vllm import SamplingParams  # lazy: vllm
        from vllm.inputs import TokensPrompt  # lazy: vllm

        self._check_idle("generate")
        limit = self.cfg.max_model_len - 1
        starts = [0] * len(prompts) if routing_start is None else [int(s) for s in routing_start]
        if len(starts) != len(prompts):
            raise ValueError(f"routing_start has {len(starts)} entries for {len(prompts)} "
                             "prompts")
        requests = []
        for i, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if not ids or len(ids) > limit:
                raise RolloutError(self.index, "generate",
                                   f"prompt {first_index + i} has {len(ids)} tokens; must have "
                                   f"1..{limit} (max_model_len={self.cfg.max_model_len})")
            if not 0 <= starts[i] <= len(ids):
                raise ValueError(f"prompt {first_index + i}: routing_start {starts[i]} is not "
                                 f"within its {len(ids)} tokens")
            requests.append(ids)
        if not requests:
            return []
        # one request per sample, each with its own seed (vLLM would seed a prompt's n
        # samples seed, seed+1, ...: see mcore_rl/config/seeds.py); vLLM fans n > 1 out into
        # n requests itself, so this costs nothing
        n = sampling.n
        params = [SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens, stop_token_ids=list(sampling.stop_token_ids),
            seed=sampling.sample_seed(first_index + i, j),
            logprobs=0 if sampling.logprobs else None, detokenize=False,
            **({"routed_experts_prompt_start": starts[i]} if self.routed_experts else {}))
            for i in range(len(requests)) for j in range(n)]
        adapter = lora_request() if self.adapter_installed else None
        with self._lock, compiler_off(not self.cfg.compile):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in requests
                                         for _ in range(n)], params,
                                        use_tqdm=False, lora_request=adapter)
        return [[_completion(out.outputs[0], sampling.logprobs,
                             _RoutedRows(len(prompt), start) if self.routed_experts else None)
                 for out in outputs[i * n:(i + 1) * n]]
                for i, (prompt, start) in enumerate(zip(prompts, starts))]

    def reset_prefix_cache(self) -> None:
        """Drop cached KV (it was computed with the previous weights)."""
        if not self.llm.reset_prefix_cache():
            raise RolloutError(self.index, "sync", "reset_prefix_cache() refused "
                                                   "(requests still running?)")

    @property
    def _sleeps(self) -> bool:
        return self.cfg.enable_sleep and not self.on_cpu  # vLLM's CPU worker cannot sleep

    def sleep(self) -> None:
        """GPU with enable_sleep: free weights (level 2) or offload them (level 1) and the KV
        cache while training runs. A no-op on CPU (vLLM's CPU worker has no sleep mode)."""
        if self._sleeps:
            self.llm.sleep(level=self.sleep_level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo `sleep` for `tags` ("weights", "kv_cache"; None: all): a run wakes the weights,
        syncs into them, then wakes the KV cache. Once everything is awake vLLM resumes
        scheduling; an engine still partly asleep after a wake of everything raises."""
        if not self._sleeps:
            return
        awake = self.llm.wake_up(None if tags is None else list(tags))
        if not awake and (tags is None or "kv_cache" in tags):
            raise RolloutError(self.index, "wake-up", f"vLLM is still partly asleep after "
                                                      f"wake_up({tags})")

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

    # ---------------------------------------------------------------- weight sync: sync_client.py

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


@dataclass(frozen=True)
class _RoutedRows:
    """The routed experts one request must return: positions routing_start .. of its prompt
    (prompt_len tokens) + completion, all but the last sampled token."""

    prompt_len: int
    routing_start: int

    def rows(self, output: Any, sampled: int) -> torch.Tensor:
        want = self.prompt_len + sampled - 1 - self.routing_start
        got = output.routed_experts
        if got is None or got.ndim != 3 or got.shape[0] != want:
            raise RuntimeError(f"vLLM returned routed experts of shape "
                               f"{None if got is None else tuple(got.shape)} for a completion "
                               f"that needs {want} positions (prompt {self.prompt_len} + "
                               f"{sampled} sampled - 1 - routing_start {self.routing_start})")
        # vLLM's ids are uint8/uint16; int16 holds any expert count megatron shards
        return torch.from_numpy(got.astype("int16", copy=False))


def _completion(output: Any, with_logprobs: bool, routed: _RoutedRows | None = None
                ) -> Completion:
    ids = tuple(int(t) for t in output.token_ids)
    lps: tuple[float, ...] = ()
    if with_logprobs:
        entries = 0 if output.logprobs is None else len(output.logprobs)
        if entries != len(ids):
            raise RuntimeError(f"vLLM returned {entries} log-prob entries for {len(ids)} tokens")
        lps = tuple(float(pos[tok].logprob) for pos, tok in zip(output.logprobs, ids))
    routing = None if routed is None else routed.rows(output, len(ids))
    return Completion(ids, lps, str(output.finish_reason), routing=routing)


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


__all__ = ["Completion", "RolloutEngine"]
