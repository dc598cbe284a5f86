"""The context mesh axis (issue 46): rows split along the sequence over it give the one-device
forward and gradients exactly, its attention gathers keys and values (never hidden states), and rows
it cannot split are refused before anything compiles."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh

from ppo_jax import sharding
from ppo_jax.cli.plan import mesh_size
from ppo_jax.models import CausalLM, ModelConfig, positions_from_mask
from ppo_jax.models.attention import attention_mask, einsum_attention
from ppo_jax.models.context import blockwise_attention, key_chunks
from ppo_jax.models.forward import response_logits, token_logprobs
from ppo_jax.models.transformer import check_context_rows

VOCAB, T = 96, 16
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=T)
LLAMA = dict(BASE, num_kv_heads=2, intermediate_size=48, tie_word_embeddings=False)
CONFIGS = {
    "gpt2": ModelConfig(arch="gpt2", **BASE),
    "llama": ModelConfig(arch="llama", **LLAMA),
    "mistral": ModelConfig(arch="mistral", **dict(LLAMA, sliding_window=4)),
    # soft-capped scores and logits, a sliding layer then a full one, in one scanned body
    "gemma2": ModelConfig(arch="gemma2", **dict(LLAMA, tie_word_embeddings=True), scale_embeddings=True,
                          norm_unit_offset=True, post_norms=True, query_pre_attn_scalar=20, attn_logit_softcap=5.0,
                          final_logit_softcap=3.0, sliding_window=4, sliding_layers=(True, False)),
    # the fused kernel (jax.nn.dot_product_attention): one device runs it on right-aligned rows by their
    # lengths, a split row with its mask rows
    "llama_xla": ModelConfig(arch="llama", **LLAMA, attention="xla"),
    # GPT-OSS: experts (split over the expert axis), attention sinks, a sliding layer then a full one
    "moe": ModelConfig(arch="gpt_oss", **LLAMA, num_experts=4, experts_per_token=2, moe_intermediate_size=16,
                       router_softmax="topk", router_bias=True, expert_kind="clamped_swiglu", swiglu_limit=2.0,
                       attention_sinks=True, attention_bias=True, attention_out_bias=True, sliding_window=4,
                       sliding_layers=(True, False), norm_scale_float32=True),
}
PROMPT_LENGTHS = (16, 9, 3, 12)  # left padding of 0, 7, 13 and 4 slots


def _batch(length: int = T):
    """tokens, positions, mask [B, length]: left-padded rows."""
    real = np.minimum(PROMPT_LENGTHS, length)
    mask = (np.arange(length)[None, :] >= length - real[:, None]).astype(np.int32)
    tokens = np.random.default_rng(0).integers(1, VOCAB, mask.shape) * mask
    mask = jnp.asarray(mask)
    return jnp.asarray(tokens, jnp.int32), positions_from_mask(mask), mask


def _host_params(config: ModelConfig):
    """Random NumPy params, biases and norm scales included (init would leave them 0 and 1)."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    abstract = jax.eval_shape(lambda: CausalLM(config).init(jax.random.key(0), tokens, tokens,
                                                           jnp.ones_like(tokens))["params"])
    rng = np.random.default_rng(1)
    return abstract, jax.tree.map(lambda leaf: (0.3 * rng.standard_normal(leaf.shape)).astype(leaf.dtype),
                                  nn.unbox(abstract))


def _loss_and_grads(config: ModelConfig):
    """jitted (params, tokens, positions, mask[, segment_ids]) -> ((loss, logits [B, T, V] at the real
    tokens, 0 on padding), grads): a weighted sum of every real token's log-probability of the next."""
    model = CausalLM(config)

    def loss(params, tokens, positions, mask, segment_ids=None):
        hidden = model.apply({"params": params}, tokens, positions, mask, segment_ids, method=CausalLM.hidden)
        logits = model.apply({"params": params}, hidden, method=CausalLM.project)
        logp = jax.nn.log_softmax(logits[:, :-1])
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        weights = (mask[:, :-1] * mask[:, 1:] * (1 + jnp.arange(tokens.shape[1] - 1) % 3)).astype(jnp.float32)
        return -(picked * weights).sum() / weights.sum(), logits * mask[..., None]  # padding outputs: any finite

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


_REFERENCE = {}


