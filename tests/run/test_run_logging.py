"""Issue #29, what a run leaves behind: its resolved config as RUN_DIR/config.yaml (written
whole or not at all, read back equal), and its step metrics in wandb too when `logging.wandb`
asks (offline here: no network), which needs the optional wandb package."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import yaml

from mcore_rl.config import ConfigError, check_config, load_config, write_config
from mcore_rl.rl.metrics import MetricsWriter
from mcore_rl.runconfig import RLConfig, WandbConfig, sections

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for p in [*ROOT.glob("configs/*.yaml"), *ROOT.glob("configs/gpu/*.yaml")]
                 if p.name != "lm_micro.yaml")  # lm_micro is `mcore-rl train-lm`'s
OFFLINE = ["logging.wandb.project=mcore-rl-test", "logging.wandb.mode=offline"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_resolved_config_round_trips(tmp_path, path):
    """Every shipped config: written with its derived values filled in, read back equal."""
    cfg = load_config(RLConfig, path, [])
    written = write_config(cfg, tmp_path / "config.yaml")
    text = yaml.safe_load(written.read_text())
    for role in ("train", "critic_train"):  # derived: no nulls left
        assert text[role]["seq_len"] == getattr(cfg, role).seq_len is not None
        assert text[role]["micro_batch_size"] == getattr(cfg, role).micro_batch_size
    assert text["warmup"]["train"]["seq_len"] == cfg.warmup.train.seq_len is not None
    assert text["rollout"]["max_model_len"] == cfg.rollout.max_model_len is not None
    assert load_config(RLConfig, written, []) == cfg
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]  # no temp file left


def test_resolved_config_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    path = write_config(load_config(RLConfig, None, []), tmp_path / "config.yaml")
    before = path.read_text()

    def broken_dump(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(yaml, "safe_dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        write_config(load_config(RLConfig, None, ["steps=7"]), path)
    assert path.read_text() == before  # the earlier file, untouched
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_the_run_writes_its_resolved_config(tmp_path, monkeypatch):
    """run_rl writes OUT/config.yaml once preflight passed, before anything is built."""
    from mcore_rl.run import lifecycle, train

    class Built(Exception):
        pass

    def stop_here(*args, **kwargs):
        raise Built

    monkeypatch.setattr(lifecycle, "model_dir_while_ray_starts", stop_here)
    cfg = load_config(RLConfig, ROOT / "configs/tiny_ci.yaml", ["steps=3"])
    with pytest.raises(Built):
        train.run_rl(cfg, tmp_path / "run")
    assert load_config(RLConfig, tmp_path / "run" / "config.yaml", []) == cfg


def _wandb_records(run_dir: Path) -> list:
    """The records of the one offline wandb run under RUN_DIR/wandb: its .wandb file is a
    LevelDB-style log (7-byte file header; 32 KiB blocks of records, each crc32 (4 bytes),
    length (2, little-endian), type (1: whole, 2/3/4: first/middle/last part)) of protobuf
    `Record`s."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's trailer
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def _records_once_written(run_dir: Path, kinds: set[str], timeout_s: float = 30.0) -> list:
    """The run's records once records of every kind in `kinds` are in its file: wandb's
    service process writes the file, and on a loaded machine it may still be flushing when
    `finish()` has returned."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(run_dir)
        if kinds <= {r.WhichOneof("record_type") for r in records} \
                or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def test_metrics_writer_logs_every_step_to_an_offline_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name, value in (("WANDB_DIR", tmp_path / "wandb_home"), ("WANDB_SILENT", "true"),
                        ("WANDB_CONFIG_DIR", tmp_path / "wandb_config"),
                        ("WANDB_CACHE_DIR", tmp_path / "wandb_cache")):
        monkeypatch.setenv(name, str(value))
    run_dir = tmp_path / "run"
    writer = MetricsWriter(run_dir, phase="warmup", run_config={"steps": 3},
                           wandb=WandbConfig(project="p", name="mine", mode="offline"))
    steps = {1: {"loss": 2.5, "accuracy": 0.25}, 2: {"loss": 1.5, "accuracy": 0.5}}
    for step, values in steps.items():
        writer.write(step, values)
    writer.close()
    records = _records_once_written(run_dir, kinds={"run", "history"})
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, run.run_group, run.job_type) == \
        ("p", "mine/warmup", "mine", "warmup")
    assert {i.key: i.value_json for i in run.config.update}["steps"] == "3"
    history = [{i.key or "/".join(i.nested_key): float(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["loss"], h["accuracy"]) for h in history] == \
        [(step, v["loss"], v["accuracy"]) for step, v in steps.items()]
    assert (run_dir / "warmup_metrics.jsonl").is_file() and (run_dir / "tb" / "warmup").is_dir()


def test_a_writer_without_wandb_starts_none(tmp_path):
    writer = MetricsWriter(tmp_path, phase="rl")
    writer.write(1, {"reward_mean": 0.5})
    writer.close()
    assert writer.wandb is None and not (tmp_path / "wandb").exists()


def test_logging_wandb_loads_and_defaults_off():
    assert load_config(RLConfig, None, []).logging.wandb is None
    pytest.importorskip("wandb")
    cfg = load_config(RLConfig, None, OFFLINE + ["logging.wandb.name=mine"])
    assert cfg.logging.wandb == WandbConfig(project="mcore-rl-test", name="mine",
                                            mode="offline")
    _, errors = check_config(RLConfig, None, ["logging.wandb.project=p",
                                              "logging.wandb.mode=sometimes"])
    assert [str(e) for e in errors] == ["logging.wandb.mode='sometimes': allowed values: "
                                        "online, offline, disabled"]


def test_wandb_without_the_package_is_one_config_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sections, "wandb_installed", lambda: False)
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, None, OFFLINE)
    message = str(err.value)
    assert err.value.field == "logging.wandb" and "\n" not in message
    assert message.endswith("wandb logging needs the wandb package: "
                            "pip install 'mcore-rl[wandb]'")
    from mcore_rl.cli import main

    assert main(["preflight", str(ROOT / "configs/tiny_ci.yaml"), *OFFLINE]) == 2
    assert "ERROR [config] logging.wandb=" in capsys.readouterr().out
    # a writer asked for wandb where the import fails says the same
    monkeypatch.setitem(sys.modules, "wandb", None)
    writer = MetricsWriter(tmp_path, wandb=WandbConfig(project="p", mode="offline"))
    with pytest.raises(ConfigError, match=r"^logging\.wandb=.*pip install 'mcore-rl\[wandb\]'"):
        writer.write(1, {"reward_mean": 0.5})
    writer.close()


def test_the_run_passes_logging_wandb_to_its_writers():
    from mcore_rl.run.train import _loggers

    assert _loggers(load_config(RLConfig, None, [])) == {"wandb": None, "run_config": None}
    pytest.importorskip("wandb")
    cfg = load_config(RLConfig, None, OFFLINE)
    loggers = _loggers(cfg)
    assert loggers["wandb"] is cfg.logging.wandb
    assert loggers["run_config"]["logging"]["wandb"] == dataclasses.asdict(cfg.logging.wandb)
