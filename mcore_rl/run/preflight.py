"""Preflight of an RL run: the checks `mcore-rl preflight` runs (grid vs model, vLLM TP,
placement, sync backend, memory) run on the run's config (`RLConfig`) itself, automatically
before `mcore-rl train` / `demo` start any worker. Their messages name the RLConfig's fields
(`actor.tp`, `cluster.nodes`, ...) because those are the only fields there are.

What is sized: the model as `ModelConfig.planning_model` says (the demo spec, hf_dir's
config.json, or the preset when the checkpoint is not on this machine); the device as the
run resolves (`mcore_rl.runconfig.resolve`: detected, or assumed with `assume_gpu`); the
devices as `cfg.cluster` says (this machine for device "local").

Preflight reads what the run will read, where it is: model.hf_dir (and reward_model.hf_dir)
and a jsonl task's files must be on this machine — an error when they are not, a warning only
with `remote_paths` (`mcore-rl preflight --remote-paths`: a config checked from a machine that
does not hold the files). The files are read as the run reads them (`tasks.jsonl.read_jsonl`),
so a missing file or key stops `train` here, not in a worker; with the tokenizer here too, the
prompts are tokenized as the engines get them and their lengths checked against
`max_prompt_tokens`.

Preflight also reads the environment the run's processes start with: inside a SLURM
allocation, whether Ray can ever place the plan's per-node bundles (`launch.allocation`: an
error naming what the allocation lacks); whether vLLM will load mcore-rl's weight-transfer
backend (its entry point installed, a VLLM_PLUGINS allow-list naming it); and, a warning each,
the fused kernels the plan asks for whose providers do not import here, with what running
without them costs (`models.kernels`; each actor rank decides again on its own node).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping

from mcore_rl.config import ConfigError, ConfigFileError, check_config
from mcore_rl.launch.allocation import SlurmAllocation, allocation_shortfall
from mcore_rl.launch.placement import node_bundles
from mcore_rl.models.kernels import KERNELS, PROVIDERS, dropped, resolve_kernels
from mcore_rl.models.presets import PRESETS
from mcore_rl.models.spec import ModelSpec
from mcore_rl.planning.grid_checks import Problem, format_problems, preflight
from mcore_rl.planning.sized import sized_run
from mcore_rl.rollout.vllm_plugin import plugin_missing
from mcore_rl.runconfig import RLConfig
from mcore_rl.runconfig.resolve import layer_spec_of, placement_plan_of, trainers_fuse_kernels
from mcore_rl.tasks.jsonl import DatasetError, read_jsonl
from mcore_rl.tasks.tokenizer import encode_prompts, load_tokenizer


class PreflightFailed(RuntimeError):
    """The run cannot work as configured; the message lists every problem with its fix."""


def _preset_mismatch(cfg: RLConfig) -> list[Problem]:
    """A warning when model.preset and hf_dir's config.json are both here and differ."""
    m = cfg.model
    if m.preset is None or m.hf_dir is None or not (Path(m.hf_dir) / "config.json").is_file():
        return []

    if ModelSpec.from_hf_dir(m.hf_dir) == PRESETS[m.preset]:
        return []
    return [Problem("model-preset", f"model.preset={m.preset} differs from {m.hf_dir}/config.json "
                    "(preflight used the checkpoint)", "model.preset naming the checkpoint's "
                    "shapes, or null", "warning")]


def _remote(check: str, field: str, path: str, what: str) -> Problem:
    """The warning for a path that `--remote-paths` says lives on another machine."""
    return Problem(check, f"{field}={path}: not on this machine, not checked ({what})",
                   f"run `mcore-rl preflight` where {field} is", "warning")


# A directory holds an HF tokenizer when it has one of these (a fast tokenizer's
# tokenizer.json, or a slow one's vocabulary: sentencepiece, BPE, WordPiece), or *.tiktoken
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")


def tokenizer_missing(path: str | Path) -> str | None:
    """What is missing when the HF directory `path` holds no tokenizer (None: it has one) —
    the run's driver and engines load it from model.hf_dir, before any step."""
    path = Path(path)
    if any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken")):
        return None
    return (f"no tokenizer files in it (expected {TOKENIZER_FILES[0]}, or a slow tokenizer's "
            f"{', '.join(TOKENIZER_FILES[1:])} or *.tiktoken)")


