"""MoE routing replay (`moe.router_replay`, docs/off_policy.md): the sampler records the experts each
prompt and response token went to, and the policy's training forwards (experience and update) route
every token to them instead of recomputing its top k, so a router near-tie that the sampler resolved
one way (bf16, stale weights) cannot flip in training and blow up the token's ratio.

The record travels as `Rollout.routed_experts` and `Experience.routed_experts` [B, Lq + Lr, Lm, k]
(Lm MoE layers, k experts per token; int8 / int16, -1 where nothing was recorded: a token whose own
top k stands), aligned with the training forward's prompt + response sequence. Off, both are None and
nothing changes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ppo_jax.config import ConfigError
from ppo_jax.models.config import ModelConfig

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class MoeSettings:
    """A mixture-of-experts policy's training options (its router losses: ppo.router_aux_coef / router_z_coef)."""

    router_replay: bool = False  # the sampler records each token's experts and the policy's training forwards use them instead of recomputing the top k (gate weights from the current router logits at those experts); with partial rollouts each token's are those of the weights that fed it; metric rollout/routing_mismatch

    def check_model(self, cfg: ModelConfig) -> None:
        """Refuses replay on a policy without MoE layers (raised while the policy config is read)."""
        if self.router_replay and not cfg.num_experts:
            raise ConfigError(f"moe.router_replay replays the experts of a mixture-of-experts policy, and this "
                              f"{cfg.arch} policy has none (model.num_experts=0): set moe.router_replay=False")


def routing_mismatch(flips: Array | None, mask: Array) -> dict[str, Array]:
    """rollout/routing_mismatch: the share of response tokens (mask [B, Lr]) whose own top k, in any MoE
    layer of the training forward, differs from the recorded experts (flips [B, Lr]; None: no replay)."""
    if flips is None:
        return {}
    mask = mask.astype(jnp.float32)
    return {"rollout/routing_mismatch": (flips * mask).sum() / jnp.maximum(mask.sum(), 1.0)}
