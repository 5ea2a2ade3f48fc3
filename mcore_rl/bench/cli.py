"""`mcore-rl bench ...`: benchmarks that report ratios against a baseline measured in the same
run. Each prints a human summary, writes JSON + markdown under --out (logprob, rollout and
step also a PNG chart), and prints one JSON object as its last line."""

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
                      help="preset (micro, micro-moe, tiny, llama3-70b, qwen3-30b-a3b, ...) or "
                           "HF model dir")
    sync.add_argument("--train-tp", type=int, default=1)
    sync.add_argument("--train-pp", type=int, default=1)
    sync.add_argument("--vpp", type=int, default=None)
    sync.add_argument("--train-dp", type=int, default=1)
    sync.add_argument("--train-ep", type=int, default=1,
                      help="expert parallel (MoE models): etp * ep must divide tp * dp")
    sync.add_argument("--train-etp", type=int, default=None,
                      help="expert tensor parallel (MoE models); default: --train-tp")
    sync.add_argument("--infer-tp", type=int, default=1)
    sync.add_argument("--engines", type=int, default=1)
    sync.add_argument("--bucket-mb", type=float, default=64.0)
    sync.add_argument("--dtype", choices=("float32", "bfloat16", "fp32", "bf16"),
                      default="float32")
    sync.add_argument("--baseline", choices=("gather", "link"), action="append", default=[],
                      help="also run a baseline (repeatable): gather = gather to rank 0 then "
                           "broadcast; link = the plan's byte matrix as plain sends on the same "
                           "group (reports link_efficiency = link time / sync time)")
    sync.add_argument("--check", action="store_true",
                      help="compare every received shard bit for bit with the reference")
    sync.add_argument("--repeats", type=int, default=1)
    sync.add_argument("--warmup", type=int, default=0,
                      help="untimed syncs before the timed ones (steady state, as in training)")
    sync.add_argument("--timeout-s", type=float, default=300.0)
    sync.add_argument("--transport", choices=("p2p", "ipc"), default="p2p",
                      help="p2p: sends on the sync group; ipc: colocated ranks (inference rank d "
                           "on training rank d's device) copy out of shared staging buffers")
    sync.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                      help="where the ranks' tensors live (cuda: NCCL for p2p and baseline)")
    sync.add_argument("--plan-only", action="store_true",
                      help="plan from shapes only (any size) and project times; moves no data")
    sync.add_argument("--gpus-per-node", type=int, default=8)
    sync.add_argument("--intra-node-gbs", type=float, default=370.0)
    sync.add_argument("--inter-node-gbs", type=float, default=45.0)
    sync.add_argument("--latency-us", type=float, default=20.0)
    sync.add_argument("--out", type=Path, default=None,
                      help="directory for sync.json and sync.md (default: none)")
    sync.set_defaults(func=run_sync)
    _add_logprob(kinds)
    _add_rollout(kinds)
    _add_step(kinds)


def _add_common(parser: argparse.ArgumentParser, name: str, repeats: int) -> None:
    parser.add_argument("--repeats", type=int, default=repeats,
                        help="timed repetitions; median and min/max are reported")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"directory for {name}.json, {name}.md and {name}.png "
                             "(default: none)")


def _add_logprob(kinds) -> None:
    p = kinds.add_parser("logprob", help="vocab-parallel log-prob+entropy vs gathered logits")
    p.add_argument("--tokens", type=int, default=4096, help="b*s positions")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, default=2, help="gloo ranks (vocab shards)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "fp32", "bf16"),
                   default="float32")
    p.add_argument("--backward", action="store_true", help="also the backward to the shard")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0)
    _add_common(p, "logprob", 3)
    p.set_defaults(func=run_logprob)


