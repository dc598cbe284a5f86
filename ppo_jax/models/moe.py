"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, GPT-OSS): a top-k softmax router and gated experts,
dropless.

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
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.layers import DenseGeneral, activation

Array = jax.Array

# The Flax collection MoEMLP sows its router statistics into (one entry per layer) when a forward
# makes it mutable: `apply(..., mutable=[ROUTER])`. Forwards that do not (the sampler, scoring)
# compute nothing for it.
ROUTER = "router_stats"


@dataclasses.dataclass(frozen=True)
class Routing:
    """Each token's experts and their weights, and the order that groups the pairs by expert.

    experts [N, k] int32, weights [N, k] (compute dtype), order [N*k]: the flat (token, slot) pairs
    sorted by expert; group_sizes [E] int32: how many pairs each expert receives."""

    experts: Array
    weights: Array
    order: Array
    group_sizes: Array


def route(router_logits: Array, k: int, normalize: bool, dtype, softmax: str = "all") -> Routing:
    """The top k experts of each token and their weights, in float32. router_logits [N, E].

    softmax "all": softmax over all experts, then the top k; `normalize` rescales the k weights to
    sum to 1 (Mixtral always; Qwen3-MoE's norm_topk_prob). "topk": the top k logits, then a softmax
    over those k (GPT-OSS)."""
    logits = router_logits.astype(jnp.float32)
    if softmax == "topk":
        top, experts = jax.lax.top_k(logits, k)
        weights = jax.nn.softmax(top, axis=-1)
    else:
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        if normalize:
            weights = weights / weights.sum(-1, keepdims=True)
    flat = experts.reshape(-1)
    num_experts = router_logits.shape[-1]
    return Routing(experts=experts, weights=weights.astype(dtype),
                   order=jnp.argsort(flat, stable=True),
                   group_sizes=jnp.bincount(flat, length=num_experts).astype(jnp.int32))


@flax.struct.dataclass
class RouterLosses:
    """What the MoE layers' routers did in one forward, over its real tokens, pooled over layers.

    balance: the load-balancing loss as transformers computes it (Switch Transformer, eqs. 4-6):
      E * sum_e f_e * P_e, f_e the share of (token, slot) assignments to expert e and P_e its mean
      router probability (softmax over all E logits), both pooled over every layer's tokens.
    z: the router z-loss (ST-MoE): the mean over tokens and layers of logsumexp(logits)^2.
    load_max: the busiest expert's assignments over the mean expert's, in the worst layer (1 when
      perfectly balanced; E / k when every token of a layer goes to the same k experts).
    dropped: assignments not computed (0: routing is dropless by construction).
    """

    balance: Array
    z: Array
    load_max: Array
    dropped: Array


@dataclasses.dataclass(frozen=True)
class RouterCoefs:
    """The router losses' weights in a training loss (transformers' router_aux_loss_coef; ST-MoE's
    z-loss coefficient)."""

    aux: float = 0.0
    z: float = 0.0

    def penalty(self, losses: RouterLosses) -> Array:
        return self.aux * losses.balance + self.z * losses.z


def router_stats(logits: Array, routing: Routing, real: Array) -> dict[str, Array]:
    """One layer's sums over its real tokens: logits [N, E], real [N] (1 for real tokens) ->
    counts [E] (assignments per expert), probs [E] (summed softmax probabilities), z [] (summed
    logsumexp^2), tokens [] (real tokens)."""
    real = real.astype(jnp.float32)
    logits = logits.astype(jnp.float32)
    k = routing.experts.shape[-1]
    counts = jnp.zeros(logits.shape[-1], jnp.float32).at[routing.experts.reshape(-1)].add(jnp.repeat(real, k))
    return {"counts": counts, "probs": (jax.nn.softmax(logits, axis=-1) * real[:, None]).sum(0),
            "z": (jnp.square(jax.nn.logsumexp(logits, axis=-1)) * real).sum(), "tokens": real.sum()}


def router_losses(sown: Any, experts_per_token: int) -> RouterLosses:
    """RouterLosses from the collection a forward sowed (`apply(..., mutable=[ROUTER])`): the per-layer
    sums of `router_stats`, stacked [L, ...] under scanned layers or one entry per layer."""
    entries = jax.tree.leaves(sown, is_leaf=lambda x: isinstance(x, dict) and "counts" in x)
    if not entries:
        raise ValueError("the forward sowed no router statistics: the model has no MoE layers")
    num_experts = entries[0]["counts"].shape[-1]
    counts = jnp.concatenate([e["counts"].reshape(-1, num_experts) for e in entries])  # [L, E]
    probs = jnp.concatenate([e["probs"].reshape(-1, num_experts) for e in entries])
    z = jnp.concatenate([e["z"].reshape(-1) for e in entries])  # [L]
    tokens = jnp.concatenate([e["tokens"].reshape(-1) for e in entries])
    total = jnp.maximum(tokens.sum(), 1.0)
    balance = num_experts * jnp.sum(counts.sum(0) / total * (probs.sum(0) / total))
    load = counts.max(-1) / jnp.maximum(counts.mean(-1), 1e-9)
    return RouterLosses(balance=balance, z=z.sum() / total, load_max=load.max(),
                        dropped=(tokens * experts_per_token - counts.sum(-1)).sum())


