"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, GPT-OSS): a top-k softmax router and gated experts,
dropless.

Every token goes to its `experts_per_token` experts, none is dropped: the (token, expert) pairs are
sorted by expert and each expert's rows multiply its weights in one grouped matmul
(`jax.lax.ragged_dot`, which XLA lowers to a grouped GEMM on GPU and TPU), so the cost is that of the
routed tokens, with no capacity factor and no padding to it.

A token's output depends only on the token (routing, the grouped matmuls and the weighted sum are
all per row), so with the same weights and numerics the sampler's cached decode and the training
forward route every token to the same experts. When they differ (a bf16 sampler, stale weights) a
near-tie of two router logits can resolve the other way: routing replay (`moe.router_replay`,
docs/off_policy.md) records the sampler's choice (the CHOSEN collection) and the training forward
takes it (`MoEMLP`'s `experts`) instead of its own top-k.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax import sharding
from ppo_jax.models.config import ModelConfig
from ppo_jax.models.layers import DenseGeneral, activation

Array = jax.Array

# The Flax collection MoEMLP sows its router statistics into (one entry per layer) when a forward
# makes it mutable: `apply(..., mutable=[ROUTER])`. Forwards that do not (the sampler, scoring)
# compute nothing for it.
ROUTER = "router_stats"
# The collection MoEMLP sows each token's chosen experts into ([B, T, k] int32 per layer) when a
# forward makes it mutable: the sampler's record for routing replay.
CHOSEN = "chosen_experts"


@dataclasses.dataclass(frozen=True)
class Routing:
    """Each token's experts and their weights: experts [N, k] int32, weights [N, k] (compute dtype);
    with routing replay also own [N, k] int32, the token's own top k (what replay overrode)."""

    experts: Array
    weights: Array
    own: Array | None = None


def route(router_logits: Array, k: int, normalize: bool, dtype, softmax: str = "all",
          replay: Array | None = None) -> Routing:
    """The top k experts of each token and their weights, in float32. router_logits [N, E].

    softmax "all": softmax over all experts, then the top k; `normalize` rescales the k weights to
    sum to 1 (Mixtral always; Qwen3-MoE's norm_topk_prob). "topk": the top k logits, then a softmax
    over those k (GPT-OSS).

    replay [N, k] int (routing replay): the experts to use instead of the top k, -1 for a token whose
    own top k stands. The weights are the same function of these logits evaluated at the replayed
    experts (the router still gets its gradient through them); at a token whose replayed experts are
    its own top k they are the very same numbers, so replay changes nothing where routing agrees."""
    logits = router_logits.astype(jnp.float32)
    scores = logits if softmax == "topk" else jax.nn.softmax(logits, axis=-1)
    _, own = jax.lax.top_k(scores, k)
    experts = own if replay is None else jnp.where(replay[:, :1] >= 0, replay.astype(own.dtype), own)
    picked = jnp.take_along_axis(scores, experts, axis=-1)  # == top_k's values where not replayed
    if softmax == "topk":
        weights = jax.nn.softmax(picked, axis=-1)
    else:
        weights = picked / picked.sum(-1, keepdims=True) if normalize else picked
    return Routing(experts=experts, weights=weights.astype(dtype), own=None if replay is None else own)


def index_dtype(num_experts: int):
    """The narrowest signed int holding an expert index and the -1 of "not recorded": a recorded
    routing [R, T, Lm, k] is the sampler's largest buffer after the KV cache."""
    return jnp.int8 if num_experts <= 127 else jnp.int16


def routing_flips(own: Array, recorded: Array) -> Array:
    """[..., T] float32: 1 where a token's own top k differs (as a set) from its recorded experts in
    any MoE layer, 0 elsewhere and where nothing was recorded (-1). own, recorded [..., T, Lm, k]."""
    differs = jnp.any(jnp.sort(own, axis=-1) != jnp.sort(recorded.astype(own.dtype), axis=-1), axis=-1)
    return jnp.any(differs & (recorded[..., 0] >= 0), axis=-1).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Groups:
    """Flat (token, slot) pairs sorted by group: order [M] (row i is pair order[i]), sizes [G] int32
    (rows per group, in group order), keys [M] (each sorted row's group; G for a pair in no group,
    sorted after every group)."""

    order: Array
    sizes: Array
    keys: Array


def group_pairs(keys: Array, num_groups: int) -> Groups:
    """keys [M] in [0, num_groups]: each pair's group, num_groups for "in none" (another device's
    expert under expert parallelism)."""
    order = jnp.argsort(keys, stable=True)
    sizes = jnp.bincount(keys, length=num_groups + 1)[:num_groups].astype(jnp.int32)
    return Groups(order=order, sizes=sizes, keys=keys[order])


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


def expert_ffn(cfg: ModelConfig, w: dict[str, Array], rows: Array, sizes: Array, row_expert: Array) -> Array:
    """Each row through its expert: rows [M, D] grouped by expert (`sizes` [E'] rows for each of the
    E' experts in `w`, in order; rows past their sum are left unspecified), row_expert [M] (into `w`'s
    experts; read for the biases) -> [M, D]. w: the expert weights [E', ...] of `MoEMLP`."""
    if cfg.expert_kind == "clamped_swiglu":
        gate_up = jax.lax.ragged_dot(rows, w["gate_up"], sizes) + w["gate_up_bias"][row_expert]
        hidden = clamped_swiglu(gate_up, cfg.swiglu_limit, cfg.swiglu_alpha)
        return jax.lax.ragged_dot(hidden, w["down"], sizes) + w["down_bias"][row_expert]
    hidden = (activation(cfg.act)(jax.lax.ragged_dot(rows, w["gate"], sizes))
              * jax.lax.ragged_dot(rows, w["up"], sizes))
    return jax.lax.ragged_dot(hidden, w["down"], sizes)


def combine(out: Array, order: Array, weights: Array) -> Array:
    """The expert outputs back to their tokens: out [N*k, D] in `order` (row i is flat (token, slot)
    pair order[i]), weights [N, k] -> [N, D], each token's weighted sum over its k slots."""
    n, k = weights.shape
    per_slot = jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)
    return (per_slot * weights[..., None]).sum(axis=1)


