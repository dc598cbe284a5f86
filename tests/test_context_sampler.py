"""The sampler over a KV cache split along its slots on the context axis (issue 46, item 3): the same
key gives the one-device tokens and log-probs on the static and continuous engines, and the compiled
programs keep each device's S / c slots of the cache, never gathering them."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh

from ppo_jax import sharding
from ppo_jax.models import CausalLM, ModelConfig, context
from ppo_jax.sampling import SamplingConfig, make_sampler

VOCAB, LQ = 96, 8
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
             max_position_embeddings=32, tie_word_embeddings=False)
CONFIGS = {
    "llama": ModelConfig(arch="llama", **LLAMA),
    # soft-capped scores and logits, a sliding layer (window 4) then a full one
    "gemma2": ModelConfig(arch="gemma2", **dict(LLAMA, tie_word_embeddings=True), scale_embeddings=True,
                          norm_unit_offset=True, post_norms=True, query_pre_attn_scalar=20, attn_logit_softcap=5.0,
                          final_logit_softcap=3.0, sliding_window=4, sliding_layers=(True, False)),
    # GPT-OSS: experts (split over the expert axis; a decode step's one token is not split over the
    # context axis), attention sinks, a sliding layer then a full one
    "moe": ModelConfig(arch="gpt_oss", **LLAMA, num_experts=4, experts_per_token=2, moe_intermediate_size=16,
                       router_softmax="topk", router_bias=True, expert_kind="clamped_swiglu", swiglu_limit=2.0,
                       attention_sinks=True, attention_bias=True, attention_out_bias=True, sliding_window=4,
                       sliding_layers=(True, False), norm_scale_float32=True),
}
# (model, mesh, max_new_tokens, unroll_layers, num_samples, continuous slots). llama: S = 8 + 13 - 1 =
# 20 slots, 5 per device, decoded layer by layer (the CPU default); gemma2: 8 + 6 - 1 = 13 slots
# padded to 16, 2 per device, the scanned decode (the TPU default), prefilled once and repeated for 2
# samples per prompt; continuous: llama's on 4 decode slots (rows inserted into them, then compacted
# into 2), compared with the one-device static engine; moe: 2 x 4 devices, experts over the first.
CASES = {"llama": ("llama", (1, 2, 1, 1, 4), 13, None, 1, 0), "gemma2": ("gemma2", (1, 1, 1, 1, 8), 6, False, 2, 0),
         "continuous": ("llama", (1, 2, 1, 1, 4), 13, None, 1, 4), "moe": ("moe", (1, 1, 1, 2, 4), 13, None, 1, 0)}


def _prompts():
    """Left-padded prompts [4, LQ] of 8, 5, 2 and 7 real tokens."""
    real = np.array([8, 5, 2, 7])
    mask = (np.arange(LQ)[None, :] >= LQ - real[:, None]).astype(np.int32)
    return (np.random.default_rng(0).integers(1, VOCAB, mask.shape) * mask).astype(np.int32), mask


_SAMPLERS = {}


def _sampler(case: str, shape):
    """(sampler, its placed args) of `case` on the mesh `shape`, from the same random params (biases and
    norm scales included), built once per (case, shape)."""
    if (case, shape) not in _SAMPLERS:
        _SAMPLERS[case, shape] = _build(case, shape)
    return _SAMPLERS[case, shape]


def _build(case: str, shape):
    """`_sampler`'s (sampler, args), built anew."""
    name, _, new, unroll, samples, slots = CASES[case]
    model = CausalLM(CONFIGS[name])
    tokens = jnp.zeros((1, 2), jnp.int32)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens,
                                                 jnp.ones_like(tokens))["params"])
    rng = np.random.default_rng(1)
    host = jax.tree.map(lambda leaf: (0.3 * rng.standard_normal(leaf.shape)).astype(leaf.dtype),
                        nn.unbox(abstract))
    mesh = make_test_mesh(shape)
    shardings = sharding.tree_shardings(abstract, mesh)
    config = SamplingConfig(max_new_tokens=new, pad_token_id=0, unroll_layers=unroll, num_samples=samples,
                            engine="continuous" if slots else "static", slots=slots)
    args = (jax.device_put(host, shardings), *sharding.put_batch(_prompts(), mesh), jax.random.key(3))
    return make_sampler(model, config, mesh, shardings), args


@pytest.mark.parametrize("case", list(CASES))
def test_split_cache_samples_the_one_device_tokens(case):
    sampler, args = _sampler(case, CASES[case][1])
    reference, ref_args = _sampler("llama" if case == "continuous" else case, (1, 1, 1))
    got, want = jax.device_get((sampler(*args), reference(*ref_args)))
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.mask, want.mask)
    for field in ("logprobs", "sampling_logprobs"):
        np.testing.assert_allclose(getattr(got, field), getattr(want, field), atol=2e-5, rtol=0)
    print(f"{case}: max log-prob diff {np.abs(got.logprobs - want.logprobs).max():.1e}")


@pytest.mark.parametrize("case", ["llama", "continuous"])
def test_compiled_decode_keeps_each_devices_slots(case):
    """llama on (1, 2, 1, 1, 4): each device's rows are 2 of 4 and its slots 5 of 20. The decode loop
    carries every layer's k and v as [2, K=2, 5, Dh=8] (the continuous engine: 2 of its 4 slots, then
    1 of 2); nothing in the program holds a layer's whole 20 slots of a row (no all-gather of the
    cache: the attention's softmax statistics and weighted values are all-reduced instead, the
    prefill writes each device's own slots, the continuous engine's inserts and compaction move rows
    of each device's slots)."""
    sampler, args = _sampler(case, CASES[case][1])
    hlo = sampler.lower(*args).compile().as_text()
    loops = [line for line in hlo.splitlines() if re.search(r"= \(.*\) while\(", line)]
    assert any(line.count("f32[2,2,5,8]") == 4 for line in loops), "the decode loop carries no split cache"
    whole = [line.strip()[:160] for line in hlo.splitlines() if re.search(r"\[[\d,]*,20,8\]", line)]
    assert not whole, f"the program holds whole rows of cache slots: {whole[:3]}"
    reduced = [line for line in hlo.splitlines() if " all-reduce(" in line and "/attn/" in line]
    assert reduced, "the attention over the split slots all-reduces nothing"


def test_a_prefill_into_the_split_cache_attends_a_block_of_queries_at_a_time(monkeypatch):
    """With `context.QUERY_BLOCK` = 2 the llama case's 8 prompt queries attend the split cache 2 at a
    time: the one-device tokens still, and the compiled prefill's scores are [2 rows, K=2, 2, 2 queries,
    5 slots], never all 8 queries' [2, 2, 2, 8, 5] (at 2,048 prompt tokens and 32k slots, 17 GB of an
    H200's memory instead of 4.3)."""
    monkeypatch.setattr(context, "QUERY_BLOCK", 2)
    sampler, args = _build("llama", CASES["llama"][1])
    reference, ref_args = _sampler("llama", (1, 1, 1))
    got, want = jax.device_get((sampler(*args), reference(*ref_args)))
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-5, rtol=0)
    hlo = sampler.lower(*args).compile().as_text()
    assert "f32[2,2,2,2,5]" in hlo, "the prefill attends no block of 2 queries"
    assert "f32[2,2,2,8,5]" not in hlo, "the prefill holds all 8 queries' scores at once"
