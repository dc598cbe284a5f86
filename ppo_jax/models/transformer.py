"""One Flax Linen decoder for GPT-2 and the Llama family, with an explicit KV cache.

Conventions
  B batch, T new tokens in this call, S key slots (T without a cache, the cache length with one),
  D hidden size, H query heads, K key/value heads, Dh head size, F MLP size, V vocabulary, L layers.

Every call takes explicit `positions [B, T]` and `kv_mask [B, S]` (1 for real key slots): left-padded
batches are the norm in RLHF, so nothing is inferred from the token ids. Every parameter carries
logical axis names that `ppo_jax.sharding` maps onto the mesh.

The layer loop is a choice of `ModelConfig.scan_layers`:
- scanned (`nn.scan`): one compiled layer body; parameters carry a leading `layers` axis [L, ...].
  Compiles fastest, and is what XLA:TPU is tuned for.
- unscanned: a Python loop over per-layer parameters `layers_0 ... layers_{L-1}`. Nothing is sliced
  out of a stacked buffer, so no layer pays a copy of its weights (or, in the backward pass, of its
  gradients and saved activations); on an H100 a 22-layer 1B training step runs 28% faster with
  half the peak memory (docs/gpu_probe.md), at a longer compile.
Hugging Face import/export and `split_layer_params` handle both layouts.

The cache travels through the layers as part of the carry, not as a scanned input/output: a decode
step then writes only its new keys and values into the stacked [L, ...] buffers in place, instead of
slicing out and re-stacking every layer's whole slab.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ppo_jax import sharding
from ppo_jax.models import lora
from ppo_jax.models.attention import Attention, attention_mask
from ppo_jax.models.cache import KVCache
from ppo_jax.models.config import ModelConfig
from ppo_jax.models.layers import MLP, DenseGeneral, norm, softcap
from ppo_jax.models.moe import CHOSEN, ROUTER, MoEMLP
from ppo_jax.models.rope import rope_tables
from ppo_jax.ppo.stats import last_token_index

Array = jax.Array

# Activations the backward pass keeps under remat (`ModelConfig.remat_policy`); None saves nothing.
_REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def split_layer_params(params: Any) -> tuple[Any, ...]:
    """One Block parameter tree per layer out of a CausalLM/ScalarModel tree (or its "lora" adapter
    tree, which has the same paths): the per-layer trees themselves when the layers are unscanned,
    else slices of the stacked tree (copies)."""
    backbone = params["transformer"]
    if "layers" not in backbone:
        count = sum(1 for name in backbone if name.startswith("layers_"))
        return tuple(backbone[f"layers_{i}"] for i in range(count))
    stacked = backbone["layers"]
    count = jax.tree.leaves(stacked)[0].shape[0]
    return tuple(jax.tree.map(lambda leaf, i=i: leaf[i], stacked) for i in range(count))


def positions_from_mask(mask: Array) -> Array:
    """Position ids of a left-padded batch: [B, T] mask -> [B, T] int32, 0 on padding."""
    mask = mask.astype(jnp.int32)
    return jnp.cumsum(mask, axis=-1) - mask


def leading_padding(mask: Array) -> Array:
    """[B, T] mask -> [B] int32: the padding slots before each row's first real token (0 for a row
    without one)."""
    return jnp.argmax(mask.astype(bool), axis=-1).astype(jnp.int32)


def roll_rows(x: Array, shift: Array) -> Array:
    """Row b of x [B, T, ...] rolled left by shift[b] slots (right by -shift[b]): slot t takes slot
    (t + shift) mod T. A left-padded row rolled by its `leading_padding` is right-padded."""
    slots = (jnp.arange(x.shape[1])[None, :] + shift[:, None]) % x.shape[1]  # [B, T]
    return jnp.take_along_axis(x, slots.reshape(slots.shape + (1,) * (x.ndim - 2)), axis=1)


def activation_axes(cached: bool) -> tuple[str, str, str]:
    """Logical names of the hidden states [B, T, D] between layers: a cache-free forward's are split
    along the sequence over the context axis (`context.context_attention`); a cached one's (the
    sampler's prefill and decode) stay whole along it, like its cache."""
    return ("batch", "length" if cached else "act_length", "act_embed")


