"""`mcore-rl demo` / `mcore-rl train`: an RL run from one config (`RLConfig`).

The model follows `ModelConfig`'s rule: with `model.hf_dir` null (the demo's default) a
sentencepiece tokenizer trained on the addition task's own text and a small random Llama are
built locally, nothing downloaded; with `model.hf_dir` set the run loads that HF checkpoint
directory. The Megatron actor (TP2 by default) warms up on noisy answers, then GRPO
runs with vLLM rollouts and streamed weight sync. The run directory gets config.yaml (the
resolved config: `load_config(RLConfig, RUN_DIR/config.yaml)` reads it back equal),
metrics.jsonl, TensorBoard logs (and wandb's, with logging.wandb set), reward.png /
phases.png and summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

from mcore_rl.config import CONFIG_ERROR_EXIT, ConfigError, load_config, to_dict, write_config
from mcore_rl.launch.exit_codes import (
    CHECKPOINT_WRITE_EXIT_CODE,
    REWARD_FAILED_EXIT_CODE,
    WORKER_FAILED_EXIT_CODE,
)
from mcore_rl.launch.logs import add_verbose_argument, configure_process_logs, set_verbose
from mcore_rl.launch.process_cpu import cpu_floor_s
from mcore_rl.launch.watchdog import WatchdogTimeout, WorkerDied
from mcore_rl.rl import checkpoint_dirs
from mcore_rl.rl.checkpoint_dirs import CheckpointNotFound, CheckpointWriteError, check_resume
from mcore_rl.rl.metrics import MetricsWriter, plot_compare, plot_run
from mcore_rl.rl.recovery import EngineFailed
from mcore_rl.run.lifecycle import RLRun
from mcore_rl.run.preflight import PreflightFailed, check_run
from mcore_rl.run.same_run import check_same_run
from mcore_rl.run.signals import RunStopped, StopControl
from mcore_rl.runconfig import RLConfig
from mcore_rl.runconfig.resolve import resolve_run
from mcore_rl.tasks.base import RewardFailed

# OUT/<this>: the run's resolved config (every derived value filled in), written when it starts
RESOLVED_CONFIG = "config.yaml"


def check_layer_spec_here(cfg, resume: Path | None = None) -> None:
    """Before any worker starts: the resolved layer spec can be built here (a run on this
    machine that resolves "te" needs TransformerEngine), and a resumed checkpoint was saved
    under the same spec (`megatron.role_checkpoint.check_resume`). Raises ConfigError."""
    run = resolve_run(cfg)
    if cfg.cluster.device == "local" and run.layer_spec == "te":
        from mcore_rl.models.gpt import te_importable  # lazy: megatron

        if not te_importable():
            raise ConfigError("cluster.device", cfg.cluster.device, (
                "runs on this machine's CUDA, so the resolved layer_spec is 'te', but "
                "TransformerEngine (transformer_engine.pytorch) is not importable: install it "
                "(pip install .[gpu]), or set cluster.device=cpu for the local layer spec"))
    if resume is not None:  # a checkpoint of the other layer spec fails here, not in a worker

        check_resume(resume, run.layer_spec)


def run_rl(cfg, out: Path, resume: str | Path = "auto", command: str = "demo") -> dict:
    """The run; `resume`: "auto" (the newest complete checkpoint in OUT/checkpoints, if any),
    "never" (start over: OUT's checkpoints and metrics are removed) or a checkpoint path.
    SIGTERM/SIGUSR1/SIGINT stop it at the next safe point with a checkpoint (raises
    RunStopped)."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    configure_process_logs(out, "driver")  # library logs to OUT/logs unless --verbose
    checkpoint = _preflight(cfg, out, resume)
    if checkpoint is not None and checkpoint_dirs.step_of(checkpoint) >= cfg.steps:
        print(f"run already complete: {checkpoint} is after step {cfg.steps} of {cfg.steps}; "
              f"nothing to do (run dir {out})")
        return {"already_complete": True, "checkpoint": str(checkpoint)}
    write_config(cfg, out / RESOLVED_CONFIG)  # a refused run leaves an earlier one's in place
    stop = StopControl(cfg.checkpoint.stop_grace_s).install()
    try:
        with RLRun(cfg, out) as run:
            startup_s = seconds_since_process_start()  # every worker and engine up
            stop.install()  # again: Ray's driver installed its own (aborting) SIGTERM handler
            first_step = _begin(run, cfg, out, checkpoint, stop)
            if stop.requested:  # during start-up or warm-up: nothing to save yet
                raise RunStopped(first_step - 1, stop.signal_name, checkpoint)
            _train(run, cfg, out, stop, first_step)
            digests = run.controller.weights_digests()
    finally:
        stop.restore()
    plot_run(out)
    summary = _summary(cfg, out, accuracy=run.warmup_accuracy, first_step=first_step,
                       digests=digests, wall_s=time.perf_counter() - start)
    summary["startup_s"] = startup_s
    summary["startup_cpu_s"] = run.startup_cpu
    summary["startup_cpu_floor_s"] = cpu_floor_s(run.startup_cpu["total"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    k = min(5, summary["steps"])
    print(f"{command} done in {summary['wall_s']:.0f} s: reward {summary['reward_first5']:.3f} "
          f"(mean of first {k} steps) -> {summary['reward_last5']:.3f} (last {k}); "
          f"run dir {out}")
    return summary


def seconds_since_process_start() -> float:
    """Wall time since this process started (imports included, which run_rl's own clock
    misses)."""
    return time.time() - psutil.Process().create_time()


def _preflight(cfg, out: Path, resume: str | Path) -> Path | None:
    """Check the run before anything is built and return the checkpoint it starts from.
    Preflight sizes from the config alone (the demo spec, or hf_dir / preset); it raises
    PreflightFailed listing every error. An explicit --resume is checked (layer spec,
    converted checkpoint) before anything moves; with "auto", the found checkpoint too. A
    resume must continue the run OUT holds: its config.yaml and this config may differ only
    in fields that do not shape training (`run.same_run`), else ConfigError."""
    for said in check_run(cfg):  # warnings and notes
        fix = "vs" if said.severity == "note" else "fix"
        print(f"preflight {said.severity} [{said.check}] {said.message} ({fix}: {said.fix})")
    explicit = None if str(resume) in ("auto", "never") else Path(resume)
    check_layer_spec_here(cfg, explicit)
    checkpoint = start_point(out, resume)
    if explicit is None and checkpoint is not None:
        check_layer_spec_here(cfg, checkpoint)
    if checkpoint is not None:  # before config.yaml is written: refused, OUT stays as it was
        check_same_run(out, cfg, out / RESOLVED_CONFIG, checkpoint)
    return checkpoint


def _begin(run: RLRun, cfg, out: Path, checkpoint: Path | None, stop) -> int:
    """The run's metrics files cut back to where it starts, then `RLRun.begin`: from scratch
    the warm-up (its metrics in OUT/warmup_metrics.jsonl, the warmed-up model in
    OUT/warmup_hf), from a checkpoint its state. Returns the first RL step to run."""
    if checkpoint is not None:
        first_step = run.begin(checkpoint, stop=stop)
        checkpoint_dirs.truncate_metrics(out, first_step - 1)
        print(f"resumed from {checkpoint} (step {first_step - 1})")
        return first_step
    checkpoint_dirs.truncate_metrics(out, 0)
    warm = MetricsWriter(out, phase="warmup", **_loggers(cfg))
    try:
        return run.begin(warmup_writer=warm, stop=stop)
    finally:
        warm.close()


def _train(run: RLRun, cfg, out: Path, stop, first_step: int) -> None:
    """RL steps first_step..cfg.steps through the run loop, each one's metrics written;
    checkpoints when due and at a stop request (then RunStopped)."""
    writer = MetricsWriter(out, **_loggers(cfg))
    if first_step == 1 and cfg.eval.due(0, cfg.steps):  # the starting weights, as step 0
        evaluated = run.controller.evaluate(0)
        if evaluated:  # {}: no held-out prompts (preflight said so)
            writer.write(0, evaluated)
    run.train(range(first_step, cfg.steps + 1), writer.write,
              checkpoint_due=lambda step: cfg.checkpoint.due(step, cfg.steps),
              keep_last=cfg.checkpoint.keep_last, stop=stop,
              evaluate_due=lambda step: cfg.eval.due(step, cfg.steps))
    writer.close()


def _loggers(cfg) -> dict:
    """MetricsWriter's optional loggers of this run (logging.wandb, with the resolved config)."""
    wandb = cfg.logging.wandb
    return {"wandb": wandb, "run_config": to_dict(cfg) if wandb is not None else None}


def _summary(cfg, out: Path, *, accuracy, first_step: int, digests, wall_s: float) -> dict:
    """summary.json's content: reward (and tool calls) over the first and last 5 steps, and
    the first and last evaluations' reward (`eval_first` / `eval_last`: step and reward)."""
    rows = [row for row in _metrics_rows(out) if "reward_mean" in row]  # step 0: an eval only
    rewards = [row["reward_mean"] for row in rows]
    k = min(5, len(rewards))
    summary = {"warmup_accuracy": accuracy, "reward_first5": sum(rewards[:k]) / max(k, 1),
               "reward_last5": sum(rewards[-k:]) / max(k, 1), "steps": len(rewards),
               "resumed_from_step": first_step - 1, "wall_s": wall_s,
               "weights_digests": digests}
    evals = [(row["step"], row["eval/reward_mean"]) for row in _metrics_rows(out)
             if "eval/reward_mean" in row]
    if evals:
        summary["eval_first"], summary["eval_last"] = evals[0], evals[-1]
    if cfg.task.multi_turn:
        tool_calls = [row.get("tool_calls/mean", 0.0) for row in rows]
        summary["tool_calls_first5"] = sum(tool_calls[:k]) / max(k, 1)
        summary["tool_calls_last5"] = sum(tool_calls[-k:]) / max(k, 1)
    return summary


def start_point(out: Path, resume: str | Path) -> Path | None:
    """The checkpoint a run in `out` starts from (None: from scratch). Saves that never
    completed are removed first; "never" removes OUT/checkpoints altogether."""
    root = checkpoint_dirs.checkpoint_root(out)
    if str(resume) == "never":
        if root.exists():
            print(f"--resume never: removing the earlier run's checkpoints in {root}")
            shutil.rmtree(root)
        return None
    checkpoint_dirs.clean_incomplete(root)
    if str(resume) == "auto":
        return checkpoint_dirs.newest_complete(root)
    return checkpoint_dirs.resolve_checkpoint(Path(resume))


def _metrics_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def add_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="end-to-end GRPO on CPU (addition task, tiny Llama)")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"))
    demo.add_argument("--config", type=Path, default=None,
                      help="YAML (default: configs/grpo_addition.yaml, the GRPO demo; may "
                           "also be the first positional argument)")
    demo.add_argument("--task", choices=sorted(DEMO_TASKS), default=None,
                      help="a built-in demo task's config (tool_calc: multi-turn tool use); "
                           "default: the addition demo")
    demo.add_argument("--model", choices=sorted(DEMO_MODELS), default="dense",
                      help="moe: the addition demo on a tiny Qwen3-MoE (EP2 actor)")
    demo.add_argument("overrides", nargs="*", help="a.b.c=value")
    add_verbose_argument(demo)
    demo.set_defaults(func=_run)
    train = sub.add_parser("train", help="an RL run from a YAML config (task, model, grids)")
    train.add_argument("--config", type=Path, default=None,
                       help="run config YAML (or give it as the first positional argument)")
    train.add_argument("--out", type=Path, default=Path("runs/train"))
    train.add_argument("--resume", default="auto",
                       help="auto (default: the newest complete checkpoint in --out, if any), "
                            "never (start over), or a checkpoint dir (or a run's checkpoints "
                            "dir: its newest)")
    train.add_argument("overrides", nargs="*", help="a.b.c=value")
    add_verbose_argument(train)
    train.set_defaults(func=_run)
    plot = sub.add_parser("plot", help="reward.png and phases.png from RUN_DIR/metrics.jsonl")
    plot.add_argument("run_dir", type=Path)
    plot.add_argument("--compare", type=Path, default=None, metavar="OTHER_RUN_DIR",
                      help="also RUN_DIR/reward_compare.png: both runs' rewards overlaid")
    plot.set_defaults(func=_plot)


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
# `mcore-rl demo` as is (and `bench step` without --config): the GRPO addition demo
DEMO_CONFIG = CONFIG_DIR / "grpo_addition.yaml"
# `mcore-rl demo --task NAME`: the config each built-in demo task runs with
DEMO_TASKS = {"addition": DEMO_CONFIG.name, "tool_calc": "tool_calc.yaml"}
# `mcore-rl demo --model NAME`: the config the addition demo runs with per model kind
DEMO_MODELS = {"dense": DEMO_CONFIG.name, "moe": "demo_moe.yaml"}


def _config_path(args) -> Path:
    """--config (or the positional config), else the built-in demo's for --task / --model
    (`mcore-rl train` requires a config: mcore_rl.cli refuses it without one)."""
    task = getattr(args, "task", None)
    model = getattr(args, "model", "dense")
    if args.config is not None:
        return args.config
    if model != "dense":
        if task not in (None, "addition"):
            raise ConfigError("--model", model, f"the {model} demo runs the addition task, "
                                                f"not --task {task}")
        return CONFIG_DIR / DEMO_MODELS[model]
    return CONFIG_DIR / DEMO_TASKS[task or "addition"]


def _run(args) -> int:
    """Exit 0 when the run completes; on a config error (the file, a field, a preflight
    problem, a --resume that cannot be used) its message on stderr and CONFIG_ERROR_EXIT; a
    reward function that raised: one line on stderr naming the sample and the checkpoint of
    the last completed step, and REWARD_FAILED_EXIT_CODE."""
    if args.verbose:  # before Ray starts: workers inherit it (as they do MCORE_RL_VERBOSE=1)
        set_verbose(True)

    created: list[Path] = []  # the directory of --out this run made, if it made one

    def refuse(message: str) -> int:
        print(f"mcore-rl {args.command}: {message}", file=sys.stderr, flush=True)
        remove_unused_out(created, args.out)  # a refused run leaves no run directory behind
        return CONFIG_ERROR_EXIT

    try:
        cfg = load_config(RLConfig, _config_path(args), args.overrides)
    except ConfigError as err:
        return refuse(f"config error: {err}")
    problem = out_dir_problem(args.out)
    if problem is not None:
        return refuse(f"--out {args.out}: {problem}")
    created.extend(p for p in [outermost_missing(args.out)] if p is not None)

    try:
        run_rl(cfg, args.out, getattr(args, "resume", "auto"), command=args.command)
    except RunStopped as stopped:  # SIGTERM/SIGUSR1: checkpointed, "requeue me" (75); Ctrl-C: 130
        print(f"mcore-rl {args.command}: {stopped}", flush=True)
        return stopped.exit_code
    except CheckpointNotFound as err:
        return refuse(f"--resume: {err}")
    except CheckpointWriteError as err:
        print(f"mcore-rl {args.command}: checkpoint error: {err}")
        return CHECKPOINT_WRITE_EXIT_CODE
    except ConfigError as err:  # e.g. model.hf_dir that is not a checkpoint
        return refuse(f"config error: {err}")
    except PreflightFailed as err:
        return refuse(str(err))
    except (WatchdogTimeout, WorkerDied, EngineFailed) as err:  # a hang or a dead worker
        print(f"mcore-rl {args.command}: {err}")
        return WORKER_FAILED_EXIT_CODE
    except RewardFailed as err:  # one line: the sample, the step, the exception, the checkpoint
        saved = (f"the last completed step is checkpointed in {err.checkpoint}"
                 if err.checkpoint is not None else "no step completed in this run (its "
                 "checkpoints are as they were)")
        print(f"mcore-rl {args.command}: {err}; {saved} (task.reward_errors: zero scores such "
              "samples 0)", file=sys.stderr, flush=True)
        return REWARD_FAILED_EXIT_CODE
    return 0


def out_dir_problem(out: Path) -> str | None:
    """Why `out` cannot hold a run (None: it can): it is a file or lies under one, or this
    process cannot write where it is or would be made (a read-only filesystem, a directory
    without permission, /proc or /sys). Tried by making and removing a temporary entry there,
    so it holds as root too (root passes permission checks, not a read-only filesystem)."""
    out, here = Path(out), None
    try:  # a parent without search permission makes even exists() fail
        if out.exists() and not out.is_dir():
            return "is a file, not a directory"
        here = next(p for p in (out, *out.absolute().parents) if p.exists())
        if not here.is_dir():
            return f"{here} is a file, not a directory"
        if here == out:
            fd, probe = tempfile.mkstemp(dir=here, prefix=".mcore-rl-probe-")
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(dir=here, prefix=".mcore-rl-probe-"))
    except OSError as err:
        return (f"cannot write in {here}: " if here is not None else "cannot reach it: ") + \
            str(err.strerror or err)
    return None


def outermost_missing(out: Path) -> Path | None:
    """The outermost directory of `out` (itself or a parent) that does not exist yet: what
    this run makes (None: `out` exists)."""
    missing = None
    for path in (out, *out.absolute().parents):
        if path.exists():
            return missing
        missing = path
    return missing


def remove_unused_out(created: list[Path], out: Path) -> None:
    """Remove the directories this run made for `out` when it was refused before it trained
    (nothing under OUT/checkpoints): the logs of a run that never started are not a run."""
    if checkpoint_dirs.checkpoint_root(out).exists():
        return
    for path in created:
        shutil.rmtree(path, ignore_errors=True)


def _plot(args) -> int:
    """Exit 0 with the charts' paths; a run directory that is not there or holds no metrics
    (or metrics that do not read): one line on stderr and CONFIG_ERROR_EXIT, no chart
    written."""
    def refuse(message: str) -> int:
        print(f"mcore-rl plot: {message}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT

    for flag, run_dir in (("RUN_DIR", args.run_dir), ("--compare", args.compare)):
        if run_dir is None:
            continue
        if not run_dir.is_dir():
            return refuse(f"{flag} {run_dir}: no such directory")
        if not (run_dir / "metrics.jsonl").is_file():
            return refuse(f"{flag} {run_dir}: no metrics.jsonl in it (not a run directory, "
                          "or a run that has not finished a step)")
    try:
        paths = plot_run(args.run_dir)
        if args.compare is not None:
            paths.append(plot_compare(args.run_dir, args.compare))
    except json.JSONDecodeError as err:
        dirs = " or ".join(str(d) for d in (args.run_dir, args.compare) if d is not None)
        return refuse(f"a line of metrics.jsonl in {dirs} is not JSON ({err.msg})")
    except ValueError as err:  # a metrics.jsonl without steps
        return refuse(" ".join(str(err).split()))
    for path in paths:
        print(path)
    return 0
