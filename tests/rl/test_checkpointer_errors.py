"""Issue #43: a checkpoint that a rank cannot write (a full disk) is one line naming the file
and the reason — not the rank's traceback, which Ray raises in colour as RayTaskError(OSError).
No worker starts: the ranks are a stand-in whose call raises what Ray raises."""

import errno
import os
import traceback

import pytest

from mcore_rl.rl.checkpoint_dirs import CheckpointWriteError
from mcore_rl.rl.checkpointer import Checkpointer

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


class FullDiskRanks:
    """Actor ranks whose save fails in rank 1 as a full disk does, raised as Ray raises a
    worker's error."""

    def __init__(self, filename: str):
        self.cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    def call(self, method: str, *args, phase: str):
        from ray.exceptions import RayTaskError  # here: the GPU check machine has no Ray

        try:
            raise self.cause
        except OSError:
            remote = traceback.format_exc()
        raise RayTaskError(f"ActorRank.{method}", remote, self.cause, proctitle="ray::ActorRank",
                           pid=4242, ip="127.0.0.1").as_instanceof_cause()


def test_a_ranks_full_disk_is_one_line_naming_the_file(tmp_path):
    from ray.exceptions import RayTaskError

    root = tmp_path / "checkpoints"
    shard = root / ".step_3.tmp" / "rank_1" / "model.pt"
    ranks = FullDiskRanks(str(shard))
    with pytest.raises(RayTaskError) as raw:  # what the message was made of before
        ranks.call("save_checkpoint", phase="save")
    assert len(str(raw.value).splitlines()) > 3 and "\x1b[" in str(raw.value)
    with pytest.raises(CheckpointWriteError) as err:
        Checkpointer(tmp_path, actors=ranks, layer_spec="local").save(3)
    (line,) = str(err.value).splitlines()
    assert line == (f"checkpoint after step 3 not written: {shard}: No space left on device; "
                    f"the previous checkpoint in {root} is intact")
    assert err.value.errno == errno.ENOSPC
    assert not (root / ".step_3.tmp").exists() and not (root / "step_3").exists()
