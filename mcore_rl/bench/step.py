"""`mcore-rl bench step`: whole RL steps through `RLController` (Megatron actor on Ray, vLLM
engines, streamed weight sync) — seconds per phase, the share of the step spent in weight
sync, tokens/s per device and model FLOPs utilization (MFU). Nothing here is CPU-specific: on
a cluster, pass a GPU config and the device's peak (`peak_tflops=...`).

Model FLOPs (the convention of PaLM, appendix B, and Megatron-LM's throughput report):
    N  = matmul parameters = layers * (hidden*(q_dim + 2*kv_dim) + q_dim*hidden
                                       + 3*hidden*ffn) + vocab*hidden (output layer);
         embeddings lookups, norms and biases are not counted. The critic's N has a
         hidden x 1 value head in place of the vocab x hidden output layer.
    d  = heads * head_dim (q_dim), L = layers, s = the sequence's length.
    forward pass over one sequence  (inference: gen, old_logprob, ref, values)
        F_fwd(s)   = 2*N*s + 4*L*d*s^2        (QK^T and AV, 2*s*d FLOPs per token each;
                                                no causal-mask discount)
    forward + backward              (training: update_actor, update_critic)
        F_train(s) = 3 * F_fwd(s) = 6*N*s + 12*L*d*s^2
    i.e. per token 2N + 4*L*d*s (inference) and 6N + 12*L*d*s (training), the "12 * layers *
    hidden * seq" attention term. Activation recomputation is not counted (that is HFU).
    The output layer counts at every position, as the convention has it, though the policy
    update computes logits at its response positions only (`PolicyBatch.logit_window`): the
    update's MFU includes prompt logits it does not compute.
Which sequences: the actor passes run on the padded batch the controller builds,
prompts_per_step * samples_per_prompt rows of `train.seq_len` tokens, each update epoch once
(`updates_per_batch` mini-batches cover the batch once); generation counts one forward over
each final sequence (prompt + response ids, unpadded; the KV cache makes the real work
smaller, not larger).
MFU of a phase = F_phase / (seconds * devices of that phase * peak FLOP/s per device), with
devices = actor.tp*pp*dp for actor/critic/reference phases and rollout.tp*engines for gen;
the step's MFU = sum of F_phase / (step seconds * all devices * peak) (actor and engines are
separate devices, as `RLController` places them).
The peak: `peak_tflops` when given (a GPU's datasheet figure in the training dtype: a GPU run
must give it); on CPU, by default, measured in the same run before anything starts — a matrix
product in the actor's dtype on one thread, what an actor rank computes on (one intra-op
thread), so a phase's MFU is against this machine's own rate (an engine running more OpenMP
threads, rollout.cpu_threads, can pass 100 %).
tokens/s per device = (prompt + response tokens of the step, unpadded) / step seconds /
all devices.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Sequence

from mcore_rl.bench.report import Table, spread
from mcore_rl.bench.shapes import build_shape, get_shape, shape_overrides
from mcore_rl.bench.trl_baseline import PHASES as TRL_PHASES
from mcore_rl.bench.trl_baseline import run_in_subprocess
from mcore_rl.config import ConfigError, load_config
from mcore_rl.config.dtypes import torch_dtype
from mcore_rl.launch.process_cpu import cpu_floor_s
from mcore_rl.models.spec import ModelSpec

# gen_wait: one-step off-policy only — the time a step blocked on generation that ran beside
# training (`gen` is then the generation's own time, overlapped).
PHASES = ("gen", "gen_wait", "reward", "old_logprob", "ref", "values", "adv", "update_actor",
          "update_critic", "sync")
INFERENCE = ("gen", "old_logprob", "ref", "values")
TRAINING = ("update_actor", "update_critic")
ACTOR_PHASES = ("old_logprob", "ref", "values", "update_actor", "update_critic")


@dataclass(frozen=True, kw_only=True)
class FlopsModel:
    """The FLOPs convention of the module doc. matmul_params: N; layers: L; attn_dim: d."""

    matmul_params: int
    layers: int
    attn_dim: int

    @classmethod
    def policy(cls, spec: ModelSpec) -> "FlopsModel":
        return cls(matmul_params=_backbone_params(spec) + spec.vocab * spec.hidden,
                   layers=spec.layers, attn_dim=spec.q_dim)

    @classmethod
    def critic(cls, spec: ModelSpec) -> "FlopsModel":
        return cls(matmul_params=_backbone_params(spec) + spec.hidden,
                   layers=spec.layers, attn_dim=spec.q_dim)

    def forward(self, seq_lens: Sequence[int]) -> float:
        """F_fwd summed over sequences of the given lengths."""
        return float(sum(2 * self.matmul_params * s + 4 * self.layers * self.attn_dim * s * s
                         for s in seq_lens))

    def train(self, seq_lens: Sequence[int]) -> float:
        """F_train = 3 * F_fwd (forward + backward)."""
        return 3.0 * self.forward(seq_lens)


def _backbone_params(spec: ModelSpec) -> int:
    attn = spec.hidden * (spec.q_dim + 2 * spec.kv_dim) + spec.q_dim * spec.hidden
    return spec.layers * (attn + 3 * spec.hidden * spec.ffn)


def mfu(flops: float, seconds: float, devices: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilization: flops / (seconds * devices * peak per device)."""
    if seconds <= 0 or devices < 1 or peak_flops_per_device <= 0:
        raise ValueError(f"mfu: need seconds > 0, devices >= 1, peak > 0; got {seconds}, "
                         f"{devices}, {peak_flops_per_device}")
    return flops / (seconds * devices * peak_flops_per_device)


