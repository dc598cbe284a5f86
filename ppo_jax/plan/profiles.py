"""Static profiles of a run's GPU programs (`ppo-jax-plan --profile`): the planner compiles the run's
programs for a GPU kind this machine does not have, and `ppo_jax.accelerators.profile` reads each
optimised program's kernels, FLOPs, bytes, loops and host round trips into a time estimate.

The one thing the text cannot say is how many times the sampler's decode loop runs, whose condition
reads device data: a full-length response is assumed (the worst case, and what the benchmark runs).
"""

from __future__ import annotations

import math
from typing import Any

from ppo_jax.accelerators.profile import DEVICE_MODELS, ProgramProfile, profile_program
from ppo_jax.config import ConfigError
from ppo_jax.rl.sampler_settings import AUTO_STEPS_PER_SYNC
from ppo_jax.rl.settings import Settings


def decode_groups(s: Settings) -> tuple[int, int]:
    """(decode steps of a full-length response after the prefill's token, iterations of the static
    engine's decode loop for them: one per rollout.steps_per_sync steps, auto on a GPU)."""
    steps = max(s.rollout.response_length - 1, 1)
    per_sync = max(1, min(s.rollout.steps_per_sync or AUTO_STEPS_PER_SYNC["gpu"], steps))
    return steps, math.ceil(steps / per_sync)


def static_profiles(texts: dict[str, str], s: Settings) -> dict[str, ProgramProfile]:
    """Phase name -> the static profile of its optimised HLO text."""
    _, groups = decode_groups(s)
    return {name: profile_program(name, text, unknown_trip_count=groups if name == "sampler" else 1)
            for name, text in texts.items()}


def device_model(gpu: str):
    """The estimate's model of a GPU kind; ConfigError if there is none."""
    if gpu not in DEVICE_MODELS:
        raise ConfigError(f"--profile needs --platform=gpu --gpu=KIND with KIND one of {', '.join(DEVICE_MODELS)}")
    return DEVICE_MODELS[gpu]


def profiles_to_dict(profiles: dict[str, ProgramProfile], gpu: str) -> dict[str, Any]:
    """The JSON form: per phase launches, host round trips, FLOPs, bytes, the estimate and its split."""
    device = device_model(gpu)
    return {name: {"launches": p.launches, "host_syncs": p.host_syncs, "flops": p.flops, "bytes": p.bytes,
                   "estimated_seconds": p.seconds(device), "by_kind": p.by_category(device),
                   "loops": [dict(name=l.name, trip_count=l.trip_count, known=l.known,
                                  kernels_per_iteration=l.kernels_per_iteration) for l in p.loops]}
            for name, p in profiles.items()}
