"""The decoder itself: cached decode equals the full forward, and every mesh computes the same thing
with the parameter shardings we intend. (PyTorch parity lives in test_hf.py.)"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MESH_SHAPES, make_test_mesh
from jax.sharding import PartitionSpec as P

from ppo_jax import sharding
from ppo_jax.models import CausalLM, ModelConfig, init_cache, positions_from_mask
from ppo_jax.models.attention import attention_mask

VOCAB = 128
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=64)
LLAMA3 = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
          ("original_max_position_embeddings", 64.0), ("rope_type", "llama3"))
CONFIGS = {
    "gpt2": ModelConfig(arch="gpt2", **BASE),
    "llama": ModelConfig(arch="llama", **BASE, num_kv_heads=2, intermediate_size=96,
                         rope_theta=500000.0, rope_scaling=LLAMA3, tie_word_embeddings=False),
    "mistral": ModelConfig(arch="mistral", **BASE, num_kv_heads=2, intermediate_size=96,
                           sliding_window=4, tie_word_embeddings=False),
    "qwen2": ModelConfig(arch="qwen2", **BASE, num_kv_heads=2, intermediate_size=96,
                         attention_bias=True, tie_word_embeddings=True),
    # For the mesh tests: every kind of parameter at once (GQA, biases, untied head).
    "qwen2-untied": ModelConfig(arch="qwen2", **BASE, num_kv_heads=2, intermediate_size=96,
                                attention_bias=True, tie_word_embeddings=False),
}

PROMPT_LENGTHS = (6, 4, 2, 1, 6, 5, 3, 1)  # left-padded prompts (8 rows: every mesh splits them),
# then GENERATED real tokens in every row
PROMPT = max(PROMPT_LENGTHS)
GENERATED = 5
TOTAL = PROMPT + GENERATED


def _sequence():
    """tokens, mask [B, TOTAL]: a left-padded prompt followed by GENERATED tokens."""
    rng = np.random.default_rng(1)
    mask = np.ones((len(PROMPT_LENGTHS), TOTAL), np.int32)
    for row, n in enumerate(PROMPT_LENGTHS):
        mask[row, :PROMPT - n] = 0
    tokens = rng.integers(1, VOCAB, mask.shape) * mask
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)


TOKENS, MASK = _sequence()
POSITIONS = positions_from_mask(MASK)


def _abstract(config: ModelConfig):
    """Boxed abstract params (shapes and logical axis names), without compiling anything."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    return jax.eval_shape(lambda: CausalLM(config).init(
        jax.random.key(0), tokens, tokens, jnp.ones_like(tokens))["params"])


def _host_params(config: ModelConfig, seed: int = 0):
    """Random NumPy params: every weight, bias and norm scale random (init would leave biases 0 and
    scales 1, hiding mistakes in how they are used)."""
    rng = np.random.default_rng(seed)

    def one(path, leaf):
        offset = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
        return (offset + 0.1 * rng.standard_normal(leaf.shape)).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, nn.unbox(_abstract(config)))


_FORWARDS = {}


def _forward(config: ModelConfig):
    """One jitted full forward per config, reused across tests (it recompiles only per mesh)."""
    if config not in _FORWARDS:
        _FORWARDS[config] = jax.jit(CausalLM(config).apply)
    return _FORWARDS[config]


def _place(host_params, config: ModelConfig, mesh):
    """Host params onto `mesh`, each on the sharding its logical axis names ask for."""
    return jax.device_put(host_params, sharding.tree_shardings(_abstract(config), mesh))


# ---------------------------------------------------------------------------------------------
# Acceptance 2: prefill, then one token at a time, gives the full forward's logits.


