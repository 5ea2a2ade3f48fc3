"""One run directory, one run: a run that resumes in RUN_DIR (`--resume auto` finding a
checkpoint there, or an explicit `--resume PATH`) must be the run RUN_DIR holds.

RUN_DIR/config.yaml is the resolved config the run there started with (`run.train`); before
anything is built or overwritten, the config resolved now is compared with it field by field.
A field that shapes what is trained — the model, the task and its data, the algorithm, the
optimizers, the grids, the lengths, the seed, ... — must be equal: a PPO run directory given
a GRPO config would otherwise continue as GRPO, overwrite config.yaml and mix the two runs'
metrics. The fields that only say how long, where or how the same run goes may differ; they
are listed once, in `MAY_CHANGE_ON_RESUME`, each with why.

Only fields present in both are compared: a field that a newer mcore-rl added (or an older one
dropped) between the two starts says nothing about the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mcore_rl.config import ConfigError, to_dict
from mcore_rl.config.loader import read_config_file

# Dotted field paths (a section: every field under it) that a resumed run may change, and why
# they do not make it another run.
MAY_CHANGE_ON_RESUME: dict[str, str] = {
    "steps": "how long the run goes: a larger value continues it (the step is the data "
             "position, so the steps already run are the same)",
    "deadlines": "how long a phase may take before the watchdog stops the run",
    "checkpoint": "when checkpoints are written and how many are kept (and a test's fault "
                  "injection)",
    "recovery": "how dead engines are restarted (and a test's fault injection)",
    "inject_stall": "a watchdog test's fault injection",
    "logging": "where the metrics also go (wandb) and how many samples are shown",
    "eval": "the held-out evaluation: what is measured, not what is trained",
    "cluster": "the allocation preflight sizes for and how the roles are placed on it (a "
               "requeued job may get other nodes); the layer spec it implies is checked on "
               "its own (`rl.checkpoint_dirs.check_resume`), the grids below are compared",
    "rollout.engines": "how many engines share the generation: each sample's seed follows "
                       "its global prompt index, not its engine",
    "rollout.startup_engines": "how many engines start before the first step (the others "
                               "join at a later sync): the samples are the same",
    "rollout.gpu_memory_utilization": "the engines' memory budget, not what they sample",
    "rollout.kv_cache_gib": "the engines' memory budget, not what they sample",
    "rollout.max_num_seqs": "how many sequences an engine batches per step",
    "rollout.cpu_threads": "CPU threads of an engine",
    "rollout.cpu_threads_bind": "CPU cores of an engine's TP ranks",
    "rollout.cpus_per_engine": "Ray CPUs reserved per engine",
    "rollout.host_ip": "the address the engines bind to",
    "rollout.enable_sleep": "whether colocated engines free their memory while the actor "
                            "trains (follows cluster.placement)",
    "rollout.sleep_level": "what a sleeping engine keeps (the next sync restores every "
                           "weight)",
    "sync.bucket_mb": "how the weight sync cuts its transfers: the engines receive the same "
                      "weights",
    "sync.backend": "what carries the weight sync's bytes: the engines receive the same "
                    "weights",
    "task.reward_errors": "what a reward function that raises does: a run it stopped (exit 5) "
                          "may resume scoring such samples 0 (troubleshooting.md)",
}

# a value longer than this (its repr) is cut in the refusal's message
_SHOWN_CHARS = 40
# the refusal names this many differing fields, then counts the rest
_SHOWN_FIELDS = 8


def may_change(field: str) -> bool:
    """Whether `field` (a dotted path) is in MAY_CHANGE_ON_RESUME, itself or by a section."""
    return any(field == name or field.startswith(f"{name}.") for name in MAY_CHANGE_ON_RESUME)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as {dotted path: value}; lists are values."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out.update(flatten(value, path) if isinstance(value, dict) else {path: value})
    return out


def differences(saved: dict, resolved: dict) -> list[tuple[str, Any, Any]]:
    """(field, saved value, resolved value) of every field that shapes training (not
    `may_change`) and differs, in the resolved config's field order. Both are plain mappings
    (`to_dict` of a config, or its YAML read back); only fields present in both count."""
    old, new = flatten(saved), flatten(resolved)
    return [(field, old[field], value) for field, value in new.items()
            if field in old and not may_change(field) and old[field] != value
            and not _lora_off_in_both(field, old, new)]


def _lora_off_in_both(field: str, old: dict, new: dict) -> bool:
    """A LoRA setting (`<role>.lora.<key>`, the rank aside) while both runs have LoRA off
    (rank 0): it shapes nothing."""
    section, _, key = field.rpartition(".")
    if section.rpartition(".")[2] != "lora" or key == "rank":
        return False
    rank = f"{section}.rank"
    return old.get(rank) == 0 and new.get(rank) == 0


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS - 1]}…"


def check_same_run(run_dir: Path, cfg, saved_config: Path, checkpoint: Path) -> None:
    """Refuse to resume `checkpoint` in `run_dir` with `cfg` (the resolved RLConfig) when
    `saved_config` (RUN_DIR/config.yaml, if there is one) differs from it in a field that
    shapes training: ConfigError naming the fields with both values and how to start fresh."""
    if not saved_config.is_file():
        return
    found = differences(read_config_file(saved_config), to_dict(cfg))
    if not found:
        return
    named = "; ".join(f"{field} {_shown(old)} -> {_shown(new)}"
                      for field, old, new in found[:_SHOWN_FIELDS])
    more = (f"; and {len(found) - _SHOWN_FIELDS} more field(s)"
            if len(found) > _SHOWN_FIELDS else "")
    raise ConfigError("--out", str(run_dir), (
        f"holds another run: resuming {checkpoint.name} with a config that differs from its "
        f"{saved_config.name} in {len(found)} field(s) that shape training ({named}{more}); "
        "to train this config, start afresh with --resume never (removes the run's "
        "checkpoints and metrics there) or give another --out"))


__all__ = ["MAY_CHANGE_ON_RESUME", "check_same_run", "differences", "flatten", "may_change"]
