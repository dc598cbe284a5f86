"""Run untrusted Python code (a tool call's) behind a kernel boundary and say how it ended.

    result = run_python("print(2 ** 100)", Limits(wall_seconds=5))
    result.status, result.stdout      # ("ok", "1267650600228229401496703205376\\n")

The boundary is the kernel's (docs/agentic.md has the threat model, each line with what enforces it):

- `sandbox_boundary.py`: each run in a fresh bwrap sandbox: new user, PID, network, IPC, UTS, cgroup
  and mount namespaces, a read-only root holding only the interpreter and its standard library, a
  fresh /proc, a tmpfs of `disk_bytes` at /sandbox as the only writable place (the code is
  /sandbox/main.py, copied in from a memfd), no-new-privs, `--die-with-parent`, `--new-session`;
- `seccomp.py`: no sockets, ptrace, mounts, namespaces, keyrings, BPF, io_uring, SysV IPC, forks
  (threads only) or execve;
- the runner (`_sandbox_child.py`): rlimits (CPU, address space, file size, open files, threads);
  before the code starts it reports what the kernel says is in place, and a run whose report lacks a
  layer stops with SandboxSetupError before any code ran (fail closed);
- the trainer's side (this module): a wall-clock deadline and a cap on the bytes read from stdout and
  stderr, then SIGKILL; the runner is PID 1 of the run's PID namespace, so everything the code
  started dies with it.

Where the boundary cannot be set up (no bwrap, no user namespaces), `run_python` raises
SandboxSetupError naming what is missing, unless `Limits.trusted_code` says the code is trusted: then
it runs as the trainer's user with the rlimits and the seccomp filters only, and says so (a warning
once per process, and `"trusted_code"` in `SandboxResult.layers`). An audit hook words refusals
readably (`Limits.audit_hook`); it is no boundary. A limit that hits is a result, not an exception:
the run goes on and the observation says what happened.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time

from ppo_jax.agentic import sandbox_boundary, seccomp

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
# = _sandbox_child's (that script is not importable by design). Code may exit with these itself: it
# only mislabels its own ending.
MEMORY_EXIT, CPU_EXIT = 99, 97
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
# Both launches put two filters on the runner: the boundary filter (bwrap's, or the runner's when
# trusted) and the no-execve filter.
SECCOMP_FILTERS = 2
_log = logging.getLogger(__name__)


class SandboxSetupError(RuntimeError):
    """The sandbox could not be put in place on this host (no bwrap, no user namespaces, a layer the
    kernel did not confirm). A problem of the host, not of the code: no code ran, and the run should
    stop rather than feed the policy an observation."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one run may use. The defaults suit a calculator-sized tool call; tests use tighter ones."""

    wall_seconds: float = 10.0  # deadline from start to kill, on the trainer's clock
    cpu_seconds: int = 5  # RLIMIT_CPU (SIGXCPU, then SIGKILL a second later)
    memory_bytes: int = 512 << 20  # RLIMIT_AS: the run's one process (no fork), threads included
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: the largest file the code may write
    disk_bytes: int = 64 << 20  # all its files together: the size of its /sandbox tmpfs
    output_bytes: int = 64 << 10  # stdout + stderr read before the run is killed
    processes: int | None = 8  # RLIMIT_NPROC: threads of the run (binds where the trainer is not root)
    audit_hook: bool = True  # a readable refusal for sockets, ctypes, exec, writes outside; not a boundary
    # The code is trusted: where the kernel boundary cannot be set up, run it anyway as the trainer's
    # user with the rlimits and seccomp filters only (said in a warning and in SandboxResult.layers).
    trusted_code: bool = False

    def __post_init__(self):
        if self.wall_seconds <= 0 or self.cpu_seconds < 1:
            raise ValueError(f"sandbox limits: wall_seconds={self.wall_seconds} must be > 0 and "
                             f"cpu_seconds={self.cpu_seconds} >= 1")
        if min(self.memory_bytes, self.file_bytes, self.disk_bytes, self.output_bytes) <= 0:
            raise ValueError("sandbox limits: memory_bytes, file_bytes, disk_bytes and output_bytes must be > 0")
        if self.processes is not None and self.processes < 1:
            raise ValueError(f"sandbox limits: processes={self.processes} must be >= 1 (or None)")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """How one run ended. `status` is one of STATUSES; `exit_code` is None when a signal ended it
    (then `signal` names it); `layers` are the isolation layers that were in place (docs/agentic.md)."""

    status: str
    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    wall_seconds: float
    cpu_seconds: float  # the code's CPU time (its threads included; 0 when the trainer killed it)
    limit: str | None  # the Limits field that stopped it (e.g. "cpu_seconds"), None when none did
    layers: tuple[str, ...]

    def observation(self, max_chars: int = 2000) -> str:
        """The text a policy sees: stdout when it worked, else what went wrong, both cut to `max_chars`."""
        if self.status == "ok":  # "(no output)" rather than nothing: the policy should learn to print
            return _cut(self.stdout, max_chars) if self.stdout else "(no output)"
        what = {"error": f"error (exit code {self.exit_code})",
                "timeout": (f"stopped: CPU time limit ({self.cpu_seconds:.1f} s)" if self.limit == "cpu_seconds" else
                            f"stopped: time limit ({self.wall_seconds:.1f} s)"),
                "memory": "stopped: memory limit reached",
                "output_limit": "stopped: output limit reached",
                "killed": f"killed (signal {self.signal})"}[self.status]
        tail = (self.stderr.strip() or self.stdout.strip())
        return _cut(f"{what}\n{tail}" if tail else what, max_chars)


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 15] + "\n...[truncated]"


