"""mcore-rl's vLLM plugin as vLLM loads it (N12): its entry point, and vLLM's VLLM_PLUGINS
allow-list, which silently drops a general plugin it does not name. `plugin_missing` must
agree with vLLM's own loader, and an engine refuses to start, in one line, when its workers
would lack the weight-transfer backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mcore_rl.rollout import RolloutConfig, RolloutEngine
from mcore_rl.rollout.errors import RolloutError
from mcore_rl.rollout.vllm_plugin import BACKEND, plugin_installed, plugin_missing

# VLLM_PLUGINS values (None: unset), each a case of vLLM's `VLLM_PLUGINS.split(",")`
ALLOW_LISTS = [None, "", "mcore_rl", "lora_filesystem_resolver", "lora_filesystem_resolver,"
               "mcore_rl", "lora_filesystem_resolver, mcore_rl", " mcore_rl", "MCORE_RL"]

LOADER = """
import json, os, sys
from vllm.plugins import load_plugins_by_group
loaded = {}
for allow in json.loads(sys.argv[1]):
    os.environ.pop("VLLM_PLUGINS", None)
    if allow is not None:
        os.environ["VLLM_PLUGINS"] = allow
    loaded[json.dumps(allow)] = "mcore_rl" in load_plugins_by_group("vllm.general_plugins")
print(json.dumps(loaded))
"""


def test_the_check_agrees_with_vllms_own_plugin_loader():
    """vLLM's `load_plugins_by_group` (a fresh process: vLLM caches its env once an engine
    ran) loads mcore_rl exactly for the allow-lists `plugin_installed` accepts."""
    done = subprocess.run([sys.executable, "-c", LOADER, json.dumps(ALLOW_LISTS)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    ours = {json.dumps(allow): plugin_installed({} if allow is None else
                                                {"VLLM_PLUGINS": allow})
            for allow in ALLOW_LISTS}
    assert ours == loaded
    assert sum(loaded.values()) == 3  # unset, "mcore_rl" and the list naming it exactly


def test_an_engine_refuses_to_start_when_vllm_plugins_leaves_it_out(monkeypatch, micro_dir):
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    missing = plugin_missing()
    assert missing is not None and str(missing) == (
        "VLLM_PLUGINS='lora_filesystem_resolver' leaves out 'mcore_rl': vLLM loads only the "
        "plugins it lists, so its workers would not have mcore-rl's weight-transfer backend "
        "(VLLM_PLUGINS=lora_filesystem_resolver,mcore_rl, or unset it)")
    with pytest.raises(RolloutError) as err:
        RolloutEngine(micro_dir, RolloutConfig(), call_timeout_s=10.0, device="cpu")
    assert str(err.value) == f"rollout engine 0, start-up: {missing}"
    assert BACKEND in str(err.value) and "\n" not in str(err.value)
