"""Attention: the mask, the reference einsum kernel, the fused kernels (cuDNN flash, TPU splash), and
the layer.

Three kernels compute the same function:

- `einsum_attention`, the reference: float32 scores, grouped-query attention by reshaping the query
  heads, reading keys and values in the KV cache's [B, K, S, Dh] layout. Used for one-token decode
  steps on every platform (they read the cache where it lies), and everywhere with `attention="einsum"`.
- `fused_attention`: `jax.nn.dot_product_attention` on keys and values as the projections produce them
  ([B, T, K, Dh], no cache), with `implementation="cudnn"` (flash attention: measured 3.5-4x faster
  than the einsum for the forward + backward of a 22-layer 1B model on an H100, docs/gpu_probe.md) or
  "xla". Without a cache, `Transformer` first moves each row's real tokens to slots [0, length)
  (`roll_rows`), so the call takes `is_causal` and the rows' lengths (`aligned_attention`): cuDNN's
  padding-causal kernel, no mask. A mask would become a dense [B, 1, T, S] bias, read in the forward
  and differentiated in the backward (cuDNN refuses a [B, 1, 1, S] key mask on T > 1, and its
  sequence lengths assume right padding); `fused_attention` passes it where no alignment applies
  (a prefill at a cache offset, packed rows, a scanned body of mixed window sizes). The K/V heads go in unrepeated (cuDNN
  does grouped-query attention itself; repeating them is slower and less accurate). It has no
  soft-capping, so a model with `attn_logit_softcap` (Gemma 2) runs the einsum kernel whatever
  `ModelConfig.attention` says. With a KV cache, a call of T > 1 tokens (the sampler's prefill, a
  chunk of one) runs it too, on all S cache slots with the [B, T, S] mask and no `is_causal` (its
  queries may sit at a cache offset).

- `splash_attention`: Pallas splash attention, the TPU's fused kernel (flash attention with block
  sparsity: blocks above the diagonal or outside the window are skipped, never read). Splash masks
  are static, so the per-row padding travels as segment ids (padding slots one segment, real tokens
  another) beside a static causal or local (sliding-window) mask; `attn_logits_soft_cap` covers
  Gemma 2 and the query is pre-scaled for `query_pre_attn_scalar`. No cache: the sampler's cached
  prefill and decode run the einsum kernel.

Padding rows see no real key; every kernel gives them a finite output (never NaN), which the losses
mask out (einsum and cuDNN: all keys masked; splash: the padding slots up to their own).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from ppo_jax import sharding
from ppo_jax.models.config import ModelConfig
from ppo_jax.models.context import context_attention, over_query_blocks
from ppo_jax.models.layers import DenseGeneral, norm, project_shared_input, softcap
from ppo_jax.models.rope import apply_rope

Array = jax.Array


def attention_mask(kv_mask: Array, query_slots: Array, sliding_window: int | None,
                   segment_ids: Array | None = None) -> Array:
    """[B, T, S] bool: key slot s is visible from query slot t.

    kv_mask [B, S]: real (non-padding, already written) key slots; query_slots [T]: the slot of each
    query, or [B, T] when every row writes at its own slots (a slot-based decode). Causality is by
    slot; within a left-padded row, or within one sequence of a packed row, slot differences equal
    position differences, so the sliding window is by slot too.
    segment_ids [B, T] (self-attention only, T == S): a packed row's sequence of each slot (0 on
    padding); a real query then sees only the keys of its own sequence. A padding query keeps the
    unpacked rule (every earlier real key): its output is ignored either way, and a 0/1 segment row
    gives exactly the unpacked mask.
    """
    key_slots = jnp.arange(kv_mask.shape[-1])
    query_slots = query_slots[..., None]  # [T, 1] or [B, T, 1]
    visible = key_slots <= query_slots
    if sliding_window is not None:
        visible &= query_slots - key_slots < sliding_window
    visible = visible & kv_mask[:, None, :].astype(bool)  # [T, S] or [B, T, S] -> [B, T, S]
    if segment_ids is not None:
        query = segment_ids[:, :, None]
        visible &= (query == segment_ids[:, None, :]) | (query == 0)
    return visible


def einsum_attention(q: Array, k: Array, v: Array, mask: Array, scale: float | None = None,
                     cap: float | None = None, sinks: Array | None = None) -> Array:
    """Grouped-query attention, the reference kernel.

    q [B, T, H, Dh], k/v [B, K, S, Dh] (the cache layout), mask [B, T, S] -> [B, T, H, Dh]. Scores and
    softmax in float32; a masked score is the most negative finite float (not -inf), so a padded query
    whose keys are all masked gets a finite, ignored output instead of NaN. scale: the scores'
    factor (None: 1/sqrt(Dh)); cap: soft-capping of the scaled scores (None: off); sinks [H]: one
    more logit per head in every softmax, for a key with no value (GPT-OSS; None: off).
    """
    b, t, h, dh = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(b, t, kv_heads, h // kv_heads, dh)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(dh) if scale is None else scores * scale
    scores = softcap(scores, cap)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    else:  # the softmax over [scores, sink], the sink's own probability dropped
        sink = sinks.astype(jnp.float32).reshape(1, kv_heads, h // kv_heads, 1, 1)
        top = jnp.maximum(scores.max(-1, keepdims=True), sink)
        exp = jnp.exp(scores - top)
        probs = (exp / (exp.sum(-1, keepdims=True) + jnp.exp(sink - top))).astype(v.dtype)
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
    cuDNN turns the mask into a dense [B, 1, T, S] bias (and its backward computes that bias's
    gradient): rows aligned to slot 0 take `aligned_attention` instead.
    """
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, is_causal=is_causal,
                                       implementation=implementation)
    return out.astype(q.dtype)


