"""The sandbox lets nothing out (issue 45 item 5). Each escape is tried against each layer alone that
claims to stop it (the others switched off), so a test goes red when its layer is removed; kernel
layers the machine does not permit are skipped with the reason. Limits are tight: every test is
well under 2 s, and none can hurt the machine when its layer is broken (allocations, forks and output
are bounded in the attacking code itself, or stopped by a second, independent limit)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tracemalloc

import pytest

from ppo_jax.agentic.sandbox import Limits, run_python

# The wall clock is generous on purpose: on a loaded machine (2 cores shared with other jobs) starting
# two interpreters can take a second, and a test must not fail for it. Busy code meets the 1 s CPU
# limit first; the tests of the wall clock itself set their own.
TIGHT = Limits(wall_seconds=10.0, cpu_seconds=1, memory_bytes=256 << 20, file_bytes=1 << 20,
               output_bytes=64 << 10, processes=8)
NO_LAYERS = dict(isolate_network=False, isolate_pids=False, private_disk=False, drop_privileges=False,
                 audit_hook=False)


def only(layer: str, **limits) -> Limits:
    """TIGHT with one isolation layer on (rlimits and the trainer's limits always apply)."""
    switches = dict(NO_LAYERS)
    switches[{"network_namespace": "isolate_network", "pid_namespace": "isolate_pids",
              "unprivileged_user": "drop_privileges", "audit_hook": "audit_hook",
              "disk_quota": "private_disk"}[layer]] = True
    fields = {**TIGHT.__dict__, **switches, **limits}
    return Limits(**fields)


def run_with(layer: str, code: str, **limits):
    """Runs `code` with `layer` alone, skipping when the kernel does not grant that layer here."""
    result = run_python(code, only(layer, **limits))
    if layer not in result.layers:
        pytest.skip(f"{layer} is not available on this machine (layers in place: {result.layers})")
    return result


def sandbox_processes() -> list[int]:
    """PIDs of live (not zombie) processes of sandboxes this process started (other pytest-xdist workers
    run their own)."""
    mine = b'"trainer_pid": %d,' % os.getpid()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"_sandbox_child.py" in cmdline and mine in cmdline and state != "Z":
            found.append(int(pid))
    return found


def my_children() -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    count += 1
        except OSError:
            continue
    return count


def wait_until_gone(seconds: float = 1.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def test_ordinary_code_runs_and_every_layer_is_in_place_by_default():
    result = run_python("import fractions\nprint(fractions.Fraction(2, 6), 2 ** 70)", TIGHT)
    assert result.status == "ok", result
    assert result.stdout == "1/3 1180591620717411303424\n"
    assert {"rlimits", "audit_hook", "process_cap"} <= set(result.layers)


def test_closing_its_output_does_not_end_the_run_early():
    code = "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(0.3)\nopen('x', 'w')\nos._exit(3)"
    result = run_python(code, TIGHT)
    assert result.status == "error" and result.exit_code == 3 and result.wall_seconds >= 0.3, result
    assert run_python("x = 1", TIGHT).observation() == "(no output)"


def test_an_exception_is_an_error_observation_without_the_sandboxs_own_frames():
    result = run_python("def f():\n    return 1 / 0\nf()", TIGHT)
    assert result.status == "error" and result.exit_code == 1
    assert "ZeroDivisionError" in result.observation() and "_sandbox_child" not in result.stderr


@pytest.mark.parametrize("layer", ["audit_hook", "network_namespace"])
def test_a_socket_cannot_reach_even_the_hosts_loopback(layer):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = ("import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
            "s.sendall(b'leak')\nprint('CONNECTED')")
    try:
        result = run_with(layer, code)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    finally:
        server.close()
    assert result.status == "error" and "CONNECTED" not in result.stdout, result


@pytest.mark.parametrize("layer", ["audit_hook", "unprivileged_user"])
def test_files_outside_the_sandbox_cannot_be_read(tmp_path, layer):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    secret.chmod(0o600)
    result = run_with(layer, f"print(open({str(secret)!r}).read())")
    assert result.status == "error" and "TOP-SECRET" not in result.stdout
    assert "PermissionError" in result.stderr


@pytest.mark.parametrize("code", ["print(open('/etc/passwd').read())",
                                  "import os\nos.symlink('/etc/passwd', 'p')\nprint(open('p').read())"])
def test_the_hook_refuses_world_readable_host_files_which_the_kernel_layers_allow(code):
    result = run_with("audit_hook", code)
    assert result.status == "error" and "root:" not in result.stdout and "PermissionError" in result.stderr


@pytest.mark.parametrize("layer", ["audit_hook", "unprivileged_user"])
def test_nothing_outside_the_sandbox_can_be_written(tmp_path, layer):
    existing = tmp_path / "existing.txt"
    existing.write_text("original")
    code = (f"open({str(tmp_path / 'planted.txt')!r}, 'w').write('x')\n"
            f"open({str(existing)!r}, 'w').write('changed')")
    result = run_with(layer, code)
    assert result.status == "error" and "PermissionError" in result.stderr
    assert not (tmp_path / "planted.txt").exists() and existing.read_text() == "original"


def test_the_sandbox_directory_is_writable_and_files_are_size_capped():
    code = ("try:\n    open('big', 'wb').write(b'x' * (4 << 20))\nexcept OSError as e:\n    print(type(e).__name__)\n"
            "import os\nprint(os.path.getsize('big'))")
    result = run_python(code, TIGHT)
    assert result.status == "ok", result
    assert result.stdout.split()[-1] == str(1 << 20)  # RLIMIT_FSIZE: the write stopped at 1 MiB


def test_all_files_together_are_capped_and_the_host_sees_none_of_them():
    """1 MiB files (the RLIMIT_FSIZE cap) until the 4 MiB tmpfs is full; at most 32 tried, so a broken
    quota writes 32 MiB, not the disk."""
    code = ("written = 0\ntry:\n    for i in range(32):\n        with open(f'f{i}', 'wb') as f:\n"
            "            f.write(b'x' * (1 << 20))\n        written += 1\nexcept OSError as e:\n"
            "    print(type(e).__name__, e.errno)\nprint(written)")
    result = run_with("disk_quota", code, disk_bytes=4 << 20)
    assert result.status == "ok", result
    assert int(result.stdout.split()[-1]) < 4 and "OSError 28" in result.stdout  # ENOSPC


def test_the_process_count_is_capped():
    """RLIMIT_NPROC binds only an unprivileged user: the run drops to one (as root) or is one. Forks
    that succeed are counted; each child sleeps, so without the cap 40 would (and get killed after)."""
    code = ("import os, time\nn = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        continue\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
            "    n += 1\nprint(n)")
    result = run_python(code, only("unprivileged_user"))  # as root, the cap needs the drop
    if "process_cap" not in result.layers:
        pytest.skip(f"the process cap is not in place here (layers: {result.layers})")
    assert result.status == "ok" and int(result.stdout) < TIGHT.processes, result
    assert wait_until_gone() == []


def test_a_fork_bomb_is_stopped_and_nothing_of_it_is_left():
    """Its children leave the process group (setsid), escaping a group kill; the PID namespace takes
    them anyway (its first process dies, the kernel kills the rest). The process cap keeps the bomb
    small, and escapees spin, so RLIMIT_CPU would end them within seconds were the namespace broken."""
    children_before = my_children()
    code = ("import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
            "    except OSError:\n        pass")
    limits = Limits(**{**TIGHT.__dict__, **NO_LAYERS, "isolate_pids": True, "drop_privileges": True,
                       "wall_seconds": 1.0})
    result = run_python(code, limits)
    if not {"pid_namespace", "process_cap"} <= set(result.layers):
        pytest.skip(f"needs a PID namespace and the process cap (layers here: {result.layers})")
    assert result.status == "timeout", result
    assert wait_until_gone(0.3) == []
    assert my_children() == children_before


@pytest.mark.parametrize("code, refused", [
    ("import os\nos.fork()", "os.fork"),
    ("import subprocess\nsubprocess.run(['true'])", "_posixsubprocess"),  # its fork_exec raises no event
    ("import os\nos.system('true')", "os.system"),
    ("import ctypes\nctypes.CDLL(None).getpid()", "ctypes.dlopen"),
    ("import gc\ngc.get_objects()", "gc.get_objects"),
])
def test_the_hook_refuses_new_processes_foreign_code_and_object_walks(code, refused):
    result = run_with("audit_hook", code + "\nprint('done')")
    assert result.status == "error" and "done" not in result.stdout and refused in result.stderr, result


def test_allocating_without_end_is_a_memory_status():
    """Bounded at 1 GiB (4 x the limit) so that a broken limit cannot take the machine's memory."""
    result = run_python("x = []\nfor _ in range(100):\n    x.append(b'x' * 10 ** 7)", TIGHT)
    assert result.status == "memory", result
    assert "memory limit" in result.observation()


def test_an_endless_loop_is_stopped_by_the_wall_clock():
    result = run_python("import time\nwhile True:\n    time.sleep(0.01)", Limits(**{**TIGHT.__dict__, "wall_seconds": 0.5}))
    assert result.status == "timeout" and result.limit == "wall_seconds" and 0.5 <= result.wall_seconds < 3.0, result
    assert wait_until_gone() == []


def test_an_endless_computation_is_stopped_by_the_cpu_limit():
    result = run_python("while True:\n    pass", TIGHT)
    assert result.status == "timeout" and result.limit == "cpu_seconds", result  # not the wall clock
    assert "CPU time limit" in result.observation()


def test_printing_gigabytes_stops_at_the_output_cap_and_the_parent_holds_only_the_cap():
    tracemalloc.start()
    try:
        result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 10 ** 6)", TIGHT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.status == "output_limit", result
    assert len(result.stdout) + len(result.stderr) <= TIGHT.output_bytes
    assert peak < 4 * TIGHT.output_bytes + (1 << 20), peak


def test_killing_its_parent_kills_only_the_supervisor_and_the_trainer_goes_on():
    """All isolation layers off: the code's parent is the supervisor, never this process."""
    result = run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time\ntime.sleep(5)",
                        Limits(**{**TIGHT.__dict__, **NO_LAYERS}))
    assert result.status == "killed", result
    assert wait_until_gone() == []
    os.kill(os.getpid(), 0)  # still here


