"""What only a GPU can measure, in the parts `scripts/gpu_check.sh` runs — each in its own
process (`python -m mcore_rl.bench.gpu PART --out DIR`), so one part's failure or memory never
reaches the next — and the summary that folds them into one JSON and a markdown table.

  actor    the actor's old-log-prob pass and policy update of a ~1B Llama
           (configs/bench/gpu_actor.yaml) at TP1 in bf16 on one GPU, on made-up rollouts:
           memory planned (`plan-memory`'s actor rank, sized for the layer spec the check
           builds) against measured (`torch.cuda.max_memory_allocated` per update, over
           `--updates` updates: the second update's peak is where actors OOM), and the update's
           tokens/s and MFU — against the datasheet peak and against a bf16 matrix product
           measured in the same process.
  refit    the colocated refit: `bench sync` with transport=ipc on the one GPU (a training and
           an inference process, CUDA-IPC staging, every byte checked against the reference,
           every sync digest-verified), and a device-to-device copy of the same bytes on the
           same GPU: the refit's bandwidth as a ratio of the copy's; the digest's cost per sync.
  summary  the parts and pytest's junit files (`--junit NAME=FILE`) → gpu_check.json and
           gpu_check.md in --out.

Without CUDA a part writes {"ran": false, "why": ...} and exits 0; `--device cpu` runs a
part's code on the CPU instead (its CPU twin: tests/bench/test_gpu.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_rl.bench.step import FlopsModel
from mcore_rl.bench.sync import SyncBenchConfig, SyncSettings, resolve_model, run_sync_bench
from mcore_rl.config import load_config
from mcore_rl.config.seeds import derive_seed
from mcore_rl.layouts import hf_shards
from mcore_rl.parallel import ParallelConfig
from mcore_rl.parallel.groups import backend_for, init_training_groups
from mcore_rl.parallel.world import join_default_group
from mcore_rl.planning.memory import training_rank
from mcore_rl.planning.sized import sized_run
from mcore_rl.resharding import digest
from mcore_rl.runconfig import RLConfig

ACTOR_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "bench" / "gpu_actor.yaml"

#: dense bf16 peak per device, TFLOP/s (the datasheets; SXM parts), by a name's substring
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


def datasheet_peak_tflops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, n: int = 8192, repeats: int = 10) -> float:
    """TFLOP/s of an n×n×n bf16 matrix product on `device` (3 warm-ups, mean of `repeats`):
    the same-process baseline the update's FLOP rate is compared with."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * n ** 3 * repeats / (time.perf_counter() - start) / 1e12


def copy_gbs(nbytes: int, device: torch.device, repeats: int = 10) -> float:
    """GB/s of a device-to-device copy of `nbytes` on `device`, counted as the refit counts
    its bytes (each byte delivered once), mean of `repeats` after 2 warm-ups."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return nbytes * repeats / (time.perf_counter() - start) / 1e9


# --- the actor ---------------------------------------------------------------------------------


def _world(device: torch.device):
    """A one-rank world on `device` (NCCL on CUDA) and megatron's groups for TP1."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                          timeout=datetime.timedelta(seconds=60))
    join_default_group(backend_for(str(device)), store=store, rank=0, world_size=1,
                       timeout=datetime.timedelta(seconds=120))
    return init_training_groups(ParallelConfig(), timeout_s=120, device=str(device))


