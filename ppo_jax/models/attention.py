"""Attention: the mask, the reference einsum kernel, the fused (cuDNN flash) call, and the layer.

Two kernels compute the same function:

- `einsum_attention`, the reference: float32 scores, grouped-query attention by reshaping the query
  heads, reading keys and values in the KV cache's [B, K, S, Dh] layout. Used for one-token decode
  steps on every platform (they read the cache where it lies), and everywhere with `attention="einsum"`.
- `fused_attention`: `jax.nn.dot_product_attention` on keys and values as the projections produce them
  ([B, T, K, Dh], no cache), with `implementation="cudnn"` (flash attention: measured 3.5-4x faster
  than the einsum for the forward + backward of a 22-layer 1B model on an H100, docs/gpu_probe.md) or
  "xla". Left padding stays on the fused path: the [B, T, S] mask is passed whole ([B, 1, T, S]; cuDNN
  refuses a [B, 1, 1, S] key mask on T > 1 and its sequence-length arguments assume right padding),
  and `is_causal` lets cuDNN skip the blocks above the diagonal. The K/V heads go in unrepeated (cuDNN
  does grouped-query attention itself; repeating them is slower and less accurate). It has no
  soft-capping, so a model with `attn_logit_softcap` (Gemma 2) runs the einsum kernel whatever
  `ModelConfig.attention` says. With a KV cache, a call of T > 1 tokens (the sampler's prefill, a
  chunk of one) runs it too, on all S cache slots with the [B, T, S] mask and no `is_causal` (its
  queries may sit at a cache offset).

Padding rows see no key at all; both kernels give them a finite output (never NaN), which the losses
mask out.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from ppo_jax.models.config import ModelConfig
from ppo_jax.models.layers import DenseGeneral, norm, softcap
from ppo_jax.models.rope import apply_rope

Array = jax.Array


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


def einsum_attention(q: Array, k: Array, v: Array, mask: Array, scale: float | None = None,
                     cap: float | None = None) -> Array:
    """Grouped-query attention, the reference kernel.

    q [B, T, H, Dh], k/v [B, K, S, Dh] (the cache layout), mask [B, T, S] -> [B, T, H, Dh]. Scores and
    softmax in float32; a masked score is the most negative finite float (not -inf), so a padded query
    whose keys are all masked gets a finite, ignored output instead of NaN. scale: the scores'
    factor (None: 1/sqrt(Dh)); cap: soft-capping of the scaled scores (None: off).
    """
    b, t, h, dh = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(b, t, kv_heads, h // kv_heads, dh)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(dh) if scale is None else scores * scale
    scores = softcap(scores, cap)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v)
    return out.reshape(b, t, h, dh).astype(q.dtype)


def fused_attention(q: Array, k: Array, v: Array, mask: Array, implementation: str,
                    scale: float | None = None, is_causal: bool = True) -> Array:
    """Attention of T queries on S keys through `jax.nn.dot_product_attention`.

    q [B, T, H, Dh], k/v [B, S, K, Dh] (projection layout), mask [B, T, S] (causal, padding and window
    already in it) -> [B, T, H, Dh]; implementation "cudnn" or "xla"; scale: the scores' factor
    (None: 1/sqrt(Dh)). is_causal: query t is slot t (self-attention without a cache, T == S), so
    the kernel may skip the blocks above the diagonal; off for queries written at a cache offset,
    where the mask alone says what each sees. No soft-capping: such models stay on `einsum_attention`.
    """
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, is_causal=is_causal,
                                       implementation=implementation)
    return out.astype(q.dtype)


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
        q = DenseGeneral((d,), (h, dh), ("embed", "heads", "head_dim"), qkv_bias, name="q",
                         lora=cfg.lora_for("q"), **common)(x)
        k = DenseGeneral((d,), (kh, dh), ("embed", "kv_heads", "head_dim"), qkv_bias, name="k",
                         lora=cfg.lora_for("k"), **common)(x)
        v = DenseGeneral((d,), (kh, dh), ("embed", "kv_heads", "head_dim"), qkv_bias, name="v",
                         lora=cfg.lora_for("v"), **common)(x)
        if cfg.qk_norm:  # over each head's Dh features, before the rotation
            q, k = norm(cfg, "q_norm")(q), norm(cfg, "k_norm")(k)
        if not gpt2:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
        fused = cfg.attention != "einsum" and cfg.attn_logit_softcap is None  # see config.ATTENTION_KINDS
        if cache_kv is None and fused:
            out = fused_attention(q, k, v, mask, cfg.attention, scale)
        else:
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, Dh]
            if cache_kv is not None:
                cache_kv, (k, v) = _write_cache(cache_kv, k, v, layer, cache_index)
            if fused and q.shape[1] > 1:
                # A prefill (or a chunk of one): T queries against the cache's S slots on the fused
                # kernel, the cache read in the projection layout. A one-token decode step stays on
                # the einsum, which reads the cache where it lies.
                kv = tuple(x.transpose(0, 2, 1, 3).astype(q.dtype) for x in (k, v))  # [B, S, K, Dh]
                out = fused_attention(q, *kv, mask, cfg.attention, scale, is_causal=False)
            else:
                out = einsum_attention(q, k, v.astype(q.dtype), mask, scale, cfg.attn_logit_softcap)
        out = DenseGeneral((h, dh), (d,), ("heads", "head_dim", "embed"), gpt2 or cfg.attention_out_bias,
                           name="o", lora=cfg.lora_for("o"), **common)(out)
        return out, cache_kv


def _write_cache(cache_kv, k: Array, v: Array, layer, cache_index):
    """Writes only the T new slots of this layer (k, v [B, K, T, Dh]) into the cache, then reads the
    layer's [B, K, S, Dh] slab: (the updated cache_kv, (k, v) of all S slots)."""
    if layer is None:
        cache_kv = tuple(jax.lax.dynamic_update_slice(c, new.astype(c.dtype), (0, 0, cache_index, 0))
                         for c, new in zip(cache_kv, (k, v)))
        return cache_kv, cache_kv
    start = (layer, 0, 0, cache_index, 0)
    cache_kv = tuple(jax.lax.dynamic_update_slice(c, new[None].astype(c.dtype), start)
                     for c, new in zip(cache_kv, (k, v)))
    slabs = tuple(jax.lax.dynamic_index_in_dim(c, layer, axis=0, keepdims=False) for c in cache_kv)
    return cache_kv, slabs