def check_context_rows(cfg: ModelConfig, length: int, mesh=None, error: type[Exception] = ValueError,
                       what: str = "a cache-free forward", attention: str = "") -> None:
    """Rows of `length` slots split along the mesh's context axis (mesh None: the one being traced
    under): the axis must divide them, and a model with learned absolute positions (GPT-2) gets no
    position past its table from the split. attention: the user's kernel setting, refused where the
    split cannot run it (splash's static masks assume queries from slot 0). Raises `error`."""
    n = sharding.context_axis_size(mesh)
    if n == 1:
        return
    sharding.check_context_split(length, mesh, what, error)
    if cfg.family == "gpt2" and length > cfg.max_position_embeddings:
        raise error(f"{what}: rows of {length} tokens on a context axis of {n} devices, but {cfg.arch}'s learned "
                    f"positions end at max_position_embeddings={cfg.max_position_embeddings}: the axis splits rows, "
                    "it does not extend the table; use a model with rotary positions for longer rows")
    if attention == "splash":
        raise error(f"{what}: attention='splash' cannot split rows over a context axis of {n} devices (its "
                    "masks are static, for queries from slot 0); use attention='einsum' or 'auto'")


def _for_layer(sliding, full_inputs, sliding_inputs):
    """The inputs of a sliding-window layer or of a full-attention one. `sliding` is a Python bool
    when the layer loop is unrolled (chosen while tracing), a [] bool array inside the scan (chosen
    by `where`: one scanned body serves both kinds of layer)."""
    if isinstance(sliding, bool):
        return sliding_inputs if sliding else full_inputs
    return jax.tree.map(lambda full, local: jnp.where(sliding, local, full), full_inputs, sliding_inputs)


def layer_experts(cfg: ModelConfig, experts: Array | None) -> list:
    """Each layer's replayed experts [B, T, k] out of experts [B, T, Lm, k] over the Lm MoE layers
    (None for a dense layer, or every layer without replay)."""
    moe_index = [sum(cfg.layer_moe[:i]) if m else None for i, m in enumerate(cfg.layer_moe)]
    return [None if experts is None or j is None else experts[:, :, j] for j in moe_index]


def chosen_experts(sown: Any, name: str = "experts") -> Array:
    """The experts each token went to, [B, T, Lm, k] int32 over the Lm MoE layers in order, from the
    CHOSEN collection a forward sowed (`apply(..., mutable=[CHOSEN])`): stacked [Lm, B, T, k] under
    scanned layers, else one entry per layer (`layers_i`, or `decode_i` from `Transformer.unrolled`).
    name "own": under replay, each token's own top k instead (`MoEMLP`)."""
    entries = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(sown)[0]:
        names = [str(getattr(p, "key", "")) for p in path]
        decoded = any(n.startswith("decode_") for n in names)  # the unrolled decode's: always the experts used
        if name not in names and not (decoded and name == "experts"):
            continue
        index = next((int(m.group(1)) for n in names if (m := re.fullmatch(r"(?:layers|decode)_(\d+)", n))), None)
        entries.append((index, leaf[None] if index is not None else leaf))
    if not entries:
        raise ValueError("the forward sowed no chosen experts: the model has no MoE layers")
    stacked = jnp.concatenate([leaf for _, leaf in sorted(entries, key=lambda e: e[0] or 0)])
    return jnp.moveaxis(stacked, 0, 2)


