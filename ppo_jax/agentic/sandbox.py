"""Run untrusted Python code (a tool call's) in a separate, limited process and say how it ended.

    result = run_python("print(2 ** 100)", Limits(wall_seconds=5))
    result.status, result.stdout      # ("ok", "1267650600228229401496703205376\\n")

The code runs as `main.py` in a fresh private temporary directory (its cwd, HOME and TMPDIR, its only
writable place), removed afterwards. The layers, outermost first (docs/agentic.md says which holds
where; `SandboxResult.layers` says which were in place for a run):

- the trainer's side (this module): a wall-clock deadline, a cap on the bytes read from stdout and
  stderr together, and on any limit SIGKILL to the whole process group (a new session), after which
  nothing the code started is left: the code's processes are the session, and with the PID namespace
  the kernel kills everything in it when its first process dies;
- the kernel (`_sandbox_child.py`): RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE, no core
  files; a new network namespace (no interfaces but a down loopback) and PID namespace where the
  kernel permits unsharing them, and a mount namespace in which the directory is a tmpfs of
  `disk_bytes` (all files together); when the trainer runs as root, the code runs as `nobody` (file
  permissions then guard the host's files, other users' processes cannot be signalled, and
  RLIMIT_NPROC, which does not bind root, caps its processes);
- an audit hook (`sys.addaudithook`) in the code's interpreter: no sockets, processes, ctypes or
  signals to other processes, no writes outside its directory, no reads outside it and the Python
  installation. A hook is not a security boundary against determined code; the kernel layers are.

The code never runs as the trainer's child: a supervisor process sits between them, so killing the
parent kills only the supervisor. A limit that hits is a result, not an exception: the run goes on
and the observation says what happened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
# = _sandbox_child's (that script is not importable by design). Code may exit with these itself: it
# only mislabels its own ending.
MEMORY_EXIT, CPU_EXIT = 99, 97
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")


class SandboxSetupError(RuntimeError):
    """The sandbox could not be put in place on this host (e.g. root without the right to change user:
    set `Limits.drop_privileges=False` to run as the trainer's user). A problem of the host, not of the
    code: no code ran, and the run should stop rather than feed the policy an observation."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one run may use. The defaults suit a calculator-sized tool call; tests use tighter ones."""

    wall_seconds: float = 10.0  # deadline from start to kill, on the trainer's clock
    cpu_seconds: int = 5  # RLIMIT_CPU per process (SIGXCPU, then SIGKILL a second later)
    memory_bytes: int = 512 << 20  # RLIMIT_AS per process (address space, so above the data size)
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: the largest file the code may write
    disk_bytes: int = 64 << 20  # all its files together (a tmpfs), where a mount namespace is permitted
    output_bytes: int = 64 << 10  # stdout + stderr read before the run is killed
    processes: int | None = 8  # RLIMIT_NPROC headroom (binds only an unprivileged user); None = none
    # The layers, each switchable so the tests can show that each one holds on its own.
    isolate_network: bool = True  # new network namespace where the kernel permits it
    isolate_pids: bool = True  # new PID namespace where the kernel permits it
    private_disk: bool = True  # the directory as a tmpfs of disk_bytes in a new mount namespace
    drop_privileges: bool = True  # when running as root, run the code as `nobody`
    audit_hook: bool = True

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
    cpu_seconds: float  # the code's first process's CPU time (0 when it was killed from outside)
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


def _unprivileged_ids() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def run_python(code: str, limits: Limits = Limits()) -> SandboxResult:
    """Runs `code` under `limits` (see the module docstring) and returns how it ended. Thread-safe:
    many runs may go on at once from a thread pool (each one is its own processes). Raises only
    SandboxSetupError (before any code ran); whatever the code does is the result."""
    start = time.monotonic()
    directory = tempfile.mkdtemp(prefix="ppo_jax_sandbox_")
    status_r = status_w = -1
    try:
        with open(os.path.join(directory, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        drop_to = _unprivileged_ids() if limits.drop_privileges and os.geteuid() == 0 else None
        if drop_to is not None:
            try:
                for path in (directory, os.path.join(directory, "main.py")):
                    os.chown(path, *drop_to)
            except PermissionError as e:  # root without CAP_CHOWN (a restricted container)
                raise SandboxSetupError(f"the sandbox could not be set up: {e!r}; Limits(drop_privileges="
                                        "False) runs the code as this user") from None
        status_r, status_w = os.pipe()
        # trainer_pid: which process started a sandbox, for `ps` (and for the tests to find their own).
        config = {"trainer_pid": os.getpid(), "directory": directory, "status_fd": status_w, "drop_to": drop_to,
                  "cpu_seconds": limits.cpu_seconds, "memory_bytes": limits.memory_bytes,
                  "file_bytes": limits.file_bytes, "processes": limits.processes,
                  "isolate_network": limits.isolate_network, "isolate_pids": limits.isolate_pids,
                  "private_disk": limits.private_disk, "disk_bytes": limits.disk_bytes,
                  "audit_hook": limits.audit_hook}
        env = {"PATH": "/usr/bin:/bin", "HOME": directory, "TMPDIR": directory, "LANG": "C.UTF-8"}
        # start_new_session: the code's processes form their own group, signalled as one; stdin is
        # closed; no descriptor of the trainer's but the status pipe is inherited.
        proc = subprocess.Popen([sys.executable, "-I", _CHILD, json.dumps(config)], cwd=directory, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(status_w,), start_new_session=True)
        os.close(status_w)
        status_w = -1
        stopped, out, err = _watch(proc, start + limits.wall_seconds, limits.output_bytes)
        report = _read_report(status_r)
        if "setup_error" in report:
            raise SandboxSetupError(f"the sandbox could not be set up: {report['setup_error']} (as root, the code "
                                    "runs as 'nobody'; Limits(drop_privileges=False) runs it as this user)")
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(directory, ignore_errors=True)
    return _result(stopped, report, out, err, time.monotonic() - start, limits.cpu_seconds)


def _watch(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[str | None, bytes, bytes]:
    """Reads stdout and stderr until the code has exited and both pipes closed, the deadline passes or
    `cap` bytes came; then kills the process group. Returns (why the trainer stopped it: "timeout" /
    "output_limit" / None, stdout, stderr). Holds at most `cap` bytes, whatever the code prints."""
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    selector = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    stopped, exited = None, False
    try:
        # Closed pipes are not the end: code may close its stdout and go on running.
        while stopped is None and not (exited and not selector.get_map()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stopped = "timeout"
                break
            if not selector.get_map():
                time.sleep(min(remaining, 0.01))
            for key, _ in selector.select(min(remaining, 0.1)) if selector.get_map() else ():
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
        _kill_group(proc)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return stopped, bytes(buffers[out_fd]), bytes(buffers[err_fd])


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


def _read_report(fd: int) -> dict:
    """The supervisor's JSON lines merged: {"layers": [...]} before the code starts, then
    {"exit_code", "signal"} when it ended (missing when the supervisor was killed first)."""
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    report = {}
    for line in data.decode(errors="replace").splitlines():
        try:
            report.update(json.loads(line))
        except ValueError:
            pass
    return report


def _result(stopped: str | None, report: dict, out: bytes, err: bytes, wall: float,
            cpu_limit: int) -> SandboxResult:
    """The status from who stopped the run: the trainer (wall clock, output cap), the kernel (the CPU
    limit: SIGXCPU or the hard limit's SIGKILL once the CPU time is spent; the memory limit: a
    MemoryError), a signal from elsewhere (killed), or the code itself (ok, error)."""
    exit_code, sig, cpu = report.get("exit_code"), report.get("signal"), report.get("cpu_seconds", 0.0)
    limit = None
    if stopped is not None:
        status, limit = stopped, {"timeout": "wall_seconds", "output_limit": "output_bytes"}[stopped]
    elif "exit_code" not in report:
        status, sig = "killed", signal.SIGKILL  # the supervisor died before reporting: killed from inside
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
                         layers=tuple(report.get("layers", ())))
