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
Under a causal mask the last device's queries see every key and the first device's only its own:
`_balanced` evens the work by having device i compute the row's half-chunks i and 2c - 1 - i (of
2c), skipping the key blocks in their future (about (2c + 1) / 4c of the unbalanced work on each).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ppo_jax import sharding
from ppo_jax.models.layers import softcap

Array = jax.Array

KEY_CHUNK = 1024  # the blockwise kernel's most keys per step: [B, H, T / c, 1024] float32 scores live
QUERY_BLOCK = 512  # a prefill into a split cache: most queries per step, [B, H, 512, S / c] scores live


def key_chunks(length: int, parts: int) -> int:
    """How many equal key chunks `blockwise_attention` takes for `length` keys over `parts` devices:
    each device's T / parts keys in the fewest chunks of at most KEY_CHUNK slots that divide them."""
    part = length // parts
    return parts * next(m for m in range(1, part + 1) if part % m == 0 and part // m <= KEY_CHUNK)


def context_attention(q: Array, k: Array, v: Array, mask: Array, kernel: str, scale: float | None = None,
                      cap: float | None = None, sinks: Array | None = None, causal: bool = True,
                      window: int | None = None, sliding: bool | Array = False) -> Array:
    """Self-attention of rows split along the sequence over the mesh's context axis (no cache).

    q [B, T, H, Dh], k/v [B, T, K, Dh] (projection layout), mask [B, T, T] -> [B, T, H, Dh], each
    split along T over the axis. kernel: "einsum" (`blockwise_attention`: soft-capping and sinks), or
    "cudnn" / "xla" through `jax.nn.dot_product_attention` with the mask (its queries sit at an
    offset: no `is_causal`; cuDNN reads the mask as a [B, 1, T / c, T] bias). scale: the scores'
    factor (None: 1/sqrt(Dh)); cap: soft-capping of the scaled scores; sinks [H]: GPT-OSS's sink logits.
    causal: the mask is causal by slot (every self-attention mask is): with the einsum kernel and 2c
    dividing T, the work is balanced (`_balanced`) and key blocks in a query block's future skipped.
    window, sliding: the sliding window and whether this layer slides (a bool, or a [] bool array in a
    scanned body of mixed layers): the balanced kernel also skips key blocks left of the window.
    """
    parts = sharding.context_axis_size()
    chunks = key_chunks(q.shape[1], parts)
    balanced = causal and q.shape[1] % (2 * parts) == 0

    def local(q, k, v, mask, sinks=None):  # one device: T / c queries on all T keys
        k, v = (sharding.gather_context(x, axis=1) for x in (k, v))
        if kernel == "einsum" and balanced:
            return _balanced(q, k, v, mask, parts, functools.partial(
                blockwise_attention, chunks=chunks * 2, scale=scale, cap=cap, sinks=sinks,
                window=None if sliding is False else window, sliding=sliding))
        if kernel == "einsum":
            return blockwise_attention(q, k, v, mask, chunks, scale, cap, sinks)
        out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask[:, None],
                                           scale=scale, is_causal=False, implementation=kernel)
        return out.astype(q.dtype)

    if kernel != "einsum":
        # Manual over every axis: inside `over_context` the other axes stay XLA's, and cuDNN's custom
        # partitioner cannot read their shardings (XLA:GPU refuses to compile). Rows split over the
        # batch axes, heads over tensor when both q's and k's heads divide (GQA pairs local heads).
        heads = "heads" if sharding.splits_alike(("heads", q.shape[2]), ("kv_heads", k.shape[2])) else None
        names = (("batch", "act_length", heads, None),) * 3 + (("batch", "act_length", None),)
        return sharding.over_every_axis(local, names)(q, k, v, mask)
    args = (q, k, v, mask) + (() if sinks is None else (sinks,))
    return sharding.over_context(local, (1, 1, 1, 1, None)[:len(args)], out_axis=1)(*args)