def phase_flops(spec: ModelSpec, *, phases: Sequence[str], rows: int, seq_len: int,
                gen_seq_lens: Sequence[int], old_logprob_rows: int | None = None
                ) -> dict[str, float]:
    """Model FLOPs of each phase that ran (module doc). rows x seq_len: the actor's padded
    batch; gen_seq_lens: prompt + response length of every generated sequence;
    old_logprob_rows: the rows the old-log-prob pass ran on (None: all)."""
    policy, critic = FlopsModel.policy(spec), FlopsModel.critic(spec)
    batch = [seq_len] * rows
    old_rows = rows if old_logprob_rows is None else old_logprob_rows
    table = {"gen": lambda: policy.forward(gen_seq_lens),
             "old_logprob": lambda: policy.forward([seq_len] * old_rows),
             "ref": lambda: policy.forward(batch),
             "values": lambda: critic.forward(batch),
             "update_actor": lambda: policy.train(batch),
             "update_critic": lambda: critic.train(batch)}
    return {p: table[p]() for p in phases if p in table}


def step_metrics(timings: dict[str, float], flops: dict[str, float], *, actor_devices: int,
                 rollout_devices: int, tokens: int, peak_flops_per_device: float) -> dict:
    """Derived numbers of one step from its phase seconds (`timings`, incl. "step") and phase
    FLOPs: per-phase MFU, the step's MFU, sync share, tokens/s per device."""
    total_devices = actor_devices + rollout_devices
    step_s = timings["step"]
    out: dict = {"sync_share": timings.get("sync", 0.0) / step_s,
                 "tokens": tokens,
                 "tokens_per_s_per_device": tokens / step_s / total_devices,
                 "step_flops": sum(flops.values()),
                 "mfu": mfu(sum(flops.values()), step_s, total_devices, peak_flops_per_device)}
    for phase, f in flops.items():
        devices = rollout_devices if phase == "gen" else actor_devices
        out[f"mfu/{phase}"] = mfu(f, timings[phase], devices, peak_flops_per_device)
    return out


