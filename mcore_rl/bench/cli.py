"""`mcore-rl bench ...`: benchmarks that report ratios against a baseline measured in the same
run. sync, logprob and rollout are set like everything else: a frozen config dataclass
(`SyncBenchConfig`, `LogprobBenchConfig`, `RolloutBenchConfig`) from `--config FILE` and
`a.b=c` overrides; step takes the same overrides, of its own fields (`StepBenchConfig`:
untimed_steps, peak_tflops, compare, baseline, shape) and of the RL config (every other key). Flags
are only the common ones: --config, --repeats, --out. Each prints a human summary, writes
JSON + markdown under --out (logprob, rollout and step also a PNG chart), and prints one JSON
object as its last line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mcore_rl.bench import step
from mcore_rl.bench.report import write_outputs
from mcore_rl.bench.trl_baseline import check_available, trl_arguments
from mcore_rl.config import CONFIG_ERROR_EXIT, ConfigError, load_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (ratios against same-run baselines)")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, help_, doc in (
            ("sync", "weight sync: streamed shards vs gather+broadcast",
             "SyncBenchConfig in mcore_rl/bench/sync.py (the run config's names), e.g. "
             "actor.tp=2 actor.pp=2 rollout.tp=2 sync.bucket_mb=16 baseline=[gather,link] "
             "check=true; plan_only=true projects any size with link_model.*"),
            ("logprob", "vocab-parallel log-prob+entropy vs gathered logits",
             "LogprobBenchConfig in mcore_rl/bench/logprob.py, e.g. tokens=4096 vocab=32000 "
             "tp=2 backward=true"),
            ("rollout", "vLLM generation vs HF transformers generate",
             "RolloutBenchConfig in mcore_rl/bench/rollout.py, e.g. model=micro prompts=16 "
             "prompt_len=32 max_new_tokens=64")):
        p = kinds.add_parser(name, help=help_)
        p.add_argument("--config", default=None, metavar="FILE",
                       help="YAML of the benchmark's config (overrides apply on top)")
        p.add_argument("overrides", nargs="*", metavar="A.B=VALUE", help=f"fields of {doc}")
        _add_common(p, name, repeats=None)
        p.set_defaults(func={"sync": run_sync, "logprob": run_logprob,
                             "rollout": run_rollout}[name])
    _add_step(kinds)


def _add_common(parser: argparse.ArgumentParser, name: str, repeats: int | None) -> None:
    parser.add_argument("--repeats", type=int, default=repeats,
                        help="timed repetitions; median and min/max are reported"
                             + ("" if repeats is not None else " (the same as repeats=N)"))
    parser.add_argument("--out", type=Path, default=None,
                        help=f"directory for {name}.json, {name}.md and {name}.png "
                             "(default: none)")


#: the flags `bench step` had before it took overrides: each names its override now
_OLD_STEP_FLAGS = {"--warmup-steps": "untimed_steps", "--peak-tflops": "peak_tflops",
                   "--compare": "compare", "--baseline": "baseline"}


def _add_step(kinds) -> None:
    p = kinds.add_parser("step", help="RL steps: time per phase, sync share, tokens/s, MFU")
    p.add_argument("--config", default=None,
                   help="RLConfig YAML (default: configs/grpo_addition.yaml, the demo)")
    p.add_argument("overrides", nargs="*", metavar="A.B=VALUE",
                   help="StepBenchConfig fields in mcore_rl/bench/step.py (untimed_steps=1, "
                        "peak_tflops=989, compare=[rollout.mode=async], baseline=trl, "
                        "shape=qwen2_16k: a realistic shape, mcore_rl/bench/shapes.py); "
                        "every other key overrides the RL config")
    for flag in _OLD_STEP_FLAGS:  # accepted only to say what replaced them
        p.add_argument(flag, dest="old_" + _OLD_STEP_FLAGS[flag], action="append",
                       default=None, help=argparse.SUPPRESS)
    _add_common(p, "step", None)
    p.set_defaults(func=run_step)


def bench_config(cls, args):
    """The benchmark's frozen config: `--config` YAML, then the `a.b=c` overrides, then
    `--repeats` (a flag for the one field every benchmark has). Raises ConfigError naming the
    field."""
    overrides = list(args.overrides)
    if args.repeats is not None:
        overrides.append(f"repeats={args.repeats}")
    return load_config(cls, args.config, overrides)


def _run_bench(args, name: str, make_config, run, module) -> int:
    """Shared tail of logprob / rollout / step: config errors exit 2, summary, files, JSON
    last line."""
    try:
        cfg = make_config(args)
    except (ValueError, KeyError, OSError, ImportError) as err:  # ConfigError: a ValueError
        return _refuse(name, err)
    try:
        report = run(cfg)
    except (ValueError, KeyError) as err:  # e.g. an unknown model or a bad config file
        print(f"mcore-rl bench {name}: {err}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    print("\n".join(module.summary_lines(report)))
    if args.out:
        write_outputs(args.out, name, report, module.tables(report), module.chart(report))
    print(json.dumps(report, default=str))
    return 0


def _refuse(name: str, err: Exception) -> int:
    """A benchmark whose config does not load: one line on stderr, CONFIG_ERROR_EXIT."""
    what = "config error: " if isinstance(err, ConfigError) else ""
    print(f"mcore-rl bench {name}: {what}{err}", file=sys.stderr)
    return CONFIG_ERROR_EXIT


def run_logprob(args) -> int:
    from mcore_rl.bench import logprob  # lazy: torch

    return _run_bench(args, "logprob", lambda a: bench_config(logprob.LogprobBenchConfig, a),
                      logprob.run_logprob_bench, logprob)


def run_rollout(args) -> int:
    from mcore_rl.bench import rollout  # lazy: torch

    return _run_bench(args, "rollout", lambda a: bench_config(rollout.RolloutBenchConfig, a),
                      rollout.run_rollout_bench, rollout)


def run_step(args) -> int:
    def make(a):
        for flag, name in _OLD_STEP_FLAGS.items():
            if getattr(a, "old_" + name):
                raise ConfigError(flag, getattr(a, "old_" + name)[0],
                                  f"bench step takes it as the override {name}=VALUE")
        cfg = step.step_bench_config(a.config, a.overrides, repeats=a.repeats)
        rl = cfg.rl_config()  # fail on a bad config before anything starts
        cfg.variant().rl_config()
        if cfg.baseline == "trl":  # settings TRL cannot match, or TRL missing, fail here too

            trl_arguments(rl, "unused", 1)
            check_available()
        return cfg

    return _run_bench(args, "step", make, step.run_step_bench, step)


def run_sync(args) -> int:
    from mcore_rl.bench.sync import SyncBenchConfig, plan_only_report, run_sync_bench  # lazy: torch

    try:
        cfg = bench_config(SyncBenchConfig, args)
        report = plan_only_report(cfg) if cfg.plan_only else run_sync_bench(cfg)
    except (ValueError, KeyError, OSError) as err:
        return _refuse("sync", err)
    from mcore_rl.launch.slurm import is_primary  # lazy: torch

    if is_primary():  # under srun every task gets the report; one prints and writes it
        _print_summary(report)
        if args.out:
            _write(args.out, "sync", report)
        print(json.dumps(report, default=str))
    return 0 if report.get("check") in ("pass", "not run", None) else 1


def _print_summary(report: dict) -> None:
    gib = 1 << 30
    print(f"model {report['model']} ({report['params'] / 1e9:.3f} B params, "
          f"{report['model_bytes'] / gib:.2f} GiB), actor {report['actor']} -> "
          f"rollout {report['rollout']}, bucket {report['sync_bucket_mb']} MB, "
          f"{report['rounds']} rounds")
    if "assumptions" in report:
        print(f"link model: {report['assumptions']}")
        print(f"projected: ours {report['projected_s']:.3f} s, baseline "
              f"{report['baseline_projected_s']:.3f} s, ratio "
              f"{report['baseline_projected_s'] / report['projected_s']:.1f}x; busiest "
              f"inference rank receives {report['max_rank_bytes_received'] / gib:.2f} GiB "
              f"(its own shards: {report['ideal_rank_bytes'] / gib:.2f} GiB)")
        if "fp8_sync" in report:
            fp8 = report["fp8_sync"]
            print(f"{report['quantization']}: one sync {fp8['total_bytes'] / gib:.2f} GiB vs "
                  f"{fp8['without_fp8_bytes'] / gib:.2f} GiB unquantized ({fp8['ratio']:.3f}x); "
                  f"projected {report['fp8_projected_s']:.3f} s")
        return
    print(f"ours ({report['transport']}): {report['wall_s']:.3f} s, check {report['check']}, "
          f"max staging {report['max_peak_extra_bytes'] / (1 << 20):.1f} MiB (training ranks "
          f"{report['max_train_peak_extra_bytes'] / (1 << 20):.1f} MiB)")
    gb = 1e9
    print(f"ours: {report['sync_gbs_per_receiver']:.2f} GB/s per receiver "
          f"({max(report['bytes_received'].values()) / gb:.3f} GB into the busiest)")
    if "fp8" in report:
        fp8 = report["fp8"]
        print(f"{report['quantization']}: {fp8['wall_s']:.3f} s, check {fp8['check']}, "
              f"{report['fp8_bytes_sent'] / 1e6:.2f} MB sent vs "
              f"{sum(report['bytes_sent'].values()) / 1e6:.2f} MB unquantized; unquantized / "
              f"FP8 time {report['fp8_speedup']:.2f}x")
    if "link" in report:
        print(f"link (plan's byte matrix as plain sends): {report['link']['wall_s']:.3f} s, "
              f"{report['link_gbs_per_receiver']:.2f} GB/s per receiver; link_efficiency "
              f"{report['link_efficiency']:.2f} (runs: "
              f"{', '.join(f'{e:.2f}' for e in report['link_efficiency_runs'])})")
    if "baseline" in report:
        print(f"baseline (gather to rank 0 + broadcast): {report['baseline']['wall_s']:.3f} s, "
              f"max staging {report['baseline_max_peak_extra_bytes'] / (1 << 20):.1f} MiB; "
              f"speedup {report['speedup_vs_baseline']:.2f}x")


def _write(out: Path, name: str, report: dict) -> None:
    """sync.json, sync.md and sync.png: time and the largest staging buffer, ours vs the
    baseline (or the projections, with --plan-only)."""
    def chart(fig):
        if "projected_s" in report:
            ax = fig.add_subplot(1, 1, 1)
            ax.bar(["streamed (ours)", "gather+broadcast"],
                   [report["projected_s"], report["baseline_projected_s"]],
                   color=["tab:blue", "tab:orange"])
            ax.set_ylabel("projected seconds")
            ax.set_title(f"{report['model']}: {report['actor']} -> {report['rollout']}")
            return
        base, link = report.get("baseline"), report.get("link")
        labels = ["streamed (ours)"] + (["gather+broadcast"] if base else [])
        time_ax, mem_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        time_labels = labels + (["link (plain sends)"] if link else [])
        time_ax.bar(time_labels, [report["wall_s"]] + ([base["wall_s"]] if base else [])
                    + ([link["wall_s"]] if link else []),
                    color=["tab:blue", "tab:orange", "tab:gray"][:len(time_labels)])
        time_ax.set_ylabel("wall seconds (median)")
        time_ax.set_title("sync time")
        mib = 1 << 20
        mem_ax.bar(labels, [report["max_peak_extra_bytes"] / mib]
                   + ([report["baseline_max_peak_extra_bytes"] / mib] if base else []),
                   color=["tab:blue", "tab:orange"][:len(labels)])
        mem_ax.set_ylabel("MiB")
        mem_ax.set_title("largest per-rank staging memory")

    write_outputs(out, name, report, [], chart)