def model_dir_problems(cfg: RLConfig, *, remote_paths: bool) -> list[Problem]:
    """model.hf_dir (and an enabled reward model's hf_dir) exists here with its config.json:
    an error when it does not, a warning with `remote_paths` (then model.preset sizes it).
    model.hf_dir here must hold its tokenizer too (the reward model shares it)."""
    problems = []
    dirs = [("model", cfg.model)]
    if cfg.reward_model.enabled:
        dirs.append(("reward_model", cfg.reward_model))
    for section, model in dirs:
        field, path = f"{section}.hf_dir", model.hf_dir
        if path is not None and (Path(path) / "config.json").is_file():
            missing = tokenizer_missing(path) if section == "model" else None
            if missing is not None:
                problems.append(Problem("model-dir", f"{field}={path}: {missing}", (
                    f"{field} with the checkpoint's tokenizer files (the tokenizer's "
                    f"save_pretrained('{path}') writes them)")))
            continue
        if path is None:
            continue
        preset = f"{section}.preset={model.preset}"
        if remote_paths:
            problems.append(_remote("model-dir", field, path, f"sized from {preset}"))
            continue
        what = "no config.json in it" if Path(path).is_dir() else "no such directory"
        problems.append(Problem("model-dir", f"{field}={path}: {what} on this machine", (
            f"{field} naming an HF checkpoint directory here (config.json, *.safetensors, "
            f"tokenizer files); or, checking a config for another machine, --remote-paths "
            f"(sizes from {preset})")))
    return problems


def dataset_problems(cfg: RLConfig, *, remote_paths: bool = False) -> list[Problem]:
    """A jsonl task's files, read as the run will read them: a missing file, a malformed
    line, a missing key or an empty file is an error naming the field. With `remote_paths`
    a file that is not here is only a warning. With the tokenizer here (model.hf_dir), the
    prompts' token lengths: a note, and an error (a warning with task.overlong_prompts
    "filter") for prompts over max_prompt_tokens."""
    task = cfg.task
    if task.kind != "jsonl":
        return []

    problems = []
    for field in ("path", "heldout_path"):
        path = getattr(task, field)
        if path is None:
            continue
        if remote_paths and not Path(path).is_file():
            problems.append(_remote("dataset", f"task.{field}", path, "`mcore-rl train` reads "
                                    "it before any worker starts"))
            continue
        try:
            examples = read_jsonl(path, task.prompt_key, task.answer_key,
                                  chats=not task.multi_turn)
        except DatasetError as err:
            problems.append(_dataset_problem(cfg, field, err))
            continue
        problems += prompt_length_problems(cfg, field, [e.prompt for e in examples])
    return problems