@dataclass(frozen=True, kw_only=True)
class StepBenchConfig:
    """config: RLConfig YAML (None: the demo's, configs/grpo_addition.yaml); overrides:
    `a.b=value` strings.
    repeats: measured RL steps; untimed_steps: unmeasured steps before them (start-up costs).
    peak_tflops: dense peak per device, TFLOP/s, in the training dtype (e.g. 989 for H100
    bf16); the CPU default is a placeholder for a couple of cores.
    compare: extra overrides of a variant (e.g. "rollout.mode=async"): the same steps run
        again with them in the same invocation, and the report gives the variant's timings
        and its speed-up (baseline median step seconds / variant's).
    baseline: "trl" also runs Hugging Face TRL's GRPOTrainer (`bench.trl_baseline`) on the
        same task and settings from the same starting weights (the HF export of our actor
        after its warm-up, or the starting model when warmup.max_steps is 0), the same
        number of steps on the same prompts, and reports our median step / TRL's.
    shape: a realistic shape (`mcore_rl.bench.shapes.SHAPES`, e.g. "qwen2_16k"): its model,
        tokenizer and prompts are built into a temporary directory and the steps run on them
        with its RL config (configs/bench/step_<shape>.yaml; `config` replaces it, overrides
        apply on top). The report then gives `shape` and the prompt and response lengths
        each side generated."""

    config: str | None = None
    overrides: tuple[str, ...] = ()
    MOVED: ClassVar[dict[str, str]] = {
        "warmup_steps": "set untimed_steps (`warmup` is the supervised warm-up)"}

    repeats: int = 2
    untimed_steps: int = 1
    peak_tflops: float | None = None
    compare: tuple[str, ...] = ()
    baseline: str | None = None
    shape: str | None = None

    def __post_init__(self) -> None:
        if self.shape is not None:
            get_shape(self.shape)  # raises ConfigError("shape", ...) for an unknown one
        if self.baseline not in (None, "trl"):
            raise ConfigError("baseline", self.baseline, "must be null or 'trl'")
        if self.repeats < 1:
            raise ConfigError("repeats", self.repeats, "must be >= 1")
        if self.untimed_steps < 0:
            raise ConfigError("untimed_steps", self.untimed_steps, "must be >= 0")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError("peak_tflops", self.peak_tflops, "must be > 0 (or null: measured)")

    #: the fields `a.b=c` overrides set here (and the moved ones, refused naming their new
    #: key); every other key is the RL config's
    OWN: ClassVar[frozenset[str]] = frozenset(
        {"repeats", "untimed_steps", "peak_tflops", "compare", "baseline", "shape",
         "warmup_steps"})

    @property
    def config_path(self) -> str:
        """The RL config's YAML: `config`, or the demo's (both sides of a TRL comparison read
        this one file)."""
        from mcore_rl.run.train import DEMO_CONFIG  # lazy: torch

        return str(self.config or DEMO_CONFIG)

    def rl_config(self):
        """The RL config (with a shape not yet built: pointing at where it will be)."""
        from mcore_rl.runconfig import RLConfig  # lazy: torch

        cfg = self.built(Path("/shape-built-at-run-time")) if self.shape else self
        return load_config(RLConfig, cfg.config_path, list(cfg.overrides))

    def built(self, shape_dir: Path) -> "StepBenchConfig":
        """This benchmark on its shape as built into `shape_dir` (`shapes.build_shape`): the
        shape's RL config (unless `config` is given) with overrides pointing at the model and
        prompts there, then this benchmark's overrides."""
        return replace(self, shape=None, config=self.config or str(get_shape(self.shape).config),
                       overrides=shape_overrides(shape_dir) + self.overrides)

    def variant(self) -> "StepBenchConfig":
        """This benchmark with the `compare` overrides applied (and no further variant)."""
        return StepBenchConfig(config=self.config, overrides=self.overrides + self.compare,
                               repeats=self.repeats, untimed_steps=self.untimed_steps,
                               peak_tflops=self.peak_tflops, shape=self.shape)


def step_bench_config(config: str | None, overrides: Sequence[str], *,
                      repeats: int | None = None) -> StepBenchConfig:
    """The benchmark from `a.b=c` overrides: keys in `StepBenchConfig.OWN` set the benchmark,
    every other key overrides the RL config (`config`: its YAML). Raises ConfigError naming
    the field."""
    own = [o for o in overrides if o.partition("=")[0] in StepBenchConfig.OWN]
    rest = tuple(o for o in overrides if o.partition("=")[0] not in StepBenchConfig.OWN)
    if repeats is not None:
        own.append(f"repeats={repeats}")
    cfg = load_config(StepBenchConfig, None, own)
    return replace(cfg, config=config, overrides=rest)


