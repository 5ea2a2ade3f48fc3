"""`mcore-rl bench ...`: benchmarks that report ratios against a baseline measured in the same
run. Each prints a human summary, writes JSON + markdown under --out, and prints one JSON
object as its last line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mcore_rl.parallel import ParallelConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (ratios against same-run baselines)")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    sync = kinds.add_parser("sync", help="weight sync: streamed shards vs gather+broadcast")
    sync.add_argument("--model", default="tiny",
                      help="preset (micro, tiny, llama3-8b, llama3-70b, ...) or HF model dir")
    sync.add_argument("--train-tp", type=int, default=1)
    sync.add_argument("--train-pp", type=int, default=1)
    sync.add_argument("--vpp", type=int, default=None)
    sync.add_argument("--train-dp", type=int, default=1)
    sync.add_argument("--infer-tp", type=int, default=1)
    sync.add_argument("--engines", type=int, default=1)
    sync.add_argument("--bucket-mb", type=float, default=64.0)
    sync.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    sync.add_argument("--baseline", choices=("gather",), default=None,
                      help="also run the gather-to-rank-0-then-broadcast baseline")
    sync.add_argument("--check", action="store_true",
                      help="compare every received shard bit for bit with the reference")
    sync.add_argument("--repeats", type=int, default=1)
    sync.add_argument("--timeout-s", type=float, default=300.0)
    sync.add_argument("--plan-only", action="store_true",
                      help="plan from shapes only (any size) and project times; moves no data")
    sync.add_argument("--gpus-per-node", type=int, default=8)
    sync.add_argument("--intra-node-gbs", type=float, default=370.0)
    sync.add_argument("--inter-node-gbs", type=float, default=45.0)
    sync.add_argument("--latency-us", type=float, default=20.0)
    sync.add_argument("--out", type=Path, default=None,
                      help="directory for sync.json and sync.md (default: none)")
    sync.set_defaults(func=run_sync)


def _config(args):
    from mcore_rl.bench.sync import SyncBenchConfig

    train = ParallelConfig(tp=args.train_tp, pp=args.train_pp, vpp=args.vpp, dp=args.train_dp)
    return SyncBenchConfig(model=args.model, train=train, infer_tp=args.infer_tp,
                           engines=args.engines, bucket_mb=args.bucket_mb, dtype=args.dtype,
                           baseline=args.baseline == "gather", check=args.check,
                           repeats=args.repeats, timeout_s=args.timeout_s)


def run_sync(args) -> int:
    from mcore_rl.bench.sync import plan_only_report, run_sync_bench

    try:
        cfg = _config(args)
        if args.plan_only:
            from mcore_rl.bench.link_model import LinkModel

            link = LinkModel(gpus_per_node=args.gpus_per_node,
                             intra_node_gbs=args.intra_node_gbs,
                             inter_node_gbs=args.inter_node_gbs,
                             latency_s=args.latency_us * 1e-6)
            report = plan_only_report(cfg, link)
        else:
            report = run_sync_bench(cfg)
    except (ValueError, KeyError) as err:
        print(f"mcore-rl bench sync: {err}", file=sys.stderr)
        return 2
    _print_summary(report)
    if args.out:
        _write(args.out, "sync", report)
    print(json.dumps(report, default=str))
    return 0 if report.get("check") in ("pass", "not run", None) else 1


def _print_summary(report: dict) -> None:
    gib = 1 << 30
    print(f"model {report['model']} ({report['params'] / 1e9:.3f} B params, "
          f"{report['model_bytes'] / gib:.2f} GiB), train {report['train']} -> "
          f"infer {report['infer']}, bucket {report['bucket_mb']} MB, {report['rounds']} rounds")
    if "assumptions" in report:
        print(f"link model: {report['assumptions']}")
        print(f"projected: ours {report['projected_s']:.3f} s, baseline "
              f"{report['baseline_projected_s']:.3f} s, ratio "
              f"{report['baseline_projected_s'] / report['projected_s']:.1f}x; busiest "
              f"inference rank receives {report['max_rank_bytes_received'] / gib:.2f} GiB")
        return
    print(f"ours: {report['wall_s']:.3f} s, check {report['check']}, max staging "
          f"{report['max_peak_extra_bytes'] / (1 << 20):.1f} MiB")
    if "baseline" in report:
        print(f"baseline (gather to rank 0 + broadcast): {report['baseline']['wall_s']:.3f} s, "
              f"max staging {report['baseline_max_peak_extra_bytes'] / (1 << 20):.1f} MiB; "
              f"speedup {report['speedup_vs_baseline']:.2f}x")


def _write(out: Path, name: str, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str))
    rows = [("metric", "value")] + [(k, v) for k, v in report.items()
                                     if isinstance(v, (int, float, str))]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    (out / f"{name}.md").write_text(table.replace("| metric | value |",
                                                  "| metric | value |\n|---|---|", 1) + "\n")