@pytest.fixture(scope="module", params=["gpt2", "llama", "mistral", "qwen2"])
def decode_run(request):
    config = CONFIGS[request.param]
    mesh = make_test_mesh((1, 1, 1))
    params = _place(_host_params(config), config, mesh)
    model = CausalLM(config)

    @jax.jit
    def forward(params, tokens, positions, kv_mask, cache):
        return model.apply({"params": params}, tokens, positions, kv_mask, cache)

    with jax.set_mesh(mesh), sharding.activation_rules():
        full, _ = forward(params, TOKENS, POSITIONS, MASK, None)
        # The cache holds TOTAL slots; kv_mask is the final sequence's mask: slots not yet written
        # are hidden by causality, padding by the mask.
        cache = init_cache(config, TOKENS.shape[0], TOTAL)
        prefill, cache = forward(params, TOKENS[:, :PROMPT], POSITIONS[:, :PROMPT], MASK, cache)
        steps = []
        for t in range(PROMPT, TOTAL):
            logits, cache = forward(params, TOKENS[:, t:t + 1], POSITIONS[:, t:t + 1], MASK, cache)
            steps.append(logits[:, 0])
    return request.param, np.asarray(full), np.asarray(prefill), np.stack(steps, 1), cache


def test_prefill_matches_full_forward(decode_run):
    name, full, prefill, _, _ = decode_run
    real = np.asarray(MASK[:, :PROMPT], bool)
    assert np.abs(full).max() > 1.0
    err = np.abs(prefill[real] - full[:, :PROMPT][real]).max()
    assert err <= 1e-5, f"{name}: prefill differs from the full forward by {err}"


def test_each_decode_step_matches_full_forward(decode_run):
    name, full, _, steps, cache = decode_run
    assert steps.shape == (TOKENS.shape[0], GENERATED, VOCAB)
    err = np.abs(steps - full[:, PROMPT:]).max()
    assert err <= 1e-5, f"{name}: cached decode differs from the full forward by {err}"
    assert int(cache.index) == TOTAL


def test_sliding_window_masks_keys_in_this_batch():
    """The Mistral window (4) really hides keys here, or the decode test would not exercise it."""
    slots = jnp.arange(TOTAL)
    windowed = np.asarray(attention_mask(MASK, slots, CONFIGS["mistral"].sliding_window))
    causal = np.asarray(attention_mask(MASK, slots, None))
    hidden = causal & ~windowed  # [B, T, S] keys the window removes
    assert not hidden[:, :4].any()  # the first 4 slots see all their keys either way
    assert hidden[0, 4:].any(-1).all()  # every later query of the full row loses its oldest keys
    assert hidden[0, 4:].sum(-1).tolist() == list(range(1, TOTAL - 3))


# ---------------------------------------------------------------------------------------------
# Acceptance 5: the same forward on every mesh; parameters carry the intended PartitionSpecs.

# Intended specs for the "qwen2-untied" model: D=64, H=4, K=2, Dh=16, F=96, V=128, L=2.
# "embed" -> fsdp; "heads", "kv_heads", "mlp", "vocab" -> tensor, when the axis divides.
EXPECTED_SPECS = {
    (1, 1, 1): {},
    (8, 1, 1): {},  # data parallel only: parameters replicated
    (1, 8, 1): {
        "embed": P(None, "fsdp"), "lm_head": P("fsdp"), "q": P(None, "fsdp"),
        "k": P(None, "fsdp"), "o": P(None, None, None, "fsdp"), "gate": P(None, "fsdp"),
        "down": P(None, None, "fsdp"), "q_bias": P(), "norm": P()},
    (2, 2, 2): {
        "embed": P("tensor", "fsdp"), "lm_head": P("fsdp", "tensor"),
        "q": P(None, "fsdp", "tensor"), "k": P(None, "fsdp", "tensor"),
        "o": P(None, "tensor", None, "fsdp"), "gate": P(None, "fsdp", "tensor"),
        "down": P(None, "tensor", "fsdp"), "q_bias": P(None, "tensor"), "k_bias": P(None, "tensor"),
        "norm": P()},
    (1, 2, 4): {
        "embed": P("tensor", "fsdp"), "lm_head": P("fsdp", "tensor"),
        "q": P(None, "fsdp", "tensor"),
        "k": P(None, "fsdp"),  # 2 kv heads do not split 4 ways: kept whole, still fsdp-sharded
        "o": P(None, "tensor", None, "fsdp"), "gate": P(None, "fsdp", "tensor"),
        "down": P(None, "tensor", "fsdp"), "q_bias": P(None, "tensor"), "k_bias": P(),
        "norm": P()},
}