def _measured_sampler_cls():
    from mcore_rl.rl.sampler import Sampler  # lazy: torch

    class MeasuredSampler(Sampler):
        """The run's Sampler, recording the lengths of the sequences it generates (for the
        generation FLOPs and the token count) — nothing else changes."""

        def generate(self, prompts, sampling, routing_start=None):
            outs = super().generate(prompts, sampling, routing_start)
            self.gen_seq_lens = [len(p) + len(c.token_ids) for p, o in zip(prompts, outs)
                                 for c in o]
            self.gen_lens = {"prompt": [len(p) for p in prompts],
                             "response": [len(c.token_ids) for o in outs for c in o]}
            return outs

        def collect(self, step, timer):
            rollouts = super().collect(step, timer)
            self.step_prompts = sorted({e.prompt for e in rollouts.examples})
            return rollouts

    return MeasuredSampler


def matmul_tflops(dtype: "torch.dtype", n: int = 512, seconds: float = 0.5) -> float:
    """TFLOP/s of n×n×n matrix products in `dtype` on one CPU thread (after 3 warm-ups)."""
    import torch  # lazy: torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
        for _ in range(3):
            a @ b
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or count < 3:
            a @ b
            count += 1
        return 2 * n ** 3 * count / elapsed / 1e12
    finally:
        torch.set_num_threads(threads)


def with_peak(cfg: StepBenchConfig) -> tuple[StepBenchConfig, str]:
    """`cfg` with its peak per device, and where it came from: given, or (a CPU run without
    one) measured now (`matmul_tflops` in the actor's dtype). A GPU run must give it."""
    if cfg.peak_tflops is not None:
        return cfg, "given (peak_tflops)"
    from mcore_rl.runconfig.resolve import run_device  # lazy: torch

    rl = cfg.rl_config()
    if run_device(rl) == "cuda":
        raise ConfigError("peak_tflops", None, "a GPU run's dense peak per device in the "
                          "training dtype, TFLOP/s (e.g. 989 for an H100 in bf16): only a "
                          "CPU's is measured here")
    measured = matmul_tflops(torch_dtype(rl.train.dtype))
    return (replace(cfg, peak_tflops=measured),
            f"measured: a {rl.train.dtype} matrix product on one thread of this machine")


def run_step_bench(cfg: StepBenchConfig) -> dict:
    """The baseline's report; with `compare`, the variant's under "compare" with the
    speed-up of the median step (both measured in this run). With `shape`, on that shape
    built into a temporary directory (and the report's `shape` says what it was). The peak
    per device is given or measured first, on the still quiet machine (`with_peak`)."""
    cfg, source = with_peak(cfg)
    report = _run_step_bench_shape(cfg)
    report["peak_source"] = source
    return report


def _run_step_bench_shape(cfg: StepBenchConfig) -> dict:
    if cfg.shape is None:
        return _run_step_bench(cfg)

    with tempfile.TemporaryDirectory(prefix=f"mcore-rl-bench-{cfg.shape}-") as built:
        start = time.perf_counter()
        build_shape(cfg.shape, Path(built), seed=cfg.rl_config().seed)
        build_s = time.perf_counter() - start
        report = _run_step_bench(cfg.built(Path(built)))
    shape = get_shape(cfg.shape)
    report["shape"] = {"name": cfg.shape, "config": str(shape.config),
                       "prompt_tokens": shape.prompt_tokens, "vocab": shape.vocab,
                       "build_s": build_s}
    return report


def _run_step_bench(cfg: StepBenchConfig) -> dict:
    report = _measure(cfg)
    if cfg.compare:
        variant = _measure(cfg.variant())
        base_s, var_s = (r["timing_s"]["step"]["median"] for r in (report, variant))
        report["compare"] = {"overrides": list(cfg.compare), "step_speedup": base_s / var_s,
                             "timing_s": variant["timing_s"],
                             "reward_mean": [s["reward_mean"] for s in variant["per_step"]]}
    return report


