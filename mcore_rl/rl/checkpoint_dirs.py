"""Where an RL run's checkpoints live, which of them count, and which are kept.

RUN_DIR/checkpoints/step_<k> is written as `.step_<k>.tmp`, renamed, and only then marked
complete: `complete.json` is written last (temp + rename), after every file of the checkpoint
has been flushed to disk. A directory without the marker is a save that was cut off: it is
never loaded, and `clean_incomplete` removes it. `keep_last` prunes older checkpoints only
after the new one is complete, so a failed save always leaves the previous one loadable.

A save that cannot write (unwritable or full run directory) raises `CheckpointWriteError`
naming the path; the half-written temporary directory is removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path

from mcore_rl.config import ConfigError
from mcore_rl.conversion.output import fsync_dir, fsync_tree

MARKER = "complete.json"
_PREFIX = "step_"
# the controller's record in each step directory: its step and the run's layer spec
CONTROLLER_FILE = "controller.json"
# What checkpoints written before the field existed were saved with (CPU runs only).
LEGACY_LAYER_SPEC = "local"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; names the path. The previous one is intact."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno N]" prefix
        return str(self.strerror)


class CheckpointNotFound(FileNotFoundError):
    """A path given to resume from holds no complete checkpoint."""


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_of(path: Path) -> int | None:
    name = path.name
    if name.startswith(_PREFIX) and name[len(_PREFIX):].isdigit():
        return int(name[len(_PREFIX):])
    return None


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None
             and is_complete(p)]
    return sorted(found, key=step_of)


def newest_complete(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run's checkpoints root (→ its newest complete one).
    Raises CheckpointNotFound if that is not a complete checkpoint."""
    path = Path(path)
    if step_of(path) is None and path.is_dir():
        newest = newest_complete(path / "checkpoints" if (path / "checkpoints").is_dir()
                                 else path)
        if newest is None:
            raise CheckpointNotFound(f"{path}: no complete checkpoint (step_<k> directories "
                                     f"with {MARKER})")
        return newest
    if not is_complete(path):
        raise CheckpointNotFound(f"{path}: not a complete checkpoint (no {MARKER}: the save "
                                 "was cut off, or this is not a checkpoint directory)")
    return path


def clean_incomplete(root: Path) -> list[Path]:
    """Remove saves that never completed (temporary dirs, step dirs without the marker)."""
    removed = []
    if not root.is_dir():
        return removed
    for path in root.iterdir():
        temporary = path.name.startswith(f".{_PREFIX}") and path.name.endswith(".tmp")
        if path.is_dir() and (temporary or (step_of(path) is not None
                                            and not is_complete(path))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def prune(root: Path, keep_last: int) -> list[Path]:
    """Remove all but the `keep_last` newest complete checkpoints (0: keep all)."""
    if keep_last <= 0:
        return []
    old = complete_checkpoints(root)[:-keep_last]
    for path in old:
        # the marker goes first: a prune cut off half-way leaves an incomplete dir, not a
        # "complete" one with files missing
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return old


def check_writable(directory: Path) -> None:
    """Create `directory` and a probe file in it; CheckpointWriteError naming the path if
    either fails (read-only file system, full disk, permissions)."""
    probe = directory / ".write_probe"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as handle:
            handle.write(b"\0" * 4096)
            handle.flush()
            os.fsync(handle.fileno())
        probe.unlink()
    except OSError as err:
        raise CheckpointWriteError(err.errno, f"cannot write checkpoints to {directory}: "
                                              f"{err.strerror}") from err


@contextlib.contextmanager
def writing(root: Path, tmp: Path, step: int, inject: str | None = None):
    """Around the writing of one checkpoint into `tmp`: the root must be writable first; any
    error inside removes `tmp` and is raised as CheckpointWriteError naming the path."""
    check_writable(root)
    try:
        yield
        if inject == f"save@step{step}":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, CheckpointWriteError):
            raise
        where = getattr(err, "filename", None) or tmp
        raise CheckpointWriteError(getattr(err, "errno", None) or errno.EIO,
                                   f"checkpoint after step {step} not written: {where}: "
                                   f"{getattr(err, 'strerror', None) or err}; the previous "
                                   f"checkpoint in {root} is intact") from err


def publish(tmp: Path, final: Path, step: int) -> Path:
    """Make the fully written `tmp` the checkpoint `final`: flush it, rename it, then write
    the completion marker (last), and point `latest` at it."""
    fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    marker_tmp = final / f".{MARKER}.tmp"
    marker_tmp.write_text(json.dumps({"step": step}))
    os.replace(marker_tmp, final / MARKER)
    fsync_dir(final)
    (final.parent / "latest").write_text(final.name)
    fsync_dir(final.parent)
    return final


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Keep metrics.jsonl lines of steps <= last_step (a resumed run appends from there:
    no step missing, none repeated); last_step 0 starts the files over (warm-up's too)."""
    run_dir = Path(run_dir)
    if last_step <= 0:
        for name in ("metrics.jsonl", "warmup_metrics.jsonl"):
            (run_dir / name).unlink(missing_ok=True)
        return
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            break  # a line cut off by the kill: nothing after it counts
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def checkpoint_dir(path: str | Path) -> Path:
    """A step directory as given; a run directory or its checkpoints root → its newest complete
    step, or the path itself when it holds none."""
    path = Path(path)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if step_of(path) is None and root.name == "checkpoints":
        return newest_complete(root) or path
    return path


def check_resume(path: str | Path, layer_spec: str) -> Path:
    """The checkpoint `--resume PATH` names, checked against the run's resolved layer spec
    before any worker starts; returns its step directory.

    Why refuse the other spec although megatron-core spells dist-checkpoint keys the TE way
    under both (so the tensors would load): a resume continues the same run — the same kernels,
    TE's fp8 scaling state in `_extra_state`, bit-for-bit continuation. Switching between the
    local and the TransformerEngine spec is a different run: start it from the weights instead
    (`mcore-rl convert mcore-to-hf`, then `model.hf_dir`).
    """
    ckpt = checkpoint_dir(path)
    meta = ckpt / CONTROLLER_FILE
    if not meta.is_file():
        if (ckpt / "mcore_rl_checkpoint.json").is_file():
            raise ConfigError("--resume", str(path), "is an HF->Megatron converted checkpoint "
                              "(mcore_rl_checkpoint.json), not a training checkpoint "
                              "(RUN_DIR/checkpoints/step_<k> with controller.json); to start "
                              "from its weights convert it back (mcore-rl convert mcore-to-hf) "
                              "and set model.hf_dir")
        raise ConfigError("--resume", str(path), f"not a checkpoint (no {ckpt / CONTROLLER_FILE})")
    saved = json.loads(meta.read_text()).get("layer_spec", LEGACY_LAYER_SPEC)
    if saved != layer_spec:
        names = {"te": "TransformerEngine", "local": "megatron-core's local"}
        raise ConfigError("--resume", str(path), (
            f"saved by a run with layer_spec={saved!r} ({names.get(saved, saved)} layer spec, "
            f"{meta}), but this run resolves layer_spec={layer_spec!r} "
            f"({names.get(layer_spec, layer_spec)}: 'te' on CUDA, 'local' on CPU — "
            "cluster.device); resume on the kind of machine that saved it, or start a new run "
            "from its weights (mcore-rl convert mcore-to-hf, then model.hf_dir)"))
    return ckpt