def _run(name: str, shape, *inputs):
    """(loss, logits, grads) as NumPy of config `name` on the mesh `shape`, from the same params."""
    config = CONFIGS[name]
    abstract, host = _host_params(config)
    mesh = make_test_mesh(shape)
    with sharding.mesh_context(mesh):
        params = jax.device_put(host, sharding.tree_shardings(abstract, mesh))
        (loss, logits), grads = _loss_and_grads(config)(params, *sharding.put_batch(inputs, mesh))
    return jax.device_get((loss, logits, grads))


def _assert_same(name, shape, *inputs):
    """Max abs difference of `_run` on `shape` from one device's (asserted <= 2e-5); a fused-kernel
    variant is compared with its einsum model, which has the same params."""
    key = (name.removesuffix("_xla"), len(inputs), inputs[0].shape)
    if key not in _REFERENCE:
        _REFERENCE[key] = _run(key[0], (1, 1, 1), *inputs)
    want = _REFERENCE[key]
    got = _run(name, shape, *inputs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)
    return max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


CASES = [("llama", (1, 1, 1, 1, 2)), ("llama_xla", (1, 1, 1, 1, 8)), ("llama_xla", (1, 2, 2, 1, 2)),
         ("gpt2", (1, 2, 1, 1, 4)),
         ("mistral", (1, 1, 2, 1, 4)), ("gemma2", (1, 2, 1, 1, 4)), ("moe", (1, 1, 1, 2, 4))]


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
def test_split_rows_give_the_one_device_logits_and_gradients(name, shape):
    diff = _assert_same(name, shape, *_batch())
    print(f"{name} {shape}: max abs diff {diff:.2e}")


def test_rows_of_an_odd_number_of_half_chunks_run_unbalanced():
    """12-slot rows on a 4-way axis: 3 slots per device do not halve, so each device attends with its
    own queries (the plain split, not `_balanced`)."""
    diff = _assert_same("llama", (1, 1, 1, 1, 4), *_batch(12))
    print(f"llama (1, 1, 1, 1, 4), 12 slots: max abs diff {diff:.2e}")


def test_packed_rows_split_along_the_sequence_keep_their_segments():
    """Several sequences per row (segment ids, positions restarting at 0), split 4 ways: each token
    still attends only within its own sequence, whichever devices its keys are on."""
    lengths = ((5, 6, 3), (16,), (8, 8), (4,))
    segments = np.zeros((len(lengths), T), np.int32)
    positions = np.zeros_like(segments)
    for row, parts in enumerate(lengths):
        start = 0
        for i, n in enumerate(parts):
            segments[row, start:start + n], positions[row, start:start + n] = i + 1, np.arange(n)
            start += n
    mask = (segments > 0).astype(np.int32)
    tokens = np.random.default_rng(2).integers(1, VOCAB, mask.shape) * mask
    diff = _assert_same("llama", (1, 1, 1, 1, 4), *(jnp.asarray(x) for x in (tokens, positions, mask, segments)))
    print(f"packed llama (1, 1, 1, 1, 4): max abs diff {diff:.2e}")


@pytest.mark.parametrize("chunks", [1, 2, 8])
def test_blockwise_attention_is_the_reference_kernel(chunks):
    """The split's einsum kernel, key chunk by key chunk with an online softmax, equals the reference
    kernel: soft-capping, sinks, a window, left padding and a query that sees no key (both average
    every value), and the gradients."""
    rng = np.random.default_rng(4)
    b, t, h, k, dh = 2, 16, 4, 2, 8
    q, key, value = (jnp.asarray(rng.standard_normal((b, t, n, dh)), jnp.float32) for n in (h, k, k))
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
    kv_mask = jnp.asarray(np.arange(t)[None] >= np.array([[0], [5]]), jnp.int32)
    mask = attention_mask(kv_mask, jnp.arange(t), 6).at[1, 2].set(False)  # row 1 slot 2: no key at all

    def reference(q, key, value):
        return einsum_attention(q, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3), mask, 0.3, 2.0, sinks)

    def blockwise(q, key, value):
        return blockwise_attention(q, key, value, mask, chunks, 0.3, 2.0, sinks)

    for fn in (lambda f: f, lambda f: jax.grad(lambda *a: (f(*a) ** 2).sum(), argnums=(0, 1, 2))):
        got, want = (jax.tree.leaves(jax.jit(fn(f))(q, key, value)) for f in (blockwise, reference))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-5)
    assert (key_chunks(32768, 8), key_chunks(16, 4), key_chunks(6000, 2)) == (32, 4, 6)
    # a half's queries skip the blocks past their last slot and wholly left of their first one's window:
    # the same outputs wherever a key is seen
    if chunks > 1:
        for start in (0, 8):
            rows = slice(start, start + 8)
            part = jax.jit(lambda q: blockwise_attention(
                q, key, value, mask[:, rows], chunks, 0.3, 2.0, sinks, first_slot=jnp.asarray(start),
                last_slot=jnp.asarray(start + 7), window=6))(q[:, rows])
            seen = np.asarray(mask[:, rows].any(-1))
            np.testing.assert_allclose(np.asarray(part)[seen], np.asarray(reference(q, key, value))[:, rows][seen],
                                       atol=2e-6, rtol=1e-5)


