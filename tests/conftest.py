"""Every test sees 8 fake CPU devices; mesh fixtures cover the shapes DESIGN.md names."""

import os

# Must happen before JAX initialises its backends.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
