"""How a PPO run ends other than by finishing: each is an exception the command line turns into one
line and its exit status."""

from __future__ import annotations

import signal

# The shells' convention, 128 + the signal's number, so a wrapper tells an interrupted run from a
# finished one. A TPU preemption notice is the platform terminating the VM: SIGTERM's status.
STOP_EXIT_STATUS = {"SIGINT": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}
PREEMPTION_NOTICE = "a TPU preemption notice"


class NonFiniteError(RuntimeError):
    """Too many consecutive updates were skipped for non-finite losses, gradients or rewards."""


class RunFailedError(RuntimeError):
    """An exception stopped the loop; the last good state was saved first (the cause is chained
    and its traceback written to `<workdir>/error.log`)."""


class RunStopped(Exception):
    """SIGINT, SIGTERM or a TPU preemption notice stopped the run after a save; the same command
    resumes it. `exit_status`: 130 (SIGINT) or 143 (SIGTERM, preemption)."""

    def __init__(self, reason: str):
        super().__init__(f"stopped by {reason}")
        self.reason = reason
        self.exit_status = STOP_EXIT_STATUS.get(reason, STOP_EXIT_STATUS["SIGTERM"])