def made_up_rollouts(rows: int, seq_len: int, prompt: int, vocab: int, seed: int,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """A batch shaped as the controller sends one: random tokens, every row `prompt` prompt
    tokens then a response to the end, one advantage per row (GRPO's)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=g)
    mask = torch.zeros(rows, seq_len)
    mask[:, prompt:] = 1.0
    advantages = torch.randn(rows, 1, generator=g).expand(rows, seq_len) * mask
    return {k: v.to(device) for k, v in {
        "tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
        "response_mask": mask, "advantages": advantages.contiguous()}.items()}


def actor_part(config: Path, overrides: list[str], updates: int, device: torch.device) -> dict:
    """Plan the actor rank, then build it and run `updates` RL updates (old log-probs, then
    one optimizer step on the whole batch), measuring each."""
    from mcore_rl.megatron.train import setup_trainer  # lazy: megatron

    cfg = load_config(RLConfig, config, overrides)
    on_gpu = device.type == "cuda"
    run = replace(sized_run(cfg, assume_gpu=on_gpu, cuda_available=on_gpu), layer_spec="local")
    planned = training_rank(run, run.spec, "actor", 0)
    train, spec = cfg.train, run.spec
    rows, seq, mbs = run.global_batch, train.seq_len, train.micro_batch_size
    trainer = setup_trainer(spec, _world(device), train, layer_spec="local",
                            fused_kernels=False, compiled_fusions=False,
                            seed=derive_seed(cfg.seed, "train"))
    _sync(device)
    out: dict = {"ran": True, "device": _device_name(device), "model": cfg.model.preset,
                 "params": spec.num_params(), "layer_spec": "local", "dtype": train.dtype,
                 "seq_len": seq, "micro_batch_size": mbs, "rows_per_update": rows,
                 "tokens_per_update": rows * seq}
    if on_gpu:
        out["memory_after_build_bytes"] = torch.cuda.memory_allocated(device)
    measured = _timed_updates(trainer, cfg, spec, rows, seq, updates, device)
    out["updates"] = [{"logprob_s": a, "update_s": b, "loss": r["loss"],
                       "grad_norm": r["grad_norm"], "update_tokens": r["update_tokens"]}
                      for a, b, r in zip(measured["logprob_s"], measured["update_s"],
                                         measured["reports"])]
    out["throughput"] = _throughput(spec, rows, seq, measured)
    if on_gpu:
        out["throughput"].update(_against_peaks(out["throughput"]["update_tflops"], device))
        out["memory"] = {**_memory_report(planned, measured["peaks"], measured["resident"]),
                         "measured_logprob_peak_bytes": measured["logprob_peaks"],
                         "policy_loss": loss_transient(trainer, cfg.algorithm, mbs, seq, device)}
    else:
        out["memory"] = {
            "planned_bytes": planned.total, "planned_resident_bytes": planned.resident,
            "measured": None, "why": "torch's allocator statistics are CUDA's: measured on a GPU"}
    return out


def _timed_updates(trainer, cfg, spec, rows: int, seq: int, updates: int,
                   device: torch.device) -> dict[str, list]:
    """`updates` RL updates on made-up rollouts, each the old log-probs' pass then one policy
    update over the whole batch: their seconds, reports and (on a GPU) memory peaks."""
    # lazy: megatron
    from mcore_rl.megatron.policy import PolicyBatch, compute_logprobs, policy_update
    from mcore_rl.megatron.train import MicroBatch  # lazy: megatron

    on_gpu = device.type == "cuda"
    mbs = cfg.train.micro_batch_size
    prompt = cfg.max_prompt_tokens or seq // 8
    got: dict[str, list] = {key: [] for key in ("logprob_s", "update_s", "reports", "peaks",
                                                "resident", "logprob_peaks")}
    for u in range(updates):
        batch = made_up_rollouts(rows, seq, prompt, spec.vocab, derive_seed(cfg.seed, "data", u),
                                 device)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        forward = [MicroBatch(tokens=batch["tokens"][i:i + mbs], labels=batch["labels"][i:i + mbs],
                              loss_mask=batch["response_mask"][i:i + mbs])
                   for i in range(0, rows, mbs)]
        old = torch.cat(compute_logprobs(trainer, forward))
        _sync(device)
        mid = time.perf_counter()
        if on_gpu:
            got["logprob_peaks"].append(torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        micro = [PolicyBatch(tokens=batch["tokens"][i:i + mbs], labels=batch["labels"][i:i + mbs],
                             response_mask=batch["response_mask"][i:i + mbs],
                             old_logp=old[i:i + mbs], advantages=batch["advantages"][i:i + mbs])
                 for i in range(0, rows, mbs)]
        got["reports"].append(policy_update(trainer, micro, cfg.algorithm))
        _sync(device)
        got["logprob_s"].append(mid - start)
        got["update_s"].append(time.perf_counter() - mid)
        del batch, forward, old, micro
        if on_gpu:
            got["peaks"].append(torch.cuda.max_memory_allocated(device))
            got["resident"].append(torch.cuda.memory_allocated(device))
    return got


def _throughput(spec, rows: int, seq: int, measured: dict[str, list]) -> dict:
    """Median update and log-prob seconds (the first of each pays one-off costs: left out
    when there are more), tokens per second and the update's TFLOP/s."""
    update_s = statistics.median(measured["update_s"][1:] or measured["update_s"])
    logprob_s = statistics.median(measured["logprob_s"][1:] or measured["logprob_s"])
    update_flops = FlopsModel.policy(spec).train([seq] * rows)
    return {"update_s": update_s, "logprob_s": logprob_s,
            "update_tokens_per_s": rows * seq / update_s,
            "logprob_tokens_per_s": rows * seq / logprob_s,
            "update_tflops": update_flops / update_s / 1e12}


def _against_peaks(achieved_tflops: float, device: torch.device) -> dict:
    """The update's TFLOP/s against the device's datasheet peak and its measured matmul rate."""
    peak = datasheet_peak_tflops(_device_name(device))
    matmul = matmul_tflops(device)
    return {"datasheet_peak_tflops": peak, "mfu": achieved_tflops / peak if peak else None,
            "matmul_tflops": matmul, "fraction_of_matmul": achieved_tflops / matmul}


def loss_transient(trainer, algo, rows: int, seq: int, device: torch.device) -> dict:
    """What the policy loss itself allocates beyond its input logits, forward and backward,
    for one micro batch: bytes, and in fp32 vocabulary rows ([rows·seq, V/tp] fp32), the unit
    the planner's logits terms are in."""
    from mcore_rl.megatron.policy import PolicyBatch, _policy_loss  # lazy: megatron

    vocab = trainer.spec.mcore_padded_vocab(trainer.groups.config.tp) // trainer.groups.config.tp
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, seq, vocab, device=device, generator=g,
                         dtype=torch.bfloat16).requires_grad_()
    ids = torch.randint(0, trainer.spec.vocab, (rows, seq), device=device, generator=g)
    mask = torch.ones(rows, seq, device=device)
    batch = PolicyBatch(tokens=ids, labels=ids, response_mask=mask,
                        old_logp=torch.full((rows, seq), -10.0, device=device),
                        advantages=torch.ones(rows, seq, device=device))
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss, _, _ = _policy_loss(batch, algo, trainer, logits)
    loss.backward()
    _sync(device)
    extra = torch.cuda.max_memory_allocated(device) - base
    unit = rows * seq * vocab * 4
    return {"extra_peak_bytes": extra, "fp32_vocab_rows": extra / unit,
            "logits_dtype": "bfloat16", "rows": rows, "seq": seq, "vocab_per_rank": vocab}


