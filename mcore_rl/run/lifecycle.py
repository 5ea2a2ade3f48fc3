"""One RL run's lifecycle, the same for `mcore-rl train` / `demo`, `bench step` and the tests:

    with RLRun(cfg, run_dir) as run:                  # Ray, the model, every worker and engine
        first_step = run.begin(checkpoint, ...)       # warm-up or resume, fresh optimizer, sync
        run.train(range(first_step, cfg.steps + 1), record, ...)   # run.loop.run_steps
    # leaving the block shuts every worker and engine down (and Ray, when the run started it)

What one RL step does is `RLController.rl_step` (mcore_rl/rl/controller.py); what the loop
around it does (records, checkpoints, stops) is `run.loop.run_steps`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mcore_rl.config import ConfigError
from mcore_rl.config.seeds import derive_seed
from mcore_rl.launch.process_cpu import cpu_by_role
from mcore_rl.launch.ray_runtime import start_local_ray
from mcore_rl.launch.startup_gc import gc_paused
from mcore_rl.models.hf_factory import make_hf_model_dir
from mcore_rl.rl.controller import RLController
from mcore_rl.rl.metrics import MetricsWriter
from mcore_rl.run.hf_export import export_actor_hf
from mcore_rl.run.loop import run_steps
from mcore_rl.run.preflight import tokenizer_missing
from mcore_rl.tasks.config import build_task
from mcore_rl.tasks.tokenizer import build_tokenizer_dir

# RUN_DIR/<this>: the actor after the warm-up as an HF directory (`run.hf_export`); a run
# with model.hf_dir=RUN_DIR/warmup_hf warmup.max_steps=0 starts from the same weights
WARMUP_HF = "warmup_hf"


class RLRun:
    """Starts the run's workers on entry and shuts them down on exit, whatever happened.

    model_dir: the model to load; None builds the run's own (`model.hf_dir`, or the demo
    model built into `run_dir`) while Ray starts. After entry: `controller`, `model_dir`,
    `startup_s` (entry to every worker and engine up) and `startup_cpu` (what that start-up
    cost each role's processes, `launch.process_cpu.cpu_by_role`)."""

    def __init__(self, cfg, run_dir: Path, *, model_dir: Path | None = None,
                 sampler_cls=None):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.model_dir = None if model_dir is None else Path(model_dir)
        self.sampler_cls = sampler_cls
        self.controller = None
        # begin's warm-up: its last accuracy, the warmed-up actor's HF directory, seconds
        self.warmup_accuracy: float | None = None
        self.warmed_up_dir: Path | None = None
        self.warmup_s = 0.0
        self.first_sync: dict[str, float] = {}  # begin's sync: its metrics
        self.startup_s = 0.0
        self.startup_cpu: dict[str, float] = {}

    def __enter__(self) -> RLRun:
        start = time.perf_counter()
        owns_ray = False
        with gc_paused():  # transformers' import, the tokenizer's training (launch/startup_gc.py)
            if self.model_dir is None:
                self.model_dir, owns_ray = model_dir_while_ray_starts(self.cfg, self.run_dir)
            extra = {} if self.sampler_cls is None else {"sampler_cls": self.sampler_cls}
            # the controller's init_local_ray finds Ray up: the run hands it the Ray it started
            self.controller = RLController(self.cfg, self.model_dir, self.run_dir,
                                           owns_ray=owns_ray, **extra)
        self.startup_s = time.perf_counter() - start
        self.startup_cpu = cpu_by_role()
        return self

    def __exit__(self, *exc) -> None:
        if self.controller is not None:
            self.controller.shutdown()

    def begin(self, checkpoint: Path | None = None, *, warmup_writer=None,
              export_to: Path | None = None, admit_late_engines: bool = False,
              stop=None) -> int:
        """Everything before the first RL step; returns that step. From `checkpoint`: its
        weights and optimizer. Otherwise the supervised warm-up when the config asks for one
        (its metrics to `warmup_writer`, a `MetricsWriter`; the warmed-up actor exported as an
        HF directory to `export_to`, RUN_DIR/warmup_hf by default, which LoRA adapters record
        as their base), and a fresh RL optimizer. admit_late_engines: engines that start late
        (rollout.startup_engines) join first, so every step runs on all of them. Then the
        engines get the actor's weights."""
        controller = self.controller
        if checkpoint is not None:
            controller.reset_optimizer()
            first_step = controller.load_checkpoint(checkpoint) + 1
        else:
            if self.cfg.warmup.max_steps:
                self._warm_up(warmup_writer, export_to or self.run_dir / WARMUP_HF)
            controller.reset_optimizer()
            first_step = 1
        if stop is not None and stop.requested:
            return first_step
        if admit_late_engines:
            controller.admit_late_engines(wait=True)
        self.first_sync = controller.sync_weights()
        return first_step

    def _warm_up(self, writer, export_to: Path) -> None:
        start = time.perf_counter()
        own = writer is None
        writer = MetricsWriter(self.run_dir, phase="warmup") if own else writer
        try:
            self.warmup_accuracy = self.controller.warmup(writer)
        finally:
            if own:
                writer.close()
        self.warmed_up_dir = export_actor_hf(self.controller, self.model_dir, export_to)
        # the base LoRA adapters (attached next) sit on: what the run's checkpoints record
        self.controller.call_actors("set_base_model", str(export_to), phase="setup")
        self.warmup_s = time.perf_counter() - start

    def train(self, steps: Iterable[int], record: Callable[[int, dict], None],
              **loop) -> Path | None:
        """RL steps `steps` through the run loop (`run.loop.run_steps`, with its keyword
        arguments: checkpoint_due, keep_last, stop, evaluate_due); returns the last
        checkpoint written (None: none was)."""
        return run_steps(self.controller, steps, record, **loop)


def model_dir_of(cfg, out: Path) -> Path:
    """The model the run loads: model.hf_dir, or the demo model built into `out`."""
    if cfg.model.hf_dir is None:
        return build_demo_model(cfg, out)

    hf_dir = Path(cfg.model.hf_dir)
    missing = [name for name in ("config.json",) if not (hf_dir / name).is_file()]
    if missing or not any(hf_dir.glob("*.safetensors")) or tokenizer_missing(hf_dir):
        raise ConfigError("model.hf_dir", str(hf_dir), "expected an HF checkpoint directory "
                          "(config.json, *.safetensors, tokenizer files)")
    return hf_dir


def model_dir_while_ray_starts(cfg, out: Path) -> tuple[Path, bool]:
    """`model_dir_of(cfg, out)` with the driver's Ray started (`start_local_ray`), and whether
    this call started it (the run then owns it: `RLController(owns_ray=...)`). The demo
    model is built in a thread meanwhile: ray.init mostly waits on the processes it launches,
    and the build (transformers' import, the tokenizer's training) is seconds of driver CPU.
    A given model.hf_dir is checked first, so a bad one fails before Ray starts."""
    if cfg.model.hf_dir is not None:
        model_dir = model_dir_of(cfg, out)
        return model_dir, start_local_ray()
    with ThreadPoolExecutor(1, thread_name_prefix="demo-model") as pool:
        model_dir = pool.submit(model_dir_of, cfg, out)
        started = start_local_ray()
        return model_dir.result(), started


# sentencepiece vocabulary (a soft limit) of the demo tokenizer per task kind: addition needs
# 16 pieces; the tool task's traces and error messages need 52 characters, and 64 lets BPE
# merge its tool name ("calc") into one piece
DEMO_TOKENIZER_VOCAB = {"addition": 16, "tool_calc": 64}
# OUT/<this>: the demo model (tokenizer included) a run without model.hf_dir builds
DEMO_MODEL_DIR = "model"


def build_demo_model(cfg, out: Path) -> Path:
    """Tokenizer trained on the task's own text + random-weight HF Llama in out/model (shapes:
    `cfg.model.demo_spec()`; the vocabulary is the tokenizer's)."""
    tok_dir = build_tokenizer_dir(out / "tokenizer", build_task(cfg.task),
                                  vocab_size=DEMO_TOKENIZER_VOCAB[cfg.task.kind])
    return make_hf_model_dir(cfg.model.demo_spec(), out / DEMO_MODEL_DIR,
                             seed=derive_seed(cfg.seed, "model"),
                             tokenizer_dir_or_obj=tok_dir)


__all__ = ["RLRun", "WARMUP_HF", "build_demo_model", "model_dir_of",
           "model_dir_while_ray_starts"]
