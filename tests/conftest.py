"""Every test sees 8 fake CPU devices; mesh fixtures cover the shapes DESIGN.md names."""

import os
import tempfile

# Must happen before JAX initialises its backends.
# The tiny test programs run for milliseconds but compile for seconds: LLVM's optimisation of the
# CPU kernels is a quarter of a cold suite's time, so tests skip it (the HLO passes -- fusion, layout,
# sharding -- still run, so the programs are the same; values agree with an optimised build to
# rounding). The whole suite from a cold cache on 2 cores: 13:48 instead of 18:09 (2026-11-25).
# A run that sets its own level in XLA_FLAGS keeps it.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite builds the same tiny trainers many times over (and in subprocesses): JAX's persistent
# compilation cache, keyed by the program's content, compiles each program once. Halves the suite.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"ppo_jax_tests_xla_cache_{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

MESH_SHAPES = [(1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]


def make_test_mesh(shape):
    from ppo_jax import sharding

    n = int(np.prod(shape))
    return sharding.make_mesh(shape, jax.devices()[:n])


@pytest.fixture(params=MESH_SHAPES, ids=lambda s: "mesh" + "x".join(map(str, s)))
def mesh(request):
    """Each mesh shape in turn (data, fsdp, tensor)."""
    return make_test_mesh(request.param)


@pytest.fixture
def mesh_1():
    return make_test_mesh((1, 1, 1))


@pytest.fixture
def mesh_8():
    return make_test_mesh((2, 2, 2))
