"""mcore_rl.compat.vllm_pynccl: importing vLLM's PyNccl into a trainer rank leaves the
process environment exactly as it was, while a bare import of the same module rewrites it
(vLLM's `env_override`: when an upgrade stops doing so, the second test fails — the guard
can go). Each in a child interpreter, so vLLM is imported fresh and stays out of pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_GUARDED = r"""
import json, os
before = dict(os.environ)
from mcore_rl.compat import vllm_pynccl
communicator, wrapper = vllm_pynccl.pynccl()
again = vllm_pynccl.pynccl()
print(json.dumps({"same": dict(os.environ) == before, "restored": vllm_pynccl.RESTORED,
                  "classes": [hasattr(communicator, "PyNcclCommunicator"),
                              hasattr(wrapper, "NCCLLibrary")],
                  "again": again == (communicator, wrapper)}))
"""

_BARE = r"""
import json, os
before = dict(os.environ)
from vllm.distributed.device_communicators import pynccl
print(json.dumps(sorted(k for k in set(before) | set(os.environ)
                        if before.get(k) != os.environ.get(k))))
"""

# set by vLLM's import unconditionally: absent here, so a change shows
_VLLM_WRITES = ("PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_COMPILE_THREADS")


def _run(code: str):
    env = {k: v for k, v in os.environ.items() if k not in _VLLM_WRITES}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pynccl_for_a_trainer_rank_leaves_the_environment_as_it_was():
    out = _run(_GUARDED)
    assert out["same"] and out["classes"] == [True, True] and out["again"]
    assert set(_VLLM_WRITES) <= set(out["restored"])


def test_a_bare_vllm_import_still_rewrites_the_environment():
    assert set(_VLLM_WRITES) <= set(_run(_BARE))
