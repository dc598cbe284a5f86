"""Masked statistics over padded `[B, L]` arrays, and token-weighted reductions that split exactly.

Conventions
  `mask` is 1 (or True) on real tokens and 0 on padding; it broadcasts against `x`. Padded entries of
  `x` are never read arithmetically (`jnp.where`, not `x * mask`), so NaN or inf stored in padding
  (e.g. a log-prob of a pad token) cannot leak into a statistic.

Variance is biased (divide by the token count) by default, as the reference PPO implementations use
for advantage whitening.

Token-weighted means across microbatches and devices: a mean of per-microbatch means is wrong when
microbatches hold different numbers of real tokens. `SumCount` keeps the sum and the count apart so
that adding microbatch (or device) results and dividing once gives the exact full-batch mean; `Moments`
does the same for a variance. Under `jax.jit` with sharded global arrays a plain masked sum is already
global; inside `jax.shard_map` reduce with `jax.lax.psum(sum_count, axis_name)` (both are pytrees).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


def last_token_index(mask: Array) -> Array:
    """Index of the last real position of each row: [B, L] mask -> [B] int32, -1 for a row with no
    real position (to gather with it, clamp: `jnp.maximum(index, 0)`, and mask the empty rows)."""
    mask = jnp.asarray(mask) != 0
    length = mask.shape[-1]
    from_end = jnp.argmax(mask[..., ::-1], axis=-1)
    return jnp.where(mask.any(axis=-1), length - 1 - from_end, -1).astype(jnp.int32)


def _float(x: Array) -> Array:
    """At least float32 for accumulation (bf16 sums over thousands of tokens lose digits)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _mask_as(x: Array, mask: Array) -> Array:
    """Mask broadcast to x's shape as float (0/1 weights)."""
    return jnp.broadcast_to(_float(jnp.asarray(mask)), jnp.shape(x))


def _safe_divide(numerator: Array, denominator: Array) -> Array:
    """numerator / denominator, and 0 where the denominator is 0 (an empty selection has no mean)."""
    nonzero = denominator != 0
    return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1), 0)


def check_same_shape(**arrays) -> tuple[int, ...]:
    """Raise a ValueError naming the offending argument unless all arrays share one shape."""
    shapes = {name: tuple(jnp.shape(a)) for name, a in arrays.items()}
    first_name, first_shape = next(iter(shapes.items()))
    for name, shape in shapes.items():
        if shape != first_shape:
            raise ValueError(f"{name} has shape {shape} but {first_name} has shape {first_shape}; "
                             f"{', '.join(shapes)} must have the same shape")
    return first_shape


def masked_sum(x: Array, mask: Array, axis=None) -> Array:
    """Sum of x over real positions (mask != 0), weighted by mask. x: [...], mask broadcastable."""
    x = _float(x)
    weights = _mask_as(x, mask)
    return jnp.sum(jnp.where(weights != 0, x, 0) * weights, axis=axis)


def masked_count(x: Array, mask: Array, axis=None) -> Array:
    """Number of real positions (sum of mask weights) over `axis`, as float."""
    return jnp.sum(_mask_as(x, mask), axis=axis)


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
    """Mean of x over real positions; 0 where no position is real."""
    return _safe_divide(masked_sum(x, mask, axis), masked_count(x, mask, axis))


def masked_var(x: Array, mask: Array, unbiased: bool = False, axis=None) -> Array:
    """Variance of x over real positions (biased by default; `unbiased` applies n / (n - 1)).

    Returns 0 where fewer than one (biased) or two (unbiased) positions are real.
    """
    mean = masked_mean(x, mask, axis)
    mean = mean if axis is None else jnp.expand_dims(mean, axis)
    centered = _float(x) - mean
    count = masked_count(x, mask, axis)
    sum_sq = masked_sum(centered * centered, mask, axis)
    return _safe_divide(sum_sq, count - 1 if unbiased else count) * (count > (1 if unbiased else 0))