class Block(nn.Module):
    """Pre-norm residual block. The scan carry is (residual stream x [B, T, D], whole-cache (k, v)
    or None); the scanned inputs are the layer index and whether the layer is a sliding-window one.

    ropes: ((cos, sin), (cos, sin)) and masks: ([B, T, S], [B, T, S]), each a pair (every layer of
    a model whose layers are alike, or a mixed model's full-attention layers; its sliding-window
    layers); segment_ids [B, T]: a packed row's sequence ids, or None; lengths [B]: the rows are
    right-padded to these lengths (`Transformer.aligned_rows`), or None."""

    config: ModelConfig
    moe: bool | None = None  # whether the MLP is the mixture of experts; None: as config.num_experts says

    @nn.compact
    def __call__(self, carry, layer, sliding, ropes, masks, cache_index, segment_ids=None, lengths=None,
                 experts=None):
        """experts [B, T, k] int: an MoE layer's replayed routing (`MoEMLP`), None: its own."""
        x, cache_kv = carry
        if self.config.sliding_layers is None:
            (cos, sin), mask = ropes[0], masks[0]
        else:
            (cos, sin), mask = _for_layer(sliding, (ropes[0], masks[0]), (ropes[1], masks[1]))
        attn_out, cache_kv = Attention(self.config, name="attn")(
            norm(self.config, "ln_1")(x), cos, sin, mask, cache_kv, layer, cache_index, sliding, segment_ids,
            lengths)
        if self.config.post_norms:
            attn_out = norm(self.config, "post_attn_norm")(attn_out)
        x = x + attn_out
        h = norm(self.config, "ln_2")(x)
        if self.config.num_experts if self.moe is None else self.moe:
            # Without a cache query slot t is key slot t: the mask's diagonal is the real tokens.
            real = jnp.diagonal(mask, axis1=1, axis2=2) if cache_kv is None else None
            mlp_out = MoEMLP(self.config, name="mlp")(h, real, experts)
        else:
            mlp_out = MLP(self.config, name="mlp")(h)
        if self.config.post_norms:
            mlp_out = norm(self.config, "post_mlp_norm")(mlp_out)
        x = x + mlp_out
        x = nn.with_logical_constraint(x, activation_axes(cache_kv is not None))
        return (x, cache_kv), None


def _block_class(cfg: ModelConfig):
    """Block, wrapped in `nn.remat` with the configured policy when remat is on. Inside a scan the
    recomputation cannot be hoisted out of the loop, so CSE prevention is off there."""
    if not cfg.remat:
        return Block
    return nn.remat(Block, prevent_cse=not cfg.scan_layers, policy=_REMAT_POLICIES[cfg.remat_policy])



def _lookup(embed: nn.Embed, ids: Array, rows: str = "vocab") -> Array:
    """Embedding rows for ids [B, T] -> [B, T, D].

    The table is gathered over its hidden axis first (the FSDP all-gather of a weight before use)
    while it stays split over the vocabulary: XLA partitions a gather along a sharded row axis well,
    but not one whose gathered axis is sharded too (it would replicate the whole table instead).
    """
    table = nn.with_logical_constraint(embed.embedding, (rows, "act_embed"))
    return jnp.take(table, ids, axis=0).astype(embed.dtype)


def axis_rules_key() -> tuple:
    """The logical axis rules in effect (`sharding.activation_rules`), hashable: part of the key of
    `_decode_block`'s traces, which jax keys by the mesh but not by Flax's rules (a trace made outside
    `sharding.mesh_context` would otherwise serve a call inside it, without the activations'
    sharding constraints). `nn.jit` needs no such key: its traces live as long as one `apply`."""
    return tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                 for name, axes in nn.get_logical_axis_rules())


@functools.lru_cache(maxsize=64)
def _decode_block(cfg: ModelConfig, moe: bool, sliding: bool, record: bool, axis_rules: tuple):
    """One layer of `Transformer.unrolled`, unbound and applied to that layer's own parameters, under
    a jit of its own: the alike layers of a decode step then share one trace (XLA inlines the calls),
    so tracing the sampler costs one layer per kind, not L. record: sow the layer's CHOSEN experts;
    axis_rules: `axis_rules_key()`, a key only."""

    def decode_layer(variables, carry, ropes, masks, cache_index):
        return Block(cfg, moe, parent=None).apply(variables, carry, None, sliding, ropes, masks, cache_index,
                                                  mutable=[CHOSEN] if record else False)

    return jax.jit(decode_layer)


