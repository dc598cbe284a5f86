"""compute.precompile: a run's programs compiled side by side before its first iteration.

Without it, each jitted phase compiles at its first call, one after another: the sampler, the
experience forwards, then the update. XLA releases Python's lock while it compiles, so programs in
threads of their own compile at the same time. Compiled for an H200 on this project's 2-core CPU
machine, TinyLlama's three programs took 68.6 s side by side against 102.1 s in a row
(docs/benchmarks.md, issue 63 item 4).

So before the first iteration the trainer lowers each phase on abstract inputs
(`rl/phase_inputs.py`): its own trees as ShapeDtypeStructs, and each later phase's input from the
output shapes of the program before it. Each program starts compiling in its own thread as soon as
it is lowered; lowering stays in the calling thread, in order. The first calls then find their
executables in jax's caches and compile nothing (tests/test_precompile.py counts the lowerings).

It applies to one-turn whole samples: the static or the continuous engine, any role layout, LoRA,
k-step off-policy, dynamic sampling. Partial rollouts and multi-turn episodes decode with programs
of their own (segments, turns), and those runs compile at first call, as before.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ppo_jax import sharding
from ppo_jax.rl import roles
from ppo_jax.rl.build import Steps
from ppo_jax.rl.hyper import PPOHyper
from ppo_jax.rl.phase_inputs import abstract, lowered_phases, sampled_rollout, sampler_inputs
from ppo_jax.rl.remat_choice import MemoryChosenUpdate
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import FrozenParams, PPOState


def applies(setting: str, platform: str) -> bool:
    """Whether a run compiles ahead: compute.precompile "on", or "auto" off a CPU. On a CPU "auto"
    leaves it off: its programs compile in seconds, and the 2-core machines the suite and the demo run
    on have no idle core for a second compile (each is a test worker's or the demo's own)."""
    return setting == "on" or (setting == "auto" and platform != "cpu")


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What compiling ahead took: each program's seconds in its own thread (for the update under
    compute.remat="auto" on a GPU, its remat choice's compiles) and the wall time from the first
    lowering to the last compile's end."""

    seconds: dict[str, float]
    wall_s: float

    def text(self) -> str:
        each = ", ".join(f"{name} {secs:.1f} s" for name, secs in self.seconds.items())
        return f"compiled ahead, side by side in {self.wall_s:.1f} s ({each})"


def _timed(job: Callable[[], Any]) -> float:
    start = time.perf_counter()
    job()
    return time.perf_counter() - start


def precompile(steps: Steps, s: Settings, hp: PPOHyper, meshes: roles.RoleMeshes, state: PPOState,
               kept: FrozenParams, scorer: FrozenParams | None) -> CompileReport:
    """Compiles the sampler, [the scoring program,] the experience step and the update on abstract
    inputs, side by side. state, kept: the trainer's train state and the frozen trees it keeps;
    scorer: roles.scoring="sampler"'s frozen trees on the sampler's mesh (else None). Arrays, read
    only for their shapes, dtypes and shardings: nothing runs and nothing is copied (the sampler's
    weights are those the first sync will make, `phase_inputs.sampler_inputs`)."""
    start = time.perf_counter()
    state, kept = abstract(state), abstract(kept)
    decoded = sampler_inputs(state.policy, kept.policy, steps.sampler_shardings, meshes.shared)
    # compute.remat="auto" on a GPU: the update is lowered by its remat choice, in its thread.
    chooser = steps.update_jit if isinstance(steps.update_jit, MemoryChosenUpdate) else None
    futures: dict[str, Future] = {}
    outputs: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="precompile") as pool:
        for name, lowered in lowered_phases(steps, s, hp, meshes, state, kept, decoded, abstract(scorer),
                                            update=chooser is None):
            futures[name] = pool.submit(_timed, lowered.compile)
            outputs[name] = lowered.out_info
        if chooser is not None:
            rollout = sampled_rollout(s, meshes, outputs["sampler"], tuple(outputs.get("scoring", ())))
            experience = outputs["experience"][0]
            futures["update"] = pool.submit(_timed, _remat_choice(chooser, (state, kept, experience),
                                                                  (rollout, experience), meshes.trainer))
    return CompileReport({name: future.result() for name, future in futures.items()}, time.perf_counter() - start)


def _remat_choice(update: MemoryChosenUpdate, args: tuple, held_then: Any, mesh) -> Callable[[], None]:
    """compute.remat="auto" on a GPU: the update's remat chosen ahead, a job for a thread. The free
    memory is read now, in this thread (with several processes it is gathered from all of them, at the
    same point of every process's run), less what the first update's call will hold besides: the
    rollout and the experience [R, ...] (`held_then`), which do not exist yet."""
    free = update.free_bytes()
    if free is not None:
        free -= sharding.device_bytes(held_then)

    def choose() -> None:
        with sharding.mesh_context(mesh):  # jax's mesh context is the calling thread's own
            update.choose(args, free)

    return choose
