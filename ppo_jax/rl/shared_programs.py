"""The PPO trainer's programs shared between the trainers of one process with equal inputs
(`ppo_jax/program_cache.py`): a resumed run, a sweep's repeat, or the straight run a test compares a
resumed one with trace and compile nothing again. The optimizers are closures with no value equality,
so they come from the cache too, one pair per equal settings.

No program reads the loop's settings (`train`: iterations, logging, evaluation, checkpoints), so trainers
that differ only there share their programs: a run stopped after 1 iteration and the same run of 2.
`train.iterations` reaches a program through one door, the optimizers' decay schedule
(`schedule_steps`), which keys the optimizers whenever it is read."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ppo_jax.program_cache import PROGRAMS, value_key
from ppo_jax.rl import build
from ppo_jax.rl.hyper import DerivedSizes, PPOHyper
from ppo_jax.rl.settings import PPOTrainSettings, Settings
from ppo_jax.rl.state import Modules


def schedule_steps(s: Settings) -> int | None:
    """The optimizer steps a decaying learning-rate schedule spans (`build.make_optimizers`); None for a
    constant one (after its warmup), which never reads them."""
    return None if s.optim.schedule == "constant" else build.optimizer_steps(s)


def program_settings(s: Settings) -> Settings:
    """`s` with the loop's settings at their defaults: what the programs are built from."""
    return dataclasses.replace(s, train=PPOTrainSettings())


def shared_optimizers(s: Settings):
    """`build.make_optimizers(s)`, the same pair for the same optimizer settings and schedule length."""
    return PROGRAMS.get(value_key("optimizers", s.optim, s.uses_critic, schedule_steps(s)),
                        lambda: build.make_optimizers(s))


def shared_steps(s: Settings, mesh, sizes: DerivedSizes, hp: PPOHyper, modules: Modules, policy_tx, value_tx,
                 state_shardings, frozen_shardings, stop_ids: Sequence[int], pad_id: int,
                 sampler_mesh=None) -> build.Steps:
    """`build.build_steps`, the same `Steps` for equal inputs: a second trainer of equal settings
    traces and compiles nothing again, and its `trace_counts` are the shared programs'. An update
    that chooses its remat by the free memory it meets is never shared: what one trainer found free
    need not hold for the next."""
    key = None if build.chooses_remat(s, mesh) else value_key(
        "steps", program_settings(s), mesh, sizes, hp, modules, policy_tx, value_tx, state_shardings,
        frozen_shardings, tuple(stop_ids), pad_id, sampler_mesh)
    return PROGRAMS.get(key, lambda: build.build_steps(s, mesh, sizes, hp, modules, policy_tx, value_tx,
                                                       state_shardings, frozen_shardings, stop_ids, pad_id,
                                                       sampler_mesh=sampler_mesh))