def _measure(cfg: StepBenchConfig) -> dict:
    """Start the controller on the run's model (model.hf_dir, or the demo model built
    locally), run the supervised warm-up if warmup.max_steps > 0, then unmeasured + measured
    RL steps; with `baseline`, TRL from the same starting weights. Returns the report."""
    from mcore_rl.run.lifecycle import RLRun  # lazy: torch

    rl = cfg.rl_config()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mcore-rl-bench-step-") as scratch:
        with RLRun(rl, Path(scratch) / "run", sampler_cls=_measured_sampler_cls()) as run:
            spec = ModelSpec.from_hf_dir(run.model_dir)
            # the steady state is measured: late engines (rollout.startup_engines) join first
            run.begin(export_to=Path(scratch) / "start_hf", admit_late_engines=True)
            start_dir = run.warmed_up_dir or run.model_dir
            steps, prompts, lens = [], [], []

            def record(step: int, metrics: dict) -> None:
                measured = run.controller.sampler
                prompts.append(measured.step_prompts)
                if step > cfg.untimed_steps:
                    steps.append((metrics, list(measured.gen_seq_lens)))
                    lens.append(measured.gen_lens)

            run.train(range(1, cfg.untimed_steps + cfg.repeats + 1), record)
        startup_s, startup_cpu, warmup_s = run.startup_s, run.startup_cpu, run.warmup_s
        process_s = time.perf_counter() - start
        report = build_report(cfg, rl, spec, steps, startup_s)
        report["lengths"] = length_summary(lens)
        report.update(warmup_s=warmup_s, ours_process_s=process_s,
                      steps_run=len(prompts), startup_cpu_s=startup_cpu,
                      startup_cpu_floor_s=cpu_floor_s(startup_cpu["total"]))
        if cfg.baseline == "trl":
            trl = run_in_subprocess(cfg.config_path, list(cfg.overrides), str(start_dir),
                                    len(prompts))
            report["baseline"] = trl_summary(trl, cfg.untimed_steps, same_prompts=(
                trl["prompts"] == prompts))
            report["baseline"]["lengths"] = length_summary(
                trl["lengths"][cfg.untimed_steps:])
            report["ratio_vs_trl"] = (report["timing_s"]["step"]["median"]
                                      / report["baseline"]["timing_s"]["step"]["median"])
    return report


def length_summary(steps: list[dict[str, list[int]]]) -> dict:
    """min / max / mean prompt and response tokens over the measured steps' sequences
    (each step: {"prompt": [...], "response": [...]})."""
    out = {}
    for kind in ("prompt", "response"):
        values = [n for s in steps for n in s[kind]]
        out[kind] = {"min": min(values), "max": max(values),
                     "mean": sum(values) / len(values), "count": len(values)}
    return out


def trl_summary(trl: dict, unmeasured: int, *, same_prompts: bool) -> dict:
    """The TRL run's measured steps (after `unmeasured`) as median/min/max per phase, beside
    its start-up, process time and rewards."""
    measured = trl["per_step"][unmeasured:]
    return {"name": "trl", "version": trl["trl_version"], "steps_run": len(trl["per_step"]),
            "same_prompts": same_prompts, "threads": trl["threads"],
            "timing_s": {p: spread([s[p] for s in measured]) for p in TRL_PHASES},
            "startup_s": trl["startup_s"], "import_s": trl["import_s"],
            "train_s": trl["train_s"], "process_s": trl["process_s"],
            "reward_mean": trl["reward_mean"]}


