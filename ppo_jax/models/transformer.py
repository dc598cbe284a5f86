"""One Flax Linen decoder for GPT-2 and the Llama family, with an explicit KV cache.

Conventions
  B batch, T new tokens in this call, S key slots (T without a cache, the cache length with one),
  D hidden size, H query heads, K key/value heads, Dh head size, F MLP size, V vocabulary, L layers.

Every call takes explicit `positions [B, T]` and `kv_mask [B, S]` (1 for real key slots): left-padded
batches are the norm in RLHF, so nothing is inferred from the token ids. Layers are stacked with
`nn.scan` (one compiled layer body, parameters carry a leading `layers` axis), and every parameter
carries logical axis names that `ppo_jax.sharding` maps onto the mesh.

The cache is a plain pytree passed in and returned (no mutable Flax collections), so the sampler can
hold it in a `lax.while_loop` carry and donate it. It travels through the layer scan as part of the
carry, not as a scanned input/output: a decode step then writes only its new keys and values into the
stacked [L, ...] buffers in place, instead of slicing out and re-stacking every layer's whole slab.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax.models.config import ModelConfig, to_dtype

Array = jax.Array


# Logical axis names of KVCache.k / KVCache.v.
KV_CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")


class KVCache(flax.struct.PyTreeNode):
    """Preallocated keys and values of every layer.

    k, v:  [L, B, K, S, Dh] ([B, K, S, Dh] for one layer's cache, `split_cache`), in the layout
           attention consumes: for each (row, kv head) the S keys are contiguous [S, Dh] rows, so
           scores and the weighted sum are batched GEMMs that read the cache where it lies (no
           per-step transpose copy of the whole cache).
    index: [] int32, the number of slots already written (the same for every row: batches are
           left-padded, so row r's slot s holds its token s whatever its length).
    """

    k: Array
    v: Array
    index: Array

    @property
    def length(self) -> int:
        return self.k.shape[-2]


def init_cache(config: ModelConfig, batch: int, length: int, dtype: Any = None) -> KVCache:
    """Zero cache for `batch` rows of `length` slots; dtype defaults to the compute dtype."""
    dtype = to_dtype(dtype) if dtype is not None else config.jnp_dtype
    shape = (config.num_layers, batch, config.kv_heads, length, config.dim_per_head)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), index=jnp.zeros((), jnp.int32))


def split_cache(cache: KVCache) -> tuple[KVCache, ...]:
    """The stacked cache as one KVCache per layer, k and v [B, K, S, Dh] each (copies)."""
    return tuple(KVCache(k=cache.k[i], v=cache.v[i], index=cache.index)
                 for i in range(cache.k.shape[0]))


def split_layer_params(params: Any) -> tuple[Any, ...]:
    """One Block parameter tree per layer out of a CausalLM/ScalarModel tree (copies the layers)."""
    stacked = params["transformer"]["layers"]
    count = jax.tree.leaves(stacked)[0].shape[0]
    return tuple(jax.tree.map(lambda leaf, i=i: leaf[i], stacked) for i in range(count))


def positions_from_mask(mask: Array) -> Array:
    """Position ids of a left-padded batch: [B, T] mask -> [B, T] int32, 0 on padding."""
    mask = mask.astype(jnp.int32)
    return jnp.cumsum(mask, axis=-1) - mask


# --------------------------------------------------------------------------------------------
# Small building blocks with logical axis names.


def _param(module: nn.Module, name: str, init, shape, axes, dtype):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class DenseGeneral(nn.Module):
    """x[..., *in] @ kernel[*in, *out] (+ bias[*out]) with named axes; computes in `dtype`."""

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical names of kernel axes (in + out)
    use_bias: bool
    dtype: Any
    param_dtype: Any
    kernel_init: Any = nn.initializers.normal(0.02)

    @nn.compact
    def __call__(self, x: Array) -> Array:
        kernel = _param(self, "kernel", self.kernel_init, self.in_shape + self.out_shape, self.axes,
                        self.param_dtype)
        n_in = len(self.in_shape)
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        y = jax.lax.dot_general(x.astype(self.dtype), kernel.astype(self.dtype), (contract, ((), ())))
        if self.use_bias:
            bias = _param(self, "bias", nn.initializers.zeros, self.out_shape,
                          self.axes[n_in:], self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y


class LayerNorm(nn.Module):
    """GPT-2 LayerNorm (scale and bias), statistics in float32."""

    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d = x.shape[-1]
        scale = _param(self, "scale", nn.initializers.ones, (d,), ("norm",), self.param_dtype)
        bias = _param(self, "bias", nn.initializers.zeros, (d,), ("norm",), self.param_dtype)
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in float32, cast back, then scale (the Hugging Face order)."""

    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d = x.shape[-1]
        scale = _param(self, "scale", nn.initializers.ones, (d,), ("norm",), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
        return y.astype(self.dtype) * scale.astype(self.dtype)


def _norm(config: ModelConfig, name: str) -> nn.Module:
    cls = LayerNorm if config.family == "gpt2" else RMSNorm
    return cls(config.norm_eps, config.jnp_dtype, config.jnp_param_dtype, name=name)


# --------------------------------------------------------------------------------------------
# Rotary position embeddings (Hugging Face "rotate half" layout).


def rope_inverse_frequencies(config: ModelConfig) -> Array:
    """[Dh/2] inverse frequencies, with Llama-3 or linear scaling when configured."""
    dh = config.dim_per_head
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    scaling = config.rope_scaling_dict
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", "llama3")
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(is_medium, smoothed, scaled)


def rope_tables(config: ModelConfig, positions: Array) -> tuple[Array, Array]:
    """cos, sin tables [B, T, Dh] (float32) for integer positions [B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * rope_inverse_frequencies(config)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, heads, Dh] rotated by cos/sin [B, T, Dh]; math in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


# --------------------------------------------------------------------------------------------
# Attention and MLP.


def attention_mask(kv_mask: Array, query_slots: Array, sliding_window: int | None) -> Array:
    """[B, T, S] bool: key slot s is visible from query slot t.

    kv_mask [B, S]: real (non-padding, already written) key slots; query_slots [T]: the slot of each
    query. Causality is by slot; within a left-padded row slot differences equal position
    differences, so the sliding window is by slot too.
    """
    key_slots = jnp.arange(kv_mask.shape[-1])
    visible = key_slots[None, :] <= query_slots[:, None]
    if sliding_window is not None:
        visible &= query_slots[:, None] - key_slots[None, :] < sliding_window
    return visible[None, :, :] & kv_mask[:, None, :].astype(bool)


def dot_product_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """Grouped-query attention.

    q [B, T, H, Dh], k/v [B, K, S, Dh] (the cache layout), mask [B, T, S] -> [B, T, H, Dh]. Scores and softmax in
    float32; a masked score is the most negative finite float (not -inf), so a padded query whose
    keys are all masked gets a finite, ignored output instead of NaN.
    """
    b, t, h, dh = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(b, t, kv_heads, h // kv_heads, dh)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(dh)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v)
    return out.reshape(b, t, h, dh).astype(q.dtype)


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, cos, sin, mask, cache_kv, layer, cache_index):
        """x [B, T, D] -> ([B, T, D], cache_kv with this layer's new slots written, or None).

        cache_kv: None, the whole cache's (k, v) [L, B, K, S, Dh] with `layer` ([] int32) this layer's
        index into it, or (layer None) this layer's own (k, v) [B, K, S, Dh]; cache_index: [] int32,
        the slot of the first of the T new tokens.
        """
        cfg = self.config
        d, h, kh, dh = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
        gpt2 = cfg.family == "gpt2"
        common = dict(dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype)
        qkv_bias = gpt2 or cfg.attention_bias
        q = DenseGeneral((d,), (h, dh), ("embed", "heads", "head_dim"), qkv_bias, name="q", **common)(x)
        k = DenseGeneral((d,), (kh, dh), ("embed", "kv_heads", "head_dim"), qkv_bias, name="k", **common)(x)
        v = DenseGeneral((d,), (kh, dh), ("embed", "kv_heads", "head_dim"), qkv_bias, name="v", **common)(x)
        if not gpt2:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, Dh]
        if cache_kv is not None:
            # Write only the T new slots of this layer, then read the layer's [B, K, S, Dh] slab.
            if layer is None:
                cache_kv = tuple(jax.lax.dynamic_update_slice(c, new.astype(c.dtype), (0, 0, cache_index, 0))
                                 for c, new in zip(cache_kv, (k, v)))
                k, v = cache_kv
            else:
                start = (layer, 0, 0, cache_index, 0)
                cache_kv = tuple(jax.lax.dynamic_update_slice(c, new[None].astype(c.dtype), start)
                                 for c, new in zip(cache_kv, (k, v)))
                k, v = (jax.lax.dynamic_index_in_dim(c, layer, axis=0, keepdims=False) for c in cache_kv)
        out = dot_product_attention(q, k, v.astype(q.dtype), mask)
        out = DenseGeneral((h, dh), (d,), ("heads", "head_dim", "embed"), gpt2, name="o", **common)(out)
        return out, cache_kv


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        d, f = cfg.hidden_size, cfg.mlp_dim
        common = dict(dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype)
        act = {"gelu_new": lambda y: jax.nn.gelu(y, approximate=True),
               "gelu": lambda y: jax.nn.gelu(y, approximate=False),
               "silu": jax.nn.silu, "relu": jax.nn.relu}[cfg.act]
        if cfg.family == "gpt2":
            hidden = act(DenseGeneral((d,), (f,), ("embed", "mlp"), True, name="fc", **common)(x))
            return DenseGeneral((f,), (d,), ("mlp", "embed"), True, name="proj", **common)(hidden)
        gate = DenseGeneral((d,), (f,), ("embed", "mlp"), False, name="gate", **common)(x)
        up = DenseGeneral((d,), (f,), ("embed", "mlp"), False, name="up", **common)(x)
        return DenseGeneral((f,), (d,), ("mlp", "embed"), False, name="down", **common)(act(gate) * up)


class Block(nn.Module):
    """Pre-norm residual block. The scan carry is (residual stream x [B, T, D], whole-cache (k, v)
    or None); the scanned input is the layer index."""

    config: ModelConfig

    @nn.compact
    def __call__(self, carry, layer, cos, sin, mask, cache_index):
        x, cache_kv = carry
        attn_out, cache_kv = Attention(self.config, name="attn")(
            _norm(self.config, "ln_1")(x), cos, sin, mask, cache_kv, layer, cache_index)
        x = x + attn_out
        x = x + MLP(self.config, name="mlp")(_norm(self.config, "ln_2")(x))
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        return (x, cache_kv), None


def _lookup(embed: nn.Embed, ids: Array, rows: str = "vocab") -> Array:
    """Embedding rows for ids [B, T] -> [B, T, D].

    The table is gathered over its hidden axis first (the FSDP all-gather of a weight before use)
    while it stays split over the vocabulary: XLA partitions a gather along a sharded row axis well,
    but not one whose gathered axis is sharded too (it would replicate the whole table instead).
    """
    table = nn.with_logical_constraint(embed.embedding, (rows, "act_embed"))
    return jnp.take(table, ids, axis=0).astype(embed.dtype)


class Transformer(nn.Module):
    """Embeddings + scanned blocks + final norm: tokens [B, T] -> hidden [B, T, D]."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed"))
        self.embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=init,
                              dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype, name="embed")
        if cfg.family == "gpt2":
            pinit = nn.with_logical_partitioning(nn.initializers.normal(0.01), ("positions", "embed"))
            self.pos_embed = nn.Embed(cfg.max_position_embeddings, cfg.hidden_size, embedding_init=pinit,
                                      dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
                                      name="pos_embed")
        block = nn.remat(Block, prevent_cse=False) if cfg.remat else Block
        self.layers = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(cfg, name="layers")
        self.ln_f = _norm(cfg, "ln_f")

    def __call__(self, tokens: Array, positions: Array, kv_mask: Array,
                 cache: KVCache | None = None) -> tuple[Array, KVCache | None]:
        """tokens, positions [B, T]; kv_mask [B, S] -> hidden [B, T, D], cache (advanced by T)."""
        cache_index = cache.index if cache is not None else jnp.zeros((), jnp.int32)
        x, cos, sin, mask = self._block_inputs(tokens, positions, kv_mask, cache_index)
        cache_kv = (cache.k, cache.v) if cache is not None else None
        layer_ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        (x, cache_kv), _ = self.layers((x, cache_kv), layer_ids, cos, sin, mask, cache_index)
        if cache is not None:
            cache = KVCache(k=cache_kv[0], v=cache_kv[1], index=cache.index + tokens.shape[1])
        return self.ln_f(x), cache

    def unrolled(self, tokens: Array, positions: Array, kv_mask: Array, caches: tuple[KVCache, ...],
                 layer_params: tuple[Any, ...]) -> tuple[Array, tuple[KVCache, ...]]:
        """`__call__` with a cache, one layer at a time on per-layer parameters and caches.

        caches: one KVCache per layer with k, v [B, K, S, Dh] (`split_cache`); layer_params: one
        Block parameter tree per layer (`split_layer_params`). Used by the sampler's decode loop on
        XLA:CPU, where a scan over the stacked layers copies every layer's weights and cache slab out
        of the stacked buffers at every token (a dynamic slice feeding a dot is not fused there);
        with separate buffers the dots read weights and cache where they lie and each cache is
        updated in place.
        """
        cache_index = caches[0].index
        x, cos, sin, mask = self._block_inputs(tokens, positions, kv_mask, cache_index)
        block = Block(self.config, parent=None)  # unbound: applied to each layer's own parameters
        new_caches = []
        for params, cache in zip(layer_params, caches, strict=True):
            (x, (k, v)), _ = block.apply({"params": params}, (x, (cache.k, cache.v)), None, cos, sin, mask,
                                         cache_index)
            new_caches.append(KVCache(k=k, v=v, index=cache.index + tokens.shape[1]))
        return self.ln_f(x), tuple(new_caches)

    def _block_inputs(self, tokens, positions, kv_mask, cache_index):
        """Embedded tokens x [B, T, D], rope tables cos, sin [B, T, Dh] (scalars for GPT-2) and the
        attention mask [B, T, S] of T new tokens written from slot `cache_index` on."""
        cfg = self.config
        x = _lookup(self.embed, tokens)
        if cfg.family == "gpt2":
            x = x + _lookup(self.pos_embed, positions, rows="positions")
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        if cfg.family == "gpt2":
            cos = sin = jnp.zeros((), jnp.float32)  # unused
        else:
            cos, sin = rope_tables(cfg, positions)
        query_slots = cache_index + jnp.arange(tokens.shape[1])
        return x, cos, sin, attention_mask(kv_mask, query_slots, cfg.sliding_window)

    def logits(self, hidden: Array) -> Array:
        """Tied output projection: [B, T, D] -> [B, T, V] float32."""
        return self.embed.attend(hidden).astype(jnp.float32)


class CausalLM(nn.Module):
    """Language model: returns logits [B, T, V] (float32) and the advanced cache."""

    config: ModelConfig

    def setup(self):
        self.transformer = Transformer(self.config, name="transformer")
        if not self.config.tie_word_embeddings:
            cfg = self.config
            self.lm_head = DenseGeneral((cfg.hidden_size,), (cfg.vocab_size,), ("embed", "vocab"), False,
                                        cfg.jnp_dtype, cfg.jnp_param_dtype, name="lm_head")

    def __call__(self, tokens, positions, kv_mask, cache=None):
        hidden, cache = self.transformer(tokens, positions, kv_mask, cache)
        return self.project(hidden), cache

    def hidden(self, tokens, positions, kv_mask):
        """Final hidden states [B, T, D] without the output projection (slice before projecting)."""
        return self.transformer(tokens, positions, kv_mask)[0]

    def project(self, hidden: Array) -> Array:
        """[..., D] -> [..., V] float32. Flattened to [N, D] first: the backward pass of a 3-D
        projection writes its large [V, D] gradient through an extra transpose on XLA:CPU."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.config.tie_word_embeddings:
            logits = self.transformer.logits(flat)
        else:
            logits = self.lm_head(flat).astype(jnp.float32)
        return logits.reshape(hidden.shape[:-1] + logits.shape[-1:])


class ScalarModel(nn.Module):
    """Transformer with a scalar head (value and reward models): returns [B, T] float32.

    head_init "reward": N(0, 1/sqrt(D+1)) as in Stiennon et al.; "zero": all zeros (a value model
    grown from the policy starts by predicting 0).
    """

    config: ModelConfig
    head_init: str = "reward"

    @nn.compact
    def __call__(self, tokens, positions, kv_mask, cache=None):
        cfg = self.config
        hidden, cache = Transformer(cfg, name="transformer")(tokens, positions, kv_mask, cache)
        if self.head_init == "zero":
            init = nn.initializers.zeros
        elif self.head_init == "reward":
            init = nn.initializers.normal(1.0 / math.sqrt(cfg.hidden_size + 1))
        else:
            raise ValueError(f"head_init must be 'reward' or 'zero', got {self.head_init!r}")
        head = DenseGeneral((cfg.hidden_size,), (1,), ("embed", "score"), True, jnp.float32,
                            cfg.jnp_param_dtype, kernel_init=init, name="score")
        return head(hidden.astype(jnp.float32))[..., 0], cache


def last_token_index(mask: Array) -> Array:
    """Index of the last real token of each row of a [B, T] mask (-> [B] int32; 0 if empty)."""
    t = mask.shape[-1]
    idx = jnp.where(mask.astype(bool), jnp.arange(t)[None, :], -1).max(-1)
    return jnp.maximum(idx, 0).astype(jnp.int32)


def score_at_last_token(values: Array, mask: Array) -> Array:
    """Scalar-head output read at the last real token: values [B, T], mask [B, T] -> [B]."""
    return jnp.take_along_axis(values, last_token_index(mask)[:, None], axis=1)[:, 0]
