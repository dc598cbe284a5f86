"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a top-k softmax router and gated experts, dropless.

Every token goes to its `experts_per_token` experts, none is dropped: the (token, expert) pairs are
sorted by expert and each expert's rows multiply its weights in one grouped matmul
(`jax.lax.ragged_dot`, which XLA lowers to a grouped GEMM on GPU and TPU), so the cost is that of the
routed tokens, with no capacity factor and no padding to it.

A token's output depends only on the token (routing, the grouped matmuls and the weighted sum are
all per row), so the sampler's cached decode and the training forward route every token to the same
experts and give the same numbers: no routing replay is needed for rollout log-probs to be training
log-probs.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.layers import DenseGeneral, activation

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Routing:
    """Each token's experts and their weights, and the order that groups the pairs by expert.

    experts [N, k] int32, weights [N, k] (compute dtype), order [N*k]: the flat (token, slot) pairs
    sorted by expert; group_sizes [E] int32: how many pairs each expert receives."""

    experts: Array
    weights: Array
    order: Array
    group_sizes: Array


def route(router_logits: Array, k: int, normalize: bool, dtype) -> Routing:
    """Softmax over all experts in float32, then the top k; `normalize` rescales the k weights to sum
    to 1 (Mixtral always; Qwen3-MoE's norm_topk_prob). router_logits [N, E]."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    flat = experts.reshape(-1)
    num_experts = router_logits.shape[-1]
    return Routing(experts=experts, weights=weights.astype(dtype),
                   order=jnp.argsort(flat, stable=True),
                   group_sizes=jnp.bincount(flat, length=num_experts).astype(jnp.int32))


class MoEMLP(nn.Module):
    """x [B, T, D] -> [B, T, D]: sum over a token's k experts of weight * down(act(gate(x)) * up(x)).

    Params: router [D, E]; gate, up [E, D, F]; down [E, F, D] (F = moe_intermediate_size)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        b, t, d = x.shape
        e, f, k = cfg.num_experts, cfg.expert_mlp_dim, cfg.experts_per_token
        dtype, param_dtype = cfg.jnp_dtype, cfg.jnp_param_dtype
        init = nn.initializers.normal(0.02)
        logits = DenseGeneral((d,), (e,), ("embed", "expert"), False, dtype, param_dtype, name="router")(x)
        routing = route(logits.reshape(b * t, e), k, cfg.norm_topk_prob, dtype)

        def experts(name, shape, axes):
            return self.param(name, nn.with_logical_partitioning(init, axes), shape, param_dtype).astype(dtype)

        gate = experts("gate", (e, d, f), ("expert", "embed", "mlp"))
        up = experts("up", (e, d, f), ("expert", "embed", "mlp"))
        down = experts("down", (e, f, d), ("expert", "mlp", "embed"))

        tokens = x.astype(dtype).reshape(b * t, d)
        rows = tokens[routing.order // k]  # [N*k, D]: each (token, slot) pair, grouped by expert
        sizes = routing.group_sizes
        hidden = activation(cfg.act)(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
        out = jax.lax.ragged_dot(hidden, down, sizes)  # [N*k, D]
        per_slot = jnp.zeros_like(out).at[routing.order].set(out).reshape(b * t, k, d)
        y = (per_slot * routing.weights[..., None]).sum(axis=1)
        return y.reshape(b, t, d)
