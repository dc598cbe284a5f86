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