def aligned_attention(q: Array, k: Array, v: Array, lengths: Array, implementation: str,
                      scale: float | None = None, sliding_window: int | None = None) -> Array:
    """Causal self-attention of rows whose real tokens are slots [0, lengths) (right-padded),
    through `jax.nn.dot_product_attention` with sequence lengths instead of a mask: cuDNN's
    padding-causal flash attention, no bias tensor in either pass (the probe's fastest cuDNN form,
    docs/gpu_probe.md).

    q [B, T, H, Dh], k/v [B, T, K, Dh], lengths [B] int32 -> [B, T, H, Dh], 0 on the padding slots
    (cuDNN leaves them to the kernel; zeroed here so every implementation gives the same finite
    values). sliding_window W: a query sees its W - 1 predecessors and itself, as `attention_mask`.
    """
    window = None if sliding_window is None else (sliding_window - 1, 0)
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, query_seq_lengths=lengths,
                                       key_value_seq_lengths=lengths, local_window_size=window,
                                       implementation=implementation)
    real = jnp.arange(q.shape[1])[None, :] < lengths[:, None]  # [B, T]
    return jnp.where(real[:, :, None, None], out, 0).astype(q.dtype)


# Splash tiles: the kernel needs the sequence length a multiple of its blocks, and its key blocks a
# multiple of the TPU's 128 lanes. The largest of these that divides the (padded) length is used.
SPLASH_BLOCKS = (512, 256, 128)
_splash_interpret = False  # tests only: run the Pallas kernel in interpret mode (on CPU), see `splash_interpret`


@contextlib.contextmanager
def splash_interpret() -> Iterator[None]:
    """Tests only: models traced inside this context run splash attention in Pallas interpret mode,
    which runs on CPU. Not a user setting: off TPU `compute.attention='splash'` is refused."""
    global _splash_interpret
    previous, _splash_interpret = _splash_interpret, True
    try:
        yield
    finally:
        _splash_interpret = previous


