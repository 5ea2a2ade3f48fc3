"""The controller's checkpoints of a run: every role's shards (each actor rank writes its
own; no gather), the rollout buffer ahead of training, and the step — written to a temporary
directory, renamed when complete, marked complete last (rl/checkpoint_dirs.py).

`Checkpointer` is a component of `RLController` (rl/controller.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from mcore_rl.rl import checkpoint_dirs
from mcore_rl.rl.actor_ranks import ActorRanks
from mcore_rl.rollout.batches import Rollouts


class Checkpointer:
    """Save, load and digest the run's state (module doc). `actors`: the actor ranks, each
    writing and reading its own shards; `layer_spec`: recorded with the step (a resume
    checks it)."""

    def __init__(self, run_dir: Path, *, actors: ActorRanks, layer_spec: str,
                 inject_error: str | None = None):
        self.root = checkpoint_dirs.checkpoint_root(run_dir)
        self.actors, self.layer_spec, self.inject_error = actors, layer_spec, inject_error

    def save(self, step: int, pipeline=None) -> Path:
        """RUN_DIR/checkpoints/step_<k>: every rank writes into a temporary directory, which is
        renamed when all are done and only then marked complete (rl/checkpoint_dirs.py);
        a save that cannot write raises CheckpointWriteError naming the path. `pipeline`:
        the rollout pipeline whose batches ahead are saved with it (None: sync mode)."""
        final = self.root / f"step_{step}"
        tmp = self.root / f".step_{step}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        with checkpoint_dirs.writing(self.root, tmp, step, self.inject_error):
            try:
                self.actors.call("save_checkpoint", str(tmp), phase="save")
            except OSError as err:
                # a rank's write failed (a full disk): Ray raises it as RayTaskError(OSError),
                # whose message is the rank's whole traceback in colour; the rank's own error
                # (`cause`) names the file and the reason in one line
                raise getattr(err, "cause", err) from None
            if pipeline is not None:
                # the batches ahead were generated on weights this checkpoint no longer holds;
                # saved with it (and their versions), a resumed run trains on exactly them
                torch.save(pipeline.state(), tmp / "rollout_buffer.pt")
            record = {"step": step, "layer_spec": self.layer_spec}
            (tmp / checkpoint_dirs.CONTROLLER_FILE).write_text(json.dumps(record))
        return checkpoint_dirs.publish(tmp, final, step)

    def load(self, path: Path, pipeline=None) -> int:
        """Restore every role from a checkpoint (a complete one: `path` or, for a run's
        checkpoints root, its newest); returns the step it was taken after. The data position
        is the step: prompts and sampling seeds derive from it. `pipeline`: gets the batches
        ahead saved with the checkpoint."""
        path = checkpoint_dirs.resolve_checkpoint(Path(path))
        meta = path / checkpoint_dirs.CONTROLLER_FILE
        if not meta.is_file():
            raise FileNotFoundError(f"{path}: not a checkpoint (no {meta.name})")
        self.actors.call("load_checkpoint", str(path), phase="load")
        if pipeline is not None and (path / "rollout_buffer.pt").is_file():
            pipeline.load_state(torch.load(path / "rollout_buffer.pt", weights_only=True),
                                Rollouts.from_state)
        return int(json.loads(meta.read_text())["step"])

    def weights_digests(self) -> list[str]:
        return self.actors.call("weights_digest", phase="save")

    def actor_weights(self) -> list[dict[str, torch.Tensor]]:
        """Each actor rank's parameters (megatron_shards keys): `run.hf_export`."""
        return self.actors.call("export_weights", phase="save")


__all__ = ["Checkpointer"]
