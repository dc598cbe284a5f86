"""`python -m ppo_jax.cli.plan --config=FILE [--num_devices=N] [--device_memory_gb=G] [--platform=...]` (also
the console script `ppo-jax-plan`): the memory plan of a PPO config on a mesh, without allocating
anything (see `ppo_jax.rl.plan` for what the numbers mean)."""

from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import flags
from jax.experimental import topologies

from ppo_jax import sharding
from ppo_jax.cli.common import config_command
from ppo_jax.config import ConfigError
from ppo_jax.rl.plan import GB, GIB, PHASES, format_plan, plan_memory
from ppo_jax.rl.settings import Settings


def mesh_size(shape, num_devices: int | None) -> int:
    """Devices a (data, fsdp, tensor) shape needs; a -1 entry takes `num_devices`."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3:
        raise ConfigError(f"mesh.shape must have 3 entries (data, fsdp, tensor), got {shape}")
    if -1 in shape:
        if num_devices is None:
            raise ConfigError(
                f"mesh.shape={shape} has a -1 entry: pass --num_devices=N (the devices of the planned machine) "
                "or give every mesh axis explicitly")
        return int(num_devices)
    size = int(np.prod(shape))
    if num_devices is not None and num_devices != size:
        raise ConfigError(f"mesh.shape={shape} needs {size} devices, but --num_devices={num_devices}")
    return size


def _planning_devices(platform: str, n: int, tpu_topology: str = ""):
    """n devices to compile for.

    cpu: n fake CPU devices (made before JAX starts its backends). tpu with a topology: libtpu's
    compile-only devices of that slice (no TPU needed, only the libtpu package or TPU_LIBRARY_PATH).
    Otherwise: this machine's devices of that platform.
    """
    if tpu_topology:
        if platform != "tpu":
            raise ConfigError("--tpu_topology needs --platform=tpu")
        try:
            devices = topologies.get_topology_desc(topology_name=tpu_topology, platform="tpu").devices
        except RuntimeError as e:
            raise ConfigError(
                f"cannot describe TPU topology {tpu_topology!r} ({e}); compiling for a TPU without one needs "
                "libtpu: pip install libtpu (or set TPU_LIBRARY_PATH to libtpu.so)") from None
        if len(devices) != n:
            raise ConfigError(
                f"TPU topology {tpu_topology!r} has {len(devices)} chips but the mesh needs {n} devices; "
                "set --config.mesh.shape to cover the slice")
        return list(devices)
    if platform == "cpu":
        try:
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:
            pass  # backends already started (e.g. inside a test): use what is there
        devices = jax.devices("cpu")
    else:
        devices = jax.devices() if platform == "default" else jax.devices(platform)
    if len(devices) < n:
        raise ConfigError(
            f"the mesh needs {n} devices but {len(devices)} {platform} devices are available; with "
            "--platform=cpu run the planner in a fresh process so it can create them")
    return devices[:n]


def main(argv=None) -> None:
    num_devices = flags.DEFINE_integer("num_devices", None, "Devices of the planned machine (default: the "
                                       "product of mesh.shape; needed when mesh.shape has a -1).")
    memory_gb = flags.DEFINE_float("device_memory_gb", None, "Memory per device in GB (10^9 bytes), e.g. 141 "
                                   "for an H200.")
    memory_gib = flags.DEFINE_float("device_memory_gib", None, "Memory per device in GiB (2^30 bytes), e.g. 95 "
                                    "for a TPU v5p chip.")
    platform = flags.DEFINE_string("platform", "cpu", "Compiler for the phase programs: 'cpu' (fake CPU devices, "
                                   "any mesh size) or a JAX platform of this machine with enough devices "
                                   "('tpu', 'gpu', 'default').")
    tpu_topology = flags.DEFINE_string("tpu_topology", "", "With --platform=tpu: compile for this TPU slice "
                                       "without TPUs, e.g. 'v5p:2x4x4' (v5p-64, 32 chips); needs libtpu.")
    phases = flags.DEFINE_list("phases", list(PHASES), "Programs to compile (the peak is over these).")
    as_json = flags.DEFINE_bool("json", False, "Print the plan as JSON instead of a table.")

    def plan(config, workdir) -> str:
        del workdir
        if memory_gb.value is not None and memory_gib.value is not None:
            raise ConfigError("pass either --device_memory_gb or --device_memory_gib, not both")
        memory = (memory_gb.value * GB if memory_gb.value is not None else
                  memory_gib.value * GIB if memory_gib.value is not None else None)
        if memory is not None and memory <= 0:
            raise ConfigError("device memory must be positive")
        n = mesh_size(config.mesh.shape, num_devices.value)
        devices = _planning_devices(platform.value, n, tpu_topology.value)
        mesh = sharding.make_mesh(tuple(config.mesh.shape), devices)
        start = time.perf_counter()
        result = plan_memory(config, mesh, tuple(phases.value))
        seconds = time.perf_counter() - start
        if as_json.value:
            return json.dumps(dict(result.to_dict(memory), planning_seconds=round(seconds, 1)), indent=2)
        return f"{format_plan(result, memory)}\nPlanned in {seconds:.1f} s."

    config_command(plan, schema=Settings, what="PPO", workdir=False, argv=argv)


if __name__ == "__main__":
    main()
