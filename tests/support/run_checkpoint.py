"""A run's actor checkpoint without a run: the actor's trainer (HF weights, one policy update,
so the weights are no longer the HF ones and the optimizer holds Adam states) saved by
`save_role` on gloo ranks — the files `RUN_DIR/checkpoints/step_<k>/actor` holds (model and
`optimizer.` keys, `rank<r>.pt`). `fake_run_dir` puts one under a run directory with its
config.yaml, controller.json and completion marker, as `mcore-rl train` leaves it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mcore_rl.launch.spawn import run_on_ranks


def _save_trained_actor(rank: int, world: int, hf_dir: str, ckpt_dir: str, tp: int) -> None:
    from mcore_rl.algorithms import AlgorithmConfig
    from mcore_rl.layouts import materialize_rank, megatron_shards
    from mcore_rl.megatron.config import OptimizerConfig, TrainConfig
    from mcore_rl.megatron.policy import PolicyBatch, policy_update
    from mcore_rl.megatron.role_checkpoint import save_role
    from mcore_rl.megatron.train import setup_trainer
    from mcore_rl.models.gpt import load_chunks
    from mcore_rl.models.hf_weights import SafetensorsWeights
    from mcore_rl.models.spec import ModelSpec
    from mcore_rl.parallel import ParallelConfig
    from mcore_rl.parallel.groups import destroy_training_groups, init_training_groups
    from tests.support.batches import fixed_batch

    parallel = ParallelConfig(tp=tp)
    spec = ModelSpec.from_hf_dir(hf_dir)
    groups = init_training_groups(parallel)
    try:
        weights = SafetensorsWeights(Path(hf_dir))
        base = materialize_rank(megatron_shards(spec, parallel), rank, weights.__getitem__,
                                torch.float32)
        train = TrainConfig(micro_batch_size=4, num_micro_batches=2, seq_len=12,
                            optimizer=OptimizerConfig(lr=1e-2))
        trainer = setup_trainer(spec, groups, train, lambda c: load_chunks(c, base, None))
        tokens, labels, mask, adv = fixed_batch(spec)
        batches = [PolicyBatch(tokens[r], labels[r], mask[r], torch.full((4, 12), float("nan")),
                               adv[r])
                   for r in (slice(0, 4), slice(4, 8))]
        policy_update(trainer, batches, AlgorithmConfig(clip_c=None))
        save_role(trainer, Path(ckpt_dir), rank)
    finally:
        destroy_training_groups()


def save_trained_actor(hf_dir: Path, ckpt_dir: Path, tp: int = 2) -> Path:
    """`ckpt_dir`: the actor checkpoint (module doc) of the HF model `hf_dir` at TP `tp`."""
    run_on_ranks(_save_trained_actor, tp, str(hf_dir), str(ckpt_dir), tp, timeout_s=300)
    return ckpt_dir


def fake_run_dir(run_dir: Path, actor_ckpt: Path, *, step: int = 3,
                 overrides: tuple[str, ...] = ()) -> Path:
    """`run_dir` as a finished `mcore-rl train` leaves it: config.yaml (the demo-sized config
    with `overrides`) and checkpoints/step_<step> holding a copy of `actor_ckpt` as its actor/,
    controller.json and, last, the completion marker. Returns the step directory."""
    import shutil

    from mcore_rl.config import load_config, write_config
    from mcore_rl.rl.checkpoint_dirs import CONTROLLER_FILE, MARKER
    from mcore_rl.runconfig import RLConfig
    from mcore_rl.run.train import RESOLVED_CONFIG
    from tests.support import DEMO_SIZED

    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(load_config(RLConfig, DEMO_SIZED, list(overrides)), run_dir / RESOLVED_CONFIG)
    step_dir = run_dir / "checkpoints" / f"step_{step}"
    shutil.copytree(actor_ckpt, step_dir / "actor")
    (step_dir / CONTROLLER_FILE).write_text(json.dumps({"step": step, "layer_spec": "local"}))
    (step_dir / MARKER).write_text(json.dumps({"step": step}))
    return step_dir