@dataclasses.dataclass
class _Launch:
    """One run's command and the descriptors it inherits (closed here once it started)."""

    argv: list[str]
    cwd: str | None
    pass_fds: tuple[int, ...]
    boundary: bool  # under bwrap (else trusted: the runner straight under the trainer)


def runner_args(limits: Limits, status_fd: int, filters: list[bytes], probe: bool = False) -> list[str]:
    """The runner's positional arguments (`_sandbox_child._parse`)."""
    threads = "-" if limits.processes is None else str(limits.processes)
    return [str(status_fd), str(limits.cpu_seconds), str(limits.memory_bytes), str(limits.file_bytes), threads,
            str(int(limits.audit_hook)), str(int(probe)), *(f.hex() for f in filters)]


def _boundary_launch(boundary, code: str, limits: Limits, status_fd: int) -> _Launch:
    code_fd = os.memfd_create("sandbox_main_py")
    os.write(code_fd, code.encode("utf-8", "surrogateescape"))
    os.lseek(code_fd, 0, os.SEEK_SET)
    seccomp_r, seccomp_w = os.pipe()
    os.write(seccomp_w, seccomp.boundary_filter())  # a few hundred bytes: never blocks on the pipe
    os.close(seccomp_w)
    argv = boundary.command(disk_bytes=limits.disk_bytes, code_fd=code_fd, seccomp_fd=seccomp_r,
                            runner_args=runner_args(limits, status_fd, [seccomp.no_new_programs_filter()]))
    return _Launch(argv, None, (code_fd, seccomp_r, status_fd), boundary=True)


_warned_trusted = False


