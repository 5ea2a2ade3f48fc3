"""`mcore-rl bench rollout`: vLLM generation (our `RolloutEngine`, in-process, TP1) against HF
`transformers` `generate` (KV cache, one batch) on the same model, prompts and token budget.

The model is a random-weight HF folder built locally from a preset (or an existing HF folder);
prompts are `prompts` random id sequences of `prompt_len` tokens (equal lengths: HF needs no
padding). Both decode greedily (or sample at `temperature`) exactly `max_new_tokens` tokens
(the random model has no EOS). Tokens/s counts generated tokens only; each path is timed
`repeats` times after one untimed warm-up call.

Threads: vLLM's CPU worker binds its OpenMP threads and then turns `torch.set_num_threads`
into a no-op for the rest of the process, so the HF baseline runs first, with
`torch.set_num_threads(threads)`; the report records the thread count each path ran with.
On a GPU both run on the one visible device (`device`).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mcore_rl.bench.report import Table, bar_with_spread, spread
from mcore_rl.bench.sync import resolve_model
from mcore_rl.config import ConfigError, require_above, require_at_least
from mcore_rl.models.hf_factory import make_hf_model_dir
from mcore_rl.models.hf_reference import load_hf_model
from mcore_rl.models.spec import ModelSpec
from mcore_rl.rollout.config import RolloutConfig, SamplingConfig
from mcore_rl.rollout.engine import RolloutEngine

PATHS = ("vllm", "hf")


@dataclass(frozen=True, kw_only=True)
class RolloutBenchConfig:
    """model: preset name or HF model directory. prompts / prompt_len: the batch.
    max_new_tokens: tokens generated per prompt. temperature: 0 = greedy. repeats: timed
    calls per path. threads: CPU threads for both paths (0: all allowed cores). kv_cache_gib:
    vLLM's CPU KV cache. seed: weights, prompts, sampling. timeout_s: the engine's deadline for
    its worker calls (an in-process `generate` itself cannot be interrupted)."""

    model: str = "micro"
    prompts: int = 16
    prompt_len: int = 32
    max_new_tokens: int = 64
    temperature: float = 0.0
    repeats: int = 3
    threads: int = 0
    kv_cache_gib: float = 0.25
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        require_above(self, 0, "timeout_s")
        require_at_least(self, 1, "prompts", "prompt_len", "max_new_tokens", "repeats")
        require_at_least(self, 0, "temperature", note="0 = greedy")
        require_at_least(self, 0, "threads", note="0 = all cores")

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.max_new_tokens + 1


def _model_dir(cfg: RolloutBenchConfig, scratch: Path) -> Path:
    if Path(cfg.model).is_dir():
        return Path(cfg.model)
    spec = resolve_model(cfg.model)
    if cfg.max_model_len > spec.max_positions:
        raise ConfigError("prompt_len", cfg.prompt_len,
                          f"prompt_len + max_new_tokens = {cfg.max_model_len - 1} exceeds the "
                          f"model's max_positions={spec.max_positions}")
    return make_hf_model_dir(spec, scratch / "model", seed=cfg.seed)


def make_prompts(cfg: RolloutBenchConfig, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(cfg.seed)
    return torch.randint(0, vocab, (cfg.prompts, cfg.prompt_len), generator=gen).tolist()


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_hf(model_dir: Path, prompts: list[list[int]], cfg: RolloutBenchConfig) -> dict:
    """HF `generate` on the whole batch: warm-up, then `repeats` timed calls."""
    device = _device()
    model = load_hf_model(model_dir).to(device)
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    kwargs = dict(max_new_tokens=cfg.max_new_tokens,
                  do_sample=cfg.temperature > 0, pad_token_id=0, eos_token_id=None,
                  attention_mask=torch.ones_like(ids))
    if cfg.temperature > 0:
        kwargs.update(temperature=cfg.temperature, top_k=0, top_p=1.0)

    @torch.no_grad()
    def once():
        torch.manual_seed(cfg.seed)
        return model.generate(ids, **kwargs)[:, ids.shape[1]:]

    out = once()
    walls = []
    for _ in range(cfg.repeats):
        start = time.perf_counter()
        out = once()
        walls.append(time.perf_counter() - start)
    return {"wall_s": walls, "tokens": int(out.numel()), "outputs": out.tolist(),
            "threads": torch.get_num_threads()}


def run_vllm(model_dir: Path, prompts: list[list[int]], cfg: RolloutBenchConfig) -> dict:
    """Our RolloutEngine (vLLM in-process, TP1): warm-up, then `repeats` timed calls."""
    engine = RolloutEngine(model_dir, RolloutConfig(
        tp=1, max_model_len=cfg.max_model_len, kv_cache_gib=cfg.kv_cache_gib,
        enable_prefix_caching=False), call_timeout_s=cfg.timeout_s, seed=cfg.seed)
    sampling = SamplingConfig(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                              seed=cfg.seed, logprobs=False)
    try:
        outs = engine.generate(prompts, sampling)
        walls = []
        for _ in range(cfg.repeats):
            start = time.perf_counter()
            outs = engine.generate(prompts, sampling)
            walls.append(time.perf_counter() - start)
        tokens = [list(o[0].token_ids) for o in outs]
        return {"wall_s": walls, "tokens": sum(len(t) for t in tokens), "outputs": tokens,
                "threads": torch.get_num_threads(), "startup_s": engine.startup_s}
    finally:
        engine.shutdown()


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions where two greedy outputs agree, up to the first difference of
    each row (after one differs, the contexts differ too)."""
    same = total = 0
    for x, y in zip(a, b):
        total += max(len(x), len(y))
        for u, v in zip(x, y):
            if u != v:
                break
            same += 1
    return same / max(total, 1)


