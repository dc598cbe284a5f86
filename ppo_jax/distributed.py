"""Multi-controller start-up: one program per host, one global mesh.

`initialize(config)` must run before JAX touches a device. Sources, in order:
  config.distributed.{coordinator_address, num_processes, process_id}, else the environment
  (PPO_JAX_COORDINATOR, PPO_JAX_NUM_PROCESSES, PPO_JAX_PROCESS_ID), else, when
  config.distributed.auto (or PPO_JAX_DISTRIBUTED=auto) is set, JAX's own detection (TPU VMs,
  SLURM, ...). With none of them the run is single-process.
"""

from __future__ import annotations

import os

import jax


def settings(config=None) -> dict:
    """The coordinator settings the config or environment ask for ({} = single process)."""
    d = config.distributed if config is not None and "distributed" in config else None
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


def initialize(config=None) -> bool:
    """Starts the multi-controller runtime when asked to; returns whether it did."""
    kwargs = settings(config)
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