class Transformer(nn.Module):
    """Embeddings + scanned blocks + final norm: tokens [B, T] -> hidden [B, T, D]."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed"))
        self.embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=init,
                              dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype, name="embed")
        if cfg.family == "gpt2":
            pinit = nn.with_logical_partitioning(nn.initializers.normal(0.01), ("positions", "embed"))
            self.pos_embed = nn.Embed(cfg.max_position_embeddings, cfg.hidden_size, embedding_init=pinit,
                                      dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
                                      name="pos_embed")
        block = _block_class(cfg)
        if cfg.scan_layers:
            self.layers = nn.scan(
                block,
                variable_axes={"params": 0, lora.COLLECTION: 0, ROUTER: 0, CHOSEN: 0},
                split_rngs={"params": True},
                in_axes=(0, 0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg)
        else:
            if not self.is_initializing():
                # Each layer through Flax's lifted jit, which fingerprints a module without its name:
                # alike layers share one trace (and its JVP and transpose), and XLA inlines the calls
                # into the same program, so a warm start traces one layer per kind, not L (TinyLlama's
                # plan with `_decode_block`: 14.5-18.9 -> 5.6-8.2 s of tracing + lowering,
                # docs/benchmarks.md). Not at init: the lifted RNG would draw other params from the
                # same seed. `sliding` (argument 3 counting self) is a Python bool here: static.
                block = nn.jit(block, static_argnums=(3,))
            self.layers = [block(cfg, moe) for moe in cfg.layer_moe]  # params layers_0 ... layers_{L-1}
        self.ln_f = norm(cfg, "ln_f")

    def __call__(self, tokens: Array, positions: Array, kv_mask: Array,
                 cache: KVCache | None = None, segment_ids: Array | None = None, experts: Array | None = None
                 ) -> tuple[Array, KVCache | None]:
        """tokens, positions [B, T]; kv_mask [B, S] -> hidden [B, T, D], cache (advanced by T).

        segment_ids [B, T] (no cache): packed rows, several sequences per row (`models/packing.py`):
        each slot's sequence id, 0 on padding; a token attends only within its own sequence, and
        `positions` restart at 0 for each sequence. experts [B, T, Lm, k] int: routing replay, each
        token's experts in each of the Lm MoE layers (-1: its own top k; `chosen_experts`)."""
        if segment_ids is not None and cache is not None:
            raise ValueError("segment_ids (packed rows) are for cache-free forwards only")
        if cache is None:
            check_context_rows(self.config, tokens.shape[1])
        aligned = self.aligned_rows(cache, segment_ids)
        if aligned:
            # The fused kernel takes right-padded rows by their lengths (no mask, no bias tensor):
            # each row's real tokens are moved to slots [0, length), and the hidden states back.
            shift = leading_padding(kv_mask)
            tokens, positions, kv_mask = (roll_rows(x, shift) for x in (tokens, positions, kv_mask))
            experts = None if experts is None else roll_rows(experts, shift)
        lengths = kv_mask.sum(-1).astype(jnp.int32) if aligned else None
        cache_index = cache.index if cache is not None else jnp.zeros((), jnp.int32)
        x, ropes, masks = self._block_inputs(tokens, positions, kv_mask, cache_index, segment_ids,
                                             cached=cache is not None)
        cache_kv = (cache.k, cache.v) if cache is not None else None
        cfg = self.config
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        if cfg.scan_layers:
            sliding = jnp.asarray(cfg.layer_sliding)
            per_layer = None if experts is None else jnp.moveaxis(experts, 2, 0)  # [L, B, T, k]: scanned
            (x, cache_kv), _ = self.layers((x, cache_kv), layer_ids, sliding, ropes, masks, cache_index,
                                           segment_ids, lengths, per_layer)
        else:
            for layer, local, block, replay in zip(layer_ids, cfg.layer_sliding, self.layers,
                                                   layer_experts(cfg, experts)):
                (x, cache_kv), _ = block((x, cache_kv), layer, local, ropes, masks, cache_index, segment_ids,
                                         lengths, replay)
        if cache is not None:
            cache = KVCache(k=cache_kv[0], v=cache_kv[1], index=cache.index + tokens.shape[1])
        x = self.ln_f(x)
        return (roll_rows(x, -shift) if aligned else x), cache

    def aligned_rows(self, cache, segment_ids) -> bool:
        """Whether this call runs right-aligned rows on the fused kernel: cache-free, unpacked, every
        layer on `jax.nn.dot_product_attention`, and a static window in every layer (a scanned body
        of mixed sliding / full layers keeps the mask), and rows whole on every device (rolling rows
        split along the context axis would move them across devices). The rows' real tokens must be
        contiguous (left padding, right padding or both: a prompt + response), as every caller's are."""
        cfg = self.config
        return (cache is None and segment_ids is None and cfg.fused_attention
                and not (cfg.scan_layers and cfg.sliding_layers is not None)
                and sharding.context_axis_size() == 1)

    def unrolled(self, tokens: Array, positions: Array, kv_mask: Array, caches: tuple[KVCache, ...],
                 layer_params: tuple[Any, ...], layer_adapters: tuple[Any, ...] | None = None
                 ) -> tuple[Array, tuple[KVCache, ...]]:
        """`__call__` with a cache, one layer at a time on per-layer parameters and caches.

        caches: one KVCache per layer with k, v [B, K, S, Dh] (`split_cache`); layer_params: one
        Block parameter tree per layer (`split_layer_params`); layer_adapters: likewise one Block
        adapter tree per layer (`split_layer_params` of the "lora" collection), None for adapters
        off. Used by the sampler's decode loop: a scan
        over the stacked layers copies every layer's weights and cache slab out of the stacked buffers
        at every token (XLA fuses neither dynamic slice into the dots; measured 2.3x slower per token
        on an H100, docs/gpu_probe.md); with separate buffers the dots read weights and cache where
        they lie and each cache is updated in place.
        """
        cache_index = caches[0].index
        x, ropes, masks = self._block_inputs(tokens, positions, kv_mask, cache_index)
        new_caches = []
        adapters = layer_adapters if layer_adapters is not None else (None,) * len(layer_params)
        # The blocks are applied unbound: their CHOSEN experts are sown again here, one entry per layer.
        record, rules = self.is_mutable_collection(CHOSEN), axis_rules_key()
        for i, (params, lora_params, cache, local, moe) in enumerate(zip(
                layer_params, adapters, caches, self.config.layer_sliding, self.config.layer_moe, strict=True)):
            variables = {"params": params} if lora_params is None else {"params": params,
                                                                        lora.COLLECTION: lora_params}
            layer = _decode_block(self.config, moe, local, record, rules)
            out = layer(variables, (x, (cache.k, cache.v)), ropes, masks, cache_index)
            ((x, (k, v)), _), sown = out if record else (out, None)
            if sown and CHOSEN in sown:
                self.sow(CHOSEN, f"decode_{i}", sown[CHOSEN]["mlp"]["experts"][0])
            new_caches.append(KVCache(k=k, v=v, index=cache.index + tokens.shape[1]))
        return self.ln_f(x), tuple(new_caches)

    def _block_inputs(self, tokens, positions, kv_mask, cache_index, segment_ids=None, cached=True):
        """Embedded tokens x [B, T, D] and the pairs `Block` takes: rope tables ((cos, sin), ...)
        [B, T, Dh] each (scalars for GPT-2) and attention masks [B, T, S] of T new tokens written
        from slot `cache_index` on (packed rows: within each sequence of `segment_ids`). The second
        of each pair is for the sliding-window layers of a model that mixes them with
        full-attention ones (the first again otherwise). cached: a KV cache is written (x stays
        whole along the context axis, `activation_axes`)."""
        cfg = self.config
        x = _lookup(self.embed, tokens)
        if cfg.scale_embeddings:  # sqrt(D) rounded to the compute dtype first, as Gemma does
            x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
        if cfg.family == "gpt2":
            x = x + _lookup(self.pos_embed, positions, rows="positions")
        x = nn.with_logical_constraint(x, activation_axes(cached))
        if cfg.family == "gpt2":
            rope = (jnp.zeros((), jnp.float32),) * 2  # unused
        else:
            rope = rope_tables(cfg, positions)
        query_slots = jnp.asarray(cache_index)[..., None] + jnp.arange(tokens.shape[1])  # [T] or [B, T]
        if cfg.sliding_layers is None:
            mask = attention_mask(kv_mask, query_slots, cfg.sliding_window, segment_ids)
            return x, (rope, rope), (mask, mask)
        masks = (attention_mask(kv_mask, query_slots, None, segment_ids),
                 attention_mask(kv_mask, query_slots, cfg.sliding_window, segment_ids))
        local_rope = rope if cfg.rope_local_theta is None else rope_tables(cfg, positions, local=True)
        return x, (rope, local_rope), masks

    def logits(self, hidden: Array) -> Array:
        """Tied output projection: [B, T, D] -> [B, T, V] float32."""
        return self.embed.attend(hidden).astype(jnp.float32)