def splash_attention(q: Array, k: Array, v: Array, kv_mask: Array, sliding: bool | Array = False,
                     window: int | None = None, scale: float | None = None, cap: float | None = None,
                     interpret: bool = False) -> Array:
    """Self-attention of T tokens through Pallas splash attention (TPU; no cache).

    q [B, T, H, Dh], k/v [B, T, K, Dh] (projection layout; K divides H, the K/V heads are not
    repeated: the kernel maps each query head to its group), kv_mask [B, T] (real tokens; any padding
    pattern, left-padded in practice; or a packed row's sequence ids, 0 = padding, when each sequence
    sees only itself) -> [B, T, H, Dh].

    The mask is what `attention_mask` builds: causal by slot, key padding, and with `sliding` (a
    Python bool, or a [] bool array in a scanned body of mixed layers) the window
    `query_slot - key_slot < window`. Padding is dynamic, the kernel's masks static: real tokens are
    one segment and padding another, so a real query sees exactly the real keys of the einsum mask,
    and a padding query sees the padding slots up to its own (finite output, ignored downstream).
    scale: the scores' factor (None: 1/sqrt(Dh)), applied to q in its dtype; cap: soft-capping of the
    scaled scores (None: off). interpret: Pallas interpret mode (tests on CPU).

    T not a multiple of 128 (the smallest block) is padded at the end up to one, as padding tokens,
    and sliced off again: correct for any T, at the cost of up to 127 wasted rows and columns.
    Mosaic lowers the kernel's dots at the process's default matmul precision: in bfloat16 it refuses
    `jax_default_matmul_precision="highest"` (float32 precision on bf16 operands).
    """
    b, t, h, dh = q.shape
    padded = -(-t // SPLASH_BLOCKS[-1]) * SPLASH_BLOCKS[-1]
    q = q * (1 / math.sqrt(dh) if scale is None else scale)

    def heads_major(x):  # [B, T, N, Dh] -> [B, N, padded, Dh], the kernel's layout
        return jnp.pad(x, ((0, 0), (0, padded - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    segments = jnp.pad(kv_mask.astype(jnp.int32), ((0, 0), (0, padded - t)))
    run = functools.partial(_splash_local, functools.partial(_splash_kernel, window=window, cap=cap,
                                                             interpret=interpret))
    args = (heads_major(q), heads_major(k.astype(q.dtype)), heads_major(v.astype(q.dtype)), segments)
    if isinstance(sliding, bool):  # chosen while tracing: no argument to pass through shard_map
        run = functools.partial(run, sliding=sliding)
    else:
        args += (jnp.asarray(sliding),)
    specs = _splash_specs(b, h, k.shape[2])
    if specs is not None:  # a Pallas call is one opaque custom call: XLA cannot partition it itself
        heads, rows = specs
        in_specs = (heads, heads, heads, rows, jax.sharding.PartitionSpec())[:len(args)]
        run = jax.shard_map(run, in_specs=in_specs, out_specs=heads, check_vma=False)
    return run(*args).transpose(0, 2, 1, 3)[:, :t]


def _splash_local(kernel_of, q: Array, k: Array, v: Array, segments: Array, sliding: bool | Array) -> Array:
    """One device's splash call: q [B, H, T, Dh], k/v [B, K, T, Dh], segments [B, T] -> [B, H, T, Dh].
    A traced `sliding` (one scanned body for mixed sliding and full layers) chooses between the two
    static kernels with `lax.cond`, so each layer runs only its own."""
    heads, length = q.shape[1], q.shape[2]

    def attend(local: bool) -> Array:
        kernel = kernel_of(heads, length, local)
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(
            q, k, v, segments)

    if isinstance(sliding, bool):
        return attend(sliding)
    return jax.lax.cond(sliding, lambda: attend(True), lambda: attend(False))


def _splash_kernel(heads: int, length: int, local: bool, *, window: int | None, cap: float | None,
                   interpret: bool):
    """The splash kernel for `heads` query heads over `length` slots (a multiple of 128): causal, or
    with `local` and a window, causal within `window` slots. Built while tracing (its block tables
    become constants of the traced program, so it cannot be cached across traces); building it
    analyses the static mask block by block, cheap next to a compile."""
    shape = (length, length)
    mask = (splash.LocalMask(shape, (window - 1, 0), 0) if local and window is not None
            else splash.CausalMask(shape))
    block = next(size for size in SPLASH_BLOCKS if length % size == 0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
    return splash.make_splash_mha(splash.MultiHeadMask((mask,) * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, attn_logits_soft_cap=cap, interpret=interpret)


def _splash_specs(batch: int, heads: int, kv_heads: int):
    """(spec of [B, N, T, Dh], spec of [B, T]) for splash's `shard_map` on the context mesh, or None
    outside a mesh. Rows split like the batch; heads like the query heads when the K/V heads split
    the same way (each device then holds whole groups), else they stay whole on every device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return None
    rules = nn.get_logical_axis_rules() or sharding.DEFAULT_RULES
    rows = sharding.logical_to_spec(("batch",), (batch,), mesh, rules)
    q_heads = sharding.logical_to_spec(("heads",), (heads,), mesh, rules)
    kv_split = sharding.logical_to_spec(("kv_heads",), (kv_heads,), mesh, rules)
    row = rows[0] if len(rows) else None
    head = q_heads[0] if len(q_heads) and q_heads == kv_split else None
    return jax.sharding.PartitionSpec(row, head), jax.sharding.PartitionSpec(row)


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, cos, sin, mask, cache_kv, layer, cache_index, sliding=False, segment_ids=None,
                 lengths=None):
        """x [B, T, D] -> ([B, T, D], cache_kv with this layer's new slots written, or None).

        cache_kv: None, the whole cache's (k, v) [L, B, K, S, Dh] with `layer` ([] int32) this layer's
        index into it, or (layer None) this layer's own (k, v) [B, K, S, Dh]; cache_index: [] int32,
        the slot of the first of the T new tokens, or [B] int32, each row's own (a slot-based
        decode); sliding: whether this is a sliding-window layer (a bool, or a [] bool array in a
        scanned body; only splash reads it, the mask already says so);
        segment_ids: [B, T] a packed row's sequence ids (0 = padding), None unpacked; the mask already
        holds them, only splash (whose masks are static) reads them.
        lengths: [B] int32 when the rows are right-padded (`Transformer` aligned them for the fused
        kernel, no cache): the fused call then takes the lengths instead of the mask.
        """
        cfg = self.config
        d, h, kh, dh = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
        gpt2 = cfg.family == "gpt2"
        common = dict(dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype)
        qkv_bias = gpt2 or cfg.attention_bias
        q, k, v = project_shared_input(self, x, [
            DenseGeneral((d,), (h, dh), ("embed", "heads", "head_dim"), qkv_bias, name="q",
                         lora=cfg.lora_for("q"), **common),
            DenseGeneral((d,), (kh, dh), ("embed", "kv_heads", "head_dim"), qkv_bias, name="k",
                         lora=cfg.lora_for("k"), **common),
            DenseGeneral((d,), (kh, dh), ("embed", "kv_heads", "head_dim"), qkv_bias, name="v",
                         lora=cfg.lora_for("v"), **common),
        ], cfg.merge_decode_projections_above)
        if cfg.qk_norm:  # over each head's Dh features, before the rotation
            q, k = norm(cfg, "q_norm")(q), norm(cfg, "k_norm")(k)
        if not gpt2:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
        sinks = (self.param("sinks", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("heads",)),
                            (h,), cfg.jnp_param_dtype) if cfg.attention_sinks else None)
        # cuDNN's call cannot soft-cap (see config.ATTENTION_KINDS); splash can. Neither takes sinks.
        fused = cfg.attention in ("cudnn", "xla") and cfg.attn_logit_softcap is None and sinks is None
        if cache_kv is None and sharding.context_axis_size() > 1:
            # splash's static masks assume queries from slot 0: a split row runs the einsum instead
            local = sliding if cfg.sliding_layers is not None else cfg.sliding_window is not None
            out = context_attention(q, k, v, mask, cfg.attention if fused else "einsum", scale,
                                    cfg.attn_logit_softcap, sinks, window=cfg.sliding_window, sliding=local)
        elif cache_kv is None and cfg.attention == "splash" and sinks is None:
            # Without a cache query slot t is key slot t, and a token sees itself iff it is real:
            # the mask's diagonal is the key padding [B, T] (a packed row passes its sequence ids).
            # Layers all alike choose statically.
            local = sliding if cfg.sliding_layers is not None else cfg.sliding_window is not None
            segments = jnp.diagonal(mask, axis1=1, axis2=2) if segment_ids is None else segment_ids
            out = splash_attention(q, k, v, segments, local, cfg.sliding_window,
                                   scale, cfg.attn_logit_softcap, interpret=_splash_interpret)
        elif cache_kv is None and fused and lengths is not None:
            window = _sliding_window(cfg, sliding)
            out = aligned_attention(q, k, v, lengths, cfg.attention, scale, window)
        elif cache_kv is None and fused:
            out = fused_attention(q, k, v, mask, cfg.attention, scale)
        else:
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, Dh]
            if cache_kv is not None:
                cache_kv, (k, v) = _write_cache(cache_kv, k, v, layer, cache_index)
            if fused and q.shape[1] > 1 and sharding.context_axis_size() == 1:
                # A prefill (or a chunk of one): T queries against the cache's S slots on the fused
                # kernel, the cache read in the projection layout. A one-token decode step stays on
                # the einsum, which reads the cache where it lies; so does a prefill into a cache
                # split over the context axis (XLA partitions the einsum along the slots, but would
                # gather them for the fused kernel's opaque call).
                kv = tuple(x.transpose(0, 2, 1, 3).astype(q.dtype) for x in (k, v))  # [B, S, K, Dh]
                out = fused_attention(q, *kv, mask, cfg.attention, scale, is_causal=False)
            elif q.shape[1] > 1 and sharding.context_axis_size() > 1:  # a prefill into a split cache
                out = over_query_blocks(lambda q, mask: einsum_attention(
                    q, k, v.astype(q.dtype), mask, scale, cfg.attn_logit_softcap, sinks), q, mask)
            else:
                out = einsum_attention(q, k, v.astype(q.dtype), mask, scale, cfg.attn_logit_softcap, sinks)
        out = DenseGeneral((h, dh), (d,), ("heads", "head_dim", "embed"), gpt2 or cfg.attention_out_bias,
                           name="o", lora=cfg.lora_for("o"), **common)(out)
        return out, cache_kv


def _sliding_window(cfg: ModelConfig, sliding) -> int | None:
    """The window of this layer, chosen while tracing: a model whose layers all slide (or none do),
    or a mixed model's unrolled layer (`sliding` a bool). A mixed model's scanned body (`sliding` an
    array) cannot pick a static window: `Transformer.aligned_rows` keeps such models on the mask."""
    if cfg.sliding_layers is None:
        return cfg.sliding_window
    if not isinstance(sliding, bool):
        raise ValueError("a scanned body of mixed sliding / full layers has no static window")
    return cfg.sliding_window if sliding else None


def _write_cache(cache_kv, k: Array, v: Array, layer, cache_index):
    """Writes only the T new slots of this layer (k, v [B, K, T, Dh]) into the cache, then reads the
    layer's [B, K, S, Dh] slab: (the updated cache_kv, (k, v) of all S slots). cache_index [B]: each
    row from its own slot on (one scatter)."""
    if jnp.ndim(cache_index) == 1:
        return _write_cache_rows(cache_kv, k, v, layer, cache_index)
    if k.shape[2] > 1 and sharding.context_axis_size() > 1:
        return _write_cache_split(cache_kv, k, v, layer, cache_index)
    if layer is None:
        cache_kv = tuple(jax.lax.dynamic_update_slice(c, new.astype(c.dtype), (0, 0, cache_index, 0))
                         for c, new in zip(cache_kv, (k, v)))
        return cache_kv, cache_kv
    start = (layer, 0, 0, cache_index, 0)
    cache_kv = tuple(jax.lax.dynamic_update_slice(c, new[None].astype(c.dtype), start)
                     for c, new in zip(cache_kv, (k, v)))
    slabs = tuple(jax.lax.dynamic_index_in_dim(c, layer, axis=0, keepdims=False) for c in cache_kv)
    return cache_kv, slabs


def _write_slabs(cache_kv, k: Array, v: Array, layer, write):
    """(cache_kv, the layer's (k, v) slabs) with `write(slab [B, K, S, Dh], new [B, K, T, Dh])` applied
    to each of k and v: on per-layer caches directly; on a stacked [L, ...] cache to the layer's slab,
    read out and written back."""
    if layer is None:
        cache_kv = tuple(write(c, new) for c, new in zip(cache_kv, (k, v)))
        return cache_kv, cache_kv
    slabs = tuple(write(jax.lax.dynamic_index_in_dim(c, layer, axis=0, keepdims=False), new)
                  for c, new in zip(cache_kv, (k, v)))
    cache_kv = tuple(jax.lax.dynamic_update_index_in_dim(c, slab, layer, axis=0) for c, slab in zip(cache_kv, slabs))
    return cache_kv, slabs


def _write_cache_split(cache_kv, k: Array, v: Array, layer, start: Array):
    """`_write_cache` of T > 1 slots (a prefill) into a cache whose S slots may be split over the
    context axis (`loop.sample`): each slot s takes new slot s - start where that is in [0, T), by a
    gather from the (whole) new slots and a select, so every device writes only its own slots. A
    dynamic_update_slice of T slots along the split axis had XLA all-gather the whole stacked cache
    [L, B, K, S, Dh] (a one-slot decode write it partitions in place)."""
    slots = jnp.arange(cache_kv[0].shape[-2])
    offset = slots - start
    inside = ((offset >= 0) & (offset < k.shape[2]))[:, None]  # [S, 1]
    source = jnp.clip(offset, 0, k.shape[2] - 1)

    def write(slab, new):  # [B, K, S, Dh] <- [B, K, T, Dh]
        return jnp.where(inside, jnp.take(new.astype(slab.dtype), source, axis=2), slab)

    return _write_slabs(cache_kv, k, v, layer, write)


def _write_cache_rows(cache_kv, k: Array, v: Array, layer, starts: Array):
    """`_write_cache` where row b's T new slots start at its own `starts[b]` ([B] int32): one
    dynamic_update_slice per row, vmapped over the batch axis (one scatter), into the layer's slab.
    A stacked cache has the slab read out and written back: a scatter straight into the whole
    [L, B, K, S, Dh] cache made XLA:TPU hold two copies of it (compile-only Llama-3-8B on v5p-8,
    sampler temps 20.4 against 10.4 GiB, docs/benchmarks.md)."""
    def write_layer(cache, new):  # [B, K, S, Dh] <- [B, K, T, Dh]
        return jax.vmap(lambda c, n, start: jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (0, start, 0)))(
            cache, new, starts)

    return _write_slabs(cache_kv, k, v, layer, write_layer)
