"""Multi-controller start-up: one program per host, one global mesh.

`initialize(settings)` must run before JAX touches a device. Sources, in order:
  the settings' {coordinator_address, num_processes, process_id}, else the environment
  (PPO_JAX_COORDINATOR, PPO_JAX_NUM_PROCESSES, PPO_JAX_PROCESS_ID), else, when
  settings.auto (or PPO_JAX_DISTRIBUTED=auto) is set, JAX's own detection (TPU VMs,
  SLURM, ...). With none of them the run is single-process.
"""

from __future__ import annotations

import dataclasses
import os

import jax


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Multi-host wiring (a PPO config's distributed section)."""

    coordinator_address: str = ""  # "host:port" of process 0 for multi-host runs ("" = env or single process)
    num_processes: int = 0  # processes in the job (with coordinator_address)
    process_id: int = -1  # this process's index (with coordinator_address)
    auto: bool = False  # let JAX detect the cluster (TPU VMs, SLURM); also PPO_JAX_DISTRIBUTED=auto


def runtime_args(d: DistributedSettings | None = None) -> dict:
    """The coordinator arguments the settings or environment ask for ({} = single process)."""
    address = (d.coordinator_address if d is not None else "") or os.environ.get("PPO_JAX_COORDINATOR", "")
    auto = bool(d.auto if d is not None else False) or os.environ.get("PPO_JAX_DISTRIBUTED", "") == "auto"
    if not address:
        return {"auto": True} if auto else {}
    num = (d.num_processes if d is not None else 0) or int(os.environ.get("PPO_JAX_NUM_PROCESSES", "0"))
    pid = d.process_id if d is not None and d.process_id >= 0 else int(os.environ.get("PPO_JAX_PROCESS_ID", "-1"))
    if num < 1 or not 0 <= pid < num:
        raise ValueError(
            f"distributed.coordinator_address={address!r} needs distributed.num_processes >= 1 and "
            f"0 <= distributed.process_id < num_processes (got {num} and {pid}); set them in the config "
            "or as PPO_JAX_NUM_PROCESSES / PPO_JAX_PROCESS_ID")
    return {"coordinator_address": address, "num_processes": num, "process_id": pid}


def initialize(d: DistributedSettings | None = None) -> bool:
    """Starts the multi-controller runtime when asked to; returns whether it did."""
    kwargs = runtime_args(d)
    if not kwargs:
        return False
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        # CPU processes need a collectives backend to talk to each other.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if kwargs.pop("auto", False):
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(**kwargs)
    return True
