"""`mcore-rl demo` / `mcore-rl train`: an RL run from one config (`RLConfig`).

The model follows `ModelConfig`'s rule: with `model.hf_dir` null (the demo's default) a
sentencepiece tokenizer trained on the addition task's own text and a small random Llama are
built locally, nothing downloaded; with `model.hf_dir` set the run loads that HF checkpoint
directory. The Megatron actor (TP2 by default) warms up on noisy answers, then GRPO
runs with vLLM rollouts and streamed weight sync. The run directory gets metrics.jsonl,
TensorBoard logs, reward.png / phases.png and summary.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from mcore_rl.config import ConfigError, load_config
from mcore_rl.trainer import checkpoint_store


def build_demo_model(cfg, out: Path) -> Path:
    """Tokenizer + random-weight HF Llama in out/model (shapes: `cfg.model.demo_spec()`)."""
    from mcore_rl.models.hf_factory import make_hf_model_dir
    from mcore_rl.tasks.addition import AdditionTask
    from mcore_rl.tasks.tokenizer import build_tokenizer_dir

    tok_dir = build_tokenizer_dir(out / "tokenizer", AdditionTask(digits=cfg.task.digits))
    return make_hf_model_dir(cfg.model.demo_spec(), out / "model", seed=cfg.model.seed,
                             tokenizer_dir_or_obj=tok_dir)


def model_dir_of(cfg, out: Path) -> Path:
    """The model the run loads: model.hf_dir, or the demo model built into `out`."""
    if cfg.model.hf_dir is None:
        return build_demo_model(cfg, out)
    hf_dir = Path(cfg.model.hf_dir)
    missing = [name for name in ("config.json",) if not (hf_dir / name).is_file()]
    if missing or not any(hf_dir.glob("*.safetensors")):
        raise ConfigError("model.hf_dir", str(hf_dir), "expected an HF checkpoint directory "
                          "(config.json, *.safetensors, tokenizer files)")
    return hf_dir


def run_demo(cfg, out: Path, resume: str | Path = "auto") -> dict:
    """The run; `resume`: "auto" (the newest complete checkpoint in OUT/checkpoints, if any),
    "never" (start over: OUT's checkpoints and metrics are removed) or a checkpoint path.
    SIGTERM/SIGUSR1 stop it at the next safe point with a checkpoint (raises RunStopped)."""
    from mcore_rl.trainer.controller import RLController
    from mcore_rl.trainer.metrics import MetricsWriter, plot_run
    from mcore_rl.trainer.preflight import check_run
    from mcore_rl.trainer.run_control import RunStopped, StopControl, start_local_ray

    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    # Preflight sizes from the config alone (the demo spec, or hf_dir / preset), so a broken
    # run stops before anything is built; it raises PreflightFailed listing every error.
    for warning in check_run(cfg):
        print(f"preflight warning [{warning.check}] {warning.message} (fix: {warning.fix})")
    checkpoint = start_point(out, resume)
    if checkpoint is not None and checkpoint_store.step_of(checkpoint) >= cfg.steps:
        print(f"run already complete: {checkpoint} is after step {cfg.steps} of {cfg.steps}; "
              f"nothing to do (run dir {out})")
        return {"already_complete": True, "checkpoint": str(checkpoint)}
    stop = StopControl(cfg.checkpoint.stop_grace_s).install()
    model_dir = model_dir_of(cfg, out)
    start_local_ray()  # before the controller's init_local_ray (then a no-op)
    controller = RLController(cfg, model_dir, out)
    stop.install()  # again: Ray's driver installed its own (aborting) SIGTERM handler
    try:
        accuracy, first_step = None, 1
        if checkpoint is None:
            checkpoint_store.truncate_metrics(out, 0)
            warm = MetricsWriter(out, phase="warmup")
            accuracy = controller.warmup(warm) if cfg.warmup.max_steps else None
            warm.close()
            controller.reset_optimizer()
        else:
            controller.reset_optimizer()
            first_step = controller.load_checkpoint(checkpoint) + 1
            checkpoint_store.truncate_metrics(out, first_step - 1)
            print(f"resumed from {checkpoint} (step {first_step - 1})")
        if stop.requested:  # during start-up or warm-up: nothing to save yet
            raise RunStopped(first_step - 1, stop.signal_name, checkpoint)
        controller.sync_weights()
        writer = MetricsWriter(out)
        for step in range(first_step, cfg.steps + 1):
            writer.write(step, controller.rl_step(step))
            if cfg.checkpoint.due(step, cfg.steps) or stop.requested:
                saved = controller.save_checkpoint(step)
                checkpoint_store.prune(saved.parent, cfg.checkpoint.keep_last)
            if stop.requested:
                print(f"checkpoint {saved} written {stop.seconds_since_signal():.1f} s after "
                      f"{stop.signal_name}")
                raise RunStopped(step, stop.signal_name, saved)
        writer.close()
        digests = controller.weights_digests()
    finally:
        controller.shutdown()
        stop.restore()
    plot_run(out)
    rewards = [row["reward_mean"] for row in _metrics_rows(out)]
    k = min(5, len(rewards))
    summary = {"warmup_accuracy": accuracy, "reward_first5": sum(rewards[:k]) / max(k, 1),
               "reward_last5": sum(rewards[-k:]) / max(k, 1), "steps": len(rewards),
               "resumed_from_step": first_step - 1, "wall_s": time.perf_counter() - start,
               "weights_digests": digests}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"demo done in {summary['wall_s']:.0f} s: reward {summary['reward_first5']:.3f} "
          f"(mean of first {k} steps) -> {summary['reward_last5']:.3f} (last {k}); "
          f"run dir {out}")
    return summary


def start_point(out: Path, resume: str | Path) -> Path | None:
    """The checkpoint a run in `out` starts from (None: from scratch). Saves that never
    completed are removed first; "never" removes OUT/checkpoints altogether."""
    root = checkpoint_store.checkpoint_root(out)
    if str(resume) == "never":
        if root.exists():
            print(f"--resume never: removing the earlier run's checkpoints in {root}")
            shutil.rmtree(root)
        return None
    checkpoint_store.clean_incomplete(root)
    if str(resume) == "auto":
        return checkpoint_store.newest_complete(root)
    return checkpoint_store.resolve_checkpoint(Path(resume))


def _metrics_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def add_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="end-to-end GRPO on CPU (addition task, tiny Llama)")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"))
    demo.add_argument("--config", type=Path, default=None, help="YAML (default: built-in)")
    demo.add_argument("overrides", nargs="*", help="a.b.c=value")
    demo.set_defaults(func=_run)
    train = sub.add_parser("train", help="an RL run from a YAML config (task, model, grids)")
    train.add_argument("--config", type=Path, required=True)
    train.add_argument("--out", type=Path, default=Path("runs/train"))
    train.add_argument("--resume", default="auto",
                       help="auto (default: the newest complete checkpoint in --out, if any), "
                            "never (start over), or a checkpoint dir (or a run's checkpoints "
                            "dir: its newest)")
    train.add_argument("overrides", nargs="*", help="a.b.c=value")
    train.set_defaults(func=_run)
    plot = sub.add_parser("plot", help="reward.png and phases.png from RUN_DIR/metrics.jsonl")
    plot.add_argument("run_dir", type=Path)
    plot.set_defaults(func=_plot)


def _run(args) -> int:
    from mcore_rl.trainer.rl_config import RLConfig

    try:
        cfg = load_config(RLConfig, args.config, args.overrides)
    except ConfigError as err:
        print(f"mcore-rl {args.command}: config error: {err}")
        return 2
    from mcore_rl.launch.watchdog import WatchdogTimeout, WorkerDied
    from mcore_rl.trainer.preflight import PreflightFailed

    from mcore_rl.trainer.checkpoint_store import CheckpointNotFound, CheckpointWriteError
    from mcore_rl.trainer.run_control import STOP_EXIT_CODE, RunStopped

    try:
        run_demo(cfg, args.out, getattr(args, "resume", "auto"))
    except RunStopped as stopped:  # SIGTERM/SIGUSR1: checkpointed, "requeue me"
        print(f"mcore-rl {args.command}: {stopped}", flush=True)
        return STOP_EXIT_CODE
    except CheckpointNotFound as err:
        print(f"mcore-rl {args.command}: --resume: {err}")
        return 2
    except CheckpointWriteError as err:
        print(f"mcore-rl {args.command}: checkpoint error: {err}")
        return 4
    except ConfigError as err:  # e.g. model.hf_dir that is not a checkpoint
        print(f"mcore-rl {args.command}: config error: {err}")
        return 2
    except PreflightFailed as err:
        print(f"mcore-rl {args.command}: {err}")
        return 2
    except (WatchdogTimeout, WorkerDied) as err:  # a hang or a dead worker, named
        print(f"mcore-rl {args.command}: {err}")
        return 3
    return 0


def _plot(args) -> int:
    from mcore_rl.trainer.metrics import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0