class CausalLM(nn.Module):
    """Language model: returns logits [B, T, V] (float32) and the advanced cache."""

    config: ModelConfig

    def setup(self):
        self.transformer = Transformer(self.config, name="transformer")
        if not self.config.tie_word_embeddings:
            cfg = self.config
            self.lm_head = DenseGeneral((cfg.hidden_size,), (cfg.vocab_size,), ("embed", "vocab"), False,
                                        cfg.jnp_dtype, cfg.jnp_param_dtype, name="lm_head")

    def __call__(self, tokens, positions, kv_mask, cache=None):
        hidden, cache = self.transformer(tokens, positions, kv_mask, cache)
        return self.project(hidden), cache

    def hidden(self, tokens, positions, kv_mask, segment_ids=None, experts=None):
        """Final hidden states [B, T, D] without the output projection (slice before projecting);
        segment_ids: packed rows, experts [B, T, Lm, k]: routing replay (`Transformer.__call__`)."""
        return self.transformer(tokens, positions, kv_mask, segment_ids=segment_ids, experts=experts)[0]

    def project(self, hidden: Array) -> Array:
        """[..., D] -> [..., V] float32, soft-capped when the config says (Gemma 2). Flattened to
        [N, D] first (except on a context axis): the backward pass of a 3-D projection writes its
        large [V, D] gradient through an extra transpose on XLA:CPU."""
        # Rows split along the sequence over the context axis stay [B, T, D]: their flattening has no
        # sharding when B is not split (XLA would gather every token's hidden state on every device).
        flat = hidden if sharding.context_axis_size() > 1 else hidden.reshape(-1, hidden.shape[-1])
        if self.config.tie_word_embeddings:
            logits = self.transformer.logits(flat)
        else:
            logits = self.lm_head(flat).astype(jnp.float32)
        logits = softcap(logits, self.config.final_logit_softcap)
        return logits.reshape(hidden.shape[:-1] + logits.shape[-1:])


