"""`mcore-rl bench logprob`: per-token log-prob + entropy from TP-sharded logits, computed
vocab-parallel (ours) against gathering the vocabulary first (the baseline), on the same
random logits, ranks and threads, in one launch.

Ranks: `tp` gloo ranks (the default group is the TP group). Rank r holds the logits shard
[tokens, vocab/tp] = full[:, r*vocab/tp : (r+1)*vocab/tp] (seeded per rank, so the full
logits are the same in both paths) and the full target ids [tokens] (replicated).

  ours      `chunked_log_probs_and_entropy(shard, target, vocab, tp_group)` (the actor's
            path): two small all-reduces per token, never the full vocabulary, and never more
            than one chunk of the shard in fp32 (forward and backward).
  baseline  what a TP trainer without it does (megatron's
            `gather_from_tensor_model_parallel_region`): all-gather of the shards along dim 0
            (`all_gather_into_tensor`, named `all_gather_single` in torch 2.13), `cat` of the
            pieces along the vocab dim -> full [tokens, vocab] logits on every rank, then the
            reference `log_probs_and_entropy`.
  (--backward: both also backpropagate `sum(logp) + sum(entropy)` to this rank's shard.)

Time: wall seconds per call; per repeat the slowest rank counts. Memory: "peak extra bytes"
per rank = the peak, during one call run under `torch.profiler(profile_memory=True)`, of the
running sum of the CPU allocator's allocation/free events (`[memory]` events: every tensor
either path allocates, temporaries included) — the bytes a path needs beyond its inputs. That
profiled call runs first (it is also the warm-up and gives the outputs cross-checked between
the paths); the timed repeats run without the profiler. Each rank runs cores/tp torch threads.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from mcore_rl.algorithms.vocab_parallel import chunked_log_probs_and_entropy, log_probs_and_entropy
from mcore_rl.bench.report import Table, bar_with_spread, spread
from mcore_rl.config import ConfigError, require_at_least
from mcore_rl.config.dtypes import normalize_dtype_fields, torch_dtype
from mcore_rl.config.seeds import STREAM_BITS, mix
from mcore_rl.launch.spawn import run_on_ranks

PATHS = ("ours", "baseline")


@dataclass(frozen=True, kw_only=True)
class LogprobBenchConfig:
    """tokens: b*s positions. vocab: full vocabulary (divisible by tp). tp: ranks (gloo).
    dtype: logits dtype (float32 | bfloat16; maths in fp32 either way). backward: also time the
    backward to the shard. repeats: timed calls per path. logit_scale: std of the random
    logits. seed: logits and targets. timeout_s: deadline of the whole launch."""

    tokens: int = 4096
    vocab: int = 32000
    tp: int = 2
    dtype: str = "float32"
    backward: bool = False
    repeats: int = 3
    logit_scale: float = 3.0
    seed: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        require_at_least(self, 1, "tokens", "vocab", "tp", "repeats")
        require_at_least(self, 2, "tp", note="vocab-parallel needs a split")
        if self.vocab % self.tp:
            raise ConfigError("vocab", self.vocab, f"must be divisible by tp={self.tp}")
        normalize_dtype_fields(self, "dtype", allowed=("float32", "bfloat16"))

    @property
    def shard_bytes(self) -> int:
        return self.tokens * (self.vocab // self.tp) * torch_dtype(self.dtype).itemsize


def peak_allocated_bytes(fn) -> tuple[object, int]:
    """Run `fn()` under the torch profiler; return its result and the peak of the running
    sum of allocator events (bytes allocated by `fn` and still live, at its worst moment)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak


