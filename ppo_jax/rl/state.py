"""The named containers one PPO iteration passes between its phases.

Shapes: B rollout rows (prompts x samples), Lq prompt length, Lr response length. Trainable state is
donated to the update; frozen parameters (reference, reward) never are.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax

from ppo_jax import ppo

Array = jax.Array
Params = Any

@flax.struct.dataclass
class TrainState:
    """Everything the update changes; donated to the update step."""

    step: Array  # [] int32, PPO iterations done
    policy: Params
    policy_opt: Any
    value: Params | None  # None for critic-free estimators (grpo, rloo, reinforce_pp)
    value_opt: Any
    kl: ppo.KLControllerState
    key: Array  # base PRNG key; per-iteration keys are fold_in(key, step)


@flax.struct.dataclass
class FrozenParams:
    """Never donated, never optimised."""

    reference: Params
    reward: Params | None  # None when only Python reward functions score


@flax.struct.dataclass
class Rollout:
    """Sampled responses (from the sampler) plus host-side scores."""

    prompt_tokens: Array  # [B, Lq]
    prompt_mask: Array  # [B, Lq]
    tokens: Array  # [B, Lr]
    mask: Array  # [B, Lr], 1 up to and including the first stop token
    sampler_logprobs: Array  # [B, Lr], the sampler's own log-probs (for the mismatch metric)
    stopped: Array  # [B] bool
    host_scores: Array  # [B] float32, weighted Python reward functions (0 when none)


@flax.struct.dataclass
class Experience:
    """What the update trains on; every [B, Lr] array is 0 on masked positions."""

    prompt_tokens: Array  # [B, Lq]
    prompt_mask: Array  # [B, Lq]
    tokens: Array  # [B, Lr]
    mask: Array  # [B, Lr]
    old_logprobs: Array  # [B, Lr]
    ref_logprobs: Array  # [B, Lr]
    values: Array  # [B, Lr] (zeros for critic-free estimators)
    advantages: Array  # [B, Lr]
    returns: Array  # [B, Lr]
    scores: Array  # [B]

