"""`mcore-rl export RUN_DIR OUT [--step N]`: a run's trained policy as a Hugging Face checkpoint
directory (config.json, tokenizer, safetensors) that transformers, vLLM or another run
(`model.hf_dir=OUT`) load as they would the model the run started from.

Everything is found from the run directory: the checkpoint is RUN_DIR's newest complete one
(`--step N`: RUN_DIR/checkpoints/step_N), its actor's dist checkpoint (`actor/`) is what is
converted, and the model's config.json and tokenizer come from the run's starting model
(RUN_DIR/config.yaml's model.hf_dir, or the demo model the run built in RUN_DIR/model). The
conversion is `mcore-rl convert mcore-to-hf`'s (`conversion.mcore_to_hf`, streamed tensor by
tensor: the model's weights, never the optimizer); a LoRA run's checkpoint gives the merged
model, W + (alpha / rank)·B·A. OUT is written to a hidden directory beside it and renamed
when complete: it is whole or absent.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mcore_rl.config import CONFIG_ERROR_EXIT, ConfigError
from mcore_rl.config.loader import read_config_file
from mcore_rl.conversion.errors import ConversionError
from mcore_rl.rl import checkpoint_dirs
from mcore_rl.run.lifecycle import DEMO_MODEL_DIR
from mcore_rl.run.train import RESOLVED_CONFIG

# the role a checkpoint step directory holds the policy under (workers.actor.save_checkpoint)
ACTOR_DIR = "actor"


class ExportError(ValueError):
    """The run directory does not say what to export (no config, no such checkpoint, ...)."""


def run_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The step directory to export: RUN_DIR's newest complete checkpoint, or step `step`'s
    (which must be complete). ExportError naming what there is otherwise."""
    root = checkpoint_dirs.checkpoint_root(run_dir)
    complete = checkpoint_dirs.complete_checkpoints(root)
    steps = ", ".join(str(checkpoint_dirs.step_of(p)) for p in complete) or "none"
    if step is None:
        if not complete:
            raise ExportError(f"{run_dir}: no complete checkpoint in {root} (a run writes one "
                              "after its last step and every checkpoint.every steps)")
        return complete[-1]
    path = root / f"step_{step}"
    if path not in complete:
        raise ExportError(f"--step {step}: {path} is not a complete checkpoint (complete "
                          f"steps: {steps})")
    return path


def base_model_dir(run_dir: Path) -> Path:
    """The HF directory whose config.json and tokenizer the export takes: model.hf_dir of
    RUN_DIR/config.yaml, or RUN_DIR/model (the demo model the run built) when it is null."""
    config = Path(run_dir) / RESOLVED_CONFIG
    if not config.is_file():
        raise ExportError(f"{run_dir}: not a run directory (no {RESOLVED_CONFIG}: `mcore-rl "
                          "train --out RUN_DIR` writes it)")
    model = read_config_file(config).get("model") or {}
    hf_dir = model.get("hf_dir") if isinstance(model, dict) else None
    folder = Path(hf_dir) if hf_dir else Path(run_dir) / DEMO_MODEL_DIR
    if not (folder / "config.json").is_file():
        said = (f"model.hf_dir={hf_dir!r} in {config}" if hf_dir
                else f"the demo model the run built ({config} has model.hf_dir null)")
        raise ExportError(f"{folder}: no config.json; the model's config and tokenizer come "
                          f"from {said}")
    return folder


def export_run(run_dir: Path, out: Path, *, step: int | None = None, force: bool = False,
               progress: bool = True):
    """Convert RUN_DIR's checkpoint (module doc) into the HF directory `out`; returns the
    conversion's ConvertReport. ExportError / ConversionError on bad input."""
    from mcore_rl.conversion.convert import mcore_to_hf  # lazy: torch.distributed.checkpoint

    run_dir = Path(run_dir)
    model_dir = base_model_dir(run_dir)
    checkpoint = run_checkpoint(run_dir, step)
    actor = checkpoint / ACTOR_DIR
    if not actor.is_dir():
        raise ExportError(f"{checkpoint}: no {ACTOR_DIR}/ (not a checkpoint of mcore-rl train)")
    return mcore_to_hf(actor, out, hf_config=model_dir, force=force, progress=progress)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `mcore-rl export` (mcore_rl/cli.py COMMANDS)."""
    export = sub.add_parser(
        "export", help="a run's trained model as an HF checkpoint directory",
        description="Write the policy of RUN_DIR's newest complete checkpoint (or --step N) as "
                    "an HF checkpoint directory OUT: safetensors, config.json and the "
                    "tokenizer of the model the run started from. A LoRA run gives the merged "
                    "model. OUT appears only when complete.")
    export.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="the run directory (mcore-rl train --out RUN_DIR)")
    export.add_argument("out", type=Path, metavar="OUT", help="the HF directory to write")
    export.add_argument("--step", type=int, default=None,
                        help="export the checkpoint after this step (default: the newest)")
    export.add_argument("--force", action="store_true", help="replace OUT if it exists")
    export.add_argument("--no-progress", action="store_true", help="no progress bar")
    export.set_defaults(func=_run)


def _run(args) -> int:
    """Exit 0 with OUT written; bad input (no run directory, no such checkpoint, OUT exists)
    is one line on stderr and exit CONFIG_ERROR_EXIT."""
    try:
        report = export_run(args.run_dir, args.out, step=args.step, force=args.force,
                            progress=not args.no_progress)
    except (ExportError, ConversionError, ConfigError, FileNotFoundError) as err:
        print(f"mcore-rl export: {err}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    print(f"exported {Path(report.src).parent.name} of {args.run_dir}: {report.summary()}")
    print(json.dumps(report.as_dict()))
    return 0