def run_rollout_bench(cfg: RolloutBenchConfig) -> dict:
    """Build (or take) the model, run HF then vLLM, return the report."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with tempfile.TemporaryDirectory(prefix="mcore-rl-bench-rollout-") as scratch:
        model_dir = _model_dir(cfg, Path(scratch))
        spec = ModelSpec.from_hf_dir(model_dir)
        prompts = make_prompts(cfg, spec.vocab)
        hf = run_hf(model_dir, prompts, cfg)
        vllm = run_vllm(model_dir, prompts, cfg)
    report: dict = {"model": cfg.model, "params": spec.num_params(), "prompts": cfg.prompts,
                    "prompt_len": cfg.prompt_len, "max_new_tokens": cfg.max_new_tokens,
                    "temperature": cfg.temperature, "repeats": cfg.repeats,
                    "device": _device()}
    for name, res in (("vllm", vllm), ("hf", hf)):
        walls = spread(res["wall_s"])
        report[name] = {"wall_s": walls, "tokens": res["tokens"], "threads": res["threads"],
                        "tokens_per_s": spread([res["tokens"] / w for w in res["wall_s"]])}
    report["vllm"]["startup_s"] = vllm["startup_s"]
    report["speedup_vs_hf"] = (report["vllm"]["tokens_per_s"]["median"]
                               / report["hf"]["tokens_per_s"]["median"])
    if cfg.temperature == 0:
        report["greedy_agreement"] = _agreement(vllm["outputs"], hf["outputs"])
    report["config"] = asdict(cfg)
    return report


def tables(report: dict) -> list[Table]:
    rows = tuple((name, report[name]["tokens"], report[name]["wall_s"]["median"],
                  report[name]["tokens_per_s"]["median"], report[name]["tokens_per_s"]["min"],
                  report[name]["tokens_per_s"]["max"], report[name]["threads"])
                 for name in PATHS)
    return [Table(f"generation, {report['model']}: {report['prompts']} prompts x "
                  f"{report['prompt_len']} tokens -> {report['max_new_tokens']} new tokens, "
                  f"T={report['temperature']}",
                  ("engine", "tokens", "median s", "median tok/s", "min tok/s", "max tok/s",
                   "threads"), rows),
            Table("ratio (vLLM / HF tokens/s)", ("speedup",), ((report["speedup_vs_hf"],),))]


def chart(report: dict):
    def draw(fig) -> None:
        ax = fig.subplots(1, 1)
        bar_with_spread(ax, PATHS, [report[n]["tokens_per_s"] for n in PATHS],
                        ylabel="generated tokens / s",
                        title=f"{report['model']}: vLLM vs HF generate "
                              f"({report['speedup_vs_hf']:.2f}x)")
    return draw


def summary_lines(report: dict) -> list[str]:
    lines = [f"generation: {report['model']} ({report['params'] / 1e6:.2f} M params), "
             f"{report['prompts']} x {report['prompt_len']} prompt tokens -> "
             f"{report['max_new_tokens']} new tokens, T={report['temperature']}"]
    for name in PATHS:
        t = report[name]["tokens_per_s"]
        lines.append(f"  {name:5s} {t['median']:.0f} tok/s (min {t['min']:.0f}, max "
                     f"{t['max']:.0f}), {report[name]['threads']} threads")
    lines.append(f"  vLLM / HF: {report['speedup_vs_hf']:.2f}x"
                 + (f"; greedy agreement {report['greedy_agreement']:.2f}"
                    if "greedy_agreement" in report else ""))
    return lines
