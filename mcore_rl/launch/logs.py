"""Quiet console: what a user reads is the run's own progress; library logs go to files.

Every process mcore-rl starts (the driver, the Ray actor workers, the vLLM engine hosts) calls
`configure_process_logs(run_dir, role)` once, early. Unless the run is verbose
(`MCORE_RL_VERBOSE=1`, set by `--verbose`), it sends, in that process:

- Python `logging` of the libraries (`LIBRARY_LOGGERS`: vLLM's "Successfully reset prefix
  cache" on every sync, megatron's "Implicit initialization of Rerun State Machine!", Ray's
  start-up lines, ...) to `RUN_DIR/logs/<role>-<pid>.log`, INFO and above;
- Python `warnings` (megatron's "Transformer Engine and Apex are not installed" and
  CUDA_DEVICE_MAX_CONNECTIONS warnings, torch's deprecations) to the same file;
- and, through `VLLM_LOGGING_CONFIG_PATH`, the `vllm` logger of every vLLM process started
  afterwards — the engine's own TP worker processes included, which mcore-rl does not start
  itself — to `RUN_DIR/logs/vllm-<pid>.log`.

Why these means: each library installs its own console handler (vLLM on stdout, Ray and
transformers on stderr) with `propagate=False`, so the root logger never sees their records;
the handlers of the named loggers are replaced instead. vLLM re-applies its logging config in
every process it starts, and that config is authoritative when given as a file, so it is given
one. The verbosity travels as an environment variable because Ray workers and vLLM's workers
inherit the driver's environment.

Output a library writes to the console directly (print, C++ logging) is not Python logging and
stays on the console of its process; a Ray worker's console reaches the driver only when
`ray.init(log_to_driver=verbose())`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

VERBOSE_ENV = "MCORE_RL_VERBOSE"
LIBRARY_LOGGERS = ("vllm", "megatron", "ray", "torch.distributed", "transformers", "py.warnings")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_MARK = "_mcore_rl_log_file"  # set on the handlers this module made
_configured: tuple[Path, str] | None = None  # this process's (run_dir, role), once set


def verbose() -> bool:
    """Whether library logs stay on the console (`MCORE_RL_VERBOSE=1`)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def add_verbose_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help="library logs (vLLM, megatron, Ray, torch, transformers) and "
                             "warnings on the console instead of RUN_DIR/logs/")


def set_verbose(flag: bool) -> None:
    """Set the verbosity for this process and every process it starts (call before
    `ray.init`: Ray workers inherit the environment)."""
    if flag:
        os.environ[VERBOSE_ENV] = "1"
    else:
        os.environ.pop(VERBOSE_ENV, None)


def process_log_handler(log_dir: str, role: str) -> logging.FileHandler:
    """A handler appending to `log_dir/<role>-<pid>.log` (also named by vLLM's logging config,
    so it is importable and takes plain strings)."""
    path = Path(log_dir) / f"{role}-{os.getpid()}.log"
    handler = logging.FileHandler(path, mode="a", encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    setattr(handler, _MARK, str(path))
    return handler


def configure_process_logs(run_dir: str | Path, role: str) -> Path | None:
    """Route this process's library logs and warnings to `RUN_DIR/logs/<role>-<pid>.log`
    unless verbose; returns that path (None when verbose: nothing is changed). Idempotent:
    call it again after importing a library that installs console handlers at import."""
    if verbose():
        return None
    log_dir = Path(run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{role}-{os.getpid()}.log"
    global _configured
    _configured = (Path(run_dir), role)
    _point_vllm_processes_at(log_dir)
    _no_progress_bars()
    logging.captureWarnings(True)  # warnings.warn → the "py.warnings" logger
    for name in LIBRARY_LOGGERS:
        _to_file(logging.getLogger(name), log_dir, role)
    return path


def reapply_process_logs() -> None:
    """`configure_process_logs` again with this process's settings, if it was configured: a
    library imported since then (Ray, at `import ray`) may have put its console handler back."""
    if _configured is not None:
        configure_process_logs(*_configured)


def _no_progress_bars() -> None:
    """Hugging Face's tqdm bars ("Writing model shards", downloads) off: they are console
    output, not logging. The environment reaches libraries imported later and child
    processes; the calls reach the ones already imported (they read it at import)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging  # lazy: transformers

        hf_logging.disable_progress_bar()


def _to_file(logger: logging.Logger, log_dir: Path, role: str) -> None:
    """`logger`'s records (INFO and above) to this process's file only. One handler per logger:
    libraries reformat their own logger's handlers (Ray's `setup_logger`)."""
    want = str(log_dir / f"{role}-{os.getpid()}.log")
    ours = [h for h in logger.handlers if getattr(h, _MARK, None) == want]
    for handler in list(logger.handlers):
        if handler not in ours[:1]:
            logger.removeHandler(handler)
    if not ours:
        logger.addHandler(process_log_handler(str(log_dir), role))
    logger.propagate = False
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)


def _point_vllm_processes_at(log_dir: Path) -> None:
    """vLLM applies `VLLM_LOGGING_CONFIG_PATH` in every process it starts (engine core, TP
    workers): its `vllm` logger then writes to that process's own file."""
    config = {"version": 1, "disable_existing_loggers": False,
              "handlers": {"file": {"()": f"{__name__}.process_log_handler",
                                    "log_dir": str(log_dir), "role": "vllm"}},
              "loggers": {"vllm": {"handlers": ["file"], "level": "INFO",
                                   "propagate": False}}}
    path = log_dir / "vllm_logging.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # several processes may write it at once
    tmp.write_text(json.dumps(config, indent=1))
    os.replace(tmp, path)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"  # the config file needs it on


__all__ = ["LIBRARY_LOGGERS", "VERBOSE_ENV", "add_verbose_argument", "configure_process_logs",
           "process_log_handler", "reapply_process_logs", "set_verbose", "verbose"]
