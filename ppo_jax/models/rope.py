"""Rotary position embeddings (the Hugging Face "rotate half" layout) and the rope scalings of the
families we load: linear, Llama-3, YaRN, dynamic NTK and LongRoPE, each computed as `transformers`
computes it (modeling_rope_utils), so imported checkpoints give its logits.

Two of them depend on the forward call, as in `transformers`: dynamic NTK and LongRoPE look at the
longest position of the call (`max(positions) + 1` over the batch). Dynamic NTK grows its base once
that passes `max_position_embeddings`; LongRoPE switches from its short to its long factors once it
passes `original_max_position_embeddings`. Through a KV cache each chunk decides for itself, so keys
cached before the switch keep their old rotation, exactly as `transformers` does.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ppo_jax.models.config import ROPE_SCALING_KEYS, ModelConfig

Array = jax.Array

# The scalings whose frequencies change with the call's longest position.
LENGTH_DEPENDENT = ("dynamic", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeFrequencies:
    """inv_freq [Dh/2] and the factor cos and sin are multiplied by (YaRN's and LongRoPE's
    attention scaling: q.k grows by its square; 1.0 for the others)."""

    inv_freq: Array
    attention_factor: float = 1.0


def _wavelength_scales(theta, dh: int) -> Array:
    """[Dh/2] theta^(2i/Dh) (theta may be a traced scalar); each scaling divides 1 by it, in
    transformers' order of operations, so the float32 rounding is the same."""
    return theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)


def _base_inverse_frequencies(theta, dh: int) -> Array:
    """[Dh/2] the unscaled frequencies theta^(-2i/Dh)."""
    return 1.0 / _wavelength_scales(theta, dh)


def _llama3(inv_freq: Array, s: dict) -> Array:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth band between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(s: dict) -> float:
    """YaRN's cos/sin factor: `attention_factor` when given, else from `factor` (and DeepSeek's
    `mscale` / `mscale_all_dim` when both are set)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return _yarn_mscale(factor, float(s["mscale"])) / _yarn_mscale(factor, float(s["mscale_all_dim"]))
    return _yarn_mscale(factor)


def _yarn(theta: float, dh: int, s: dict) -> Array:
    """YaRN ("NTK-by-parts"): dimensions that turn fewer than `beta_slow` times over the original
    context are interpolated (divided by `factor`), those that turn more than `beta_fast` times are
    kept, with a linear ramp between."""
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dimension_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dh * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dh - 1)
    if low == high:
        high += 0.001  # as transformers: avoids dividing by zero
    ramp = jnp.clip((jnp.arange(dh // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # 1: extrapolate (keep), 0: interpolate (divide by factor)
    extrapolated = _base_inverse_frequencies(theta, dh)
    interpolated = 1.0 / (factor * _wavelength_scales(theta, dh))
    return interpolated * (1 - kept) + extrapolated * kept


def longrope_attention_factor(s: dict, max_position_embeddings: int) -> float:
    """LongRoPE's cos/sin factor: `attention_factor` when given, else sqrt(1 + ln(factor) /
    ln(original length)), `factor` defaulting to the context extension max / original."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    old_len = float(s["original_max_position_embeddings"])
    factor = float(s["factor"]) if s.get("factor") is not None else max_position_embeddings / old_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def rope_frequencies(config: ModelConfig, local: bool = False, seq_len: Array | None = None
                     ) -> RopeFrequencies:
    """The rope frequencies of the global layers, or (`local`) of the sliding ones (base
    `rope_local_theta`, never scaled). `seq_len`: the call's longest position + 1 (a scalar, may be
    traced), read only by the length-dependent scalings."""
    dh = config.dim_per_head
    theta = config.rope_local_theta if local else config.rope_theta
    scaling = None if local else config.rope_scaling_dict
    if not scaling:
        return RopeFrequencies(_base_inverse_frequencies(theta, dh))
    kind = scaling.get("rope_type", "llama3")
    if kind == "linear":
        return RopeFrequencies(_base_inverse_frequencies(theta, dh) / float(scaling["factor"]))
    if kind == "llama3":
        return RopeFrequencies(_llama3(_base_inverse_frequencies(theta, dh), scaling))
    if kind == "yarn":
        return RopeFrequencies(_yarn(theta, dh, scaling), yarn_attention_factor(scaling))
    if kind == "dynamic":
        # The base grows with the call's length past max_position_embeddings (never shrinks below it).
        factor, max_len = float(scaling["factor"]), float(config.max_position_embeddings)
        length = jnp.asarray(seq_len, jnp.float32)
        grown = theta * ((factor * length / max_len) - (factor - 1)) ** (dh / (dh - 2))
        return RopeFrequencies(_base_inverse_frequencies(jnp.where(length > max_len, grown, theta), dh))
    if kind == "longrope":
        short = jnp.asarray(scaling["short_factor"], jnp.float32)
        long = jnp.asarray(scaling["long_factor"], jnp.float32)
        is_long = jnp.asarray(seq_len) > scaling["original_max_position_embeddings"]
        ext = jnp.where(is_long, long, short)
        return RopeFrequencies(1.0 / (ext * _wavelength_scales(theta, dh)),
                               longrope_attention_factor(scaling, config.max_position_embeddings))
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, {', '.join(ROPE_SCALING_KEYS)})")


def rope_tables(config: ModelConfig, positions: Array, local: bool = False) -> tuple[Array, Array]:
    """cos, sin tables [B, T, Dh] (float32) for integer positions [B, T] (`local`: the sliding
    layers' tables), times the scaling's attention factor."""
    seq_len = jnp.max(positions) + 1 if _length_dependent(config, local) else None
    rope = rope_frequencies(config, local, seq_len)
    freqs = positions.astype(jnp.float32)[..., None] * rope.inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if rope.attention_factor == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * rope.attention_factor, jnp.sin(emb) * rope.attention_factor


def _length_dependent(config: ModelConfig, local: bool) -> bool:
    scaling = None if local else config.rope_scaling_dict
    return bool(scaling) and scaling.get("rope_type") in LENGTH_DEPENDENT


def cached_decode_limit(config: ModelConfig) -> int | None:
    """The longest sequence a cached decode rotates exactly as one forward over it does, when that
    is shorter than max_position_embeddings (the limit every run keeps to, config.check_positions);
    None otherwise.

    LongRoPE switches to its long factors past original_max_position_embeddings for the later chunks
    only: keys cached with the short factors meet queries rotated with the long ones (transformers'
    Phi-3 generate re-encodes the whole prefix at that point), so a sampler's log-probs are not a
    training forward's. Dynamic NTK changes nothing below max_position_embeddings."""
    scaling = config.rope_scaling_dict or {}
    if scaling.get("rope_type") == "longrope":
        limit = int(scaling["original_max_position_embeddings"])
        return limit if limit < config.max_position_embeddings else None
    return None


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, heads, Dh] rotated by cos/sin [B, T, Dh]; math in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
