"""What each of a sweep's parallel runs may use of this machine's accelerators, decided before any run
starts. (The sweep process never starts JAX itself: it would hold a device of its own.)

One process of JAX on a GPU preallocates 75% of every GPU it sees on first use, and a TPU host's chips
open in one process at a time; N runs started side by side with the sweep's environment would fail
all but the first. So `--parallel=N` gives each run slot an environment of its own:

- CPU (no accelerator, or JAX_PLATFORMS=cpu): nothing to divide; the runs share the cores.
- G GPUs, N <= G: each slot gets G // N GPUs of its own (CUDA_VISIBLE_DEVICES; G % N stay idle).
- G GPUs, N > G: each slot gets one GPU, shared by ceil(N / G) slots, each of which preallocates that
  share of what one process would (XLA_PYTHON_CLIENT_MEM_FRACTION = 0.75 / ceil(N / G), or the
  user's own fraction divided the same way): the processes sharing a GPU then fit in it together.
- TPU: N > 1 is refused (one line): a run takes every chip of the host, one at a time.

A run's own `mesh.shape` then sees its slot's devices only (the default `(1, -1, 1)` takes them all).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping

# JAX's default: the share of a GPU's memory one process preallocates (XLA_PYTHON_CLIENT_MEM_FRACTION).
JAX_DEFAULT_MEM_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class Accelerators:
    """The accelerators a child process would open: platform ("cpu", "gpu" or "tpu") and, for GPUs,
    the ids CUDA_VISIBLE_DEVICES takes (indices or UUIDs); `tpu_chips` for a TPU host."""

    platform: str
    gpu_ids: tuple[str, ...] = ()
    tpu_chips: int = 0


def local_accelerators(environ: Mapping[str, str], dev: str = "/dev") -> Accelerators:
    """What a child started with `environ` would open on this machine, found without starting JAX:
    JAX_PLATFORMS=cpu, else TPU chips on the PCI bus (JAX's own test), else /dev/nvidiaN entries
    (narrowed by CUDA_VISIBLE_DEVICES where it is set)."""
    platforms = [p.strip().lower() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and set(platforms) <= {"cpu"}:
        return Accelerators("cpu")
    chips = _tpu_chips()
    if chips:
        return Accelerators("tpu", tpu_chips=chips)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = tuple(i.strip() for i in visible.split(",") if i.strip() and i.strip() != "-1")
    else:
        numbers = sorted(int(m.group(1)) for name in _listdir(dev) if (m := re.fullmatch(r"nvidia(\d+)", name)))
        ids = tuple(str(n) for n in numbers)
    return Accelerators("gpu", gpu_ids=ids) if ids else Accelerators("cpu")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _tpu_chips() -> int:
    """TPU chips on the PCI bus, by the test JAX itself makes before it opens a TPU (a private helper:
    where it is gone, no TPU is assumed)."""
    try:
        from jax._src import hardware_utils
        return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])
    except Exception:  # noqa: BLE001 (a moved private helper must not stop a CPU sweep)
        return 0


def slot_environments(parallel: int, accelerators: Accelerators, environ: Mapping[str, str]
                      ) -> tuple[list[dict[str, str]], str]:
    """(one environment per run slot, a line saying what each slot holds). ConfigError on a TPU host
    with parallel > 1."""
    from ppo_jax.config import ConfigError  # here: `import ppo_jax` reads local_accelerators (host_memory), not jax

    base = dict(environ)
    if parallel == 1 or accelerators.platform == "cpu":
        return [dict(base) for _ in range(parallel)], ""
    if accelerators.platform == "tpu":
        raise ConfigError(f"--parallel={parallel} on a TPU host: its {accelerators.tpu_chips} chips open in one "
                          "process at a time; use --parallel=1 (each run then takes every chip)")
    ids = accelerators.gpu_ids
    groups = min(parallel, len(ids))
    per_group = len(ids) // groups
    sharing = math.ceil(parallel / groups)
    envs = []
    for slot in range(parallel):
        group = slot % groups
        env = dict(base, CUDA_VISIBLE_DEVICES=",".join(ids[group * per_group:(group + 1) * per_group]))
        if sharing > 1:
            total = float(environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_DEFAULT_MEM_FRACTION))
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{total / sharing:.3f}"
        envs.append(env)
    if sharing > 1:
        note = (f"{len(ids)} GPU(s), {sharing} runs on each: each run preallocates "
                f"{envs[0]['XLA_PYTHON_CLIENT_MEM_FRACTION']} of its GPU's memory")
    else:
        note = f"{len(ids)} GPUs, {per_group} per run (CUDA_VISIBLE_DEVICES)"
    return envs, note