def _memory_report(planned, peaks: list[int], resident: list[int]) -> dict:
    """The plan's actor rank (resident: weights and optimizer states; transient: the update's
    activations and logits) against what the allocator saw, per update."""
    worst = max(peaks)
    return {"planned_bytes": planned.total, "planned_resident_bytes": planned.resident,
            "planned": {c.name: c.bytes for c in planned.components},
            "measured_peak_bytes": peaks, "measured_resident_bytes": resident,
            "peak_measured_over_planned": worst / planned.total,
            "resident_measured_over_planned": resident[-1] / planned.resident,
            "second_update_peak_over_first": peaks[1] / peaks[0] if len(peaks) > 1 else None}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# --- the colocated refit -------------------------------------------------------------------------


def refit_part(model: str, repeats: int, bucket_mb: float, device: torch.device) -> dict:
    """`bench sync` transport=ipc on the one GPU (on CPU: through shared memory), bit-exact,
    and the copy it is compared with."""
    cfg = SyncBenchConfig(model=model, transport="ipc", device=device.type, check=True,
                          sync=SyncSettings(dtype="bfloat16", bucket_mb=bucket_mb),
                          repeats=repeats, untimed=1)
    report = run_sync_bench(cfg)
    received = max(report["bytes_received"].values())
    copy = copy_gbs(received, device)
    alone = digest_alone(model, device)
    return {"ran": True, "device": _device_name(device), "model": model,
            "bytes_per_sync": received, "check": report["check"],
            "check_failures": report["check_failures"], "sync_s": report["wall_s"],
            "sync_s_runs": report["wall_s_runs"], "rounds": report["rounds"],
            "sync_bucket_mb": bucket_mb, "sync_gbs": report["sync_gbs_per_receiver"],
            "copy_gbs": copy, "sync_over_copy": report["sync_gbs_per_receiver"] / copy,
            "digest_s": report["digest_s"], "compare_s": report["compare_s"],
            "digest_share": report["digest_share"],
            "max_train_peak_extra_bytes": report["max_train_peak_extra_bytes"],
            "digest_alone": alone}


