"""Per-step metrics: phase timers, and one writer for console (rich), JSONL, TensorBoard and
(optional, `logging.wandb`) Weights & Biases; `plot_run` turns a run's metrics.jsonl into PNG
charts (`mcore-rl plot RUN_DIR`), `plot_compare` overlays two runs' rewards
(`mcore-rl plot RUN_DIR --compare OTHER_RUN_DIR`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from mcore_rl.runconfig.sections import WandbConfig, no_wandb


class MetricsWriter:
    """Writes each step's metrics to RUN_DIR/metrics.jsonl, TensorBoard (RUN_DIR/tb), the
    console and, with `wandb` set, a wandb run of this phase, started at its first step
    (`run_config`: that run's config, e.g. the resolved run config as a dict)."""

    CONSOLE = ("reward_mean", "eval/reward_mean", "accuracy", "loss", "pg_loss", "clip_frac",
               "entropy", "grad_norm", "timing_s/gen", "timing_s/update_actor",
               "timing_s/sync", "timing_s/step")

    def __init__(self, run_dir: Path, phase: str = "rl", *, wandb: WandbConfig | None = None,
                 run_config: dict[str, Any] | None = None):
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = (self.run_dir / ("metrics.jsonl" if phase == "rl"
                                      else f"{phase}_metrics.jsonl")).open("a")
        self.tb = SummaryWriter(str(self.run_dir / "tb" / phase))
        # soft_wrap: one line per step, also when the output is a file or a pipe (rich would
        # hard-wrap at 80 columns there)
        self.console = Console(highlight=False, soft_wrap=True)
        self.phase = phase
        self._wandb_args = (wandb, run_config)
        self.wandb = None  # the wandb run, once a step is written

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for key, value in record.items():
            if key != "step":
                self.tb.add_scalar(key, value, step)
        if self.wandb is None and self._wandb_args[0] is not None:
            self.wandb = _start_wandb(*self._wandb_args, self.run_dir, self.phase)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)
        shown = "  ".join(f"{k.removeprefix('timing_s/')}={record[k]:.3g}"
                          for k in self.CONSOLE if k in record)
        self.console.print(f"[bold]{self.phase} step {step:4d}[/bold]  {shown}")

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _start_wandb(cfg: WandbConfig, run_config: dict[str, Any] | None, run_dir: Path,
                 phase: str):
    """The wandb run of one phase, its files under RUN_DIR/wandb (wandb imported here only:
    it is an optional dependency)."""
    try:
        import wandb  # lazy: wandb
    except ImportError:
        raise no_wandb(cfg).under("logging") from None
    name = cfg.name or run_dir.name
    return wandb.init(project=cfg.project, name=f"{name}/{phase}", group=name, job_type=phase,
                      mode=cfg.mode, dir=str(run_dir), config=run_config, reinit="create_new")


TOOL_CURVES = ("tool_calls/mean", "tool_errors/frac", "turns/mean")


def plot_run(run_dir: str | Path) -> list[Path]:
    """reward.png (reward per step) and phases.png (seconds per phase per step); for
    multi-turn runs also tools.png (reward, tool calls and errors, turns per step)."""
    import matplotlib  # lazy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib

    run_dir = Path(run_dir)
    every = _read_metrics(run_dir)
    records = _step_records(every)
    steps = [r["step"] for r in records]
    evals = [r for r in every if "eval/reward_mean" in r]

    def reward(ax):
        ax.plot(steps, [r["reward_mean"] for r in records], label="reward_mean")
        if evals:  # evaluations on the held-out prompts
            ax.plot([r["step"] for r in evals], [r["eval/reward_mean"] for r in evals],
                    marker="o", label="eval/reward_mean")
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)

    def phases(ax):
        names = sorted({k for r in records for k in r if k.startswith("timing_s/")
                        and k != "timing_s/step"})
        bottom = [0.0] * len(records)
        for phase in names:
            values = [r.get(phase, 0.0) for r in records]
            ax.bar(steps, values, bottom=bottom, label=phase.removeprefix("timing_s/"))
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.legend(fontsize=7)

    def tools(ax):  # multi-turn runs: reward beside the tool use
        for key in ("reward_mean", *TOOL_CURVES):
            ax.plot(steps, [r.get(key, float("nan")) for r in records], label=key)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)

    written = [_save_chart(plt, run_dir / "reward.png", "reward", "reward", reward),
               _save_chart(plt, run_dir / "phases.png", "time per phase", "seconds", phases)]
    if any(TOOL_CURVES[0] in r for r in records):
        written.append(_save_chart(plt, run_dir / "tools.png", "reward and tool use",
                                   "per episode", tools))
    plt.close("all")
    return written


def plot_compare(run_dir: str | Path, other_dir: str | Path, window: int = 10) -> Path:
    """RUN_DIR/reward_compare.png: both runs' reward per step (thin) and its trailing
    `window`-step mean (thick), labelled by run directory name."""
    import matplotlib  # lazy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib

    run_dir = Path(run_dir)
    runs = [(Path(d).name, _step_records(_read_metrics(d))) for d in (run_dir, other_dir)]

    def rewards(ax):
        for (name, records), color in zip(runs, ("tab:blue", "tab:orange")):
            steps = [r["step"] for r in records]
            values = [r["reward_mean"] for r in records]
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
            ax.plot(steps, trailing_mean(values, window), color=color, linewidth=2,
                    label=f"{name} ({window}-step mean)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    title = f"reward: {runs[0][0]} vs {runs[1][0]}"
    path = _save_chart(plt, run_dir / "reward_compare.png", title, "reward", rewards)
    plt.close("all")
    return path


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each index (fewer at the start)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window))
            for i in range(len(values))]


def _read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl in the run directory")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path}: no steps recorded")
    return records


def _step_records(records: list[dict]) -> list[dict]:
    """The RL steps' records (an evaluation before the first step is a record of its own)."""
    return [r for r in records if "reward_mean" in r]


def _save_chart(plt, path: Path, title: str, ylabel: str, draw) -> Path:
    """One per-step chart: `draw(ax)` plots, this labels and saves it."""
    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    return path