def _add_rollout(kinds) -> None:
    p = kinds.add_parser("rollout", help="vLLM generation vs HF transformers generate")
    p.add_argument("--model", default="micro", help="preset or HF model dir")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    p.add_argument("--kv-cache-gib", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    _add_common(p, "rollout", 3)
    p.set_defaults(func=run_rollout)


def _add_step(kinds) -> None:
    p = kinds.add_parser("step", help="RL steps: time per phase, sync share, tokens/s, MFU")
    p.add_argument("--config", default=None, help="RLConfig YAML (default: built-in)")
    p.add_argument("--warmup-steps", type=int, default=1, help="unmeasured steps first")
    p.add_argument("--peak-tflops", type=float, default=0.2,
                   help="dense peak per device in TFLOP/s (e.g. 989 for H100 bf16)")
    p.add_argument("--compare", action="append", default=[], metavar="A.B=VALUE",
                   help="also run a variant with this override (repeatable), e.g. "
                        "rollout.mode=async; reports its speed-up over the baseline")
    p.add_argument("--baseline", choices=("trl",), default=None,
                   help="also run Hugging Face TRL's GRPOTrainer (extra 'bench') on the same "
                        "task from the same starting weights; reports ours / TRL per step")
    p.add_argument("overrides", nargs="*", help="a.b.c=value")
    _add_common(p, "step", 2)
    p.set_defaults(func=run_step)


def _run_bench(args, name: str, make_config, run, module) -> int:
    """Shared tail of logprob / rollout / step: config errors exit 2, summary, files, JSON
    last line."""
    from mcore_rl.bench.report import write_outputs

    try:
        cfg = make_config(args)
    except (ValueError, KeyError, OSError, ImportError) as err:  # ConfigError: a ValueError
        print(f"mcore-rl bench {name}: {err}", file=sys.stderr)
        return 2
    try:
        report = run(cfg)
    except (ValueError, KeyError) as err:  # e.g. an unknown model or a bad config file
        print(f"mcore-rl bench {name}: {err}", file=sys.stderr)
        return 2
    print("\n".join(module.summary_lines(report)))
    if args.out:
        write_outputs(args.out, name, report, module.tables(report), module.chart(report))
    print(json.dumps(report, default=str))
    return 0


def run_logprob(args) -> int:
    from mcore_rl.bench import logprob

    return _run_bench(args, "logprob", lambda a: logprob.LogprobBenchConfig(
        tokens=a.tokens, vocab=a.vocab, tp=a.tp, dtype=a.dtype, backward=a.backward,
        repeats=a.repeats, seed=a.seed, timeout_s=a.timeout_s),
        logprob.run_logprob_bench, logprob)


def run_rollout(args) -> int:
    from mcore_rl.bench import rollout

    return _run_bench(args, "rollout", lambda a: rollout.RolloutBenchConfig(
        model=a.model, prompts=a.prompts, prompt_len=a.prompt_len,
        max_new_tokens=a.max_new_tokens, temperature=a.temperature, repeats=a.repeats,
        threads=a.threads, kv_cache_gib=a.kv_cache_gib, seed=a.seed),
        rollout.run_rollout_bench, rollout)


def run_step(args) -> int:
    from mcore_rl.bench import step

    def make(a):
        cfg = step.StepBenchConfig(config=a.config, overrides=tuple(a.overrides),
                                   repeats=a.repeats, warmup_steps=a.warmup_steps,
                                   peak_tflops=a.peak_tflops, compare=tuple(a.compare),
                                   baseline=a.baseline)
        rl = cfg.rl_config()  # fail on a bad config before anything starts
        cfg.variant().rl_config()
        if cfg.baseline == "trl":  # settings TRL cannot match, or TRL missing, fail here too
            from mcore_rl.bench.trl_baseline import check_available, trl_arguments

            trl_arguments(rl, "unused", 1)
            check_available()
        return cfg

    return _run_bench(args, "step", make, step.run_step_bench, step)


def _config(args):
    from mcore_rl.bench.sync import SyncBenchConfig

    train = ParallelConfig(tp=args.train_tp, pp=args.train_pp, vpp=args.vpp, dp=args.train_dp,
                           ep=args.train_ep, etp=args.train_etp)
    return SyncBenchConfig(model=args.model, train=train, infer_tp=args.infer_tp,
                           engines=args.engines, bucket_mb=args.bucket_mb, dtype=args.dtype,
                           baseline="gather" in args.baseline,
                           link="link" in args.baseline, check=args.check,
                           repeats=args.repeats, warmup=args.warmup,
                           timeout_s=args.timeout_s,
                           transport=args.transport, device=args.device)


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
    from mcore_rl.launch.slurm import is_primary

    if is_primary():  # under srun every task gets the report; one prints and writes it
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
              f"inference rank receives {report['max_rank_bytes_received'] / gib:.2f} GiB "
              f"(its own shards: {report['ideal_rank_bytes'] / gib:.2f} GiB)")
        return
    print(f"ours ({report['transport']}): {report['wall_s']:.3f} s, check {report['check']}, "
          f"max staging {report['max_peak_extra_bytes'] / (1 << 20):.1f} MiB (training ranks "
          f"{report['max_train_peak_extra_bytes'] / (1 << 20):.1f} MiB)")
    gb = 1e9
    print(f"ours: {report['sync_gbs_per_receiver']:.2f} GB/s per receiver "
          f"({max(report['bytes_received'].values()) / gb:.3f} GB into the busiest)")
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
    from mcore_rl.bench.report import write_outputs

    def chart(fig):
        if "projected_s" in report:
            ax = fig.add_subplot(1, 1, 1)
            ax.bar(["streamed (ours)", "gather+broadcast"],
                   [report["projected_s"], report["baseline_projected_s"]],
                   color=["tab:blue", "tab:orange"])
            ax.set_ylabel("projected seconds")
            ax.set_title(f"{report['model']}: {report['train']} -> {report['infer']}")
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