@pytest.mark.parametrize("layer", ["audit_hook", "unprivileged_user", "pid_namespace"])
def test_a_process_of_the_trainers_user_cannot_be_signalled(layer):
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        result = run_with(layer, f"import os, signal\nos.kill({bystander.pid}, signal.SIGKILL)\nprint('sent')")
        time.sleep(0.05)
        assert bystander.poll() is None, "the sandboxed code killed a host process"
        assert result.status == "error" and "sent" not in result.stdout
    finally:
        bystander.kill()
        bystander.wait()


def test_a_sandbox_that_cannot_be_set_up_raises_and_code_cannot_forge_that():
    """Root without the right to change user (CAP_SETUID dropped with setpriv): no code runs and the
    trainer gets SandboxSetupError, not an observation. Code exiting with the set-up's exit code is
    only an error."""
    assert run_python("import os\nos._exit(98)", TIGHT).status == "error"
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv")
    script = ("from ppo_jax.agentic.sandbox import run_python, SandboxSetupError\n"
              "try:\n    run_python('print(1)')\nexcept SandboxSetupError as e:\n    print('raised', e)")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(["setpriv", "--inh-caps=-setuid,-setgid", "--bounding-set=-setuid,-setgid",
                           sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": repo, "JAX_PLATFORMS": "cpu"})
    assert done.stdout.startswith("raised the sandbox could not be set up"), done
