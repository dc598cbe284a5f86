"""The KV cache: preallocated keys and values of every layer, passed in and returned as a pytree (no
mutable Flax collections), so the sampler can hold it in a `lax.while_loop` carry and donate it."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax.models.config import ModelConfig, to_dtype

Array = jax.Array


# Logical axis names of KVCache.k / KVCache.v: whole along the slots on every device of the context
# axis (the multi-turn engine, `sampling/turns.py`, not checked against a split cache) ...
KV_CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")
# ... or split along the slots over it (the static and continuous engines), each device holding S / c
# of every row's slots; XLA partitions the decode's attention over them (partial softmax statistics
# all-reduced over the axis, the cache never gathered).
SPLIT_KV_CACHE_AXES = ("layers", "batch", "kv_heads", "cache_length", "head_dim")


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
