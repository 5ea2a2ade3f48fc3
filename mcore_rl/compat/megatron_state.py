"""megatron-core 0.16.1's process-wide state, put back as its import leaves it: for a process
that runs one world after another (`launch.spawn.RankPool`, the test session's reused ranks).

megatron-core keeps its model-parallel groups, its RNG tracker, the micro-batch calculator, the
rerun state machine, the MoE auxiliary-loss tracker and two caches keyed by `id(model)` in
module globals, and functools caches on functions and methods (RoPE's holds its modules). `destroy_model_parallel()` (`parallel.groups.destroy_training_groups`) resets
most of the first (not all: two partial-DP groups survive it, and with them their gloo threads);
the others would carry one world's objects into the next (the id-keyed caches could even match
a new model that reuses a freed one's id). `reset()` clears them all;
`left()` names what a reset did not clear. Only modules already imported are touched:
importing megatron-core costs seconds, and a process that never did has nothing to reset.
Written against megatron-core `MEGATRON_CORE_VERSION` (see `megatron_cpu`); each name is
looked up, so a renamed global shows in `left()` instead of an AttributeError.
"""

from __future__ import annotations

import re
import sys

_PARALLEL_STATE = "megatron.core.parallel_state"
# module → {global: the value its import leaves}
_GLOBALS = {
    # what destroy_model_parallel() leaves set: two of them hold groups, which keep their gloo
    # contexts (and threads) alive; the rest are rank lists and overrides of the DP rank
    _PARALLEL_STATE: dict.fromkeys((
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
        "_DATA_PARALLEL_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
        "_EMBEDDING_GLOBAL_RANKS", "_EXPERT_MODEL_PARALLEL_RANKS", "_MODEL_PARALLEL_GLOBAL_RANKS",
        "_PIPELINE_GLOBAL_RANKS", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
        "_MPU_DATA_PARALLEL_RANK", "_MPU_DATA_PARALLEL_WORLD_SIZE")),
    "megatron.core.tensor_parallel.random": {"_CUDA_RNG_STATE_TRACKER": None,
                                             "_CUDA_RNG_STATE_TRACKER_INITIALIZED": False,
                                             "IS_CHECKPOINTING": False},
    "megatron.core.num_microbatches_calculator": {"_GLOBAL_NUM_MICROBATCHES_CALCULATOR": None},
    "megatron.core.rerun_state_machine": {"_GLOBAL_RERUN_STATE_MACHINE": None},
    "megatron.core.transformer.utils": {"_sequence_parallel_attr_cache": None,
                                        "cuda_graph_attr_cache": None},
}
# (module, dict global its import leaves empty)
_DICTS = (("megatron.core.transformer.moe.moe_utils", "_MOE_LAYER_WISE_LOGGING_TRACKER"),
          (_PARALLEL_STATE, "_HYBRID_DP_CP_GROUPS"))


def reset() -> None:
    """Destroy megatron's model-parallel state (call it before leaving the default group: it
    destroys its own gloo groups) and put the other globals back to their import values."""
    mpu = sys.modules.get(_PARALLEL_STATE)
    if mpu is not None:
        mpu.destroy_model_parallel()
    for name, values in _GLOBALS.items():
        module = sys.modules.get(name)
        for attr, value in values.items() if module is not None else ():
            if hasattr(module, attr):
                setattr(module, attr, value)
    for name, attr in _DICTS:
        table = getattr(sys.modules.get(name), attr, None)
        if table is not None:
            table.clear()
    for cache in _caches():
        cache.cache_clear()


def _caches():
    """The functools caches defined in megatron-core's imported modules and their classes.
    `RotaryEmbedding.forward` is one, on the class: it keeps its last 32 callers — modules,
    and through them their groups, whose gloo contexts then outlive the world."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("megatron."):
            continue
        for value in list(vars(module).values()):
            if getattr(value, "__module__", None) != name:
                continue  # imported here, defined elsewhere (or a builtin)
            if hasattr(value, "cache_clear"):
                yield value
            elif isinstance(value, type):
                yield from (attr for attr in vars(value).values() if hasattr(attr, "cache_clear"))


def left() -> list[str]:
    """megatron-core state that differs from a fresh import's (empty after `reset()`)."""
    out = []
    mpu = sys.modules.get(_PARALLEL_STATE)
    if mpu is not None:
        if mpu.model_parallel_is_initialized():
            out.append("parallel_state: model parallel initialized")
        # its import leaves every private all-caps global None or empty
        out += [f"parallel_state.{attr}" for attr, value in vars(mpu).items()
                if re.fullmatch(r"_[A-Z][A-Z0-9_]*", attr) and not callable(value) and value]
        if getattr(mpu, "_global_process_group_list", None):
            out.append("parallel_state._global_process_group_list")
    for name, values in _GLOBALS.items():
        module = sys.modules.get(name)
        for attr, value in values.items() if module is not None else ():
            if getattr(module, attr, value) != value:
                out.append(f"{name}.{attr}")
    for name, attr in _DICTS:
        if getattr(sys.modules.get(name), attr, None):
            out.append(f"{name}.{attr}")
    return out
