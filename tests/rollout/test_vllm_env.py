"""mcore_rl.rollout.vllm_env: an eager engine compiles nothing (vLLM's sampler would compile its
log-prob rank helper with inductor on the first generation), and a CPU engine inspects its
model class without vLLM's start-up subprocess."""

from __future__ import annotations

import os

import pytest
import torch

from mcore_rl.rollout.vllm_env import compiler_off, model_inspected_in_process


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


def test_compiled_functions_run_as_written_inside_and_compile_again_outside():
    x = torch.arange(4.0)
    inside = torch.compile(lambda t: t * 2 + 1, backend="eager")
    outside = torch.compile(lambda t: t * 3 - 1, backend="eager")
    before, env = _frames_compiled(), os.environ.get("TORCH_COMPILE_DISABLE")
    with compiler_off(True):
        assert os.environ["TORCH_COMPILE_DISABLE"] == "1"  # TP workers started here inherit it
        assert torch.equal(inside(x), x * 2 + 1)
    assert _frames_compiled() == before
    assert os.environ.get("TORCH_COMPILE_DISABLE") == env
    with compiler_off(False):  # rollout.compile: the user asked for compilation
        assert torch.equal(outside(x), x * 3 - 1)
    assert _frames_compiled() > before


def _inspect_llama_with_empty_cache(cache_root, monkeypatch):
    """vLLM's model-class inspection of Llama under an empty VLLM_CACHE_ROOT, with the
    registry's subprocess forbidden (it raises if vLLM tries to spawn one)."""
    from vllm import envs
    from vllm.model_executor.models import registry

    run = registry.subprocess.run

    def no_registry_subprocess(cmd, *args, **kwargs):
        if list(cmd) == registry._SUBPROCESS_COMMAND:
            raise AssertionError(f"vLLM spawned {cmd}")
        return run(cmd, *args, **kwargs)  # e.g. platform.architecture() runs `file`

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(cache_root))
    envs.disable_envs_cache()
    monkeypatch.setattr(registry.subprocess, "run", no_registry_subprocess)
    return registry.ModelRegistry.models["LlamaForCausalLM"].inspect_model_cls()


def test_cpu_engines_inspect_the_model_class_in_process_and_fill_vllms_cache(tmp_path,
                                                                           monkeypatch):
    from vllm.model_executor.models import registry

    spawn = registry._run_in_subprocess
    with model_inspected_in_process(on_cpu=True):
        info = _inspect_llama_with_empty_cache(tmp_path, monkeypatch)
    assert info.supports_pp and not info.supports_multimodal  # a real answer, not a stub
    assert (tmp_path / "modelinfos" / "vllm-model_executor-models-llama-LlamaForCausalLM.json"
            ).is_file()  # the next engine on this machine reads the cache
    assert registry._run_in_subprocess is spawn  # restored: outside, vLLM spawns again
    with pytest.raises(AssertionError, match="spawned"):
        _inspect_llama_with_empty_cache(tmp_path / "other", monkeypatch)