class ScalarModel(nn.Module):
    """Transformer with a scalar head (value and reward models): returns [B, T] float32.

    head_init "reward": N(0, 1/sqrt(D+1)) as in Stiennon et al.; "zero": all zeros (a value model
    grown from the policy starts by predicting 0).
    """

    config: ModelConfig
    head_init: str = "reward"

    @nn.compact
    def __call__(self, tokens, positions, kv_mask, cache=None, segment_ids=None):
        cfg = self.config
        hidden, cache = Transformer(cfg, name="transformer")(tokens, positions, kv_mask, cache, segment_ids)
        if self.head_init == "zero":
            init = nn.initializers.zeros
        elif self.head_init == "reward":
            init = nn.initializers.normal(1.0 / math.sqrt(cfg.hidden_size + 1))
        else:
            raise ValueError(f"head_init must be 'reward' or 'zero', got {self.head_init!r}")
        head = DenseGeneral((cfg.hidden_size,), (1,), ("embed", "score"), True, jnp.float32,
                            cfg.jnp_param_dtype, kernel_init=init, name="score")
        return head(hidden.astype(jnp.float32))[..., 0], cache


def score_at_last_token(values: Array, mask: Array) -> Array:
    """Scalar-head output read at the last real token: values [B, T], mask [B, T] -> [B] (a row
    with no real token reads slot 0)."""
    return jnp.take_along_axis(values, jnp.maximum(last_token_index(mask), 0)[:, None], axis=1)[:, 0]