def _trusted_launch(why: str, code: str, limits: Limits, status_fd: int, directory: str) -> _Launch:
    global _warned_trusted
    if not _warned_trusted:
        _warned_trusted = True
        _log.warning("tool code runs WITHOUT the sandbox's kernel boundary (Limits.trusted_code / "
                     "environment.trusted_tool_code): %s", why)
    with open(os.path.join(directory, "main.py"), "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(code)
    filters = [seccomp.boundary_filter(), seccomp.no_new_programs_filter()]
    argv = [os.path.realpath(sys.executable), "-I", "-S", "-B", _RUNNER, *runner_args(limits, status_fd, filters)]
    return _Launch(argv, directory, (status_fd,), boundary=False)


def _launch(code: str, limits: Limits, status_fd: int, directory: str) -> _Launch:
    try:
        boundary = sandbox_boundary.kernel_boundary()
    except (sandbox_boundary.KernelBoundaryMissing, seccomp.UnsupportedArchitecture) as e:
        if not limits.trusted_code:
            raise SandboxSetupError(str(e)) from None
        return _trusted_launch(str(e), code, limits, status_fd, directory)
    return _boundary_launch(boundary, code, limits, status_fd)


def run_python(code: str, limits: Limits = Limits()) -> SandboxResult:
    """Runs `code` under `limits` (see the module docstring) and returns how it ended. Thread-safe:
    many runs may go on at once from a thread pool (each one is its own sandbox). Raises only
    SandboxSetupError (before any code ran); whatever the code does is the result."""
    start = time.monotonic()
    status_r, status_w = os.pipe()
    os.set_blocking(status_r, False)
    with tempfile.TemporaryDirectory(prefix="ppo_jax_sandbox_") as directory:  # used when trusted only
        launch = _launch(code, limits, status_w, directory)
        try:
            # start_new_session: bwrap (or the trusted runner) leads a process group signalled as one;
            # stdin is closed; the environment is bwrap's --clearenv (trusted: this minimal one).
            proc = subprocess.Popen(launch.argv, cwd=launch.cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=launch.pass_fds, start_new_session=True,
                                    env={"PATH": "/nonexistent", "LANG": "C.UTF-8", "HOME": directory,
                                         "TMPDIR": directory})
        finally:
            for fd in launch.pass_fds:
                os.close(fd)
        try:
            stopped, out, err, ending = _watch(proc, start + limits.wall_seconds, limits.output_bytes, launch.boundary)
            report = _first_report(status_r)
        finally:
            os.close(status_r)
    layers = _confirmed_layers(report, launch.boundary, SECCOMP_FILTERS, limits, stopped, err)
    return _result(stopped, ending, out, err, time.monotonic() - start, limits.cpu_seconds, layers)


def _first_report(fd: int) -> dict:
    """The runner's one line (a Python literal), written before the code ran; anything after it (code that found a
    copy of the pipe) is ignored, and so is a first line that is not the runner's JSON."""
    data = b""
    while b"\n" not in data:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    try:
        report = ast.literal_eval(data.split(b"\n", 1)[0].decode("utf-8", "replace"))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return {}
    return report if isinstance(report, dict) else {}


@functools.lru_cache(maxsize=1)
def _own_namespaces() -> dict[str, str]:
    """The trainer's namespaces (read once: a process does not change its own here)."""
    return {kind: os.readlink(f"/proc/self/ns/{kind}") for kind in ("user", "pid", "net", "ipc", "uts", "mnt",
                                                                      "cgroup")}


def _confirmed_layers(report: dict, boundary: bool, filters: int, limits: Limits, stopped: str | None,
                      err: bytes) -> tuple[str, ...]:
    """The layers the runner saw in place, or SandboxSetupError when one the launch asked for is missing
    or the runner could not set up (no code ran then). A run the trainer stopped before the report
    (the wall clock on a stalled machine) is a result, not a set-up error."""
    if "setup_error" in report:
        raise SandboxSetupError(f"the sandbox could not be set up: {report['setup_error']}")
    seen = report.get("ready")
    if seen is None:
        if stopped is not None:
            return ()
        last = (err.decode("utf-8", "replace").strip().splitlines() or ["no report"])[-1]
        raise SandboxSetupError(f"the sandbox could not be set up: {last}")
    layers = ["rlimits"]
    if seen["no_new_privs"] == 1 and seen["seccomp_mode"] == 2 and seen["seccomp_filters"] in (-1, filters):
        layers.append("seccomp")
    if boundary:
        own = _own_namespaces()
        checks = {f"{kind}_namespace": seen["namespaces"].get(kind) not in (None, own[kind]) for kind in own}
        checks.update({
            "unprivileged_uid": seen["uid"] == sandbox_boundary.SANDBOX_UID,
            "fresh_proc": seen["pids_visible"] == [1],  # the runner alone, PID 1 of its namespace
            "no_network": seen["interfaces"] in ([], ["lo"]),
            "read_only_root": not seen["root_writable"],
            "disk_quota": 0 < seen["disk_bytes"] <= limits.disk_bytes,
            "seccomp": "seccomp" in layers})
        missing = [name for name, held in checks.items() if not held]
        if missing:
            raise SandboxSetupError(f"the sandbox's kernel boundary did not hold: {missing} missing (the runner "
                                    f"saw {seen})")
        layers = ["rlimits", *checks]
    else:
        layers.append("trusted_code")
    if limits.audit_hook:
        layers.append("audit_hook")
    return tuple(layers)


@dataclasses.dataclass(frozen=True)
class _Ending:
    """How the launched process ended: its exit code or signal, and the CPU time of it and every
    descendant it reaped (bwrap reaps the runner, so the code's CPU time is in it)."""

    exit_code: int | None
    signal: int | None
    cpu_seconds: float


def _reap(proc: subprocess.Popen, boundary: bool) -> _Ending:
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = status  # reaped here: Popen must not wait for it again
    cpu = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(status):
        return _Ending(None, os.WTERMSIG(status), cpu)
    code = os.WEXITSTATUS(status)
    if boundary and code > 128 and code - 128 in signal.valid_signals():
        return _Ending(None, code - 128, cpu)  # bwrap exits 128 + n when a signal n ended the runner
    return _Ending(code, None, cpu)


def _watch(proc: subprocess.Popen, deadline: float, cap: int,
           boundary: bool) -> tuple[str | None, bytes, bytes, _Ending]:
    """Reads stdout and stderr until the code has exited and both pipes closed, the deadline passes or
    `cap` bytes came; then kills the process group. Returns (why the trainer stopped it: "timeout" /
    "output_limit" / None, stdout, stderr, the ending). Holds at most `cap` bytes, whatever the code
    prints. The exit is seen through a pidfd in the same select (no polling: a call costs ~40 ms, and
    a 10 ms poll was a quarter of it); kernels before 5.3 poll every 10 ms instead."""
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    selector = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    try:
        exit_fd = os.pidfd_open(proc.pid)
        selector.register(exit_fd, selectors.EVENT_READ)
    except (AttributeError, OSError):
        exit_fd = None
    stopped, exited = None, False
    try:
        # Closed pipes are not the end: code may close its stdout and go on running.
        while stopped is None and not (exited and not set(selector.get_map()) & set(buffers)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stopped = "timeout"
                break
            for key, _ in selector.select(min(remaining, 0.1 if exit_fd is not None else 0.01)):
                if key.fd == exit_fd:
                    selector.unregister(exit_fd)
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                room = cap - sum(map(len, buffers.values()))
                buffers[key.fd] += chunk[:room]
                if len(chunk) > room:
                    stopped = "output_limit"
                    break
            if not exited and _has_exited(proc):
                # Nothing the code started may outlive it (a daemon holding the pipes open would keep
                # this loop waiting): the group goes now, the pipes then drain to EOF.
                exited = True
                _kill_group(proc)
    finally:
        selector.close()
        if exit_fd is not None:
            os.close(exit_fd)
        _kill_group(proc)
        ending = _reap(proc, boundary)
        proc.stdout.close()
        proc.stderr.close()
    return stopped, bytes(buffers[out_fd]), bytes(buffers[err_fd]), ending


def _has_exited(proc: subprocess.Popen) -> bool:
    """Whether the supervisor has exited, without reaping it: while it is unreaped its PID (= the
    process group's id) cannot be reused, so the group kill cannot hit a stranger."""
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return info is not None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _result(stopped: str | None, ending: _Ending, out: bytes, err: bytes, wall: float, cpu_limit: int,
            layers: tuple[str, ...]) -> SandboxResult:
    """The status from who stopped the run: the trainer (wall clock, output cap), the kernel (the CPU
    limit: SIGXCPU or the hard limit's SIGKILL once the CPU time is spent; the memory limit: a
    MemoryError), a signal from elsewhere (killed), or the code itself (ok, error)."""
    exit_code, sig, cpu = ending.exit_code, ending.signal, ending.cpu_seconds
    limit = None
    if stopped is not None:
        status, limit = stopped, {"timeout": "wall_seconds", "output_limit": "output_bytes"}[stopped]
    elif sig == signal.SIGXCPU or exit_code == CPU_EXIT or (exit_code != 0 and cpu >= cpu_limit):
        status, limit = "timeout", "cpu_seconds"
    elif exit_code == MEMORY_EXIT or (exit_code is not None and exit_code != 0 and
                                      err.rstrip().endswith(b"MemoryError")):
        status, limit = "memory", "memory_bytes"
    elif sig is not None:
        status = "killed"
    else:
        status = "ok" if exit_code == 0 else "error"
    return SandboxResult(status=status, stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
                         exit_code=exit_code, signal=sig, wall_seconds=wall, cpu_seconds=cpu, limit=limit,
                         layers=layers)
