"""Per-layer parameters traced once per kind of layer (issue 63's warm start: tracing 22 unscanned
layers was most of it). The forward's unscanned layers go through `nn.jit`, the decode loop's unbound
ones through `_decode_block`'s jit: every call of alike layers must then hold the very same traced
program, one per kind (dense / MoE, full / sliding window), and the result must stay what it was."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import sharding
from ppo_jax.models import CausalLM, ModelConfig, init_cache
from ppo_jax.models.cache import split_cache
from ppo_jax.models.transformer import Block, split_layer_params
from ppo_jax.sampling.loop import forward_last

from conftest import make_test_mesh

BASE = dict(vocab_size=64, hidden_size=32, num_heads=4, max_position_embeddings=64, scan_layers=False)
# name: (config, how many kinds of layer it has)
MODELS = {
    "dense": (dict(arch="llama", num_layers=4), 1),
    "mixed_moe": (dict(arch="qwen3", num_layers=4, num_experts=4, experts_per_token=2, moe_intermediate_size=16,
                       moe_layers=(False, True, True, False)), 2),
    "sliding": (dict(arch="gemma2", num_layers=4, sliding_window=4, sliding_layers=(True, False, True, False)), 2),
}


# The names of a layer's jit call: Flax's lifted jit names its function core_fn.
LAYER_CALLS = ("core_fn", "decode_layer")


def layer_calls(jaxpr) -> list:
    """The traced programs of the layer calls at the top of `jaxpr`."""
    return [eqn.params["jaxpr"].jaxpr for eqn in jaxpr.eqns if eqn.params.get("name") in LAYER_CALLS]


def model_and_params(name):
    cfg = ModelConfig(**BASE, **MODELS[name][0])
    model = CausalLM(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    mask = jnp.ones((2, 6), jnp.int32)
    params = model.init(jax.random.key(0), tokens, positions, mask)["params"]
    return model, params, (tokens, positions, mask)


def unjitted_logits(model, params, inputs):
    """The reference: the forward written out by hand, each layer an unbound `Block` applied eagerly."""
    cfg, tf = model.config, params["transformer"]
    tokens, positions, mask = inputs
    bound = model.bind({"params": params})
    x, ropes, masks = bound.transformer._block_inputs(tokens, positions, mask, jnp.zeros((), jnp.int32),
                                                      cached=False)
    for i, (sliding, moe) in enumerate(zip(cfg.layer_sliding, cfg.layer_moe)):
        (x, _), _ = Block(cfg, moe).apply({"params": tf[f"layers_{i}"]}, (x, None), jnp.asarray(i), sliding,
                                          ropes, masks, jnp.zeros((), jnp.int32))
    return bound.project(bound.transformer.ln_f(x))


@pytest.mark.parametrize("name", MODELS)
def test_alike_layers_of_the_forward_share_one_trace_and_compute_the_same(name):
    model, params, inputs = model_and_params(name)
    forward = lambda p: model.apply({"params": p}, *inputs)  # noqa: E731
    calls = layer_calls(jax.make_jaxpr(forward)(params).jaxpr)
    assert len(calls) == model.config.num_layers
    assert len({id(c) for c in calls}) == MODELS[name][1]
    logits = forward(params)
    logits = logits[0] if isinstance(logits, tuple) else logits
    np.testing.assert_allclose(np.asarray(logits), np.asarray(unjitted_logits(model, params, inputs)),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_alike_layers_of_an_unrolled_decode_step_share_one_trace(name):
    model, params, (tokens, positions, _) = model_and_params(name)
    layer_params = split_layer_params(params)
    caches = split_cache(init_cache(model.config, 2, 8))  # a prefill of the 6 tokens into 8 slots
    kv_mask, last = jnp.ones((2, 8), jnp.int32), jnp.full((2,), 5)

    def step(layer_params):
        return model.apply({"params": params}, tokens, positions, kv_mask, caches, last, layer_params,
                           method=forward_last)

    calls = layer_calls(jax.make_jaxpr(step)(layer_params).jaxpr)
    assert len(calls) == model.config.num_layers
    assert len({id(c) for c in calls}) == MODELS[name][1]


def constrains_activations(jaxpr) -> bool:
    """Whether a sharding constraint sits in `jaxpr` or in any program it calls."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            return True
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr's Jaxpr, or the Jaxpr itself
            if hasattr(inner, "eqns") and constrains_activations(inner):
                return True
    return False


def test_a_layer_traced_without_the_activation_rules_is_traced_again_with_them():
    """jax keys a trace by the mesh but not by Flax's logical axis rules: a layer trace shared across
    calls must not carry a call made outside `sharding.mesh_context` (no activation constraints) into
    one inside it, in the forward or in a decode step."""
    model, params, inputs = model_and_params("dense")
    tokens, positions, _ = inputs
    layer_params = split_layer_params(params)
    caches = split_cache(init_cache(model.config, 2, 8))
    kv_mask, last = jnp.ones((2, 8), jnp.int32), jnp.full((2,), 5)
    # Each trace a new outer function: jax would serve the same one's trace again (the same caveat, for
    # any function; the layers' trace is shared by functions that differ).
    programs = {
        "forward": (lambda: lambda p: model.apply({"params": p}, *inputs), params),
        "decode": (lambda: lambda lp: model.apply({"params": params}, tokens, positions, kv_mask, caches, last, lp,
                                                  method=forward_last), layer_params),
    }
    mesh = make_test_mesh((2, 1, 1))
    for name, (program, args) in programs.items():
        with jax.set_mesh(mesh):
            bare = layer_calls(jax.make_jaxpr(program())(args).jaxpr)
        with sharding.mesh_context(mesh):
            ruled = layer_calls(jax.make_jaxpr(program())(args).jaxpr)
        assert not any(constrains_activations(j) for j in bare), name
        assert len(ruled) == model.config.num_layers and all(constrains_activations(j) for j in ruled), name
