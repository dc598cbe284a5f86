"""`import ppo_jax` on a CPU-only machine keeps freed host memory for reuse (ppo_jax/host_memory.py): an
XLA:CPU program's large block of temporaries is no longer mapped and faulted in afresh on every run."""

import os
import subprocess
import sys

import pytest

from ppo_jax import host_memory

TEMPORARY_PAGES = 32 * 2**20 * 4 // 4096  # the program's 128 MB temporary, in 4 KB pages

# Page faults per run of a program whose temporary (128 MB, over glibc's 64 MB thread-arena heaps) is
# materialised by the barrier: the mean of 30 runs after two warm-up runs. (Tuned, a run now and then
# still grows the heap: small allocations take pieces of the freed block until the heap holds a few.)
PROGRAM = """
import resource
import ppo_jax  # noqa: F401
import jax
import jax.numpy as jnp

@jax.jit
def f(x):
    y = jax.lax.optimization_barrier(jnp.sin(x))
    return jnp.sum(y * y)

x = jnp.ones((32 * 2**20,), jnp.float32)
for _ in range(2):
    f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    f(x).block_until_ready()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 30)
"""


def faults_per_run(**env) -> float:
    base = {k: v for k, v in os.environ.items() if k not in host_memory.USER_MALLOC_SETTINGS + (host_memory.OPT_OUT,)}
    base.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1", **env)
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=base, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux) is what is tuned")
def test_a_large_temporary_is_reused_instead_of_faulted_in_on_every_run():
    tuned = faults_per_run()
    untuned = faults_per_run(**{host_memory.OPT_OUT: "system"})
    # Untuned, every page of the temporary faults in on every run (32,770 of 32,768); tuned, 0 to 30%
    # of them on average, from the heap's growth over the first runs.
    assert untuned > 0.9 * TEMPORARY_PAGES, untuned
    assert tuned < 0.5 * TEMPORARY_PAGES, tuned


@pytest.mark.parametrize("environ, platform, tuned", [
    ({}, "cpu", True),
    ({}, "gpu", False),  # the temporaries live on the device; the host keeps glibc's defaults
    ({}, "tpu", False),
    ({"PPO_JAX_HOST_MALLOC": "system"}, "cpu", False),
    ({"MALLOC_ARENA_MAX": "4"}, "cpu", False),  # the user's own malloc settings win
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "cpu", False),
])
def test_only_a_cpu_process_with_no_malloc_settings_of_its_own_is_tuned(environ, platform, tuned):
    assert host_memory.should_tune(environ, platform) is (tuned and sys.platform.startswith("linux"))


@pytest.mark.parametrize("environ, platform, library, restarts", [
    ({}, "cpu", "libjemalloc.so.2", True),
    ({}, "cpu", None, False),  # not installed: glibc, tuned as above
    ({}, "gpu", "libjemalloc.so.2", False),
    ({"PPO_JAX_HOST_MALLOC": "glibc"}, "cpu", "libjemalloc.so.2", False),
    ({"PPO_JAX_HOST_MALLOC": "system"}, "cpu", "libjemalloc.so.2", False),
    ({"LD_PRELOAD": "libtcmalloc.so.4"}, "cpu", "libjemalloc.so.2", False),  # the user's preload (or the restart's)
    ({"MALLOC_CONF": "narenas:4"}, "cpu", "libjemalloc.so.2", False),
    ({"MALLOC_ARENA_MAX": "4"}, "cpu", "libjemalloc.so.2", False),
])
def test_jemalloc_is_preloaded_only_where_malloc_is_ours_to_choose(environ, platform, library, restarts):
    got = host_memory.jemalloc_environ(environ, platform, library)
    if not (restarts and sys.platform.startswith("linux")):
        assert got is None
    else:
        assert got == {**environ, "LD_PRELOAD": library, "MALLOC_CONF": host_memory.JEMALLOC_CONF}


# A command that restarts itself with an allocator preloaded (libc itself stands in for jemalloc, which the
# machine need not have): the same command again, once, with the preload and jemalloc's settings.
RESTART = """
import os, sys
from ppo_jax import host_memory
print("ran", os.environ.get("LD_PRELOAD"), os.environ.get("MALLOC_CONF"), sys.argv[1:], flush=True)
host_memory.restart_with_jemalloc(library="libc.so.6")
print("went on", flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the restart is for glibc's Linux")
@pytest.mark.parametrize("opt_out", ["", "glibc"])
def test_a_command_restarts_once_with_the_allocator_preloaded(opt_out):
    env = {k: v for k, v in os.environ.items()
           if k not in host_memory.USER_MALLOC_SETTINGS + (host_memory.OPT_OUT, "LD_PRELOAD", "MALLOC_CONF")}
    env.update(JAX_PLATFORMS="cpu", **({host_memory.OPT_OUT: opt_out} if opt_out else {}))
    out = subprocess.run([sys.executable, "-c", RESTART, "an-argument"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    first = "ran None None ['an-argument']"
    if opt_out:
        assert lines == [first, "went on"]
    else:
        assert lines == [first, f"ran libc.so.6 {host_memory.JEMALLOC_CONF} ['an-argument']", "went on"]