def _trace(config: ModelConfig, shape, length: int):
    """Traces (never compiles) the forward of [4, length] rows on the mesh `shape`."""
    abstract, _ = _host_params(config)
    mesh = make_test_mesh(shape)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nn.unbox(abstract),
                          sharding.tree_shardings(abstract, mesh))
    rows = jax.ShapeDtypeStruct((4, length), jnp.int32, sharding=sharding.data_sharding(mesh))
    with sharding.mesh_context(mesh):
        jax.jit(lambda p, t: CausalLM(config).apply({"params": p}, t, t, t)[0]).trace(params, rows)


def test_rows_the_context_axis_cannot_split_are_refused_while_tracing():
    with pytest.raises(ValueError, match=r"rows of 15 tokens do not split over the mesh's context axis of 4 "
                                         r"devices; pad them by 1 to 16 tokens"):
        _trace(CONFIGS["llama"], (1, 2, 1, 1, 4), 15)
    with pytest.raises(ValueError, match=r"learned positions end at max_position_embeddings=16: the axis "
                                         r"splits rows, it does not extend the table"):
        _trace(CONFIGS["gpt2"], (1, 1, 1, 1, 8), 24)
    with pytest.raises(ValueError, match="attention='splash' cannot split rows"):
        check_context_rows(CONFIGS["llama"], 16, make_test_mesh((1, 1, 1, 1, 2)), attention="splash")
    _trace(CONFIGS["gpt2"], (1, 2, 1, 1, 1), 24)  # without the axis the rows are as they always were
    with pytest.raises(ValueError, match=r"4 \(\+ expert\) or 5 \(data, fsdp, tensor, expert, context\)"):
        sharding.make_mesh((1, 1, 1, 1, 1, 8))
    assert mesh_size((1, 2, 1, 1, 4), None) == 8  # ppo-jax-plan plans it (and prints "context=4")


@pytest.mark.parametrize("overrides,match", [
    ({"rollout.response_length": 9}, r"rows of 17 tokens do not split over the mesh's context axis of 4 devices; "
                                     r"pad them by 3 to 20 tokens"),
    ({"compute.attention": "splash"}, "attention='splash' cannot split rows over a context axis of 4 devices"),
], ids=["length", "splash"])
def test_ppo_settings_refuse_rows_the_axis_cannot_split(overrides, match):
    """In one line, from the settings and the mesh alone: before any weight loads or program compiles."""
    from tiny_configs import tiny_config

    from ppo_jax.config import ConfigError
    from ppo_jax.rl import build
    from ppo_jax.rl.settings import Settings

    settings = Settings.from_config(tiny_config(**overrides), reward_in_code=False)
    with pytest.raises(ConfigError, match=f"data.prompt_length \\+ rollout.response_length: {match}"):
        build.policy_model_config(settings, make_test_mesh((1, 2, 1, 1, 4)))


def test_a_context_axis_of_one_changes_no_parameter_layout():
    abstract, _ = _host_params(CONFIGS["moe"])
    for shape in ((2, 2, 2), (1, 2, 1, 4)):
        want = sharding.tree_shardings(abstract, make_test_mesh(shape))
        got = sharding.tree_shardings(abstract, make_test_mesh(shape + (1,) * (5 - len(shape))))
        assert jax.tree.map(lambda s: s.spec, got) == jax.tree.map(lambda s: s.spec, want)


def _collective_shapes(hlo: str):
    """(op, result shape) of every collective in compiled HLO text (each element of a tuple result)."""
    ops = r"all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"
    for match in re.finditer(rf"= \(?([^=]*?)\)? ({ops})\(", hlo):
        for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", match.group(1)):
            yield match.group(2), tuple(int(d) for d in dims.split(",") if d)


