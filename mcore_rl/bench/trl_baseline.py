"""Hugging Face TRL's `GRPOTrainer` on our task, as the same-run baseline of `bench step`.

It runs in its own process (`python -m mcore_rl.bench.trl_baseline ARGS.json`): its start-up
(imports, model load) is then measured the way ours is, and nothing of the controller's Ray
driver state is shared. The driver passes the RLConfig overrides, the starting HF directory
and the step count; the child prints one JSON report as its last stdout line.

What is matched, read from the RLConfig (never hard-coded): prompts (the task's
`train_examples` of steps 1..N, in order, unshuffled: generation k sees step k's prompts),
the rule reward (our reward function on our `response_text` of the completion ids, so EOS
counts as it does for us), samples_per_prompt, temperature, max_new_tokens and min_new_tokens
(HF generate's `min_new_tokens`, through GRPOConfig.generation_kwargs), group-normalized
advantages (TRL's std + 1e-4 equals `algorithm.grpo_eps` = 1e-4; another value is refused),
the clip range, `updates_per_batch` mini-batches per generated batch (one optimizer step each),
the optimizer (AdamW lr, betas, eps, weight decay, warm-up, grad clip), token-mean loss, no KL.
TRL generates with HF `generate` on the CPU, in fp32 (no vLLM).

One RL step of TRL = one generation + `updates_per_batch` optimizer steps, timed from the
first optimizer step's `on_step_begin` to the last one's `on_step_end`. Phases: gen (HF
generate), reward, old_logprob (TRL's forward over the batch before the first update), prep
(the rest of building the batch: tokenizing, advantages), update (the rest of the step:
forward, backward and optimizer steps of the mini-batches).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mcore_rl.config import ConfigError, load_config
from mcore_rl.tasks.config import build_reward, build_task
from mcore_rl.tasks.tokenizer import response_text

PHASES = ("gen", "reward", "old_logprob", "prep", "update", "step")
_LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}


def trl_arguments(rl, out_dir: str, steps: int) -> dict:
    """GRPOConfig keyword arguments equal to the RLConfig's settings (module doc); raises
    ConfigError naming a field TRL cannot match."""
    algo, opt = rl.algorithm, rl.train.optimizer
    for name, ok in (("algorithm.advantage_estimator", algo.advantage_estimator == "grpo"),
                     ("algorithm.kl_coeff", not algo.kl_coeff),
                     ("algorithm.entropy_coeff", not algo.entropy_coeff),
                     ("algorithm.grpo_eps", algo.grpo_eps == 1e-4),
                     ("algorithm.loss_agg", algo.loss_agg in _LOSS_TYPES),
                     ("algorithm.dynamic_sampling", not algo.dynamic_sampling),
                     ("train.optimizer.decay", opt.decay == "constant"),
                     ("task.multi_turn", not rl.task.multi_turn)):
        if not ok:
            raise ConfigError(name, _field(rl, name), "the TRL baseline matches only the "
                              "demo's GRPO settings (grpo, no KL/entropy terms, grpo_eps 1e-4, "
                              "token-mean or seq-mean-token-mean, constant LR, single turn)")
    rows = rl.prompts_per_step * rl.samples_per_prompt
    return dict(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, seed=rl.seed,
        report_to="none", save_strategy="no", logging_steps=10 ** 9, disable_tqdm=True,
        per_device_train_batch_size=rows // rl.updates_per_batch,
        gradient_accumulation_steps=1, steps_per_generation=rl.updates_per_batch,
        num_generations=rl.samples_per_prompt, max_steps=steps * rl.updates_per_batch,
        shuffle_dataset=False, temperature=rl.temperature, top_p=1.0, top_k=0,
        max_completion_length=rl.max_new_tokens, use_vllm=False, beta=0.0,
        epsilon=algo.clip_eps_low, epsilon_high=algo.clip_eps_high,
        scale_rewards="group" if algo.grpo_norm_by_std else "none",
        loss_type=_LOSS_TYPES[algo.loss_agg], num_iterations=1,
        learning_rate=opt.lr, lr_scheduler_type="constant_with_warmup",
        warmup_steps=opt.lr_warmup_steps, adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2,
        adam_epsilon=opt.adam_eps, weight_decay=opt.weight_decay,
        max_grad_norm=opt.clip_grad if opt.clip_grad else 1e30,
        dataloader_num_workers=0, remove_unused_columns=False,
        generation_kwargs={"min_new_tokens": rl.min_new_tokens} if rl.min_new_tokens else None)


def check_available() -> None:
    """Raise ImportError saying how to install TRL when it is missing."""
    if importlib.util.find_spec("trl") is None:
        raise ImportError("baseline=trl needs Hugging Face TRL: pip install '.[bench]'")


def _field(rl, dotted: str):
    value = rl
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def step_examples(rl, steps: int) -> list:
    """The examples our controller samples at steps 1..steps (dynamic sampling off)."""
    task = build_task(rl.task)
    return [task.train_examples(rl.prompts_per_step, step=s, attempt=0, seed=rl.seed)
            for s in range(1, steps + 1)]


def run_trl(rl, hf_dir: str, steps: int, scratch: str) -> dict:
    """TRL's GRPO for `steps` RL steps from `hf_dir`; per-step phase seconds, rewards, the
    prompts of each step, start-up seconds (imports + model + trainer)."""
    start = time.perf_counter()
    import torch  # lazy: torch
    import transformers  # lazy: transformers
    from datasets import Dataset  # lazy: datasets
    from trl import GRPOConfig, GRPOTrainer  # lazy: trl

    imported = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    examples = step_examples(rl, steps)
    answers = {e.prompt: e.answer for step in examples for e in step}
    rule = build_reward(rl.task)
    seen: list[list[str]] = []
    rewards: list[float] = []
    lengths: list[dict[str, list[int]]] = []
    prompt_tokens = {p: len(ids) for p, ids in zip(answers, tokenizer(
        list(answers), add_special_tokens=True)["input_ids"])}

    def reward(prompts, completion_ids, **_):
        seen.append(sorted(set(prompts)))
        lengths.append({"prompt": [prompt_tokens[p] for p in prompts],
                        "response": [len(ids) for ids in completion_ids]})
        scores = [float(rule(p, response_text(ids, tokenizer), answers[p]))
                  for p, ids in zip(prompts, completion_ids)]
        rewards.append(sum(scores) / len(scores))
        return scores

    dataset = Dataset.from_dict({"prompt": [e.prompt for step in examples for e in step]})
    clock = _Clock()
    trainer = _timed_trainer_cls(GRPOTrainer, clock)(
        model=model, reward_funcs=reward, processing_class=tokenizer, train_dataset=dataset,
        args=GRPOConfig(**trl_arguments(rl, scratch, steps)),
        callbacks=[clock.callback(transformers.TrainerCallback, rl.updates_per_batch)])
    ready = time.perf_counter()
    trainer.train()
    return {"startup_s": ready - start, "import_s": imported - start,
            "train_s": time.perf_counter() - ready, "threads": torch.get_num_threads(),
            "per_step": clock.steps, "reward_mean": rewards, "prompts": seen,
            "lengths": lengths,
            "trl_version": __import__("trl").__version__}


class _Clock:
    """Phase seconds of the RL step in progress, closed into `steps` at its last optimizer
    step's end."""

    def __init__(self):
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.begin = 0.0
        self.in_prep = False

    def add(self, phase: str, seconds: float) -> None:
        self.current[phase] = self.current.get(phase, 0.0) + seconds

    def callback(self, base, updates: int):
        clock = self

        class StepClock(base):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step % updates == 0:
                    clock.begin, clock.current = time.perf_counter(), {}

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step % updates == 0:  # global_step already counts this one
                    t = dict(clock.current)
                    t["step"] = time.perf_counter() - clock.begin
                    inner = sum(t.get(p, 0.0) for p in ("gen", "reward", "old_logprob"))
                    t["prep"] = t.pop("batch", 0.0) - inner
                    t["update"] = t["step"] - inner - t["prep"]
                    clock.steps.append({p: t.get(p, 0.0) for p in PHASES})

        return StepClock()


