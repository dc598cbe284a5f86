"""The KV cache: preallocated keys and values of every layer, passed in and returned as a pytree (no
mutable Flax collections), so the sampler can hold it in a `lax.while_loop` carry and donate it."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.models.config import ModelConfig, to_dtype

Array = jax.Array


# Logical axis names of KVCache.kv (its k/v axis is never sharded): whole along the slots on every
# device of the context axis (the multi-turn engine, `sampling/turns.py`, not checked against a split
# cache) ...
KV_CACHE_AXES = ("layers", None, "batch", "kv_heads", "length", "head_dim")
# ... or split along the slots over it (the static and continuous engines), each device holding S / c
# of every row's slots; XLA partitions the decode's attention over them (partial softmax statistics
# all-reduced over the axis, the cache never gathered).
SPLIT_KV_CACHE_AXES = ("layers", None, "batch", "kv_heads", "cache_length", "head_dim")


def rows_axis(kv: Array) -> int:
    """The axis of a `KVCache.kv`-shaped array ([(L,) 2, B, K, S, Dh], a cache or a prefill's new
    slots) that holds the B rows: 1 for one layer's, 2 stacked."""
    return kv.ndim - 4


def kv_axes(axes: tuple, ndim: int) -> tuple:
    """The logical names of a `KVCache.kv` of `ndim` axes from the stacked cache's `axes` (one layer's
    [2, B, K, S, Dh] has no layers axis)."""
    return axes if ndim == len(axes) else axes[1:]


class KVCache(flax.struct.PyTreeNode):
    """Preallocated keys and values of every layer.

    kv:    [L, 2, B, K, S, Dh] ([2, B, K, S, Dh] for one layer's cache, `split_cache`): keys at [.., 0],
           values at [.., 1], in one array so that a decode step writes a layer's new key and value
           with one in-place update (two arrays cost two kernels a layer a step on a GPU; the
           attention's GEMMs read the halves where they lie, no copy: docs/benchmarks.md). For each
           (row, kv head) the S keys are contiguous [S, Dh] rows, the layout attention consumes:
           scores and the weighted sum are batched GEMMs that read the cache where it lies (no
           per-step transpose copy of the whole cache).
    index: [] int32, the number of slots already written (the same for every row: batches are
           left-padded, so row r's slot s holds its token s whatever its length); [B] int32 where
           each row writes from its own slot on (the continuous and multi-turn engines).
    """

    kv: Array
    index: Array

    @property
    def k(self) -> Array:
        """Keys [(L,) B, K, S, Dh]."""
        return self.kv[..., 0, :, :, :, :]

    @property
    def v(self) -> Array:
        """Values [(L,) B, K, S, Dh]."""
        return self.kv[..., 1, :, :, :, :]

    @property
    def length(self) -> int:
        return self.kv.shape[-2]

    @property
    def rows_axis(self) -> int:
        """The axis of `kv` that holds the B rows (`rows_axis`)."""
        return rows_axis(self.kv)


def init_cache(config: ModelConfig, batch: int, length: int, dtype: Any = None) -> KVCache:
    """Zero cache for `batch` rows of `length` slots; dtype defaults to the compute dtype."""
    dtype = to_dtype(dtype) if dtype is not None else config.jnp_dtype
    shape = (config.num_layers, 2, batch, config.kv_heads, length, config.dim_per_head)
    return KVCache(kv=jnp.zeros(shape, dtype), index=jnp.zeros((), jnp.int32))


def split_cache(cache: KVCache) -> tuple[KVCache, ...]:
    """The stacked cache as one KVCache per layer, kv [2, B, K, S, Dh] each (copies)."""
    return tuple(KVCache(kv=cache.kv[i], index=cache.index) for i in range(cache.kv.shape[0]))


def with_joined_kv(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Host arrays saved by tree path (`checkpoint.trees.host_arrays_by_path`: an in-flight rollout's
    engine state) with every KV cache saved before keys and values shared one array (`<path>.k` and
    `<path>.v`, [.., B, K, S, Dh] each, until 2026-11-29) joined into the `<path>.kv` this version
    reads, so a checkpoint taken mid-rollout by an older version resumes. Other names pass as they are."""
    joined = dict(arrays)
    stems = [name[:-2] for name in arrays if name.endswith(".k")]
    for stem in stems:
        if stem + ".v" in arrays and stem + ".kv" not in arrays:
            k, v = joined.pop(stem + ".k"), joined.pop(stem + ".v")
            joined[stem + ".kv"] = np.stack([k, v], axis=k.ndim - 4)  # [(L,) 2, B, K, S, Dh]: in front of the rows
    return joined
