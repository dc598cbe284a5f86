"""A test whose xdist worker dies (a segfault) is run once more, alone, in a fresh process; it fails
only if it fails there too.

Why: jaxlib 0.10.2 segfaults now and then inside its persistent compilation cache
(`executable.serialize()` writing an entry, or the read of one), in a different test each time and
in neither when that test runs again (docs/benchmarks.md, "A crash to know about"). Such a crash is
jaxlib's, not the test's, yet it failed whole runs of 1,596 tests. A test that crashes or fails
again alone is a real failure and is reported with the rerun's output; every rerun is listed at the
end of the run, so a crash is never silent.

Controller-side xdist hooks, registered by conftest importing them. The scheduler in conftest marks
the crashed test done, so xdist itself never runs it again (its own re-queueing hung the run).
"""

import os
import re
import subprocess
import sys

import pytest

RERUN_TIMEOUT_S = 1800  # one test alone, compiling from a warm cache; a hung rerun must still end
CRASH_RERUNS: list[tuple[str, str]] = []  # (test id, outcome of the rerun), for the run's summary


def rerun_alone(nodeid: str, rootdir: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`nodeid` run by a fresh `python -m pytest` in `rootdir`, its output captured."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid]
    try:
        return subprocess.run(command, cwd=rootdir, env=env, capture_output=True, text=True,
                              timeout=RERUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")  # bytes despite text=True
        return subprocess.CompletedProcess(command, returncode=-1,
                                           stdout=output + f"\n(rerun timed out after {RERUN_TIMEOUT_S} s)", stderr="")


def rerun_environment() -> dict[str, str]:
    """The controller's environment without its device count: the rerun's conftest sets its own."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"\s*--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    return env


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """xdist's report of the crash says "failed"; it becomes the rerun's outcome before it is logged."""
    rootdir = str(sched.config.rootpath)
    result = rerun_alone(crashitem, rootdir, rerun_environment())
    if result.returncode == 0:
        report.outcome = "passed"
        report.when = "call"
        report.longrepr = None
        CRASH_RERUNS.append((crashitem, "passed when rerun alone"))
    else:
        report.longrepr = (f"{report.longrepr}\n\nand, rerun alone in a fresh process, it failed again "
                           f"(exit {result.returncode}):\n{(result.stdout + result.stderr)[-8000:]}")
        CRASH_RERUNS.append((crashitem, f"failed again alone (exit {result.returncode})"))


def pytest_terminal_summary(terminalreporter):
    if not CRASH_RERUNS:
        return
    terminalreporter.write_sep("=", f"{len(CRASH_RERUNS)} test(s) crashed their worker and were rerun alone",
                               yellow=True)
    for nodeid, outcome in CRASH_RERUNS:
        terminalreporter.write_line(f"{nodeid}: {outcome}")
