"""On a CPU-only machine, glibc's malloc is told to keep freed memory for reuse (called once, when
`ppo_jax` is imported).

XLA:CPU allocates a program's temporaries as one block per execution, with `posix_memalign`, on one of
its worker threads. glibc gives each worker thread an arena of its own, and an arena's heaps cannot
hold a block over 64 MB, so such a block is mmap-ed fresh for every execution and unmapped after it:
the kernel zero-fills every page again on first touch. The demo's SFT step (a 199 MB block of
temporaries) took 48,700 page faults and 145 ms of kernel time a step, a quarter of the step
(docs/benchmarks.md, "Page faults"). With one arena (the main heap, which grows as needed), no mmap
and up to 2 GB of freed memory kept, the block is reused: 2,400 faults and 10 ms a step.

What it costs: freed memory (up to 2 GB at the top of the heap) stays with the process instead of
going back to the system, and every thread allocates from the one arena. So it is done only where
JAX will compute on the CPU (JAX_PLATFORMS=cpu, or no TPU or GPU on the machine), only on glibc,
and never where the user has tuned malloc themselves (MALLOC_ARENA_MAX, MALLOC_MMAP_MAX_,
MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES) or set PPO_JAX_HOST_MALLOC=system.

It must run before JAX starts its CPU backend (whose worker threads take their arenas then): importing
`ppo_jax` before the first JAX computation is enough.

The one arena makes XLA's compile threads wait on its lock: a cold run's compiles take about a quarter
longer. jemalloc, where it is installed, gives both: `restart_with_jemalloc` (the demo's command line)
runs the command again with it preloaded.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

# mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
KEEP_FREED_BYTES = 2**31 - 1  # mallopt's value is an int: the most freed memory it can keep (2 GB)
USER_MALLOC_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
OPT_OUT = "PPO_JAX_HOST_MALLOC"  # "system": leave malloc as it is; "glibc": tune glibc's, never restart with jemalloc

# The demo's command line restarts itself with jemalloc preloaded where it is installed (`restart_with_jemalloc`).
# The one glibc arena above serialises XLA's compile threads (a cold run's compiles ~25 % slower); jemalloc
# gives each thread a cache of its own, and with decay off it keeps every freed page, so the block of
# temporaries is reused as the one arena reuses it. README command 1 from an empty cache: 308 s against 360 s,
# the same result to the last digit (docs/benchmarks.md, "A cold run's compile").
JEMALLOC = "jemalloc"  # ctypes.util.find_library's name: libjemalloc.so.2 (Debian/Ubuntu: apt install libjemalloc2)
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def should_tune(environ: Mapping[str, str], platform: str) -> bool:
    """Whether to tune malloc in a process with `environ` whose JAX computes on `platform`."""
    if environ.get(OPT_OUT, "").strip().lower() == "system":
        return False
    if any(name in environ for name in USER_MALLOC_SETTINGS):
        return False
    return platform == "cpu" and sys.platform.startswith("linux")


def reuse_freed_host_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Sets one arena, no mmap and a 2 GB trim threshold through mallopt(3) where `should_tune` says
    so (a non-glibc libc: nothing). Returns whether malloc was tuned."""
    from ppo_jax.sweep.devices import local_accelerators

    environ = os.environ if environ is None else environ
    if not should_tune(environ, local_accelerators(environ).platform):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl's mallopt ignores these parameters
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success; the arena count first, so no later thread takes an arena of its own.
    return all(mallopt(param, value) == 1 for param, value in
               ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP_FREED_BYTES)))


def jemalloc_environ(environ: Mapping[str, str], platform: str, library: str | None) -> dict[str, str] | None:
    """The environment to restart a command in with jemalloc (`library`, None: not installed) preloaded,
    or None to go on as it is: where `should_tune` says so, PPO_JAX_HOST_MALLOC is not "glibc", and
    nothing is preloaded or configured yet (LD_PRELOAD, MALLOC_CONF: a restarted process has both, so
    it never restarts again)."""
    if library is None or not should_tune(environ, platform) or environ.get(OPT_OUT, "").strip().lower() == "glibc":
        return None
    if "LD_PRELOAD" in environ or "MALLOC_CONF" in environ:
        return None
    return {**environ, "LD_PRELOAD": library, "MALLOC_CONF": JEMALLOC_CONF}


def restart_with_jemalloc(library: str | None = None) -> None:
    """A command line's first step, before JAX starts: where `jemalloc_environ` says so, the same command
    (`sys.orig_argv`) replaces this process with jemalloc preloaded; elsewhere it returns. library: the
    allocator to preload (None: jemalloc, found by `ctypes.util.find_library`)."""
    import ctypes.util

    from ppo_jax.sweep.devices import local_accelerators

    environ = jemalloc_environ(os.environ, local_accelerators(os.environ).platform,
                               library or ctypes.util.find_library(JEMALLOC))
    if environ is None:  # no restart: jemalloc absent, opted out, already preloaded, or off Linux / off CPU
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environ)
