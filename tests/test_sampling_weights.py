"""fp32 master weights, bf16 compute: the sampler casts the weights once per rollout, before its decode
loop, not once per step (sampling/weights.py). The loop then reads bf16 weights (half the bytes: on an
H200 the 4-layer TinyLlama slice decoded at 0.83 ms/step from fp32 weights, 0.48 from bf16), and the
samples are those the model's own per-layer casts give (the same tokens, log-probs to round-off).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh

from ppo_jax.models import CausalLM, ModelConfig, init_params
from ppo_jax.sampling import SamplingConfig, make_sampler, sample
from ppo_jax.sampling.continuous import sample_continuous
from ppo_jax.sampling.weights import KEPT_AS_HELD, weights_in_compute_dtype

MIXED = dict(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
             max_position_embeddings=32, tie_word_embeddings=False, param_dtype="float32", dtype="bfloat16")
MODELS = {
    "llama": ModelConfig(arch="llama", **MIXED),
    # experts (their weights are params the layer casts itself), a router, sinks and fp32 norm scales
    "moe": ModelConfig(arch="gpt_oss", **MIXED, num_experts=4, experts_per_token=2, moe_intermediate_size=16,
                       router_softmax="topk", router_bias=True, expert_kind="clamped_swiglu", swiglu_limit=2.0,
                       attention_sinks=True, attention_bias=True, attention_out_bias=True,
                       norm_scale_float32=True),
    # a tied head: the embedding table is read by the lookup and by the output projection
    "tied": ModelConfig(arch="llama", **dict(MIXED, tie_word_embeddings=True)),
}
CONFIG = SamplingConfig(max_new_tokens=10, temperature=0.8, top_k=40, stop_token_ids=(3, 11, 19), pad_token_id=0)
ROWS, PROMPT = 4, 6


def _model(name):
    model = CausalLM(MODELS[name])
    mesh = make_test_mesh((1, 1, 1))
    params, shardings = init_params(model, jax.random.key(0), mesh)
    # far-from-uniform next-token distributions, so a changed logit changes the draws
    params["transformer"]["embed"]["embedding"] = params["transformer"]["embed"]["embedding"] * 7.0
    return model, params, shardings, mesh


def _prompts():
    tokens = np.random.default_rng(0).integers(4, 255, (ROWS, PROMPT)).astype(np.int32)
    mask = (np.arange(PROMPT)[None, :] >= np.arange(ROWS)[:, None] % 3).astype(np.int32)
    return np.where(mask == 1, tokens, 0).astype(np.int32), mask


def _while_operands(jaxpr) -> list:
    """The avals of every operand of every while loop in `jaxpr` (nested jaxprs included)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            found += [v.aval for v in eqn.invars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _while_operands(inner)
    return found


def _weight_shapes(params, scanned: bool) -> set:
    """Shapes of the weights the layers cast before use (all but norm scales, biases and sinks), as
    stored and, for a scanned model's stacked [L, ...] layers, as one layer's slice (the layer-by-layer
    decode's loop reads those)."""
    shapes = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if path[-1].key not in KEPT_AS_HELD:
            shapes.add(leaf.shape)
            if scanned and any(getattr(k, "key", None) == "layers" for k in path):
                shapes.add(leaf.shape[1:])
    return shapes


@pytest.mark.parametrize("name, engine", [("llama", "static"), ("llama", "continuous"), ("moe", "static"),
                                          ("tied", "continuous")])
def test_the_decode_loop_reads_bf16_weights_and_samples_what_per_step_casts_sample(name, engine):
    model, params, shardings, mesh = _model(name)
    config = dataclasses.replace(CONFIG, engine=engine, slots=2 if engine == "continuous" else 0)
    sampler = make_sampler(model, config, mesh, shardings)
    tokens, mask = _prompts()
    key = jax.random.key(3)

    # No fp32 weight matrix enters a loop; bf16 ones do (the loop's own buffers are other shapes).
    operands = _while_operands(jax.make_jaxpr(sampler.jitted)(params, tokens, mask, key).jaxpr)
    weights = _weight_shapes(params, model.config.scan_layers)
    assert operands, "no decode loop found"
    fp32 = [op for op in operands if op.shape in weights and op.dtype == jnp.float32]
    bf16 = [op for op in operands if op.shape in weights and op.dtype == jnp.bfloat16]
    assert not fp32, f"fp32 weights read inside the decode loop: {sorted({op.shape for op in fp32})}"
    assert len(bf16) >= 4  # the q, k, v and output projections of a layer at least

    # The reference: the engine on the fp32 tree as stored, each layer casting its weights per step.
    engine_fn = sample_continuous if engine == "continuous" else sample
    reference = jax.jit(engine_fn, static_argnames=("model", "config"))(
        params, tokens, mask, key, model=model, config=config)
    out = sampler(params, tokens, mask, key)
    assert out.mask.sum() > ROWS  # something was decoded
    # The same bf16 operands in both programs; they are compiled apart, so the log-probs are compared
    # to round-off (a cast left inside the loop would still pass this; the jaxpr check above guards it).
    for field in ("tokens", "mask"):
        np.testing.assert_array_equal(np.asarray(getattr(out, field)), np.asarray(getattr(reference, field)),
                                      err_msg=field)
    for field in ("logprobs", "sampling_logprobs"):
        np.testing.assert_allclose(np.asarray(getattr(out, field)), np.asarray(getattr(reference, field)),
                                   atol=1e-5, rtol=0, err_msg=field)


def test_weights_already_in_the_compute_dtype_are_passed_through():
    model = CausalLM(MODELS["llama"].replace(param_dtype="bfloat16"))
    params = {"layer": {"kernel": jnp.ones((4, 4), jnp.bfloat16), "scale": jnp.ones((4,), jnp.float32)}}
    assert weights_in_compute_dtype(params, model)["layer"]["kernel"] is params["layer"]["kernel"]
    mixed = CausalLM(MODELS["llama"])
    cast = weights_in_compute_dtype({"layer": {"kernel": jnp.ones((4, 4)), "scale": jnp.ones((4,))}}, mixed)
    assert cast["layer"]["kernel"].dtype == jnp.bfloat16 and cast["layer"]["scale"].dtype == jnp.float32
