"""`python -m ppo_jax.cli.plan --config=FILE [--num_devices=N] [--device_memory_gb=G] [--platform=...]` (also
the console script `ppo-jax-plan`): the memory plan of a PPO config on a mesh, without allocating
anything (see `ppo_jax.plan` for what the numbers mean).

    ppo-jax-plan --config=configs/plan_tinyllama.py --platform=gpu --gpu=h100 --device_memory_gb=80
    ppo-jax-plan --config=configs/plan_llama7b.py --platform=tpu --tpu_topology=v5p:2x4x4
    ppo-jax-plan --config=configs/plan_llama3_8b.py --platform=gpu --gpu=h100 --config.mesh.shape=1,4,1 \
        --config.roles.sampler_devices=4 --config.roles.sampler_mesh=1,1,4   # 4 trainer + 4 sampler GPUs

`--platform=gpu --gpu=KIND` and `--platform=tpu --tpu_topology=...` compile for accelerators this
machine does not have (`ppo_jax.accelerators`). With roles.sampler_devices the planned devices are
mesh.shape's (the trainer's) plus the sampler's own; the report then has a per-role table."""

from __future__ import annotations

import json
import time

import numpy as np
from absl import flags

from ppo_jax.accelerators import GPU_KINDS, planning_devices
from ppo_jax.accelerators.profile_report import format_profiles
from ppo_jax.cli.common import config_command
from ppo_jax.config import ConfigError
from ppo_jax.plan import GB, GIB, PHASES, format_plan, plan_memory
from ppo_jax.plan import profiles as profiles_lib
from ppo_jax.plan.memory import planned_settings
from ppo_jax.rl.settings import Settings


def mesh_size(shape, num_devices: int | None) -> int:
    """Devices a (data, fsdp, tensor[, expert[, context]]) shape needs; a -1 entry takes `num_devices`."""
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (3, 4, 5):
        raise ConfigError(f"mesh.shape must have 3 entries (data, fsdp, tensor), 4 (+ expert) or 5 (data, fsdp, "
                          f"tensor, expert, context), got {shape}")
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


def planned_devices(shape, sampler_devices: int, num_devices: int | None) -> int:
    """Devices a plan compiles for: mesh.shape's (the trainer's), plus roles.sampler_devices of the
    sampler's own (`ppo_jax.rl.roles`); --num_devices counts both."""
    k = int(sampler_devices)
    if not k:
        return mesh_size(shape, num_devices)
    if num_devices is not None and num_devices <= k:
        raise ConfigError(f"roles.sampler_devices={k} leaves none of --num_devices={num_devices} for training")
    trainer = mesh_size(shape, None if num_devices is None or -1 not in tuple(shape) else num_devices - k)
    if num_devices is not None and trainer + k != num_devices:
        raise ConfigError(f"mesh.shape={tuple(shape)} (the trainer's {trainer} devices) + roles.sampler_devices={k} "
                          f"need {trainer + k} devices, but --num_devices={num_devices}")
    return trainer + k


def main(argv=None) -> None:
    num_devices = flags.DEFINE_integer("num_devices", None, "Devices of the planned machine (default: the "
                                       "product of mesh.shape; needed when mesh.shape has a -1).")
    memory_gb = flags.DEFINE_float("device_memory_gb", None, "Memory per device in GB (10^9 bytes), e.g. 141 "
                                   "for an H200.")
    memory_gib = flags.DEFINE_float("device_memory_gib", None, "Memory per device in GiB (2^30 bytes), e.g. 95 "
                                    "for a TPU v5p chip.")
    platform = flags.DEFINE_string("platform", "cpu", "Compiler for the phase programs: 'cpu' (fake CPU devices, "
                                   "any mesh size), 'gpu' with --gpu or 'tpu' with --tpu_topology (compile-only "
                                   "accelerators, none needed here), or a JAX platform of this machine with enough "
                                   "devices ('tpu', 'gpu', 'default').")
    tpu_topology = flags.DEFINE_string("tpu_topology", "", "With --platform=tpu: compile for this TPU slice "
                                       "without TPUs, e.g. 'v5p:2x4x4' (v5p-64, 32 chips); needs libtpu.")
    gpu = flags.DEFINE_string("gpu", "", f"With --platform=gpu: compile for N GPUs of this kind without GPUs "
                              f"({', '.join(GPU_KINDS)}; N = the mesh size); needs the cuda12 extra.")
    phases = flags.DEFINE_list("phases", list(PHASES), "Programs to compile (the peak is over these; scoring: only "
                               "with roles.scoring=sampler).")
    as_json = flags.DEFINE_bool("json", False, "Print the plan as JSON instead of a table.")
    profile = flags.DEFINE_bool("profile", False, "With --platform=gpu --gpu=KIND: also print each program's "
                                "static profile (kernels, FLOPs, bytes, host round trips, an estimated time; "
                                "ppo_jax/accelerators/profile.py).")

    def plan(config, workdir) -> str:
        del workdir
        if memory_gb.value is not None and memory_gib.value is not None:
            raise ConfigError("pass either --device_memory_gb or --device_memory_gib, not both")
        memory = (memory_gb.value * GB if memory_gb.value is not None else
                  memory_gib.value * GIB if memory_gib.value is not None else None)
        if memory is not None and memory <= 0:
            raise ConfigError("device memory must be positive")
        if profile.value:
            profiles_lib.device_model(gpu.value if platform.value == "gpu" else "")  # before any compile
        n = planned_devices(config.mesh.shape, config.roles.sampler_devices, num_devices.value)
        devices = planning_devices(platform.value, n, tpu_topology=tpu_topology.value, gpu=gpu.value)
        start = time.perf_counter()
        texts = {}
        keep_text = (lambda name, compiled: texts.update({name: compiled.as_text()})) if profile.value else None
        # The planner splits the devices between the roles as a run would (roles.sampler_devices).
        result = plan_memory(config, phases=tuple(phases.value), devices=devices, inspect=keep_text)
        profiles = profiles_lib.static_profiles(texts, planned_settings(config)) if profile.value else {}
        seconds = time.perf_counter() - start
        if as_json.value:
            extra = {"static_profile": profiles_lib.profiles_to_dict(profiles, gpu.value)} if profiles else {}
            return json.dumps(dict(result.to_dict(memory), planning_seconds=round(seconds, 1), **extra), indent=2)
        report = format_plan(result, memory)
        if profiles:
            steps, _ = profiles_lib.decode_groups(planned_settings(config))
            report += "\n\n" + format_profiles(profiles, profiles_lib.device_model(gpu.value), decode_steps=steps)
        return f"{report}\nPlanned in {seconds:.1f} s."

    config_command(plan, schema=Settings, what="PPO", workdir=False, example_config="configs/plan_tinyllama.py",
                   title="PPO memory plan (ppo-jax-plan: compiles the phase programs, allocates nothing)", argv=argv)


if __name__ == "__main__":
    main()