def grouped_ffn(cfg: ModelConfig, w: dict[str, Array], tokens: Array, groups: Groups, k: int) -> Array:
    """Each (token, slot) pair of `groups` through its expert in `w`: tokens [N, D] -> [N*k, D] in the
    groups' order (rows in no group come out unspecified)."""
    num_groups = groups.sizes.shape[0]
    return expert_ffn(cfg, w, tokens[groups.order // k], groups.sizes, jnp.minimum(groups.keys, num_groups - 1))


def all_experts(cfg: ModelConfig, w: dict[str, Array], tokens: Array, routing: Routing) -> Array:
    """tokens [N, D] -> [N, D] with every expert in one program (one device, or partitioned by XLA)."""
    e, k = w["down"].shape[0], routing.experts.shape[-1]
    groups = group_pairs(routing.experts.reshape(-1), e)
    return combine(grouped_ffn(cfg, w, tokens, groups, k), groups.order, routing.weights)


def _local_experts(cfg: ModelConfig, w: dict[str, Array], tokens: Array, experts: Array,
                   weights: Array) -> Array:
    """One device's share of an expert-parallel MoE layer (inside `shard_map` over the batch axes):
    tokens [n, D], experts / weights [n, k] its tokens and their routing; w its E / X experts ->
    [n, D] the full layer output for its tokens.

    The devices of an expert group (the X devices along the `expert` axis) all-gather their tokens;
    each runs its own experts' rows of the X * n tokens (dropless: a device's rows are bounded by
    X * n * k, all of them in the worst case, so that is the static buffer) and the partial sums go
    back to the tokens' devices by a reduce-scatter. This is Megatron's all-gather token dispatcher: it
    moves X * n * D values each way, where an all-to-all moves k times that (each token once per
    expert) but needs the per-device counts first."""
    local = w["down"].shape[0]
    tokens = jax.lax.all_gather(tokens, "expert", tiled=True)  # [X*n, D]
    experts = jax.lax.all_gather(experts, "expert", tiled=True)
    weights = jax.lax.all_gather(weights, "expert", tiled=True)
    n, k = experts.shape
    slot_expert = experts.reshape(-1) - jax.lax.axis_index("expert") * local  # [X*n*k]: index into w
    mine = (slot_expert >= 0) & (slot_expert < local)
    groups = group_pairs(jnp.where(mine, slot_expert, local), local)  # the other devices' pairs: in none
    out = jnp.where((groups.keys < local)[:, None], grouped_ffn(cfg, w, tokens, groups, k), 0)  # never summed
    partial = combine(out, groups.order, jnp.where(mine.reshape(n, k), weights, 0))
    return jax.lax.psum_scatter(partial, "expert", tiled=True)


def expert_parallel(cfg: ModelConfig, w: dict[str, Array], tokens: Array, routing: Routing,
                    mesh) -> Array:
    """tokens [N, D] -> [N, D] with the experts split over the mesh's `expert` axis: each device
    dispatches its own tokens (`_local_experts`); N is padded to the batch devices with tokens that
    no expert weighs."""
    n = tokens.shape[0]
    batch_axes = tuple(a for a in sharding.BATCH_AXES if a in mesh.axis_names)
    pad = -n % math.prod(mesh.shape[a] for a in batch_axes)
    experts = jnp.pad(routing.experts, ((0, pad), (0, 0)))
    weights = jnp.pad(routing.weights, ((0, pad), (0, 0)))  # padding rows weigh 0
    rows = jax.sharding.PartitionSpec(batch_axes)
    run = jax.shard_map(functools.partial(_local_experts, cfg), mesh=mesh,
                        in_specs=(jax.sharding.PartitionSpec("expert"), rows, rows, rows), out_specs=rows,
                        axis_names=set(batch_axes), check_vma=False)
    return run(w, jnp.pad(tokens, ((0, pad), (0, 0))), experts, weights)[:n]


def _experts(cfg: ModelConfig, w: dict[str, Array], x: Array, experts: Array, weights: Array) -> Array:
    """x [B, T, D] through its tokens' experts [B, T, k] weighed by weights [B, T, k] -> [B, T, D]:
    every expert in one program, or split over the mesh's expert axis (`expert_parallel`)."""
    b, t, d = x.shape
    routing = Routing(experts.reshape(b * t, -1), weights.reshape(b * t, -1))
    mesh = jax.sharding.get_abstract_mesh()
    if sharding.expert_axis_size(mesh) == 1:
        return all_experts(cfg, w, x.reshape(b * t, d), routing).reshape(b, t, d)
    return expert_parallel(cfg, w, x.reshape(b * t, d), routing, mesh).reshape(b, t, d)


class MoEMLP(nn.Module):
    """x [B, T, D] -> [B, T, D]: sum over a token's k experts of weight * expert(x).

    Params: router [D, E] (+ bias [E]); expert_kind "swiglu": gate, up [E, D, F] and down [E, F, D],
    expert(x) = down(act(gate(x)) * up(x)); "clamped_swiglu" (GPT-OSS): gate_up [E, D, 2F] (gate and
    up features interleaved, as the checkpoint holds them: one grouped matmul for both) and down
    [E, F, D], each with a bias [E, ...] (F = moe_intermediate_size).

    Under a mesh with an `expert` axis the experts are split over it (`expert_parallel`); otherwise
    every device's program holds every expert (sharded over fsdp / tensor like any weight)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, real: Array | None = None, experts: Array | None = None) -> Array:
        """real [B, T]: the real (non-padding) tokens; with it, and the ROUTER collection mutable,
        the layer sows its `router_stats`. experts [B, T, k] int: routing replay (`route`'s
        `replay`), None: each token's own top k. With the CHOSEN collection mutable the layer sows
        the experts it used [B, T, k] int32."""
        cfg = self.config
        b, t, d = x.shape
        e, f, k = cfg.num_experts, cfg.expert_mlp_dim, cfg.experts_per_token
        dtype, param_dtype = cfg.jnp_dtype, cfg.jnp_param_dtype
        init = nn.initializers.normal(0.02)
        logits = DenseGeneral((d,), (e,), ("embed", "expert"), cfg.router_bias, dtype, param_dtype,
                              name="router")(x)
        replay = None if experts is None else experts.reshape(b * t, k)
        routing = route(logits.reshape(b * t, e), k, cfg.norm_topk_prob, dtype, cfg.router_softmax, replay)
        if self.is_mutable_collection(CHOSEN):
            self.sow(CHOSEN, "experts", routing.experts.reshape(b, t, k).astype(jnp.int32))
            if routing.own is not None:  # what this forward would have chosen: the replay's mismatch metric
                self.sow(CHOSEN, "own", routing.own.reshape(b, t, k).astype(jnp.int32))
        if real is not None and self.is_mutable_collection(ROUTER):
            self.sow(ROUTER, "stats", router_stats(logits.reshape(b * t, e), routing, real.reshape(-1)))

        def param(name, shape, axes, initializer=init):
            return self.param(name, nn.with_logical_partitioning(initializer, axes), shape, param_dtype).astype(dtype)

        if cfg.expert_kind == "clamped_swiglu":
            w = {"gate_up": param("gate_up", (e, d, 2 * f), ("expert", "embed", "mlp")),
                 "gate_up_bias": param("gate_up_bias", (e, 2 * f), ("expert", "mlp"), nn.initializers.zeros),
                 "down": param("down", (e, f, d), ("expert", "mlp", "embed")),
                 "down_bias": param("down_bias", (e, d), ("expert", "embed"), nn.initializers.zeros)}
        else:
            w = {"gate": param("gate", (e, d, f), ("expert", "embed", "mlp")),
                 "up": param("up", (e, d, f), ("expert", "embed", "mlp")),
                 "down": param("down", (e, f, d), ("expert", "mlp", "embed"))}
        mesh = jax.sharding.get_abstract_mesh()
        if sharding.expert_axis_size(mesh) > 1:
            sharding.check_experts_split(e, mesh, "MoEMLP")
        chosen, weights = (a.reshape(b, t, k) for a in (routing.experts, routing.weights))
        # rows split along the sequence: each device its own slots (not a sampler's decode step, T = 1)
        if sharding.context_axis_size(mesh) > 1 and t % sharding.context_axis_size(mesh) == 0:
            return sharding.over_context(functools.partial(_experts, cfg), (None, 1, 1, 1), out_axis=1)(
                w, x.astype(dtype), chosen, weights)
        return _experts(cfg, w, x.astype(dtype), chosen, weights)