def build_report(cfg: StepBenchConfig, rl, spec: ModelSpec,
                 steps: list[tuple[dict, list[int]]], startup_s: float) -> dict:
    """Per-step derived metrics, then median/min/max of every timing and metric."""
    actor_devices = rl.actor.world_size
    rollout_devices = rl.rollout.tp * rl.rollout.engines
    rows = rl.prompts_per_step * rl.samples_per_prompt
    peak = cfg.peak_tflops * 1e12
    per_step = []
    for metrics, gen_lens in steps:
        timings = {k.removeprefix("timing_s/"): v for k, v in metrics.items()
                   if k.startswith("timing_s/")}
        ran = [p for p in PHASES if p in timings]
        old_rows = metrics.get("old_logprob_rows")
        flops = phase_flops(spec, phases=ran, rows=rows, seq_len=rl.train.seq_len,
                            gen_seq_lens=gen_lens,
                            old_logprob_rows=None if old_rows is None else int(old_rows))
        derived = step_metrics(timings, flops, actor_devices=actor_devices,
                               rollout_devices=rollout_devices, tokens=sum(gen_lens),
                               peak_flops_per_device=peak)
        per_step.append({"timings": timings, "flops": flops, **derived,
                         "reward_mean": metrics["reward_mean"],
                         "rollout_engines": metrics["rollout_engines"]})
    phases = [p for p in PHASES + ("step",) if p in per_step[0]["timings"]]
    report: dict = {
        "model_params": spec.num_params(),
        "matmul_params": FlopsModel.policy(spec).matmul_params,
        "actor": f"tp{rl.actor.tp} pp{rl.actor.pp} dp{rl.actor.dp}",
        "rollout": f"tp{rl.rollout.tp} x{rl.rollout.engines}",
        "actor_devices": actor_devices, "rollout_devices": rollout_devices,
        "devices": actor_devices + rollout_devices,
        "sequences_per_step": rows, "seq_len": rl.train.seq_len,
        "train_dtype": rl.train.dtype, "peak_tflops_per_device": cfg.peak_tflops,
        "repeats": cfg.repeats, "untimed_steps": cfg.untimed_steps, "startup_s": startup_s,
        "timing_s": {p: spread([s["timings"][p] for s in per_step]) for p in phases},
        "flops": {p: spread([s["flops"][p] for s in per_step])
                  for p in per_step[0]["flops"]},
    }
    for key in ("sync_share", "tokens", "tokens_per_s_per_device", "step_flops", "mfu"):
        report[key] = spread([s[key] for s in per_step])
    report["mfu_by_phase"] = {p: spread([s[f"mfu/{p}"] for s in per_step])
                              for p in per_step[0]["flops"]}
    report["per_step"] = per_step
    report["reward_mean"] = [s["reward_mean"] for s in per_step]
    report["config"] = {"config": cfg.config, "overrides": list(cfg.overrides),
                        "repeats": cfg.repeats, "untimed_steps": cfg.untimed_steps,
                        "peak_tflops": cfg.peak_tflops, "compare": list(cfg.compare),
                        "baseline": cfg.baseline}
    return report


def tables(report: dict) -> list[Table]:
    t, m = report["timing_s"], report["mfu_by_phase"]
    step = t["step"]["median"]
    rows = tuple((p, t[p]["median"], t[p]["min"], t[p]["max"], t[p]["median"] / step,
                  m[p]["median"] if p in m else "", report["flops"][p]["median"]
                  if p in report["flops"] else "")
                 for p in t)
    return [Table(f"RL step: actor {report['actor']}, rollout {report['rollout']}, "
                  f"{report['sequences_per_step']} sequences, peak "
                  f"{report['peak_tflops_per_device']} TFLOP/s per device",
                  ("phase", "median s", "min s", "max s", "share of step", "MFU (fraction)",
                   "model FLOPs"), rows),
            Table("per step (median)", ("sync share", "tokens/s per device", "MFU (fraction)",
                                        "devices"),
                  ((report["sync_share"]["median"],
                    report["tokens_per_s_per_device"]["median"], report["mfu"]["median"],
                    report["devices"]),))]


