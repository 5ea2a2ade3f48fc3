"""Issue #43: each bad input to `mcore-rl` is one line (no traceback), a non-zero exit, and
leaves nothing half-written — an HF directory without a tokenizer, an --out that cannot hold a
run, a checkpoint a full disk refuses, `plot` on a directory without metrics, an override
written as an option, an unknown key (with the closest known ones). Only the tokenizer case
runs `train` in a subprocess (it gets as far as preflight); the others are refused before
any run starts, in this process."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mcore_rl.cli import main

ROOT = Path(__file__).resolve().parents[2]
GRPO = str(ROOT / "configs" / "grpo_addition.yaml")


def _one_line(captured) -> str:
    """The one line a refused command printed (stdout and stderr together)."""
    lines = (captured.out + captured.err).splitlines()
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    return lines[0]


def _checkpoint_without_tokenizer(path: Path) -> Path:
    """An HF directory with config.json and weights (a stand-in file: nothing reads them
    before the refusal) but no tokenizer files."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "vocab_size": 300, "max_position_embeddings": 512}))
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_a_checkpoint_without_tokenizer_files_is_refused_by_preflight(tmp_path, capsys):
    """It used to pass preflight, then `train` printed a 34-line traceback ("install
    sentencepiece") from the driver's tokenizer load: preflight names the directory and the
    files expected, and train refuses it in one line before anything starts."""
    model = _checkpoint_without_tokenizer(tmp_path / "ckpt")
    assert main(["preflight", GRPO, f"model.hf_dir={model}"]) == 2
    (error,) = [line for line in capsys.readouterr().out.splitlines() if "ERROR" in line]
    assert error == (f"ERROR [model-dir] model.hf_dir={model}: no tokenizer files in it "
                     "(expected tokenizer.json, or a slow tokenizer's tokenizer.model, "
                     "spiece.model, vocab.json, vocab.txt or *.tiktoken)")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.cli", "train", GRPO, "--out",
                           str(out), f"model.hf_dir={model}"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"mcore-rl train: preflight found 1 error(s): ERROR [model-dir] "
                           f"model.hf_dir={model}: no tokenizer files in it"), line
    assert not out.exists()  # not even the logs of a run that never started


def _unwritable_dir() -> Path | None:
    """A directory nothing can be made in, as root too (/sys), or None on this machine."""
    try:
        os.rmdir(tempfile.mkdtemp(dir="/sys"))
    except OSError:
        return Path("/sys")
    return None


def test_an_out_that_cannot_hold_a_run_is_one_line(tmp_path, capsys):
    """--out naming a file, a path under a file, or a place nothing can be written (/sys,
    as root too): one line, exit 2, before the config's run starts; nothing is created."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    assert main(["train", GRPO, "--out", str(file)]) == 2
    assert _one_line(capsys.readouterr()) == (f"mcore-rl train: --out {file}: is a file, not "
                                              "a directory")
    assert main(["demo", "--out", str(file / "run")]) == 2
    assert _one_line(capsys.readouterr()) == (f"mcore-rl demo: --out {file / 'run'}: {file} is "
                                              "a file, not a directory")
    assert file.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    unwritable = _unwritable_dir()
    if unwritable is None:
        pytest.skip("no directory here refuses root (/sys accepts writes)")
    assert main(["train", GRPO, "--out", str(unwritable / "run")]) == 2
    line = _one_line(capsys.readouterr())
    assert line.startswith(f"mcore-rl train: --out {unwritable / 'run'}: cannot write in "
                           f"{unwritable}: "), line


def _as_nobody(fn, *args) -> str:
    """`fn(*args)` (a string) in a child process that runs as user nobody when this one is
    root, where a 0o555 directory does not stop a write; as this user otherwise."""
    if os.geteuid() != 0:
        return fn(*args)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, str(fn(*args)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, said
    return said


def test_an_out_in_a_read_only_directory_is_one_line(tmp_path, capsys):
    """A directory without write permission (0o555): as a user other than root, nothing can
    be made in it; the check tries, so it says so (run as nobody when the tests run as
    root). The one line `train` prints is the check's problem after `--out PATH: `."""
    from mcore_rl.run.train import out_dir_problem

    top = Path(tempfile.mkdtemp(dir="/tmp"))  # reachable by nobody, unlike tmp_path
    locked = top / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    top.chmod(0o755)
    try:
        assert _as_nobody(out_dir_problem, locked / "run") == (f"cannot write in {locked}: "
                                                               "Permission denied")
        assert _as_nobody(out_dir_problem, locked) == (f"cannot write in {locked}: "
                                                       "Permission denied")
        assert list(locked.iterdir()) == []
        if os.geteuid() != 0:
            assert main(["train", GRPO, "--out", str(locked / "run")]) == 2
            assert _one_line(capsys.readouterr()) == (
                f"mcore-rl train: --out {locked / 'run'}: cannot write in {locked}: "
                "Permission denied")
        private = Path(tempfile.mkdtemp(dir="/tmp"))  # 0o700: nobody cannot even look in
        if os.geteuid() == 0:
            assert _as_nobody(out_dir_problem, private / "run") == (
                "cannot reach it: Permission denied")
        private.rmdir()
    finally:
        locked.chmod(0o755)
        shutil.rmtree(top)


