"""The sandbox's child side: `python -I _sandbox_child.py CONFIG_JSON`, started by `sandbox.run_python`.

Standard library only, and it imports nothing of ppo_jax (`-I` keeps the package off `sys.path`).
Two processes, so the untrusted code is never the trainer's direct child:

    supervisor (this script's process: the trainer's child, leader of a new session)
      limits (rlimits), unshares a network, a PID and a mount namespace (a size-capped tmpfs over the
      sandbox directory) where the kernel permits, forks, waits,
      and writes two JSON lines to the status pipe: the layers it put in place, and how the code ended.
    └── runner (PID 1 of the new PID namespace, when there is one)
          drops to an unprivileged user (when started as root), caps the processes of that user,
          installs the audit hook, runs `main.py` from the sandbox directory.

Every step before the user's code fails closed: a requested privilege drop that does not work ends
the run before any user code runs, reported as {"setup_error": ...} on the status pipe.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import traceback

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
MEMORY_EXIT = 99  # the runner caught MemoryError (the RLIMIT_AS cap, normally)
CPU_EXIT = 97  # the runner got SIGXCPU (the RLIMIT_CPU soft limit)
SETUP_EXIT = 98  # a sandbox layer could not be put in place; no user code ran (reported on the pipe)

# The Python installation may not be readable by the unprivileged user (e.g. a pyenv under /root, mode
# 0700), so the modules a tool call usually wants are imported while still privileged. Anything else
# imports if the installation is world-readable, else fails with a PermissionError the code sees.
PRELOADED_MODULES = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections",
                     "re", "json", "statistics", "random", "string", "datetime", "heapq", "bisect",
                     "operator", "textwrap", "typing", "dataclasses", "numbers", "copy", "io", "time", "socket",
                     "signal", "select", "errno", "pathlib", "shutil", "tempfile", "struct",
                     "hashlib", "base64", "array", "traceback")

# Audit events refused outright: no sockets (the kernel layer is the network namespace), no new
# programs or processes, no foreign code through ctypes (which could undo the hook).
_REFUSED_PREFIXES = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                     "os.fork", "os.forkpty", "pty.", "ctypes.", "os.chroot",
                     # gc's object walks would reach the hook's closure and let code rewrite its roots.
                     "gc.get_objects", "gc.get_referrers", "gc.get_referents")
# Modules whose functions raise no audit event for what they do: `_posixsubprocess.fork_exec` starts
# programs (subprocess and multiprocessing use it), so it may not even be imported (never preloaded).
_REFUSED_IMPORTS = {"_posixsubprocess", "_xxsubinterpreters", "_testcapi", "_testinternalcapi"}
_PATH_EVENTS = {"os.listdir": 0, "os.scandir": 0, "os.remove": 0, "os.rmdir": 0, "os.mkdir": 0,
                "os.chmod": 0, "os.chown": 0, "os.truncate": 0, "os.utime": 0, "os.rename": (0, 1),
                "os.link": (0, 1), "os.symlink": (0, 1), "shutil.rmtree": 0, "os.chdir": 0}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _set_limits(config):
    """Kernel limits inherited by every process the code starts (CPU and memory are per process)."""
    cpu = int(config["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL after
    resource.setrlimit(resource.RLIMIT_AS, (config["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (config["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


def _unshare(flag):
    """True when the kernel gave this process a new namespace of `flag`'s kind (needs root or user
    namespaces; refused in many containers, in which case the run goes on without that layer)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(flag) == 0


def _private_disk(config):
    """Mounts a tmpfs of `disk_bytes` over the sandbox directory in a new mount namespace, so all the
    code's files together are capped by the kernel (RLIMIT_FSIZE caps one file) and vanish with it.
    The trainer's view of the directory is untouched. False when the kernel refuses (not root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return False
    # Mount events must not travel back to the host's namespace.
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    directory = config["directory"]
    with open(os.path.join(directory, "main.py"), "rb") as f:
        source = f.read()
    uid, gid = config["drop_to"] if config["drop_to"] is not None else (os.getuid(), os.getgid())
    options = f"size={config['disk_bytes']},mode=0700,uid={uid},gid={gid}".encode()
    if libc.mount(b"tmpfs", directory.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
        return False
    with open(os.path.join(directory, "main.py"), "wb") as f:
        f.write(source)
    os.chown(os.path.join(directory, "main.py"), uid, gid)
    return True


def _threads_of(uid):
    """Threads of every process of `uid`: what RLIMIT_NPROC counts, host-wide."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # gone meanwhile
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            total += int(fields.get("Threads", "1"))
    return total