def chart(report: dict):
    def draw(fig) -> None:
        left, right = fig.subplots(1, 2)
        t = report["timing_s"]
        phases = [p for p in t if p != "step"]
        med = [t[p]["median"] for p in phases]
        err = [[t[p]["median"] - t[p]["min"] for p in phases],
               [t[p]["max"] - t[p]["median"] for p in phases]]
        left.barh(phases, med, xerr=err, capsize=3, color="tab:blue")
        left.invert_yaxis()
        left.set_xlabel("seconds (median, min/max)")
        left.set_title(f"step {t['step']['median']:.2f} s, sync "
                       f"{100 * report['sync_share']['median']:.1f} %")
        m = report["mfu_by_phase"]
        right.bar(list(m) + ["step"], [100 * m[p]["median"] for p in m]
                  + [100 * report["mfu"]["median"]], color="tab:orange")
        right.set_ylabel("MFU %")
        right.set_title(f"MFU at {report['peak_tflops_per_device']} TFLOP/s per device")
        right.tick_params(axis="x", labelrotation=30)
    return draw


def _lengths_line(lengths: dict) -> str:
    p, r = lengths["prompt"], lengths["response"]
    return (f"prompt {p['min']}-{p['max']}, response {r['min']}-{r['max']} "
            f"(mean {r['mean']:.1f})")


def summary_lines(report: dict) -> list[str]:
    t = report["timing_s"]
    lines = [f"RL step: actor {report['actor']}, rollout {report['rollout']}, "
             f"{report['sequences_per_step']} sequences x {report['seq_len']} tokens, "
             f"{report['repeats']} measured steps (start-up {report['startup_s']:.1f} s)"]
    if "startup_cpu_s" in report:
        cpu = report["startup_cpu_s"]
        # counted from each process's launch (the driver's imports too), so the floor can
        # exceed startup_s, which starts after them
        lines.append(f"  start-up CPU {cpu['total']:.1f} s since launch ("
                     + ", ".join(f"{role} {sec:.1f}" for role, sec in cpu.items()
                                 if role != "total")
                     + f"): at least {report['startup_cpu_floor_s']:.1f} s of wall on this "
                       "machine's cores")
    for p, s in t.items():
        mf = report["mfu_by_phase"].get(p)
        lines.append(f"  {p:13s} {s['median']:.4f} s (min {s['min']:.4f}, max {s['max']:.4f})"
                     + (f"  MFU {100 * mf['median']:.3f} %" if mf else ""))
    lines.append(f"  sync share {100 * report['sync_share']['median']:.1f} %, "
                 f"{report['tokens_per_s_per_device']['median']:.1f} tokens/s per device, "
                 f"MFU {100 * report['mfu']['median']:.3f} % of "
                 f"{report['peak_tflops_per_device']} TFLOP/s x {report['devices']} devices")
    if "shape" in report:
        sh = report["shape"]
        lines.insert(0, f"shape {sh['name']} ({report['model_params'] / 1e6:.1f} M params, "
                        f"vocab {sh['vocab']}; built in {sh['build_s']:.1f} s; "
                        f"{sh['config']})")
    if "lengths" in report:
        lines.append("  tokens per sequence: ours " + _lengths_line(report["lengths"])
                     + ("; TRL " + _lengths_line(report["baseline"]["lengths"])
                        if "baseline" in report else ""))
    if "baseline" in report:
        b = report["baseline"]
        lines.append(f"  TRL {b['version']} (same weights, prompts "
                     f"{'equal' if b['same_prompts'] else 'DIFFER'}): step "
                     f"{b['timing_s']['step']['median']:.4f} s median ("
                     + ", ".join(f"{p} {b['timing_s'][p]['median']:.4f}"
                                 for p in b["timing_s"] if p != "step")
                     + f"); start-up {b['startup_s']:.1f} s, process {b['process_s']:.1f} s")
        lines.append(f"  ours / TRL median step: {report['ratio_vs_trl']:.2f}x "
                     f"(ours: start-up {report['startup_s']:.1f} s, warm-up "
                     f"{report['warmup_s']:.1f} s, process {report['ours_process_s']:.1f} s)")
    if "compare" in report:
        c = report["compare"]
        lines.append(f"  variant {' '.join(c['overrides'])}: step "
                     f"{c['timing_s']['step']['median']:.4f} s median, "
                     f"{c['step_speedup']:.2f}x the baseline's speed")
    return lines