def test_a_full_disk_is_one_line_and_exit_4(tmp_path, capsys, monkeypatch):
    """The run's CheckpointWriteError (rl/checkpointer.py makes a rank's full disk one line:
    tests/rl/test_checkpointer_errors.py) is printed as it is, exit 4."""
    from mcore_rl.rl.checkpoint_dirs import CheckpointWriteError
    from mcore_rl.run import train

    root = tmp_path / "run" / "checkpoints"
    message = (f"checkpoint after step 2 not written: {root / '.step_2.tmp'}: No space left "
               f"on device; the previous checkpoint in {root} is intact")

    def full_disk(*args, **kwargs):
        raise CheckpointWriteError(errno.ENOSPC, message)

    monkeypatch.setattr(train, "run_rl", full_disk)
    assert main(["train", GRPO, "--out", str(tmp_path / "run")]) == 4
    assert _one_line(capsys.readouterr()) == f"mcore-rl train: checkpoint error: {message}"


def test_plot_without_metrics_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(tmp_path / "gone")]) == 2
    assert _one_line(capsys.readouterr()) == (f"mcore-rl plot: RUN_DIR {tmp_path / 'gone'}: "
                                              "no such directory")
    assert main(["plot", str(empty)]) == 2
    assert _one_line(capsys.readouterr()) == (
        f"mcore-rl plot: RUN_DIR {empty}: no metrics.jsonl in it (not a run directory, or a "
        "run that has not finished a step)")
    (empty / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\nnot json\n')
    assert main(["plot", str(empty)]) == 2
    assert _one_line(capsys.readouterr()) == (f"mcore-rl plot: a line of metrics.jsonl in "
                                              f"{empty} is not JSON (Expecting value)")
    assert main(["plot", str(tmp_path), "--compare", str(empty)]) == 2
    assert "--compare" not in _one_line(capsys.readouterr())  # RUN_DIR's problem comes first
    assert sorted(p.name for p in empty.iterdir()) == ["metrics.jsonl"]  # no chart written


@pytest.mark.parametrize("argv,line", [
    (["train", GRPO, "--actor.tp=2"],
     "mcore-rl train: --actor.tp=2: overrides are written actor.tp=2 (no dashes)"),
    (["train", GRPO, "--actor.tp", "2", "--steps=3"],
     "mcore-rl train: --actor.tp 2 --steps=3: overrides are written actor.tp=2 steps=3 "
     "(no dashes)"),
    (["preflight", GRPO, "--rollout.tp=2"],
     "mcore-rl preflight: --rollout.tp=2: overrides are written rollout.tp=2 (no dashes)"),
])
def test_an_override_written_as_an_option_says_how_it_is_written(capsys, argv, line):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert _one_line(capsys.readouterr()) == line


def test_an_unknown_key_names_the_closest_known_ones(tmp_path, capsys):
    from mcore_rl.config import ConfigError, load_config
    from mcore_rl.runconfig import RLConfig

    for override, close in (("actor.tpp=2", "(did you mean actor.tp, actor.pp or actor.vpp?)"),
                            ("stepz=3", "(did you mean steps?)"),
                            ("train.optimizer.lrr=1", "(did you mean train.optimizer.lr?)")):
        with pytest.raises(ConfigError, match="unknown field") as err:
            load_config(RLConfig, None, [override])
        assert f"unknown field {close}; allowed: " in str(err.value), err.value
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, None, ["zzz=1"])
    assert "did you mean" not in str(err.value)  # nothing close: only what is allowed
    out = tmp_path / "run"
    assert main(["train", GRPO, "--out", str(out), "max_new_token=8"]) == 2
    line = _one_line(capsys.readouterr())
    assert line.startswith("mcore-rl train: config error: max_new_token=8: unknown field (did "
                           "you mean max_new_tokens, "), line
    assert not out.exists()