def digest_alone(model: str, device: torch.device, repeats: int = 3) -> dict:
    """The installed-bytes digest of every tensor of `model` in bf16 on `device`, alone (no
    sync beside it): seconds per whole model and GB/s — what a receiver pays per sync — with
    the digest's own mixing block, and with a 4× larger one (`by_block_units`: the choice a
    GPU measurement decides, resharding/digest.py's `_BLOCK_DEVICE`)."""
    shapes = hf_shards(resolve_model(model)).hf_shapes
    tensors = [torch.empty(shape, dtype=torch.bfloat16, device=device).random_(-1000, 1000)
               for shape in shapes.values()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    default = digest._BLOCK.get(device.type, digest._BLOCK_DEVICE)

    def timed() -> tuple[float, list[float], torch.Tensor]:
        runs, digests = [], None
        for _ in range(repeats + 1):
            _sync(device)
            start = time.perf_counter()
            digests = torch.stack([digest.tensor_digest(t) for t in tensors])
            _sync(device)
            runs.append(time.perf_counter() - start)
        return statistics.median(runs[1:]), runs[1:], digests.cpu()

    seconds, runs, want = timed()
    by_block = {default: seconds}
    if device.type != "cpu":  # a CPU's block is sized to its cache, not measured here
        saved = digest._BLOCK_DEVICE
        digest._BLOCK_DEVICE = 4 * default
        try:
            larger, _, got = timed()
        finally:
            digest._BLOCK_DEVICE = saved
        if not torch.equal(got, want):
            raise AssertionError("the digest changed with its block size")
        by_block[4 * default] = larger
    return {"tensors": len(tensors), "bytes": nbytes, "seconds": seconds,
            "gbs": nbytes / seconds / 1e9, "seconds_runs": runs,
            "by_block_units": {str(k): v for k, v in by_block.items()}}


# --- the summary ---------------------------------------------------------------------------------


def junit_outcome(path: Path) -> dict:
    """passed / failed / skipped counts of a pytest junit file, the failures' names, and each
    skip reason once."""
    if not path.is_file():
        return {"ran": False, "why": f"no junit file {path.name} (pytest did not finish)"}
    root = ET.parse(path).getroot()
    failed, skipped, passed = [], [], 0
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif (skip := case.find("skipped")) is not None:
            skipped.append(skip.get("message", ""))
        else:
            passed += 1
    return {"ran": True, "passed": passed, "failed": len(failed), "skipped": len(skipped),
            "failures": failed, "skip_reasons": sorted(set(skipped))}


def summary(parts_dir: Path, junits: dict[str, Path]) -> dict:
    out: dict = {}
    for part in ("env", "actor", "refit"):
        f = parts_dir / f"{part}.json"
        out[part] = (json.loads(f.read_text()) if f.is_file()
                     else {"ran": False, "why": f"part {part} wrote nothing (see the log)"})
    out["pytest"] = {name: junit_outcome(path) for name, path in junits.items()}
    return out


def _gib(n) -> str:
    return "—" if n is None else f"{n / (1 << 30):.2f} GiB"


def _num(x, fmt="{:.3g}") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _first(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def markdown(s: dict) -> str:
    """The summary as the table docs/benchmarks.md's GPU section takes."""
    env, actor, refit = s["env"], s["actor"], s["refit"]
    lines = [f"GPU check on {env.get('gpu', 'no GPU')} (torch {env.get('torch', '?')}, "
             f"CUDA {env.get('cuda', '?')}, megatron-core {env.get('megatron_core', '?')})", "",
             "| check | result |", "| --- | --- |"]
    for name, r in s["pytest"].items():
        lines.append(f"| pytest {name} | " + (
            f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped"
            + (f" (failed: {_first(r['failures'])})" if r["failures"] else "")
            if r.get("ran") else r["why"]) + " |")
    if actor.get("ran"):
        m, t = actor["memory"], actor["throughput"]
        lines += [
            f"| actor | {actor['model']} ({actor['params'] / 1e9:.2f}B), {actor['dtype']}, "
            f"{actor['layer_spec']} spec, {actor['rows_per_update']} × {actor['seq_len']} "
            "tokens per update |",
            f"| memory planned | {_gib(m['planned_bytes'])} (resident "
            f"{_gib(m['planned_resident_bytes'])}) |",
            "| memory measured | peak per update " + ", ".join(
                _gib(p) for p in m.get("measured_peak_bytes") or []) + " (resident "
            + _gib((m.get("measured_resident_bytes") or [None])[-1]) + "); peak / planned "
            + _num(m.get("peak_measured_over_planned")) + " |",
            f"| update | {_num(t['update_s'])} s, {_num(t['update_tokens_per_s'], '{:,.0f}')} "
            f"tokens/s, {_num(t['update_tflops'])} TFLOP/s: MFU {_num(t.get('mfu'))} "
            f"(datasheet {_num(t.get('datasheet_peak_tflops'))}), "
            f"{_num(t.get('fraction_of_matmul'))} of a bf16 matmul "
            f"({_num(t.get('matmul_tflops'))} TFLOP/s) |",
            f"| old log-probs | {_num(t['logprob_s'])} s, "
            f"{_num(t['logprob_tokens_per_s'], '{:,.0f}')} tokens/s |"]
    else:
        lines.append(f"| actor | not run: {actor.get('why')} |")
    if refit.get("ran"):
        lines += [
            f"| CUDA-IPC refit | {refit['model']}, {refit['bytes_per_sync'] / 1e9:.2f} GB bf16: "
            f"{_num(refit['sync_s'])} s, {_num(refit['sync_gbs'])} GB/s = "
            f"{_num(refit['sync_over_copy'])} × a D2D copy ({_num(refit['copy_gbs'])} GB/s); "
            f"bit-exact: {refit['check']} |",
            f"| sync digest | {_num(refit['digest_s'])} s digests + "
            f"{_num(refit['compare_s'])} s comparison per sync "
            f"({_num(refit['digest_share'])} of the sync); alone, by mixing block (units): "
            + ", ".join(f"{k}: {_num(v)} s" for k, v in
                        refit.get("digest_alone", {}).get("by_block_units", {}).items())
            + " |"]
    else:
        lines.append(f"| refit | not run: {refit.get('why')} |")
    return "\n".join(lines) + "\n"


# --- the command -----------------------------------------------------------------------------------


def env_part() -> dict:
    info = {"ran": True, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    try:
        import megatron.core  # lazy: megatron

        info["megatron_core"] = megatron.core.__version__
    except Exception as err:  # the summary says so; the parts that need it fail on their own
        info["megatron_core"] = f"not importable ({type(err).__name__})"
    return info


def _write(path: Path, data: dict) -> None:
    """Temp file + rename: a part killed mid-write leaves no half a JSON."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mcore_rl.bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=("env", "actor", "refit", "summary"))
    p.add_argument("--out", type=Path, required=True, help="directory of the part's JSON")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="actor, refit: cpu runs the part's CPU twin")
    p.add_argument("--config", type=Path, default=ACTOR_CONFIG, help="actor: RLConfig YAML")
    p.add_argument("--updates", type=int, default=3, help="actor: RL updates measured")
    p.add_argument("--model", default="llama3.2-1b", help="refit: preset or HF directory")
    p.add_argument("--repeats", type=int, default=3, help="refit: timed syncs")
    p.add_argument("--bucket-mb", type=float, default=512.0, help="refit: sync bucket")
    p.add_argument("--parts", type=Path, default=None, help="summary: the parts' directory")
    p.add_argument("--junit", action="append", default=[], metavar="NAME=FILE",
                   help="summary: a pytest junit file")
    p.add_argument("overrides", nargs="*", metavar="A.B=VALUE", help="actor: RLConfig overrides")
    args = p.parse_intermixed_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "summary":
        junits = {k: Path(v) for k, v in (j.split("=", 1) for j in args.junit)}
        s = summary(args.parts or args.out, junits)
        _write(args.out / "gpu_check.json", s)
        table = markdown(s)
        (args.out / "gpu_check.md").write_text(table)
        print(table)
        return 0
    if args.part == "env":
        result = env_part()
    elif args.device == "cuda" and not torch.cuda.is_available():
        result = {"ran": False, "why": "no CUDA device: nothing measured"}
    else:
        device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        result = (actor_part(args.config, args.overrides, args.updates, device)
                  if args.part == "actor" else
                  refit_part(args.model, args.repeats, args.bucket_mb, device))
    _write(args.out / f"{args.part}.json", result)
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
