"""Rotary position embeddings (the Hugging Face "rotate half" layout), with Llama-3 and linear scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ppo_jax.models.config import ModelConfig

Array = jax.Array


def rope_inverse_frequencies(config: ModelConfig, local: bool = False) -> Array:
    """[Dh/2] inverse frequencies, with Llama-3 or linear scaling when configured; `local`: those of
    the sliding layers (base `rope_local_theta`, never scaled)."""
    dh = config.dim_per_head
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    scaling = None if local else config.rope_scaling_dict
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


def rope_tables(config: ModelConfig, positions: Array, local: bool = False) -> tuple[Array, Array]:
    """cos, sin tables [B, T, Dh] (float32) for integer positions [B, T] (`local`: the sliding
    layers' tables)."""
    freqs = positions.astype(jnp.float32)[..., None] * rope_inverse_frequencies(config, local)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, heads, Dh] rotated by cos/sin [B, T, Dh]; math in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
