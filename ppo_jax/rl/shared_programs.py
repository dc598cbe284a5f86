"""The PPO trainer's programs shared between the trainers of one process with equal inputs
(`ppo_jax/program_cache.py`): a resumed run, a sweep's repeat, or the straight run a test compares a
resumed one with trace and compile nothing again. The optimizers are closures with no value equality,
so they come from the cache too, one pair per equal settings."""

from __future__ import annotations

from collections.abc import Sequence

from ppo_jax.program_cache import PROGRAMS, value_key
from ppo_jax.rl import build
from ppo_jax.rl.hyper import DerivedSizes, PPOHyper
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import Modules


def shared_optimizers(s: Settings):
    """`build.make_optimizers(s)`, the same pair for equal settings (the steps' key holds the settings
    whole, so a finer key would share nothing more)."""
    return PROGRAMS.get(value_key("optimizers", s), lambda: build.make_optimizers(s))


def shared_steps(s: Settings, mesh, sizes: DerivedSizes, hp: PPOHyper, modules: Modules, policy_tx, value_tx,
                 state_shardings, frozen_shardings, stop_ids: Sequence[int], pad_id: int,
                 sampler_mesh=None) -> build.Steps:
    """`build.build_steps`, the same `Steps` for equal inputs: a second trainer of equal settings
    traces and compiles nothing again, and its `trace_counts` are the shared programs'. An update
    that chooses its remat by the free memory it meets is never shared: what one trainer found free
    need not hold for the next."""
    key = None if build.chooses_remat(s, mesh) else value_key(
        "steps", s, mesh, sizes, hp, modules, policy_tx, value_tx, state_shardings, frozen_shardings,
        tuple(stop_ids), pad_id, sampler_mesh)
    return PROGRAMS.get(key, lambda: build.build_steps(s, mesh, sizes, hp, modules, policy_tx, value_tx,
                                                       state_shardings, frozen_shardings, stop_ids, pad_id,
                                                       sampler_mesh=sampler_mesh))
