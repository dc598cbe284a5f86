"""Attention over rows split along the sequence: the `context` mesh axis (docs/long_context.md).

A cache-free forward on a mesh with a context axis of c devices holds each row's slots [i * T / c,
(i + 1) * T / c) on device i. Attention is the one place a slot needs the others: every device
all-gathers the layer's keys and values (K heads; a factor H / K smaller than the queries or the
hidden states with grouped-query attention) and attends with its own T / c queries, whose mask rows
carry causality, padding, windows and packed segments. The backward reduce-scatters the keys' and
values' gradients.

The einsum kernel runs blockwise here: a loop over key chunks of at most KEY_CHUNK slots (each
device's part of the row, or a divisor of it) with an online softmax, each chunk's scores recomputed
in the backward, so a device holds [B, H, T / c, KEY_CHUNK] scores at a time, not [B, H, T / c, T].
Chunks that none of the device's queries may see (above the causal diagonal, outside every window)
are still computed (masked): the work is even across the axis.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ppo_jax import sharding
from ppo_jax.models.layers import softcap

Array = jax.Array

KEY_CHUNK = 1024  # the blockwise kernel's most keys per step: [B, H, T / c, 1024] float32 scores live


def key_chunks(length: int, parts: int) -> int:
    """How many equal key chunks `blockwise_attention` takes for `length` keys over `parts` devices:
    each device's T / parts keys in the fewest chunks of at most KEY_CHUNK slots that divide them."""
    part = length // parts
    return parts * next(m for m in range(1, part + 1) if part % m == 0 and part // m <= KEY_CHUNK)


def context_attention(q: Array, k: Array, v: Array, mask: Array, kernel: str, scale: float | None = None,
                      cap: float | None = None, sinks: Array | None = None) -> Array:
    """Self-attention of rows split along the sequence over the mesh's context axis (no cache).

    q [B, T, H, Dh], k/v [B, T, K, Dh] (projection layout), mask [B, T, T] -> [B, T, H, Dh], each
    split along T over the axis. kernel: "einsum" (`blockwise_attention`: soft-capping and sinks), or
    "cudnn" / "xla" through `jax.nn.dot_product_attention` with the mask (its queries sit at an
    offset: no `is_causal`; cuDNN reads the mask as a [B, 1, T / c, T] bias). scale: the scores'
    factor (None: 1/sqrt(Dh)); cap: soft-capping of the scaled scores; sinks [H]: GPT-OSS's sink logits.
    """
    chunks = key_chunks(q.shape[1], sharding.context_axis_size())

    def local(q, k, v, mask, sinks=None):  # one device: T / c queries on all T keys
        k, v = (sharding.gather_context(x, axis=1) for x in (k, v))
        if kernel == "einsum":
            return blockwise_attention(q, k, v, mask, chunks, scale, cap, sinks)
        out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask[:, None],
                                           scale=scale, is_causal=False, implementation=kernel)
        return out.astype(q.dtype)

    args = (q, k, v, mask) + (() if sinks is None else (sinks,))
    return sharding.over_context(local, (1, 1, 1, 1, None)[:len(args)], out_axis=1)(*args)


def blockwise_attention(q: Array, k: Array, v: Array, mask: Array, chunks: int, scale: float | None = None,
                        cap: float | None = None, sinks: Array | None = None) -> Array:
    """`attention.einsum_attention` over `chunks` equal blocks of keys with an online softmax.

    q [B, T, H, Dh], k/v [B, S, K, Dh] (projection layout), mask [B, T, S] -> [B, T, H, Dh]; `chunks`
    divides S. Scores, softmax statistics and the weighted sum accumulate in float32; a masked score is
    the most negative finite float, so a query that sees no key averages all values as the reference
    kernel does (finite, ignored downstream). The loop body is rematerialised: its backward recomputes
    each block's scores instead of keeping all of them.
    """
    b, t, h, dh = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    q = q.reshape(b, t, kv_heads, h // kv_heads, dh)
    blocks = tuple(x.reshape((b, chunks, s // chunks) + x.shape[2:]).swapaxes(0, 1) for x in (k, v))  # [N, B, C, K, Dh]
    masks = mask.reshape(b, t, chunks, s // chunks).transpose(2, 0, 1, 3)  # [N, B, T, C]
    lowest = jnp.finfo(jnp.float32).min
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, kv_heads, h // kv_heads, 1)

    @jax.checkpoint
    def step(carry, block):
        top, total, acc = carry  # [B, K, G, T] running max and sum of exp, [B, K, G, T, Dh] weighted values
        key, value, visible = block
        scores = jnp.einsum("btkgd,bskd->bkgts", q, key.astype(q.dtype), preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(dh) if scale is None else scores * scale
        scores = jnp.where(visible[:, None, None], softcap(scores, cap), lowest)
        new_top = jnp.maximum(top, scores.max(-1))
        probs = jnp.exp(scores - new_top[..., None])
        fade = jnp.exp(top - new_top)
        acc = acc * fade[..., None] + jnp.einsum("bkgts,bskd->bkgtd", probs.astype(value.dtype), value,
                                                 preferred_element_type=jnp.float32)
        return (new_top, total * fade + probs.sum(-1), acc), None

    start = jnp.full((b, kv_heads, h // kv_heads, t), lowest, jnp.float32)
    if sink is not None:  # the sink is one more logit in every softmax: start the running max at it
        start = jnp.maximum(start, sink)
    init = (start, jnp.zeros_like(start), jnp.zeros(start.shape + (dh,), jnp.float32))
    (top, total, acc), _ = jax.lax.scan(step, init, blocks + (masks,))
    if sink is not None:
        total = total + jnp.exp(sink - top)
    out = (acc / total[..., None]).transpose(0, 3, 1, 2, 4)  # [B, T, K, G, Dh]
    return out.reshape(b, t, h, dh).astype(q.dtype)
