"""The sandbox's runner: `python -I -S -B _sandbox_child.py STATUS_FD CPU MEMORY FILE THREADS HOOK PROBE
FILTER_HEX...`, started by `sandbox.run_python` (positional arguments, `runner_args` there).

Standard library only, and it imports nothing of ppo_jax (`-I -S` keep the package and site-packages
off `sys.path`; inside the kernel boundary they do not exist). It runs inside bwrap's namespaces
(`sandbox_boundary.py`), or directly under the trainer when the config trusts the tool's code. Before
the tool's code it:

1. sets the rlimits (CPU, address space, file size, open files, threads, no core files);
2. sets no-new-privs and installs the seccomp filters it was given (`seccomp.py`: inside bwrap the
   no-execve filter, bwrap having applied the boundary filter; trusted, both);
3. reads back what the kernel says is in place (/proc/self/status, its uid, its PID namespace's
   /proc, its network interfaces, its hostname) and writes that as one JSON line on the status pipe,
   (a Python literal) which it then closes: the trainer decides from this report, written before any untrusted code ran,
   whether the boundary holds (a missing layer stops the run), and reads nothing else from the pipe;
4. installs the audit hook where asked (a quick refusal with a readable message; no boundary: code in
   the process can undo it) and runs /sandbox/main.py (the cwd's main.py) as `__main__`.

A failure in 1-4 is reported as {"setup_error": ...} on the pipe: no user code ran. Start-up time is
most of a tool call's cost: the runner imports only ctypes and C modules (json, signal and traceback
would add 40 ms; traceback is imported when the code fails).
"""

import _signal
import ctypes
import os
import resource
import sys

MEMORY_EXIT = 99  # the runner caught MemoryError (the RLIMIT_AS cap, normally)
CPU_EXIT = 97  # the runner got SIGXCPU (the RLIMIT_CPU soft limit)
SETUP_EXIT = 98  # a layer could not be put in place; no user code ran (reported on the pipe)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
NAMESPACES = ("user", "pid", "net", "ipc", "uts", "mnt", "cgroup")  # = sandbox.py's

# Audit events the friendly hook refuses (what the seccomp filters refuse in the kernel anyway).
_REFUSED_PREFIXES = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                     "os.fork", "os.forkpty", "pty.", "ctypes.", "os.chroot")


class _SockFilterProgram(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _parse(argv):
    status_fd, cpu, memory, file_bytes, threads, hook, probe, *filters = argv
    return {"status_fd": int(status_fd), "cpu_seconds": int(cpu), "memory_bytes": int(memory),
            "file_bytes": int(file_bytes), "processes": None if threads == "-" else int(threads),
            "audit_hook": hook == "1", "probe": probe == "1", "filters": filters}


def _set_limits(config):
    """Kernel limits for the runner and whatever threads the code starts (no process can be forked)."""
    cpu = int(config["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL after
    resource.setrlimit(resource.RLIMIT_AS, (config["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (config["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    if config["processes"] is not None:  # threads: counted per user namespace, binds below root
        resource.setrlimit(resource.RLIMIT_NPROC, (config["processes"],) * 2)


def _install_filters(programs):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    for program in programs:
        code = bytes.fromhex(program)
        fprog = _SockFilterProgram(len(code) // 8, code)
        if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "installing a seccomp filter failed")


def _observed():
    """What the kernel says is in place for this process, read where the code cannot forge it yet."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    with open("/proc/net/dev") as f:
        interfaces = sorted(line.split(":")[0].strip() for line in f.readlines()[2:])
    writable_root = os.access("/", os.W_OK)
    disk = os.statvfs(".")
    return {"uid": os.getuid(), "no_new_privs": int(status.get("NoNewPrivs", "0")),
            "namespaces": {kind: os.readlink(f"/proc/self/ns/{kind}") for kind in NAMESPACES},
            "disk_bytes": disk.f_blocks * disk.f_frsize,
            "seccomp_mode": int(status.get("Seccomp", "0")),
            "seccomp_filters": int(status.get("Seccomp_filters", "-1")),
            "pids_visible": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
            "interfaces": interfaces, "hostname": os.uname().nodename, "root_writable": writable_root}


def _audit_hook(directory):
    """A hook refusing sockets, new programs, ctypes and signals to other processes with a readable
    PermissionError. Not a boundary (the kernel's layers are): it only words the refusal."""
    me = os.getpid()

    def hook(event, args):
        if event.startswith(_REFUSED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event in ("os.kill", "os.killpg", "signal.pthread_kill") and args[0] not in (me, 0):
            raise PermissionError(f"sandbox: {event} of another process is not allowed")
        if event == "open" and isinstance(args[0], (str, bytes)) and args[1] is not None and \
                any(c in args[1] for c in "wax+"):
            path = os.path.abspath(os.fsdecode(args[0]))
            if not path.startswith(directory + os.sep):
                raise PermissionError(f"sandbox: writing {path!r}: only {directory} is writable")

    sys.addaudithook(hook)


def _set_up(config, status_fd):
    _set_limits(config)
    _install_filters(config["filters"])
    if config.get("probe"):
        return None
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    report = {"ready": _observed()}
    os.write(status_fd, (repr(report) + "\n").encode())
    return source


def _run(source):
    """Runs the tool's code; never returns (os._exit)."""
    _signal.signal(_signal.SIGXCPU, lambda *_: os._exit(CPU_EXIT))
    sys.argv = ["main.py"]
    code = 0
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py",
                                                  "__builtins__": __builtins__})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except MemoryError:
        code = MEMORY_EXIT
        os.write(2, b"MemoryError: the sandbox's memory limit\n")
    except BaseException as e:
        import traceback  # only now: its imports cost 20 ms a call

        # From the user's first frame on: the runner's frames are noise to the policy.
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code)


def main():
    config = _parse(sys.argv[1:])
    status_fd = config["status_fd"]
    try:
        source = _set_up(config, status_fd)
    except BaseException as e:  # fail closed: no user code runs
        if status_fd >= 0:
            os.write(status_fd, (repr({"setup_error": repr(e)}) + "\n").encode())
        os._exit(SETUP_EXIT)
    if config.get("probe"):
        print("probe ok", flush=True)
        os._exit(0)
    os.closerange(3, 1 << 16)  # the status pipe and whatever bwrap passed: the code gets 0, 1, 2 only
    if config["audit_hook"]:
        _audit_hook(os.getcwd())
    _run(source)


if __name__ == "__main__":
    main()
