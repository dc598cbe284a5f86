"""Compile-only accelerators: XLA:GPU and XLA:TPU devices this machine does not have.

XLA compiles for an H100 or a TPU slice on a CPU-only host, and what it compiles is what that
accelerator would run: the kernels it chose (cuDNN flash attention, Pallas kernels), the loops and
copies it kept, and its own buffer assignment (`compiled.memory_analysis()`). Speed cannot be read
this way: without a device XLA:GPU cannot autotune, so its GEMM tiles are untuned fallbacks.

- GPU: the CUDA plugin (`pip install -e '.[cuda12]'`, i.e. `jax[cuda12]`) registers a topology
  factory even without a driver, provided JAX was started with `JAX_PLATFORMS=cpu` (otherwise the
  plugin's driver check fails first). A GPU kind is a `GpuTargetConfigProto` in text form, shipped
  beside this file (`<kind>.textproto`, each with its sources), with the cuDNN and CUDA runtime
  versions of the installed wheels filled in.
- TPU: libtpu (`pip install libtpu`) describes any slice, e.g. "v5p:2x4x4".

`planning_devices` is what `ppo-jax-plan --platform=...` compiles for; tests/test_accelerators.py
checks the programs' structure on these devices.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
import os
import re

import jax
from jax.experimental import topologies

from ppo_jax.config import ConfigError

GPU_KINDS = ("h100", "h200", "a100")
CUDA_INSTALL = "pip install -e '.[cuda12]' (the jax[cuda12] wheels)"
TPU_INSTALL = "pip install libtpu (or set TPU_LIBRARY_PATH to libtpu.so)"


def _wheel_version(distribution: str) -> tuple[int, int] | None:
    """(major, minor) of an installed wheel, None if absent."""
    try:
        major, minor = importlib.metadata.version(distribution).split(".")[:2]
        return int(major), int(minor)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def gpu_target_config(kind: str) -> str:
    """The GpuTargetConfigProto text of a GPU kind (one of GPU_KINDS), with the cuDNN and CUDA
    runtime versions of the installed wheels where they are installed: XLA picks its cuDNN
    attention kernels by the cuDNN version it is told the device will have."""
    if kind not in GPU_KINDS:
        raise ConfigError(f"--gpu={kind!r}: use one of {', '.join(GPU_KINDS)}")
    text = importlib.resources.files(__package__).joinpath(f"{kind}.textproto").read_text()
    for field, wheel in (("dnn_version_info", "nvidia-cudnn-cu12"), ("runtime_version", "nvidia-cuda-runtime-cu12")):
        version = _wheel_version(wheel)
        if version is not None:
            text = re.sub(rf"{field} {{[^}}]*}}", f"{field} {{ major: {version[0]} minor: {version[1]} }}", text)
    return text


def module_installed(name: str) -> bool:
    """Whether `name` (dotted: "jax_plugins.xla_cuda12") can be imported, without importing it.
    `find_spec` of a dotted name imports its parent and raises when the parent is absent (no
    `jax_plugins` package at all without an accelerator plugin): that is "not installed" too."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def cuda_plugin_installed() -> bool:
    """The CUDA plugin that compiles for GPUs this machine lacks (the `cuda12` extra)."""
    return module_installed("jax_plugins.xla_cuda12")


def libtpu_installed() -> bool:
    """libtpu, which compiles for TPU slices this machine lacks (the `tpu` extra)."""
    return module_installed("libtpu")


def gpu_devices(kind: str, count: int) -> list:
    """`count` compile-only GPUs of `kind` in one process (an NVLink-connected host: "1x1xN")."""
    config = gpu_target_config(kind)
    if not cuda_plugin_installed():
        raise ConfigError(f"compiling for a GPU without one needs the CUDA plugin: {CUDA_INSTALL}")
    try:
        devices = topologies.get_topology_desc(platform="cuda", target_config=config,
                                               topology=f"1x1x{count}").devices
    except NotImplementedError:
        raise ConfigError(
            "the CUDA plugin did not register its compile-only devices: with no GPU driver, JAX must start "
            "with JAX_PLATFORMS=cpu (run the planner in a fresh process, or set JAX_PLATFORMS=cpu)") from None
    return list(devices)


def tpu_devices(topology: str) -> list:
    """The compile-only chips of a TPU slice, e.g. "v5p:2x4x4" (32 chips) or "v5e:2x2"."""
    # libtpu locks /tmp/libtpu_lockfile for the life of the first process that loads it, meant for the
    # one process that drives a TPU; compiling for a slice drives none, so plans (and test workers)
    # may run side by side.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
    except (RuntimeError, NotImplementedError) as e:
        raise ConfigError(f"cannot describe TPU topology {topology!r} ({e}); compiling for a TPU without one "
                          f"needs libtpu: {TPU_INSTALL}") from None


def cpu_devices(count: int) -> list:
    """`count` CPU devices: made before JAX starts its backends; inside a process whose backends
    already run (a test), whatever CPU devices there are."""
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # backends already started: use what is there
    return jax.devices("cpu")


def planning_devices(platform: str, count: int, *, tpu_topology: str = "", gpu: str = "") -> list:
    """`count` devices to compile a plan for.

    cpu: fake CPU devices. gpu with `gpu` (a kind of GPU_KINDS): compile-only GPUs. tpu with
    `tpu_topology`: the slice's compile-only chips (their number must be `count`). Otherwise: this
    machine's own devices of that platform ("default": whatever JAX runs on).
    """
    if tpu_topology and platform != "tpu":
        raise ConfigError("--tpu_topology needs --platform=tpu")
    if gpu and platform != "gpu":
        raise ConfigError("--gpu needs --platform=gpu")
    if tpu_topology or gpu:
        # JAX_PLATFORMS=cpu before any backend starts: the CUDA plugin then registers its compile-only
        # devices without a driver, and neither it nor libtpu looks for an accelerator to attach to.
        cpu_devices(1)
    if tpu_topology:
        devices = tpu_devices(tpu_topology)
        if len(devices) != count:
            raise ConfigError(f"TPU topology {tpu_topology!r} has {len(devices)} chips but the mesh needs {count} "
                              "devices; set --config.mesh.shape to cover the slice")
        return devices
    if gpu:
        return gpu_devices(gpu, count)
    if platform == "cpu":
        devices = cpu_devices(count)
    else:
        try:
            devices = jax.devices() if platform == "default" else jax.devices(platform)
        except RuntimeError as e:
            hint = " (or --gpu=KIND to compile for GPUs this machine lacks)" if platform == "gpu" else (
                " (or --tpu_topology=... to compile for a slice this machine lacks)" if platform == "tpu" else "")
            raise ConfigError(f"no {platform} devices here{hint}: {e}") from None
    if len(devices) < count:
        raise ConfigError(
            f"the mesh needs {count} devices but {len(devices)} {platform} devices are available; with "
            "--platform=cpu run the planner in a fresh process so it can create them")
    return devices[:count]