def _cap_processes(extra):
    """RLIMIT_NPROC counts all of the real user's threads, not the sandbox's: the cap is what the user
    has now plus `extra` (the runner itself is already counted)."""
    limit = _threads_of(os.getuid()) + extra - 1
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))


def _audit_hook(directory, readable):
    """A hook refusing sockets, new processes, ctypes, signals to other processes, writes outside
    `directory` and reads outside it and the Python installation (`readable`). Symlinks resolve first."""
    directory = os.path.realpath(directory)
    me = os.getpid()

    def inside(path, roots):
        if isinstance(path, int):
            return True  # an already open descriptor: its opening was checked
        path = os.path.realpath(os.fsdecode(path))
        return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)

    def hook(event, args):
        if event.startswith(_REFUSED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in _REFUSED_IMPORTS:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event in ("os.kill", "os.killpg", "signal.pthread_kill") and args[0] not in (me, 0):
            raise PermissionError(f"sandbox: {event} of another process is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and bool((flags or 0) & _WRITE_FLAGS))
            roots = (directory,) if writes else (directory, *readable)
            if path is not None and not inside(path, roots):
                raise PermissionError(f"sandbox: opening {path!r} outside the sandbox directory")
        elif event in _PATH_EVENTS:
            index = _PATH_EVENTS[event]
            for i in (index if isinstance(index, tuple) else (index,)):
                roots = (directory, *readable) if event in ("os.listdir", "os.scandir") else (directory,)
                if i < len(args) and args[i] is not None and not inside(args[i], roots):
                    raise PermissionError(f"sandbox: {event} outside the sandbox directory")

    sys.addaudithook(hook)


def _run(config, status_fd):
    """The runner: never returns (os._exit), so nothing of the supervisor's code runs after it. It
    holds the status pipe until its set-up is done, to report a failed set-up where the user's code
    cannot forge the report: the pipe is closed before that code runs."""
    try:
        for name in PRELOADED_MODULES:
            __import__(name)
        if config["drop_to"] is not None:
            uid, gid = config["drop_to"]
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            if os.getuid() != uid or os.geteuid() != uid:
                raise OSError("the privilege drop did not hold")
        if config["processes"] is not None:
            _cap_processes(config["processes"])
        directory = config["directory"]
        os.chdir(directory)
        with open("main.py", encoding="utf-8") as f:
            source = f.read()
        if config["audit_hook"]:
            readable = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                      sys.base_exec_prefix)} | {"/dev/null", "/dev/urandom"}
            _audit_hook(directory, tuple(readable))
    except BaseException as e:  # fail closed
        os.write(status_fd, (json.dumps({"setup_error": repr(e)}) + "\n").encode())
        os._exit(SETUP_EXIT)
    os.close(status_fd)
    # As a PID namespace's first process the runner ignores signals it has no handler for, SIGXCPU
    # included: without this the CPU limit would act only at the hard limit, a second later.
    signal.signal(signal.SIGXCPU, lambda *_: os._exit(CPU_EXIT))
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
        # From the user's first frame on: this script's frames are noise to the policy.
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code)


def main():
    config = json.loads(sys.argv[1])
    status_fd = config["status_fd"]
    _set_limits(config)
    layers = ["rlimits"]
    if config["isolate_network"] and _unshare(CLONE_NEWNET):
        layers.append("network_namespace")
    if config["isolate_pids"] and _unshare(CLONE_NEWPID):
        layers.append("pid_namespace")
    if config["private_disk"] and _private_disk(config):
        layers.append("disk_quota")
    if config["drop_to"] is not None:  # a user of its own: the trainer's files and processes are foreign
        layers.append("unprivileged_user")
    if config["processes"] is not None and (config["drop_to"] is not None or os.geteuid() != 0):
        layers.append("process_cap")  # RLIMIT_NPROC does not bind root
    if config["audit_hook"]:
        layers.append("audit_hook")
    os.write(status_fd, (json.dumps({"layers": layers}) + "\n").encode())
    pid = os.fork()
    if pid == 0:
        _run(config, status_fd)
    # The runner's CPU time tells the CPU limit's ending apart from others (its SIGXCPU handler's exit,
    # or the hard limit's SIGKILL where the code replaced that handler).
    _, status, usage = os.wait4(pid, 0)
    ending = {"cpu_seconds": usage.ru_utime + usage.ru_stime}
    if os.WIFSIGNALED(status):
        ending.update(exit_code=None, signal=os.WTERMSIG(status))
    else:
        ending.update(exit_code=os.WEXITSTATUS(status), signal=None)
    os.write(status_fd, (json.dumps(ending) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