def over_query_blocks(attend, q: Array, mask: Array) -> Array:
    """attend(q, mask) on blocks of at most QUERY_BLOCK queries in turn (`lax.map`, the fewest equal
    blocks): q [B, T, H, Dh], mask [B, T, S] -> [B, T, H, Dh]. For a prefill of T prompt tokens into a
    cache split along its S slots, which runs the einsum kernel (XLA partitions it along the slots; a
    fused kernel's opaque call would gather them): a device then holds [B, H, QUERY_BLOCK, S / c]
    float32 scores, not [B, H, T, S / c]. With 16 rows of 2,048 prompt tokens into 32k-slot caches of
    Llama-3-8B on 4 x 2 GPUs that is 4.3 GB of scores instead of 17 (docs/benchmarks.md)."""
    b, t = q.shape[:2]
    blocks = next(n for n in range(-(-t // QUERY_BLOCK), t + 1) if t % n == 0)
    if blocks == 1:
        return attend(q, mask)
    split = (lambda x: x.reshape(b, blocks, t // blocks, *x.shape[2:]).swapaxes(0, 1))
    out = jax.lax.map(lambda qm: attend(*qm), (split(q), split(mask)))
    return out.swapaxes(0, 1).reshape(q.shape)


def _mirror(chunk: int, parts: int) -> int:
    """The device that computes query half-chunk `chunk` of 2 * parts: device i takes i and 2p - 1 - i."""
    return chunk if chunk < parts else 2 * parts - 1 - chunk


def _balanced(q: Array, k: Array, v: Array, mask: Array, parts: int, attend) -> Array:
    """Causal attention of one device's T / c queries with the work balanced over the context axis.

    Inside `over_context`: q [B, T/c, H, Dh] (slots from i * T/c), k/v [B, T, K, Dh] gathered, mask
    [B, T/c, T] -> [B, T/c, H, Dh]. Under a causal mask the last device's queries see every key and the
    first's only its own; with the row cut into 2c half-chunks, device i instead computes half-chunks
    i and 2c - 1 - i (one early, one late: the same work everywhere, the future blocks skipped by
    `attend`, `blockwise_attention` with `last_slot`). Each device's two query halves (and their mask
    rows) travel there and their outputs back by four `ppermute`s of T / 2c queries each; which of
    the two a device receives first is the even half-chunk.
    """
    i = sharding.context_index()
    half = q.shape[1] // 2
    out = []
    for slot in (0, 1):  # each device's first half-chunk 2d, then its second 2d + 1: each a permutation
        there = [(d, _mirror(2 * d + slot, parts)) for d in range(parts)]
        back = [(dst, src) for src, dst in there]
        mine = jnp.where(i % 2 == slot, i, 2 * parts - 1 - i)  # the half-chunk this device received
        q_part, mask_part = (sharding.permute_context(x[:, slot * half:(slot + 1) * half], there) for x in (q, mask))
        done = attend(q_part, k, v, mask_part, first_slot=mine * half, last_slot=(mine + 1) * half - 1)
        out.append(sharding.permute_context(done, back))
    return jnp.concatenate(out, axis=1)


def blockwise_attention(q: Array, k: Array, v: Array, mask: Array, chunks: int, scale: float | None = None,
                        cap: float | None = None, sinks: Array | None = None, first_slot: Array | None = None,
                        last_slot: Array | None = None, window: int | None = None, sliding: bool | Array = True
                        ) -> Array:
    """`attention.einsum_attention` over `chunks` equal blocks of keys with an online softmax.

    q [B, T, H, Dh], k/v [B, S, K, Dh] (projection layout), mask [B, T, S] -> [B, T, H, Dh]; `chunks`
    divides S. Scores, softmax statistics and the weighted sum accumulate in float32; a masked score is
    the most negative finite float, so a query that sees no key averages all values as the reference
    kernel does (finite, ignored downstream). The loop body is rematerialised: its backward recomputes
    each block's scores instead of keeping all of them. first_slot, last_slot ([] int32): the slots
    of the first and last query, under a causal mask; blocks past the last are skipped, and with a
    `window` on a `sliding` layer blocks wholly left of the first's window too (then a query
    that sees no key averages the values of the blocks computed instead).
    """
    b, t, h, dh = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    q = q.reshape(b, t, kv_heads, h // kv_heads, dh)
    blocks = tuple(x.reshape((b, chunks, s // chunks) + x.shape[2:]).swapaxes(0, 1) for x in (k, v))  # [N, B, C, K, Dh]
    masks = mask.reshape(b, t, chunks, s // chunks).transpose(2, 0, 1, 3)  # [N, B, T, C]
    lowest = jnp.finfo(jnp.float32).min
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, kv_heads, h // kv_heads, 1)

    @jax.checkpoint
    def attend(carry, block):
        top, total, acc = carry  # [B, K, G, T] running max and sum of exp, [B, K, G, T, Dh] weighted values
        key, value, visible, _ = block
        scores = jnp.einsum("btkgd,bskd->bkgts", q, key.astype(q.dtype), preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(dh) if scale is None else scores * scale
        scores = jnp.where(visible[:, None, None], softcap(scores, cap), lowest)
        new_top = jnp.maximum(top, scores.max(-1))
        probs = jnp.exp(scores - new_top[..., None])
        fade = jnp.exp(top - new_top)
        acc = acc * fade[..., None] + jnp.einsum("bkgts,bskd->bkgtd", probs.astype(value.dtype), value,
                                                 preferred_element_type=jnp.float32)
        return new_top, total * fade + probs.sum(-1), acc

    def step(carry, block):
        if last_slot is None:
            return attend(carry, block), None
        first = block[-1] * (s // chunks)  # the block's first key slot
        needed = first <= last_slot
        if window is not None:  # its last key within the first query's window, or a full-attention layer
            needed &= jnp.logical_not(sliding) | (first + s // chunks - 1 > first_slot - window)
        return jax.lax.cond(needed, attend, lambda carry, _: carry, carry, block), None

    start = jnp.full((b, kv_heads, h // kv_heads, t), lowest, jnp.float32)
    if sink is not None:  # the sink is one more logit in every softmax: start the running max at it
        start = jnp.maximum(start, sink)
    init = (start, jnp.zeros_like(start), jnp.zeros(start.shape + (dh,), jnp.float32))
    (top, total, acc), _ = jax.lax.scan(step, init, blocks + (masks, jnp.arange(chunks)))
    if sink is not None:
        total = total + jnp.exp(sink - top)
    out = (acc / total[..., None]).transpose(0, 3, 1, 2, 4)  # [B, T, K, G, Dh]
    return out.reshape(b, t, h, dh).astype(q.dtype)
