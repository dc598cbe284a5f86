"""Multi-controller start-up: one program per host, one global mesh.

`initialize(settings)` must run before JAX touches a device. Sources, in order:
  the settings' {coordinator_address, num_processes, process_id}, else the environment
  (PPO_JAX_COORDINATOR, PPO_JAX_NUM_PROCESSES, PPO_JAX_PROCESS_ID), else, when
  settings.auto (or PPO_JAX_DISTRIBUTED=auto) is set, JAX's own detection (TPU VMs,
  SLURM, ...). With none of them the run is single-process.

A multi-process run also starts a `peer_watch.PeerWatch`: a lost process ends every other one with
exit status 1 and one `error:` line naming it (`lost_process_timeout`), before JAX's own heartbeat
check (set to a multiple of it) would abort them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
from jax._src import distributed as jax_distributed  # the runtime client the watch talks through

from ppo_jax import peer_watch


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Multi-host wiring (a PPO config's distributed section)."""

    coordinator_address: str = ""  # "host:port" of process 0 for multi-host runs ("" = env or single process)
    num_processes: int = 0  # processes in the job (with coordinator_address)
    process_id: int = -1  # this process's index (with coordinator_address)
    auto: bool = False  # let JAX detect the cluster (TPU VMs, SLURM); also PPO_JAX_DISTRIBUTED=auto
    # seconds without a heartbeat before a process counts as lost: every other process then ends with
    # exit status 1 and an error: line naming it and the last checkpoint (0 = leave it to JAX's abort)
    lost_process_timeout: int = 30


_watch: peer_watch.PeerWatch | None = None


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


def _timeout(d: DistributedSettings | None) -> int:
    timeout = d.lost_process_timeout if d is not None else DistributedSettings.lost_process_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
        raise ValueError(f"distributed.lost_process_timeout must be a whole number of seconds >= 0 (0 = off), "
                         f"got {timeout!r}")
    return timeout


def initialize(d: DistributedSettings | None = None) -> bool:
    """Starts the multi-controller runtime when asked to; returns whether it did."""
    kwargs = runtime_args(d)
    if not kwargs:
        return False
    timeout = _timeout(d)
    if timeout:
        kwargs["heartbeat_timeout_seconds"] = peer_watch.jax_heartbeat_timeout(timeout)
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        # CPU processes need a collectives backend to talk to each other.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs.pop("auto", None)  # without an address JAX detects the cluster itself
    jax.distributed.initialize(**kwargs)
    global _watch
    state = jax_distributed.global_state
    if timeout and state.num_processes > 1 and state.client is not None:
        _watch = peer_watch.PeerWatch(state.client, state.process_id, state.num_processes, timeout,
                                      coordinator=state.coordinator_address or "").start()
        _watch.catch_abort()
    return True


def set_resume_hint(hint: Callable[[], str]) -> None:
    """What a lost process's `error:` line ends with: what was kept and how to resume (a sentence)."""
    if _watch is not None:
        _watch.resume_hint = hint


def settle() -> None:
    """Before this process reports an error of its own: returns once every other process is seen
    alive; when one is lost instead, the watch ends this process with the line that names it (the
    error seen here is then a consequence). Returns at once in a single-process run."""
    if _watch is not None:
        _watch.settle()
