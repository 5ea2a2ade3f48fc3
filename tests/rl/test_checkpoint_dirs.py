"""Checkpoint bookkeeping (rl/checkpoint_dirs.py) without workers: the completion
marker decides what counts, pruning keeps the newest complete ones, a save that cannot write
names the path and leaves the previous checkpoint loadable, and metrics.jsonl is cut back to
the resumed step."""

import errno
import json

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.rl import checkpoint_dirs as store
from mcore_rl.rl.checkpoint_dirs import CheckpointWriteError
from mcore_rl.runconfig import CheckpointConfig
from mcore_rl.runconfig import RLConfig
from tests.support import DEMO_SIZED

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def _save(root, step, *, inject=None, body=None):
    tmp, final = root / f".step_{step}.tmp", root / f"step_{step}"
    with store.writing(root, tmp, step, inject):
        tmp.mkdir(parents=True)
        (tmp / "controller.json").write_text(json.dumps({"step": step}))
        if body:
            body(tmp)
    return store.publish(tmp, final, step)


def test_only_marked_checkpoints_count_and_cut_off_saves_are_cleaned(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _save(root, step)
    assert store.newest_complete(root).name == "step_3"
    (root / "step_4").mkdir()  # renamed, marker never written: a save cut off
    (root / "step_4" / "controller.json").write_text("{}")
    (root / ".step_5.tmp").mkdir()
    assert store.newest_complete(root).name == "step_3"
    assert store.resolve_checkpoint(tmp_path).name == "step_3"  # a run dir: its newest
    assert store.resolve_checkpoint(root).name == "step_3"
    with pytest.raises(store.CheckpointNotFound, match="step_4: not a complete checkpoint"):
        store.resolve_checkpoint(root / "step_4")
    assert {p.name for p in store.clean_incomplete(root)} == {"step_4", ".step_5.tmp"}
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2", "step_3"]
    assert store.prune(root, keep_last=2)[0].name == "step_1"
    assert [p.name for p in store.complete_checkpoints(root)] == ["step_2", "step_3"]
    assert store.prune(root, keep_last=0) == []


def test_a_save_that_cannot_write_names_the_path_and_keeps_the_previous(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 2)

    def half_then_full_disk(tmp):
        (tmp / "shard0.distcp").write_bytes(b"x" * 100)

    with pytest.raises(CheckpointWriteError) as info:
        _save(root, 4, inject="save@step4", body=half_then_full_disk)
    message = str(info.value)
    assert "checkpoint after step 4 not written" in message and ".step_4.tmp" in message
    assert "No space left on device" in message and f"{root} is intact" in message
    assert info.value.errno == errno.ENOSPC
    assert not (root / ".step_4.tmp").exists() and not (root / "step_4").exists()
    assert store.resolve_checkpoint(root).name == "step_2"
    # an unwritable location (here: the checkpoints "directory" is a file) fails up front
    blocked = tmp_path / "blocked"
    blocked.write_text("not a directory")
    with pytest.raises(CheckpointWriteError, match=f"cannot write checkpoints to {blocked}"):
        _save(blocked, 1)


def test_metrics_are_cut_back_to_the_resumed_step(tmp_path):
    rows = [json.dumps({"step": s, "reward_mean": s / 10}) for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 5, "rew')
    store.truncate_metrics(tmp_path, 2)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").open()] == [1, 2]
    (tmp_path / "warmup_metrics.jsonl").write_text("{}\n")
    store.truncate_metrics(tmp_path, 0)
    assert not list(tmp_path.glob("*.jsonl"))


def test_checkpoint_config():
    cfg = load_config(RLConfig, DEMO_SIZED, ["checkpoint.every=2", "checkpoint.keep_last=3"])
    assert cfg.checkpoint == CheckpointConfig(every=2, keep_last=3)
    assert [s for s in range(1, 8) if cfg.checkpoint.due(s, 7)] == [2, 4, 6, 7]
    # the default (every 50, keep 3): a finished run always keeps its last step's
    assert CheckpointConfig() == CheckpointConfig(every=50, keep_last=3)
    assert [s for s in range(1, 121) if CheckpointConfig().due(s, 120)] == [50, 100, 120]
    assert [s for s in range(1, 8) if CheckpointConfig().due(s, 7)] == [7]
    assert [s for s in range(1, 8) if CheckpointConfig(every=0).due(s, 7)] == [7]
    with pytest.raises(ConfigError, match="checkpoint.keep_last=-1: must be >= 0"):
        load_config(RLConfig, DEMO_SIZED, ["checkpoint.keep_last=-1"])
    with pytest.raises(ConfigError, match="inject_error"):
        CheckpointConfig(inject_error="save@2")