@pytest.mark.parametrize("name,shape", [("llama", (1, 1, 1, 1, 8)), ("moe", (1, 1, 1, 1, 4))], ids=["llama", "moe"])
def test_attention_gathers_keys_and_values_not_hidden_states(name, shape):
    """Forward + backward of the whole model with rows split along the sequence: the only collectives
    over a row's [B, T, ...] activations are the all-gather of each layer's keys and values
    [B, T, K, Dh] and the reduce-scatter of their gradients (and an MoE's routing, [B, T, E] and
    [B, T, k]); the hidden states, queries, expert inputs and logits stay split."""
    config = CONFIGS[name]
    model = CausalLM(config)
    abstract, host = _host_params(config)
    mesh = make_test_mesh(shape)

    def loss(params, tokens, positions, mask):
        hidden = model.apply({"params": params}, tokens, positions, mask, method=CausalLM.hidden)
        logits = model.apply({"params": params}, hidden, method=CausalLM.project)
        return (jax.nn.log_softmax(logits) * mask[..., None]).sum()

    with sharding.mesh_context(mesh):
        params = jax.device_put(host, sharding.tree_shardings(abstract, mesh))
        hlo = jax.jit(jax.grad(loss)).lower(params, *sharding.put_batch(_batch(), mesh)).compile().as_text()
    batch, split = len(PROMPT_LENGTHS), T // shape[-1]
    kv = (batch, T, config.kv_heads, config.dim_per_head)
    weights = {x.shape[i:] for x in jax.tree.leaves(host) for i in (0, 1)}  # scanned: [L, ...] and [...]
    per_row = [(op, shape) for op, shape in _collective_shapes(hlo) if shape not in weights
               and (shape[:2] in ((batch, T), (batch, split), (batch, split // 2))
                    or shape[:1] in ((batch * T,), (batch * split,)))]
    assert ("all-gather", kv) in per_row, per_row
    assert {op for op, shape in per_row if shape == kv} == {"all-gather"}
    # the balanced causal work: each device's query halves [B, T/2c, H, Dh] (and mask rows) go to the
    # devices that compute them, their outputs come back
    queries = (batch, split // 2, config.num_heads, config.dim_per_head)
    halves = {queries, (batch, split // 2, T)}
    assert ("collective-permute", queries) in per_row, per_row
    assert " conditional(" in hlo  # the key blocks a device's queries cannot see are skipped, not masked
    routing = {(config.num_experts,), (config.experts_per_token,)} if config.num_experts else set()
    # nothing [B, T, D], [B, T, H, Dh], [B, T, V], [B * T, D]
    assert all(shape[2:] == kv[2:] or shape[2:] in routing or (op == "collective-permute" and shape in halves)
               for op, shape in per_row), per_row


def test_response_logits_stay_split_along_the_sequence():
    """The PPO forward (log-probs of a response after its prompt, and their gradient) with rows split
    4 ways: the response's slice of the hidden states moves only the prompt's offset between
    neighbours (collective-permutes), and no collective carries a row's hidden states or logits."""
    config = CONFIGS["llama"]
    model = CausalLM(config)
    abstract, host = _host_params(config)
    mesh = make_test_mesh((1, 1, 1, 1, 4))
    prompt = 4

    def logprobs(params, tokens, mask):
        logits = response_logits(model, params, tokens[:, :prompt], mask[:, :prompt], tokens[:, prompt:],
                                 mask[:, prompt:], 1.0)
        return token_logprobs(logits, tokens[:, prompt:], mask[:, prompt:]).sum()

    tokens, _, mask = _batch()
    with sharding.mesh_context(mesh):
        params = jax.device_put(host, sharding.tree_shardings(abstract, mesh))
        hlo = jax.jit(jax.grad(logprobs)).lower(params, *sharding.put_batch((tokens, mask), mesh)).compile().as_text()
    batch = len(PROMPT_LENGTHS)
    weights = {x.shape[i:] for x in jax.tree.leaves(host) for i in (0, 1)}  # scanned: [L, ...] and [...]
    moved = [(op, shape) for op, shape in _collective_shapes(hlo)
             if shape[:1] == (batch,) and len(shape) > 2 and shape not in weights]
    assert ("collective-permute", (batch, 2, config.hidden_size)) in moved, moved
    for op, shape in moved:  # K/V [B, T, K, Dh] and their gradients' reduce-scatter; else only the halo
        assert shape[2:] == (config.kv_heads, config.dim_per_head) or op == "collective-permute", (op, shape)
        assert shape[1] < T // 4 or shape[2:] == (config.kv_heads, config.dim_per_head), (op, shape)