def _tokenizer_here(cfg: RLConfig):
    """The run's tokenizer (model.hf_dir's) when it is on this machine, else None."""
    hf_dir = cfg.model.hf_dir
    if hf_dir is None or not any((Path(hf_dir) / name).is_file() for name in (
            "tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None

    return load_tokenizer(hf_dir)


def prompt_length_problems(cfg: RLConfig, field: str, prompts: list) -> list[Problem]:
    """task.<field>'s prompts (text or chats) tokenized as the engines get them (the chat
    template for a chat, and for text with task.chat_template): a note with their count and
    length distribution, and the prompts over max_prompt_tokens — an error, or a warning
    saying how many are dropped when task.overlong_prompts is "filter". Nothing when the
    tokenizer is not here."""
    try:
        tokenizer = _tokenizer_here(cfg)
    except (OSError, ValueError) as err:
        return [Problem("tokenizer", f"model.hf_dir={cfg.model.hf_dir}: the tokenizer does not "
                        f"load: {' '.join(str(err).split())}", "model.hf_dir with the "
                        "checkpoint's tokenizer files")]
    if tokenizer is None or not prompts:
        return []

    try:
        lengths = [len(ids) for ids in encode_prompts(tokenizer, prompts,
                                                      chat_template=cfg.task.chat_template)]
    except ValueError as err:  # chat prompts or chat_template=true, but no chat template
        fix = ("text prompts, or " if any(not isinstance(p, str) for p in prompts)
               else "task.chat_template=false, or ")
        return [Problem("prompt-length", f"task.{field}={getattr(cfg.task, field)}: {err}",
                        fix + "model.hf_dir with a tokenizer that has a chat template")]
    limit = cfg.max_prompt_tokens
    what = f"max_prompt_tokens={limit}"
    ranked = sorted(lengths)
    p99 = ranked[min(len(ranked) - 1, math.ceil(0.99 * len(ranked)) - 1)]
    chats = cfg.task.chat_template or any(not isinstance(p, str) for p in prompts)
    how = " with the chat template" if chats else ""
    problems = [Problem("prompt-length", f"task.{field}: {len(lengths)} prompts, tokens{how} "
                        f"min {ranked[0]} / median {ranked[len(ranked) // 2]} / p99 {p99} / "
                        f"max {ranked[-1]}", what, "note")]
    over = [i for i, n in enumerate(lengths) if n > limit]
    if not over:
        return problems
    first = over[0]
    message = (f"task.{field}: {len(over)} of {len(lengths)} prompts are longer than {what} "
               f"tokens (the first: prompt {first + 1}, {lengths[first]} tokens; the longest "
               f"{ranked[-1]})")
    raise_to = f"max_prompt_tokens={ranked[-1]}"
    if cfg.task.overlong_prompts == "filter":
        problems.append(Problem("prompt-length", message + f": task.overlong_prompts=filter "
                                f"drops these {len(over)}", f"{raise_to} to keep them",
                                "warning"))
    else:
        problems.append(Problem("prompt-length", message, f"{raise_to}, or "
                                "task.overlong_prompts=filter to drop them"))
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
                  remote_paths: bool = False,
                  env: Mapping[str, str] | None = None) -> list[Problem]:
    """Every problem of the run (errors, warnings, notes). `model_dir`: the model directory
    the run will load (the built demo model); None sizes from `cfg.model.planning_model()`.
    `remote_paths`: the run's files are on another machine — a path not here is a warning,
    not an error. `env`: the environment the run's processes start with (default this
    process's): its SLURM allocation and vLLM's plugin allow-list are checked."""
    env = os.environ if env is None else env
    paths = model_dir_problems(cfg, remote_paths=remote_paths) if model_dir is None else []
    data = dataset_problems(cfg, remote_paths=remote_paths)
    here = plugin_problems(env)
    try:
        run = sized_run(cfg, assume_gpu=assume_gpu, cuda_available=cuda_available,
                        model_dir=model_dir)
    except ConfigError as err:
        said = {p.message.split("=")[0] for p in paths  # a missing dir: said once
                if p.severity == "error"}
        fix = (f"{err.field} naming a checkpoint of a supported architecture"
               if "unsupported" in err.problem else f"fix {err.field}")
        sizing = [] if err.field in said else [Problem("model", str(err), fix)]
        return paths + sizing + data + here + evaluation_problems(cfg)
    here += allocation_problems(cfg, run.device, env) + kernel_problems(cfg, run.device)
    return (paths + preflight(run) + _preset_mismatch(cfg) + data + here
            + evaluation_problems(cfg))


def plugin_problems(env: Mapping[str, str]) -> list[Problem]:
    """vLLM's processes must load mcore-rl's weight-transfer backend: its entry point is
    installed and a VLLM_PLUGINS allow-list names it (`rollout.vllm_plugin.plugin_missing`)."""
    missing = plugin_missing(env)
    return [] if missing is None else [Problem("vllm-plugin", missing.problem, missing.fix)]


def allocation_problems(cfg: RLConfig, device: str, env: Mapping[str, str]) -> list[Problem]:
    """Inside a SLURM allocation: its nodes, GPUs and CPUs per node against the bundles the
    run's Ray placement group will reserve (`launch.allocation`); an error when one can
    never be placed. Nothing outside an allocation."""
    allocation = SlurmAllocation.from_env(env)
    if allocation is None:
        return []
    try:
        plan = placement_plan_of(cfg)
    except ConfigError:  # the placement check says what is wrong with it
        return []
    bundles = node_bundles(plan, cpus_per_engine=cfg.rollout.cpus_per_engine,
                           gpu=device == "cuda")
    short = allocation_shortfall(bundles, allocation)
    if short is None:
        return []
    return [Problem("slurm-allocation", short.lacks,
                    f"{short.options} scripts/slurm/train.sbatch CONFIG (at least)")]


def kernel_problems(cfg: RLConfig, device: str) -> list[Problem]:
    """A warning per fused kernel the plan asks for whose provider does not import here, with
    what running without it costs (`models.kernels`): the actor ranks decide again on their
    node, and build without it rather than fail."""
    try:
        fused = trainers_fuse_kernels(cfg.train.fused_kernels, layer_spec_of(device))
    except ConfigError:  # refused by the resolution itself (train.fused_kernels on CPU)
        return []
    providers = {k.field: PROVIDERS[k.provider] for k in KERNELS if k.provider}
    return [Problem("fused-kernels", f"{d.field} off on this machine: {d.why}; without it "
                    f"{d.cost} (each actor rank checks its own node)",
                    providers[d.field].fix, "warning")
            for d in dropped(resolve_kernels(fused, cfg.train.compile, device=device))]


def evaluation_problems(cfg: RLConfig) -> list[Problem]:
    """Evaluations that cannot run or cannot mean what they say (warnings: the run trains)."""
    ev, problems = cfg.eval, []
    if ev.every and cfg.task.kind == "jsonl" and cfg.task.heldout_path is None:
        problems.append(Problem("eval", f"eval.every={ev.every}, but the jsonl task has no "
                                "held-out prompts (task.heldout_path is null): the run will "
                                "not be evaluated", "task.heldout_path naming a JSONL of "
                                "held-out prompts (same keys), or eval.every=0",
                                severity="warning"))
    if ev.every and ev.samples_per_prompt > 1 and ev.temperature == 0:
        problems.append(Problem("eval", f"eval.samples_per_prompt={ev.samples_per_prompt} at "
                                "eval.temperature=0: greedy samples are all alike, so "
                                f"eval/pass@{ev.samples_per_prompt} equals eval/pass@1",
                                "eval.temperature > 0 (e.g. 1.0), or eval.samples_per_prompt=1",
                                severity="warning"))
    return problems


def preflight_config(path: str | Path, overrides: list[str] | None = None, *,
                     assume_gpu: bool = False, cuda_available: bool | None = None,
                     remote_paths: bool = False, env: Mapping[str, str] | None = None
                     ) -> tuple[RLConfig | None, list[Problem]]:
    """Load and check an RLConfig YAML. A config that does not load gives one problem per
    invalid field (`config.check_config`). Raises ConfigFileError when the file is not a
    YAML mapping (nothing to check). `env`: as `preflight_run`'s."""
    try:
        cfg, errors = check_config(RLConfig, path, overrides)
    except ConfigFileError:
        raise
    except ConfigError as err:  # a malformed override
        errors = [err]
    if errors:
        return None, [Problem("config", str(err), f"fix {err.field} in {path}")
                      for err in errors]
    return cfg, preflight_run(cfg, assume_gpu=assume_gpu, cuda_available=cuda_available,
                              remote_paths=remote_paths, env=env)


def check_run(cfg: RLConfig, model_dir: str | Path | None = None) -> list[Problem]:
    """Raise PreflightFailed listing every error (one error: one line, naming its fix);
    return the warnings and notes. Sizes the run on the device it resolves to here, as the
    controller will; its files must be here."""
    problems = preflight_run(cfg, model_dir)
    errors = [p for p in problems if p.severity == "error"]
    if len(errors) == 1:  # one line: `mcore-rl preflight` lists the warnings and notes too
        (p,) = errors
        raise PreflightFailed(f"preflight found 1 error(s): ERROR [{p.check}] "
                              f"{' '.join(p.message.split())} (fix: {p.fix})")
    if errors:
        raise PreflightFailed("preflight found problems:\n" + format_problems(problems))
    return problems


__all__ = ["PreflightFailed", "allocation_problems", "check_run", "dataset_problems",
           "evaluation_problems", "kernel_problems", "model_dir_problems", "plugin_problems",
           "tokenizer_missing",
           "preflight_config", "preflight_run", "prompt_length_problems"]
