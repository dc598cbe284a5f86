"""A test that kills its xdist worker is rerun alone in a fresh process: a crash that does not come
back passes (and is listed), one that comes back fails with the rerun's output (tests/worker_crashes.py)."""

import os

pytest_plugins = ["pytester"]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

CRASHING_TESTS = """
import os
import signal

def _crash():
    os.kill(os.getpid(), signal.SIGSEGV)

def test_crashes_only_the_first_time():
    marker = os.path.join(os.path.dirname(__file__), "crashed_once")
    if not os.path.exists(marker):
        open(marker, "w").close()
        _crash()

def test_crashes_every_time():
    _crash()

def test_plain():
    assert True
"""


def test_a_crash_that_does_not_come_back_passes_and_one_that_does_fails(pytester, monkeypatch):
    pytester.makeconftest("from worker_crashes import pytest_handlecrashitem, pytest_terminal_summary\n")
    pytester.makepyfile(test_crashing=CRASHING_TESTS)
    env_path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv("PYTHONPATH", env_path)  # the inner run's conftest imports worker_crashes

    result = pytester.runpytest_subprocess("-n", "1", "-p", "no:cacheprovider", "-rf")

    result.assert_outcomes(passed=2, failed=1)
    output = result.stdout.str()
    assert "2 test(s) crashed their worker and were rerun alone" in output
    assert "test_crashing.py::test_crashes_only_the_first_time: passed when rerun alone" in output
    assert "test_crashing.py::test_crashes_every_time: failed again alone (exit -11)" in output
    assert "FAILED test_crashing.py::test_crashes_every_time" in output