def _named(params):
    layers = params["transformer"]["layers"]
    return {
        "embed": params["transformer"]["embed"]["embedding"], "lm_head": params["lm_head"]["kernel"],
        "q": layers["attn"]["q"]["kernel"], "k": layers["attn"]["k"]["kernel"],
        "o": layers["attn"]["o"]["kernel"], "gate": layers["mlp"]["gate"]["kernel"],
        "down": layers["mlp"]["down"]["kernel"], "q_bias": layers["attn"]["q"]["bias"],
        "k_bias": layers["attn"]["k"]["bias"], "norm": layers["ln_1"]["scale"],
    }


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=lambda s: "mesh" + "x".join(map(str, s)))
def test_param_partition_specs(shape):
    """The shardings sharded init and HF loading place params on (from logical names + rules)."""
    config = CONFIGS["qwen2-untied"]
    shardings = sharding.tree_shardings(_abstract(config), make_test_mesh(shape))
    for name, s in _named(shardings).items():
        want = EXPECTED_SPECS[shape].get(name, P())
        assert s.spec == want, f"{name} on {shape}: {s.spec} != {want}"


MESH_CONFIGS = ["gpt2", "qwen2-untied"]


@pytest.fixture(scope="module", params=MESH_CONFIGS)
def single_device_run(request):
    """Host params and the (1, 1, 1) mesh's logits, the reference for the other meshes."""
    config = CONFIGS[request.param]
    mesh = make_test_mesh((1, 1, 1))
    host = _host_params(config, seed=3)
    with jax.set_mesh(mesh), sharding.activation_rules():
        logits, _ = _forward(config)({"params": _place(host, config, mesh)}, TOKENS, POSITIONS, MASK)
    return config, host, np.asarray(logits)


def test_same_logits_on_every_mesh(single_device_run, mesh):
    config, host_params, reference = single_device_run
    params = _place(host_params, config, mesh)
    with jax.set_mesh(mesh), sharding.activation_rules():
        batch = sharding.put_batch((TOKENS, POSITIONS, MASK), mesh)
        logits, _ = _forward(config)({"params": params}, *batch)
    assert logits.shape == reference.shape
    np.testing.assert_allclose(np.asarray(logits), reference, atol=2e-5, rtol=1e-5)
    shape = tuple(mesh.devices.shape)[:3]  # (data, fsdp, tensor): these meshes have no expert axis
    if config == CONFIGS["qwen2-untied"]:  # the arrays themselves carry the intended specs
        for name, x in _named(params).items():
            assert x.sharding.spec == EXPECTED_SPECS[shape].get(name, P()), (name, shape)
    if shape == (1, 8, 1):  # anything beyond a few biases is split when the mesh allows it
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
            if x.size >= 1024:
                assert x.addressable_shards[0].data.size == x.size // 8, jax.tree_util.keystr(path)


def test_sliding_layers_from_a_config_file_list_stay_hashable():
    config = ModelConfig(arch="qwen2", **BASE, sliding_window=4, sliding_layers=[1, 0])
    assert config.sliding_layers == (True, False) and config.layer_sliding == (True, False)
    assert hash(config) == hash(config.replace(sliding_layers=(True, False)))


@pytest.mark.parametrize("changes, message", [
    (dict(sliding_layers=(True, False)), "sliding_layers needs model.sliding_window"),
    (dict(sliding_window=4, sliding_layers=(True,)), "1 entries for 2 layers"),
    (dict(sliding_window=4, sliding_layers=(True, True)), "use sliding_layers=None"),
])
def test_bad_sliding_layers_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(arch="qwen2", **BASE, **changes)
