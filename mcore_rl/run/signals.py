"""Stopping a run cleanly on a signal: SIGTERM (preemption, `kill`, `scancel --batch`),
SIGUSR1 (`#SBATCH --signal=B:USR1@N`, N seconds before the time limit) or SIGINT (Ctrl-C).

The handler only records the request; the RL loop asks `stop.requested` at its safe point
(between steps: a step in progress finishes), writes a checkpoint and exits with
`STOP_EXIT_CODE` = 75 (EX_TEMPFAIL, "try again": scripts/slurm/train.sbatch requeues the job
on it, and the requeued run resumes from that checkpoint by itself) — or, for Ctrl-C, with
`INTERRUPT_EXIT_CODE` = 130 (128 + SIGINT, what a shell reports for an interrupted command;
not a request to requeue). A second Ctrl-C while stopping exits at once, without a checkpoint
(exit 130), after SIGKILL to the local Ray's processes and the workers under them. If
the safe point is not reached within `grace_s` of the signal (a step wedged beyond its own
deadlines), the process exits with `STOP_TIMEOUT_EXIT_CODE` without a checkpoint rather than
hang until SIGKILL.

Ray's driver installs its own SIGTERM handler (a native crash handler that aborts, exit 134),
so `install()` must run after Ray is up; it is called again then.

Who else gets the signal: `kill PID` reaches the driver only; a terminal's Ctrl-C, like a
shell's or batch system's signal to the process group, reaches every process in the driver's
group. What that does to the local Ray's processes, and why they start with SIGTERM and SIGINT
blocked, is in mcore_rl/launch/ray_runtime.py.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from mcore_rl.launch.exit_codes import INTERRUPT_EXIT_CODE, STOP_EXIT_CODE, STOP_TIMEOUT_EXIT_CODE
from mcore_rl.launch.ray_runtime import kill_local_ray

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def stop_exit_code(signal_name: str) -> int:
    """The exit code of a run stopped by `signal_name` at a safe point: 130 for Ctrl-C
    (SIGINT), 75 ("requeue me") for SIGTERM / SIGUSR1."""
    return INTERRUPT_EXIT_CODE if signal_name == "SIGINT" else STOP_EXIT_CODE


class RunStopped(Exception):
    """The run stopped at a safe point on a signal (after its checkpoint, if one was due);
    `exit_code`: the command's (`stop_exit_code`)."""

    def __init__(self, step: int, signal_name: str, checkpoint):
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint
        self.exit_code = stop_exit_code(signal_name)
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (nothing trained)"
        super().__init__(f"stopped on {signal_name} after step {step}; {where}; exit code "
                         f"{self.exit_code} (re-run the same command to resume)")


class StopControl:
    """Records SIGTERM/SIGUSR1/SIGINT for the loop's next safe point; arms the grace deadline.
    A second SIGINT while stopping exits at once (module doc)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signal_name: str | None = None
        self.signalled_at: float | None = None
        self._previous: dict[int, object] = {}
        self._done = threading.Event()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> "StopControl":
        """(Re)install the handlers (call again after anything else installed its own)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        return self

    def restore(self) -> None:
        """Give the signals back to whoever had them; disarm the grace deadline."""
        self._done.set()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:  # Ctrl-C again: the user wants out now
            print(f"mcore-rl: SIGINT again while stopping on {self.signal_name}: exiting now "
                  f"without a checkpoint (exit code {INTERRUPT_EXIT_CODE})", file=sys.stderr,
                  flush=True)
            _exit_now(INTERRUPT_EXIT_CODE)
        if self.requested:  # e.g. scancel's SIGTERM also forwarded by the batch script
            print(f"mcore-rl: {name} again; already stopping", file=sys.stderr, flush=True)
            return
        self.signal_name, self.signalled_at = name, time.monotonic()
        again = "; Ctrl-C again exits at once without one" if signum == signal.SIGINT else ""
        print(f"mcore-rl: {name} received: stopping at the end of the current step, then "
              f"checkpoint (deadline {self.grace_s:.0f} s{again})", file=sys.stderr,
              flush=True)
        threading.Thread(target=self._deadline, name="mcore-rl-stop-deadline",
                         daemon=True).start()

    def _deadline(self) -> None:
        if self._done.wait(self.grace_s):
            return
        print(f"mcore-rl: no safe point within {self.grace_s:.0f} s of {self.signal_name}: "
              f"exiting without a checkpoint (exit code {STOP_TIMEOUT_EXIT_CODE})",
              file=sys.stderr, flush=True)
        _exit_now(STOP_TIMEOUT_EXIT_CODE)

    def seconds_since_signal(self) -> float:
        return 0.0 if self.signalled_at is None else time.monotonic() - self.signalled_at


def _exit_now(code: int) -> None:
    """Exit without cleaning up; the local Ray's processes (and the workers and engines under
    them) are killed first, which they would otherwise outlive in part."""
    try:
        kill_local_ray()
    finally:
        os._exit(code)


