"""Loss aggregation: how per-token losses l_it (sequence i, token t) become one minibatch loss, split
so that microbatches and devices add up to it exactly.

    token_mean     sum_i sum_t l_it / sum_i |o_i|          DAPO (Yu et al. 2025, eq. 8): every token
                                                            weighs the same, long answers weigh more
    sequence_mean  (1/G) sum_i (1/|o_i|) sum_t l_it        GRPO (Shao et al. 2024, eq. 3): every answer
                                                            weighs the same, its tokens share it
    constant       sum_i sum_t l_it / (G * L)              Dr. GRPO (Liu et al. 2025, "Understanding
                                                            R1-Zero-Like Training", eq. 3 without the
                                                            1/|o_i|): a fixed divisor, L the response
                                                            length, no length bias either way

with G the minibatch's sequences (rows holding a token trained on; `constant`: all its rows) and |o_i|
the tokens of sequence i trained on. Each mode is  sum over the minibatch's real tokens of
l_it / d_it  with a per-token denominator d_it: the minibatch's count (`minibatch_normaliser`, known
before any microbatch runs) times, for sequence_mean, |o_i|, which a microbatch reads from its own
rows (a sequence never straddles microbatches). So each microbatch's token sum of l / d is its exact
share, and the shares add up to the whole minibatch's loss, however the rows fall into microbatches
and devices. The losses of `ppo/losses.py` take d as their `num_tokens` ([] or [B, L]).

Shapes: R rows of a minibatch, b rows of a microbatch (or M packed rows), L response positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ppo_jax.ppo.sequences import sequence_sum

Array = jax.Array

AGGREGATIONS = ("token_mean", "sequence_mean", "constant")


def check_aggregation(mode: str) -> str:
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(AGGREGATIONS)}")
    return mode


def minibatch_normaliser(mode: str, mask: Array) -> Array:
    """The minibatch-wide part of the denominator, [] float32, from the whole minibatch's mask [R, L]
    (the tokens trained on): token_mean its tokens, sequence_mean its rows holding a token, constant
    R * L. At least 1."""
    check_aggregation(mode)
    real = jnp.asarray(mask) != 0
    if mode == "token_mean":
        count = real.sum()
    elif mode == "sequence_mean":
        count = real.any(-1).sum()
    else:
        count = jnp.asarray(real.size)
    return jnp.maximum(count.astype(jnp.float32), 1.0)


def token_denominators(mode: str, normaliser: Array, mask: Array, segment_ids: Array | None = None) -> Array:
    """Each token's denominator d: [] (token_mean, constant: the normaliser itself) or [b, L]
    (sequence_mean: the normaliser times the token's sequence length |o_i|, >= 1 everywhere).
    mask [b, L]: this microbatch's tokens trained on; segment_ids [b, L]: packed rows (see
    `ppo/sequences.py`), None for padded rows."""
    check_aggregation(mode)
    normaliser = jnp.asarray(normaliser, jnp.float32)
    if mode != "sequence_mean":
        return normaliser
    lengths = sequence_sum((jnp.asarray(mask) != 0).astype(jnp.float32), segment_ids)
    return normaliser * jnp.maximum(lengths, 1.0)