def clamped_swiglu(gate_up: Array, limit: float, alpha: float) -> Array:
    """GPT-OSS's expert activation: gate_up [N, 2F] interleaves gate and up features (gate, up, gate,
    ...) -> [N, F] = (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    pairs = gate_up.reshape(gate_up.shape[:-1] + (-1, 2))
    gate = jnp.minimum(pairs[..., 0], limit)
    up = jnp.clip(pairs[..., 1], -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class MoEMLP(nn.Module):
    """x [B, T, D] -> [B, T, D]: sum over a token's k experts of weight * expert(x).

    Params: router [D, E] (+ bias [E]); expert_kind "swiglu": gate, up [E, D, F] and down [E, F, D],
    expert(x) = down(act(gate(x)) * up(x)); "clamped_swiglu" (GPT-OSS): gate_up [E, D, 2F] (gate and
    up features interleaved, as the checkpoint holds them: one grouped matmul for both) and down
    [E, F, D], each with a bias [E, ...] (F = moe_intermediate_size)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, real: Array | None = None) -> Array:
        """real [B, T]: the real (non-padding) tokens; with it, and the ROUTER collection mutable,
        the layer sows its `router_stats`."""
        cfg = self.config
        b, t, d = x.shape
        e, f, k = cfg.num_experts, cfg.expert_mlp_dim, cfg.experts_per_token
        dtype, param_dtype = cfg.jnp_dtype, cfg.jnp_param_dtype
        init = nn.initializers.normal(0.02)
        logits = DenseGeneral((d,), (e,), ("embed", "expert"), cfg.router_bias, dtype, param_dtype,
                              name="router")(x)
        routing = route(logits.reshape(b * t, e), k, cfg.norm_topk_prob, dtype, cfg.router_softmax)
        if real is not None and self.is_mutable_collection(ROUTER):
            self.sow(ROUTER, "stats", router_stats(logits.reshape(b * t, e), routing, real.reshape(-1)))

        def experts(name, shape, axes, initializer=init):
            return self.param(name, nn.with_logical_partitioning(initializer, axes), shape, param_dtype).astype(dtype)

        tokens = x.astype(dtype).reshape(b * t, d)
        rows = tokens[routing.order // k]  # [N*k, D]: each (token, slot) pair, grouped by expert
        sizes = routing.group_sizes
        if cfg.expert_kind == "clamped_swiglu":
            row_expert = routing.experts.reshape(-1)[routing.order]  # [N*k]: the expert of each sorted row
            gate_up = experts("gate_up", (e, d, 2 * f), ("expert", "embed", "mlp"))
            gate_up_bias = experts("gate_up_bias", (e, 2 * f), ("expert", "mlp"), nn.initializers.zeros)
            down = experts("down", (e, f, d), ("expert", "mlp", "embed"))
            down_bias = experts("down_bias", (e, d), ("expert", "embed"), nn.initializers.zeros)
            hidden = clamped_swiglu(jax.lax.ragged_dot(rows, gate_up, sizes) + gate_up_bias[row_expert],
                                    cfg.swiglu_limit, cfg.swiglu_alpha)
            out = jax.lax.ragged_dot(hidden, down, sizes) + down_bias[row_expert]  # [N*k, D]
        else:
            gate = experts("gate", (e, d, f), ("expert", "embed", "mlp"))
            up = experts("up", (e, d, f), ("expert", "embed", "mlp"))
            down = experts("down", (e, f, d), ("expert", "mlp", "embed"))
            hidden = (activation(cfg.act)(jax.lax.ragged_dot(rows, gate, sizes))
                      * jax.lax.ragged_dot(rows, up, sizes))
            out = jax.lax.ragged_dot(hidden, down, sizes)  # [N*k, D]
        per_slot = jnp.zeros_like(out).at[routing.order].set(out).reshape(b * t, k, d)
        y = (per_slot * routing.weights[..., None]).sum(axis=1)
        return y.reshape(b, t, d)
