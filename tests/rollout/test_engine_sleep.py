"""The GPU engine's sleep and wake-up order (S2) and its vLLM arguments, checked against a
recording stand-in for vLLM's `LLM` (vLLM's CPU worker has no sleep mode or CUDA graphs); the
CPU engine tests run the same methods as no-ops, the colocated controller test the run's calls."""

from __future__ import annotations

import pytest

from mcore_rl.rollout.config import RolloutConfig, engines_run_eager, engines_sleep_level
from mcore_rl.rollout.engine import RolloutEngine
from mcore_rl.rollout.errors import RolloutError


class RecordingLLM:
    """Records sleep / wake_up calls; `stuck`: some memory never wakes (vLLM's wake_up then
    answers that the engine is not fully awake)."""

    def __init__(self, stuck: bool = False):
        self.calls, self.asleep, self.stuck = [], set(), stuck

    def sleep(self, level: int):
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        self.asleep -= set(tags or ("weights", "kv_cache"))
        return not self.asleep and not self.stuck


def _gpu_engine(cfg: RolloutConfig, llm=None) -> RolloutEngine:
    """A RolloutEngine as a GPU run builds it, without starting vLLM."""
    engine = RolloutEngine.__new__(RolloutEngine)
    engine.cfg, engine.index, engine.on_cpu, engine.seed = cfg, 0, False, 0
    engine.lora = None  # serves no LoRA adapter
    engine.routed_experts = False  # returns no routed experts
    engine.enforce_eager = engines_run_eager(cfg, "cuda")  # as RolloutEngine.__init__ does
    engine.sleep_level = engines_sleep_level(cfg)
    engine.llm = llm
    return engine


def test_weights_wake_before_the_sync_and_the_kv_cache_after():
    llm = RecordingLLM()
    engine = _gpu_engine(RolloutConfig(enable_sleep=True, sleep_level=2), llm)
    engine.sleep()
    engine.wake_up(["weights"])  # partly awake: fine, the sync comes next
    engine.wake_up(["kv_cache"])
    assert llm.calls == [("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]


def test_an_engine_still_asleep_after_waking_everything_raises():
    engine = _gpu_engine(RolloutConfig(enable_sleep=True), RecordingLLM(stuck=True))
    engine.sleep()
    with pytest.raises(RolloutError, match=r"wake-up: vLLM is still partly asleep after "
                                           r"wake_up\(\['kv_cache'\]\)"):
        engine.wake_up(["kv_cache"])


def test_without_sleep_nothing_reaches_vllm():
    llm = RecordingLLM()
    engine = _gpu_engine(RolloutConfig(enable_sleep=False), llm)
    engine.sleep()
    engine.wake_up(["weights"])
    assert llm.calls == []


def test_gpu_engines_capture_decode_graphs_without_compiling(tmp_path):
    engine = _gpu_engine(RolloutConfig(dtype="bfloat16"))
    kwargs = engine._llm_kwargs(str(tmp_path))
    assert kwargs["enforce_eager"] is False
    assert kwargs["compilation_config"] == {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"}
    from vllm.config import CompilationConfig  # vLLM accepts them as given
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    parsed = CompilationConfig(**kwargs["compilation_config"])
    assert (parsed.mode, parsed.cudagraph_mode) == (CompilationMode.NONE,
                                                    CUDAGraphMode.FULL_DECODE_ONLY)
    compiled = _gpu_engine(RolloutConfig(compile=True))._llm_kwargs(str(tmp_path))
    assert compiled["enforce_eager"] is False and "compilation_config" not in compiled
    eager = _gpu_engine(RolloutConfig(enforce_eager=True))._llm_kwargs(str(tmp_path))
    assert eager["enforce_eager"] is True and "compilation_config" not in eager
