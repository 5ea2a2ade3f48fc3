"""rollout.expert_parallel at the engine: vLLM's arguments on GPU, the CPU refusal naming the
field (the engine's own guard, behind resolution and preflight)."""

import pytest

from mcore_rl.config import ConfigError
from mcore_rl.rollout.expert_parallel import engine_args

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def test_engine_args_turn_on_vllm_ep_with_the_placement_the_layout_assumes():
    assert engine_args(False, on_cpu=True) == {}
    assert engine_args(True, on_cpu=False) == {"enable_expert_parallel": True,
                                               "expert_placement_strategy": "linear"}


def test_a_cpu_engine_refuses_expert_parallel():
    with pytest.raises(ConfigError, match=r"rollout.expert_parallel=True: .*cpu_moe.py"):
        engine_args(True, on_cpu=True)
