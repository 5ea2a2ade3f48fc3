"""Preflight of an RL run: the checks `mcore-rl preflight` runs (grid vs model, vLLM TP,
placement, sync backend, memory) run on the run's config (`RLConfig`) itself, automatically
before `mcore-rl train` / `demo` start any worker. Their messages name the RLConfig's fields
(`actor.tp`, `cluster.nodes`, ...) because those are the only fields there are.

What is sized: the model as `ModelConfig.planning_model` says (the demo spec, hf_dir's
config.json, or the preset when the checkpoint is not on this machine); the device as the
run resolves (`mcore_rl.planning.resolve`: detected, or assumed with `assume_gpu`); the
devices as `cfg.cluster` says (this machine for device "local"). A jsonl task's files are read
as the run reads them (`tasks.jsonl.read_jsonl`), so a missing file or key stops `train` here,
not in a worker.
"""

from __future__ import annotations

from pathlib import Path

from mcore_rl.config import ConfigError, load_config
from mcore_rl.planning.preflight import Problem, format_problems, preflight
from mcore_rl.planning.sized import sized_run
from mcore_rl.trainer.rl_config import RLConfig


class PreflightFailed(RuntimeError):
    """The run cannot work as configured; the message lists every problem with its fix."""


def _preset_mismatch(cfg: RLConfig) -> list[Problem]:
    """A warning when model.preset and hf_dir's config.json are both here and differ."""
    m = cfg.model
    if m.preset is None or m.hf_dir is None or not (Path(m.hf_dir) / "config.json").is_file():
        return []
    from mcore_rl.models.presets import PRESETS
    from mcore_rl.models.spec import ModelSpec

    if ModelSpec.from_hf_dir(m.hf_dir) == PRESETS[m.preset]:
        return []
    return [Problem("model-preset", f"model.preset={m.preset} differs from {m.hf_dir}/config.json "
                    "(preflight used the checkpoint)", "model.preset naming the checkpoint's "
                    "shapes, or null", "warning")]


def dataset_problems(cfg: RLConfig, *, starts_here: bool) -> list[Problem]:
    """A jsonl task's files, read as the run will read them: a malformed line, a missing key
    or an empty file is an error naming the field. A file that is not on this machine is an
    error for a run that starts here (`starts_here`), and a warning when the config is only
    checked here (`mcore-rl preflight` of a config for another machine)."""
    task = cfg.task
    if task.kind != "jsonl":
        return []
    from mcore_rl.tasks.jsonl import DatasetError, read_jsonl

    problems = []
    for field in ("path", "heldout_path"):
        path = getattr(task, field)
        if path is None:
            continue
        if not starts_here and not Path(path).is_file():
            problems.append(Problem("dataset", f"task.{field}={path}: not on this machine, not "
                                    "checked (`mcore-rl train` reads it before any worker "
                                    "starts)", f"run `mcore-rl preflight` where task.{field} is",
                                    "warning"))
            continue
        try:
            read_jsonl(path, task.prompt_key, task.answer_key)
        except DatasetError as err:
            problems.append(_dataset_problem(cfg, field, err))
    return problems


def _dataset_problem(cfg: RLConfig, field: str, err) -> Problem:
    """`err` (a DatasetError reading task.<field>) as a problem naming the config field."""
    task = cfg.task
    if err.key is None:
        return Problem("dataset", f"task.{field}: {err}", f"task.{field} naming a JSONL file: "
                       f"one JSON object per line, each with keys {task.prompt_key!r} and "
                       f"{task.answer_key!r}")
    key_field = "prompt_key" if err.key == task.prompt_key else "answer_key"
    return Problem("dataset", f"task.{key_field}={err.key!r} (task.{field}): {err}",
                   f"task.{key_field} naming a key every line of task.{field} has, or that "
                   "line fixed")


def preflight_run(cfg: RLConfig, model_dir: str | Path | None = None, *,
                  assume_gpu: bool = False, cuda_available: bool | None = None,
                  starts_here: bool = False) -> list[Problem]:
    """Every problem of the run (errors and warnings). `model_dir`: the model directory the
    run will load (the built demo model); None sizes from `cfg.model.planning_model()`.
    `starts_here`: the run is about to start on this machine, so its data must be here."""
    data = dataset_problems(cfg, starts_here=starts_here)
    try:
        run = sized_run(cfg, assume_gpu=assume_gpu, cuda_available=cuda_available,
                        model_dir=model_dir)
    except ConfigError as err:
        return [Problem("model", str(err), f"fix {err.field}")] + data
    return preflight(run) + _preset_mismatch(cfg) + data


def preflight_config(path: str | Path, overrides: list[str] | None = None, *,
                     assume_gpu: bool = False, cuda_available: bool | None = None
                     ) -> tuple[RLConfig | None, list[Problem]]:
    """Load and check an RLConfig YAML. A config that does not load is one problem."""
    try:
        cfg = load_config(RLConfig, path, overrides)
    except ConfigError as err:
        return None, [Problem("config", str(err), f"fix {err.field} in {path}")]
    return cfg, preflight_run(cfg, assume_gpu=assume_gpu, cuda_available=cuda_available)


def check_run(cfg: RLConfig, model_dir: str | Path | None = None) -> list[Problem]:
    """Raise PreflightFailed listing every error; return the warnings. Sizes the run on the
    device it resolves to here, as the controller will."""
    problems = preflight_run(cfg, model_dir, starts_here=True)
    if any(p.severity == "error" for p in problems):
        raise PreflightFailed("preflight found problems:\n" + format_problems(problems))
    return problems


__all__ = ["PreflightFailed", "check_run", "preflight_config", "preflight_run"]
