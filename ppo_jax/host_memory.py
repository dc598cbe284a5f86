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
OPT_OUT = "PPO_JAX_HOST_MALLOC"  # "system": leave malloc as it is


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