def _timed_trainer_cls(base, clock: _Clock):
    """GRPOTrainer with its batch building, generation, reward and old-log-prob pass timed
    (nothing else changes)."""

    def timed(name, phase, only_in_prep=False):
        method = getattr(base, name)

        def wrapper(self, *args, **kwargs):
            if only_in_prep and not clock.in_prep:
                return method(self, *args, **kwargs)
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                clock.add(phase, time.perf_counter() - start)
        return wrapper

    def build(self, *args, **kwargs):
        clock.in_prep = True
        start = time.perf_counter()
        try:
            return base._generate_and_score_completions(self, *args, **kwargs)
        finally:
            clock.in_prep = False
            clock.add("batch", time.perf_counter() - start)

    return type("TimedGRPOTrainer", (base,), {
        "_generate_and_score_completions": build,
        "_generate": timed("_generate", "gen"),
        "_calculate_rewards": timed("_calculate_rewards", "reward"),
        "_get_per_token_logps_and_entropies": timed("_get_per_token_logps_and_entropies",
                                                    "old_logprob", only_in_prep=True)})


def run_in_subprocess(config: str | None, overrides: list[str], hf_dir: str, steps: int,
                      timeout_s: float = 1800.0) -> dict:
    """`run_trl` in a fresh Python process (see the module doc); its wall seconds from
    process start to exit are reported as `process_s`."""
    with tempfile.TemporaryDirectory(prefix="mcore-rl-trl-") as scratch:
        args = Path(scratch) / "args.json"
        args.write_text(json.dumps({"config": config, "overrides": overrides,
                                    "hf_dir": hf_dir, "steps": steps,
                                    "scratch": str(Path(scratch) / "out")}))
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "mcore_rl.bench.trl_baseline", str(args)],
                              capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "HF_HUB_OFFLINE": "1",
                                   "TRANSFORMERS_OFFLINE": "1"})
        if proc.returncode != 0:
            raise RuntimeError(f"the TRL baseline failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        report["process_s"] = time.perf_counter() - start
        return report


def main(argv: list[str]) -> int:
    from mcore_rl.runconfig import RLConfig  # lazy: torch

    args = json.loads(Path(argv[0]).read_text())
    rl = load_config(RLConfig, args["config"], args["overrides"])
    report = run_trl(rl, args["hf_dir"], args["steps"], args["scratch"])
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
