"""Per-sequence sums read back at every token, on padded rows or on packed ones.

A sequence-level objective (GSPO's length-normalised ratio, the mean over sequences of per-sequence
token means) needs, at each token, a sum over the tokens of its own sequence. On padded rows [B, L]
a sequence is a row. On packed rows [M, T] (`models/packing.py`) a row holds several sequences, each
a contiguous run of slots with one `segment_id` (0 on padding); the per-token fields of a response
token sit at the slot that predicts it, inside its sequence's run. Both layouts give the same
numbers for the same tokens, so a loss written with these functions does not care which it gets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def sequence_sum(x: Array, segment_ids: Array | None = None) -> Array:
    """[B, L] -> [B, L]: at each position the sum of `x` over the positions of its sequence.

    segment_ids [B, L] (packed rows): runs of equal ids along a row are one sequence; None (padded
    rows): each row is one sequence. Zero `x` where it must not count (e.g. `x * mask`).
    """
    x = jnp.asarray(x)
    if segment_ids is None:
        return jnp.broadcast_to(x.sum(-1, keepdims=True), x.shape)
    length = x.shape[-1]
    starts = jnp.concatenate([jnp.ones_like(segment_ids[..., :1], bool),
                              segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)
    run = jnp.cumsum(starts, axis=-1, dtype=jnp.int32) - 1  # [B, L] run index within the row, < L
    sums = jax.vmap(lambda v, r: jax.ops.segment_sum(v, r, num_segments=length))(x, run)
    return jnp.take_along_axis(sums, run, axis=-1)


def sequence_mean(x: Array, mask: Array, segment_ids: Array | None = None) -> Array:
    """[B, L] -> [B, L]: at each position the mean of `x` over the real (`mask`) positions of its
    sequence; 0 for a sequence with none."""
    mask = jnp.asarray(mask).astype(jnp.promote_types(jnp.asarray(x).dtype, jnp.float32))
    count = sequence_sum(mask, segment_ids)
    return sequence_sum(jnp.where(mask != 0, x, 0), segment_ids) / jnp.maximum(count, 1)