def _inputs(cfg: LogprobBenchConfig, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(mix(cfg.seed, "logits", rank, bits=STREAM_BITS))
    shard = torch.randn(cfg.tokens, cfg.vocab // cfg.tp, generator=gen) * cfg.logit_scale
    target = torch.randint(0, cfg.vocab, (cfg.tokens,),
                           generator=torch.Generator().manual_seed(cfg.seed))
    return shard.to(torch_dtype(cfg.dtype)), target


def ours(shard: torch.Tensor, target: torch.Tensor, group, backward: bool):
    """Vocab-parallel: returns (logp, entropy, grad of the shard or None)."""
    leaf = shard.detach().requires_grad_(backward)
    vocab = shard.shape[-1] * (dist.get_world_size(group) if group is not None else 1)
    logp, ent = chunked_log_probs_and_entropy(leaf, target, vocab=vocab, tp_group=group)
    if backward:
        (logp.sum() + ent.sum()).backward()
    return logp.detach(), ent.detach(), leaf.grad


def baseline(shard: torch.Tensor, target: torch.Tensor, group, backward: bool):
    """Gather the vocabulary (all-gather on dim 0, cat on the vocab dim), then the reference.
    With backward, the gradient of this rank's slice is cut out of the full gradient (what
    autograd through megatron's gather does)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    stacked = torch.empty((tp * shard.shape[0], shard.shape[1]), dtype=shard.dtype)
    dist.all_gather_single(stacked, shard.contiguous(), group=group)
    full = torch.cat(stacked.chunk(tp, dim=0), dim=-1)
    del stacked
    full.requires_grad_(backward)
    logp, ent = log_probs_and_entropy(full, target)
    grad = None
    if backward:
        (logp.sum() + ent.sum()).backward()
        width = shard.shape[-1]
        grad = full.grad[:, rank * width:(rank + 1) * width].clone()
    return logp.detach(), ent.detach(), grad


def rank_main(rank: int, world_size: int, cfg: LogprobBenchConfig) -> dict:
    """One TP rank: warm-up, timed repeats and one profiled call of each path."""
    group = dist.group.WORLD
    # the ranks share this machine's cores: oversubscribed threads stall the collectives
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    shard, target = _inputs(cfg, rank)
    fns = {"ours": ours, "baseline": baseline}
    out: dict = {"rank": rank, "threads": torch.get_num_threads()}
    results = {}
    for name, fn in fns.items():
        dist.barrier(group)
        # the profiled call doubles as the warm-up; its outputs feed the cross-check
        results[name], peak = peak_allocated_bytes(
            lambda: fn(shard, target, group, cfg.backward))
        walls = []
        for _ in range(cfg.repeats):
            dist.barrier(group)
            start = time.perf_counter()
            fn(shard, target, group, cfg.backward)
            walls.append(time.perf_counter() - start)
        out[name] = {"wall_s": walls, "peak_extra_bytes": peak}
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results["ours"], results["baseline"]
    out["max_abs_diff_logp"] = float((lp_a - lp_b).abs().max())
    out["max_abs_diff_entropy"] = float((ent_a - ent_b).abs().max())
    if cfg.backward:
        out["max_abs_diff_grad"] = float((g_a.float() - g_b.float()).abs().max())
    return out


def summarize(cfg: LogprobBenchConfig, per_rank: list[dict]) -> dict:
    """Fold per-rank results: per repeat the slowest rank's time; per rank the peak bytes."""
    report: dict = {"tokens": cfg.tokens, "vocab": cfg.vocab, "tp": cfg.tp, "dtype": cfg.dtype,
                    "backward": cfg.backward, "repeats": cfg.repeats,
                    "shard_bytes": cfg.shard_bytes,
                    "full_logits_bytes": cfg.shard_bytes * cfg.tp,
                    "memory_method": "torch.profiler profile_memory: peak running sum of CPU "
                                     "allocator [memory] events during one call",
                    "threads_per_rank": per_rank[0]["threads"]}
    for name in PATHS:
        runs = [max(r[name]["wall_s"][i] for r in per_rank) for i in range(cfg.repeats)]
        peaks = {r["rank"]: r[name]["peak_extra_bytes"] for r in per_rank}
        report[name] = {"wall_s": spread(runs), "peak_extra_bytes": peaks,
                        "max_peak_extra_bytes": max(peaks.values())}
    report["speedup_vs_baseline"] = (report["baseline"]["wall_s"]["median"]
                                     / report["ours"]["wall_s"]["median"])
    report["memory_ratio_vs_baseline"] = (report["baseline"]["max_peak_extra_bytes"]
                                          / max(report["ours"]["max_peak_extra_bytes"], 1))
    for key in ("max_abs_diff_logp", "max_abs_diff_entropy", "max_abs_diff_grad"):
        if key in per_rank[0]:
            report[key] = max(r[key] for r in per_rank)
    return report


def run_logprob_bench(cfg: LogprobBenchConfig) -> dict:
    """Launch `tp` local gloo ranks, run both paths, return the report."""
    per_rank = run_on_ranks(rank_main, cfg.tp, cfg, timeout_s=cfg.timeout_s)
    report = summarize(cfg, per_rank)
    report["config"] = asdict(cfg)
    return report


def tables(report: dict) -> list[Table]:
    mib = 1 << 20
    rows = tuple((name, report[name]["wall_s"]["median"], report[name]["wall_s"]["min"],
                  report[name]["wall_s"]["max"], report[name]["max_peak_extra_bytes"] / mib)
                 for name in PATHS)
    return [Table(f"log-prob + entropy, {report['tokens']} tokens x vocab {report['vocab']}, "
                  f"TP{report['tp']} {report['dtype']}"
                  + (" (+ backward)" if report["backward"] else ""),
                  ("path", "median s", "min s", "max s", "peak extra MiB / rank"), rows),
            Table("ratios (baseline / ours)", ("speedup", "memory"),
                  ((report["speedup_vs_baseline"], report["memory_ratio_vs_baseline"]),))]


def chart(report: dict):
    def draw(fig) -> None:
        left, right = fig.subplots(1, 2)
        bar_with_spread(left, PATHS, [report[n]["wall_s"] for n in PATHS], ylabel="seconds",
                        title=f"time per call (speedup {report['speedup_vs_baseline']:.2f}x)")
        right.bar(list(PATHS), [report[n]["max_peak_extra_bytes"] / (1 << 20) for n in PATHS],
                  color=["tab:blue", "tab:orange"])
        right.set_ylabel("MiB")
        right.set_title(f"peak extra memory / rank "
                        f"({report['memory_ratio_vs_baseline']:.2f}x less)")
        right.grid(axis="y", alpha=0.3)
    return draw


def summary_lines(report: dict) -> list[str]:
    mib = 1 << 20
    lines = [f"log-prob+entropy: {report['tokens']} tokens x vocab {report['vocab']}, "
             f"TP{report['tp']} {report['dtype']}, backward={report['backward']}"]
    for name in PATHS:
        w = report[name]["wall_s"]
        lines.append(f"  {name:8s} {w['median']:.4f} s (min {w['min']:.4f}, max "
                     f"{w['max']:.4f}), peak extra "
                     f"{report[name]['max_peak_extra_bytes'] / mib:.1f} MiB/rank")
    lines.append(f"  speedup {report['speedup_vs_baseline']:.2f}x, memory "
                 f"{report['memory_ratio_vs_baseline']:.2f}x less; max |diff| logp "
                 f"{report['max_abs_diff_logp']:.2e} entropy "
                 f"{report['max_abs_diff_entropy']:.2e}")
    return lines