def masked_whiten(x: Array, mask: Array, shift_mean: bool = True, eps: float = 1e-8,
                  unbiased: bool = False) -> Array:
    """(x - mean) / sqrt(var + eps) with mean and variance over real positions only.

    With `shift_mean=False` the mean is added back (only the scale changes), as reward whitening
    does. Padded positions of the result are 0. Same shape and (float) dtype as x.
    """
    x = _float(x)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=unbiased)
    whitened = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(_mask_as(x, mask) != 0, whitened, 0)


@flax.struct.dataclass
class SumCount:
    """A token-weighted mean kept as (sum, count) so that it adds exactly across microbatches/devices.

    total: [...] sum of the values over real tokens; count: [...] number of real tokens.
    `a + b` pools two disjoint sets of tokens; `.mean()` divides once (0 for an empty set).
    """

    total: Array
    count: Array

    @classmethod
    def of(cls, x: Array, mask: Array) -> "SumCount":
        """Sum and count of x over the real positions of mask (all axes)."""
        return cls(total=masked_sum(x, mask), count=masked_count(x, mask))

    @classmethod
    def zeros(cls) -> "SumCount":
        """The empty set (the start of an accumulation, e.g. a `lax.scan` carry)."""
        return cls(total=jnp.zeros((), jnp.float32), count=jnp.zeros((), jnp.float32))

    def mean(self) -> Array:
        return _safe_divide(self.total, self.count)

    def __add__(self, other: "SumCount") -> "SumCount":
        if not isinstance(other, SumCount):
            return NotImplemented
        return SumCount(total=self.total + other.total, count=self.count + other.count)


@flax.struct.dataclass
class Moments:
    """Token-weighted mean and (biased) variance kept as sums, exact across microbatches/devices.

    Stores sums of (x - shift) and (x - shift)^2 over real tokens. `shift` is a static constant near
    the expected mean (1.0 for probability ratios): it removes the catastrophic cancellation of
    E[x^2] - E[x]^2 when the variance is tiny next to the mean.
    """

    total: Array
    total_sq: Array
    count: Array
    shift: float = flax.struct.field(pytree_node=False, default=0.0)

    @classmethod
    def of(cls, x: Array, mask: Array, shift: float = 0.0) -> "Moments":
        deviation = _float(x) - shift
        return cls(total=masked_sum(deviation, mask), total_sq=masked_sum(deviation * deviation, mask),
                   count=masked_count(deviation, mask), shift=shift)

    def mean(self) -> Array:
        return _safe_divide(self.total, self.count) + self.shift * (self.count > 0)

    def var(self) -> Array:
        mean_deviation = _safe_divide(self.total, self.count)
        return jnp.maximum(_safe_divide(self.total_sq, self.count) - mean_deviation**2, 0)

    def __add__(self, other: "Moments") -> "Moments":
        if not isinstance(other, Moments):
            return NotImplemented
        if other.shift != self.shift:
            raise ValueError(f"cannot add Moments with different shifts ({self.shift} and {other.shift})")
        return Moments(total=self.total + other.total, total_sq=self.total_sq + other.total_sq,
                       count=self.count + other.count, shift=self.shift)


def add_metrics(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Pool two metric dicts of `SumCount`/`Moments` (e.g. two microbatches). Same keys required."""
    if a.keys() != b.keys():
        raise ValueError(f"metric dicts have different keys: {sorted(a)} vs {sorted(b)}")
    return {k: a[k] + b[k] for k in a}


def finalize_metrics(metrics: dict[str, Any]) -> dict[str, Array]:
    """Turn accumulated metrics into scalars: SumCount -> mean; Moments `k` -> `k` (mean) and
    `k_var` (variance); plain arrays pass through."""
    out: dict[str, Array] = {}
    for key, value in metrics.items():
        if isinstance(value, Moments):
            out[key] = value.mean()
            out[f"{key}_var"] = value.var()
        elif isinstance(value, SumCount):
            out[key] = value.mean()
        else:
            out[key] = value
    return out
