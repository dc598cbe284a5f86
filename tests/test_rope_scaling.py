"""Long-context rope scalings (YaRN, dynamic NTK, LongRoPE) against `transformers` on tiny random
models: positions below and above the original context length, full sequences and chunks through the
KV cache (where dynamic NTK and LongRoPE decide per call, as transformers does), no position ids, a
sequence-classification head, and the export round trip.

The batch is long enough (48 positions) to cross each scaling's boundary: YaRN's and LongRoPE's
original length 32, dynamic NTK's max_position_embeddings 24.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import make_test_mesh

from ppo_jax.models import ModelConfig, init_cache, positions_from_mask, score_at_last_token
from ppo_jax.models import hf
from ppo_jax.models.hf import HFModelError
from ppo_jax.models.rope import rope_frequencies

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, MLP = 96, 64, 2, 4, 2, 96
DH = HIDDEN // HEADS
PAD = 0
ORIGINAL = 32  # YaRN's and LongRoPE's original context
LONG_LENGTHS = (48, 35, 9, 1)  # real tokens per row: the longest rows cross ORIGINAL (and 24)
SHORT_LENGTHS = (20, 13, 4)  # every position below both boundaries
CHUNKS = (16, 4, 8, 12, 1, 1, 6)  # prefill below both boundaries, then chunks that cross them

_gen = np.random.default_rng(7)
# LongRoPE's per-dimension divisors: short ones near 1, long ones growing with the wavelength.
SHORT_FACTOR = list(np.round(1.0 + 0.1 * _gen.random(DH // 2), 4))
LONG_FACTOR = list(np.round(np.linspace(1.0, 6.0, DH // 2) + 0.2 * _gen.random(DH // 2), 4))


def _config(cls, **kw):
    base = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, vocab_size=VOCAB, intermediate_size=MLP,
                max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False)
    return cls(**{**base, **kw}, attn_implementation="eager")


# Variant -> (config factory, the rope_scaling we must map it to).
VARIANTS = {
    # Qwen2.5-style YaRN: factor and original length only; theta 100 puts YaRN's ramp (between the
    # dimensions turning beta_slow and beta_fast times over ORIGINAL) inside this head's 8 pairs.
    "qwen2_yarn": (lambda **kw: _config(transformers.Qwen2Config, rope_parameters={
        "rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
        **kw), {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32.0}),
    # DeepSeek/GPT-OSS-style YaRN: mscale / mscale_all_dim, explicit betas, no truncation.
    "llama_yarn": (lambda **kw: _config(transformers.LlamaConfig, rope_parameters={
        "rope_type": "yarn", "rope_theta": 100.0, "factor": 8.0, "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}, **kw),
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32.0, "beta_fast": 16.0,
         "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}),
    # Dynamic NTK: the base grows once a call's longest position passes max_position_embeddings.
    "llama_dynamic": (lambda **kw: _config(transformers.LlamaConfig, max_position_embeddings=24,
                                           rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                            "factor": 2.0}, **kw),
                      {"rope_type": "dynamic", "factor": 2.0}),
    # Phi-3-128k-style LongRoPE: original length beside rope_parameters, factors per dimension pair.
    "phi3_longrope": (lambda **kw: _config(transformers.Phi3Config, original_max_position_embeddings=ORIGINAL,
                                           rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                            "short_factor": SHORT_FACTOR,
                                                            "long_factor": LONG_FACTOR}, **kw),
                      {"rope_type": "longrope", "original_max_position_embeddings": 32.0,
                       "short_factor": tuple(SHORT_FACTOR), "long_factor": tuple(LONG_FACTOR)}),
}
CAUSAL = {"qwen2_yarn": transformers.Qwen2ForCausalLM, "llama_yarn": transformers.LlamaForCausalLM,
          "llama_dynamic": transformers.LlamaForCausalLM, "phi3_longrope": transformers.Phi3ForCausalLM}


def _batch(lengths, seed):
    rng = np.random.default_rng(seed)
    mask = np.zeros((len(lengths), max(lengths)), np.int32)
    for row, n in enumerate(lengths):
        mask[row, mask.shape[1] - n:] = 1
    tokens = rng.integers(PAD + 1, VOCAB, mask.shape) * mask + PAD * (1 - mask)
    return tokens.astype(np.int32), mask


LONG, SHORT = _batch(LONG_LENGTHS, 0), _batch(SHORT_LENGTHS, 1)


def _positions(mask):
    return np.clip(np.cumsum(mask, -1) - 1, 0, None)


def torch_logits(model, tokens, mask):
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens, dtype=torch.long),
                     attention_mask=torch.tensor(mask, dtype=torch.long),
                     position_ids=torch.tensor(_positions(mask), dtype=torch.long)).logits.numpy()


def torch_chunked_logits(model, tokens, mask):
    """transformers' cached decode chunk by chunk: each call rotates its own queries and keys."""
    positions, cache, logits, start = _positions(mask), None, [], 0
    with torch.no_grad():
        for size in CHUNKS:
            end = start + size
            out = model(input_ids=torch.tensor(tokens[:, start:end], dtype=torch.long),
                        attention_mask=torch.tensor(mask[:, :end], dtype=torch.long),
                        position_ids=torch.tensor(positions[:, start:end], dtype=torch.long),
                        cache=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits.numpy())
            start = end
    return np.concatenate(logits, axis=1)


def _randomize(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


@pytest.fixture(scope="module")
def mesh():
    return make_test_mesh((1, 1, 1))


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request, tmp_path_factory, mesh):
    """(variant, the PyTorch model, its saved directory, our loaded model)."""
    torch_model = CAUSAL[request.param](VARIANTS[request.param][0]()).eval()
    _randomize(torch_model, seed=list(VARIANTS).index(request.param))
    path = tmp_path_factory.mktemp(request.param)
    torch_model.save_pretrained(path)
    return request.param, torch_model, path, hf.load_model(path, mesh)


def _ours(loaded, tokens, mask):
    out, _ = jax.jit(lambda p, t, m: loaded.module.apply({"params": p}, t, positions_from_mask(m), m))(
        loaded.params, jnp.asarray(tokens), jnp.asarray(mask))
    return np.asarray(out)


def _ours_chunked(loaded, tokens, mask):
    module = loaded.module
    positions = positions_from_mask(jnp.asarray(mask))
    cache = init_cache(loaded.config, tokens.shape[0], tokens.shape[1])

    @jax.jit
    def step(params, tokens, positions, cache):
        def chunk(module, tokens, positions, cache):
            hidden, cache = module.transformer(tokens, positions, jnp.asarray(mask), cache)
            return module.project(hidden), cache
        return module.apply({"params": params}, tokens, positions, cache, method=chunk)

    logits, start = [], 0
    for size in CHUNKS:
        out, cache = step(loaded.params, jnp.asarray(tokens[:, start:start + size]),
                          positions[:, start:start + size], cache)
        logits.append(np.asarray(out))
        start += size
    return np.concatenate(logits, axis=1)


def _max_error(a, b, mask):
    real = mask.astype(bool)
    assert np.abs(b[real]).max() > 1.0  # not a comparison between tiny numbers
    return float(np.abs(a[real] - b[real]).max())


def test_config_maps_every_field(model):
    variant, _, _, loaded = model
    assert loaded.config.rope_scaling_dict == VARIANTS[variant][1]


def test_full_sequences_match_pytorch_below_and_above_the_original_length(model):
    _, torch_model, _, loaded = model
    for tokens, mask in (LONG, SHORT):
        assert _max_error(_ours(loaded, tokens, mask), torch_logits(torch_model, tokens, mask), mask) <= 1e-5


def test_chunks_through_the_cache_match_pytorch_chunks(model):
    """Prefill below the boundary, then chunks that cross it: dynamic NTK and LongRoPE rescale each
    call from its own longest position (the keys cached earlier keep their rotation), YaRN never
    changes; ours and transformers' cached decode agree chunk by chunk."""
    variant, torch_model, _, loaded = model
    tokens, mask = LONG
    ours, theirs = _ours_chunked(loaded, tokens, mask), torch_chunked_logits(torch_model, tokens, mask)
    assert _max_error(ours, theirs, mask) <= 1e-5
    full = torch_logits(torch_model, tokens, mask)
    if variant.endswith("yarn"):  # static frequencies: the cache is the full sequence's
        assert _max_error(ours, full, mask) <= 1e-5
    else:  # the per-call switch is real: the cached decode differs from one full forward
        assert _max_error(ours, full, mask) > 1e-3


def test_no_position_ids(model):
    """transformers without attention mask or position ids (positions 0..T-1) on an unpadded batch."""
    _, torch_model, _, loaded = model
    tokens = LONG[0][:1]
    with torch.no_grad():
        theirs = torch_model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    ones = np.ones_like(tokens)
    assert _max_error(_ours(loaded, tokens, ones), theirs, ones) <= 1e-5


def test_export_round_trip(model, tmp_path):
    variant, torch_model, _, loaded = model
    hf.export_model(tmp_path, loaded.config, loaded.params, kind="causal_lm")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert reloaded.config.rope_parameters == torch_model.config.rope_parameters
    tokens, mask = LONG
    np.testing.assert_array_equal(torch_logits(reloaded, tokens, mask), torch_logits(torch_model, tokens, mask))
    assert hf.config_from_hf(reloaded.config) == loaded.config


def test_yarn_reward_head_matches_pytorch(tmp_path, mesh):
    config = VARIANTS["qwen2_yarn"][0](num_labels=1)
    torch_model = transformers.Qwen2ForSequenceClassification(config).eval()
    _randomize(torch_model, seed=11)
    torch_model.save_pretrained(tmp_path)
    loaded = hf.load_model(tmp_path, mesh)
    assert loaded.kind == "reward" and loaded.config.rope_scaling_dict["rope_type"] == "yarn"
    tokens, mask = LONG
    with torch.no_grad():
        theirs = torch_model(input_ids=torch.tensor(tokens, dtype=torch.long),
                             attention_mask=torch.tensor(mask, dtype=torch.long),
                             position_ids=torch.tensor(_positions(mask), dtype=torch.long)).logits.numpy()[:, 0]
    out, _ = loaded.module.apply({"params": loaded.params}, jnp.asarray(tokens),
                                 positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask))
    ours = np.asarray(score_at_last_token(out, jnp.asarray(mask)))
    assert np.abs(ours - theirs).max() <= 1e-5


def test_yarn_attention_factor_as_the_paper_and_deepseek_define_it():
    """0.1 ln(s) + 1 from the factor alone; DeepSeek's ratio when mscale and mscale_all_dim are set;
    an explicit attention_factor wins."""
    def factor_of(**scaling):
        config = ModelConfig(arch="llama", rope_scaling=tuple({"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 32, **scaling}.items()))
        return rope_frequencies(config).attention_factor

    assert factor_of() == pytest.approx(0.1 * math.log(4.0) + 1)
    assert factor_of(mscale=1.0, mscale_all_dim=0.5) == pytest.approx(
        (0.1 * math.log(4.0) + 1) / (0.05 * math.log(4.0) + 1))
    assert factor_of(attention_factor=1.5) == 1.5


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "yarn", "factor": 4.0}, "yarn rope scaling needs original_max_position_embeddings"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8,
      "original_max_position_embeddings": 32}, "short_factor has 3 entries; LongRoPE needs one per rotated pair, head_dim / 2 = 8"),
    ({"rope_type": "ntk-by-parts", "factor": 2.0}, "unsupported rope_type 'ntk-by-parts'"),
])
def test_bad_rope_scaling_is_refused_by_name(scaling, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(arch="llama", hidden_size=64, num_heads=4, rope_scaling=tuple(scaling.items()))


def test_bad_longrope_checkpoint_is_refused_before_weights_load():
    data = VARIANTS["phi3_longrope"][0]().to_dict()
    data["rope_parameters"] = {**data["rope_parameters"], "long_factor": LONG_FACTOR[:5]}
    with pytest.raises(HFModelError, match="long_factor .*(length 8, got 5|has 5 entries)"):
        hf.config_from_hf(data)


def test_ppo_refuses_sequences_that_cross_the_longrope_switch():
    """Past original_max_position_embeddings the sampler's cached decode and the training forward
    would rotate the prompt's keys differently (rollout log-probs != training log-probs)."""
    from tiny_configs import tiny_config

    from ppo_jax.config import ConfigError
    from ppo_jax.rl import build
    from ppo_jax.rl.settings import Settings

    def settings(prompt_length, response_length):
        c = tiny_config(**{"data.prompt_length": prompt_length, "rollout.response_length": response_length})
        c.policy.model.update(arch="phi3", num_heads=2, max_position_embeddings=128, rope_scaling=(
            ("rope_type", "longrope"), ("original_max_position_embeddings", 16),
            ("short_factor", (1.0,) * 8), ("long_factor", (2.0,) * 8)))
        return Settings.from_config(c, reward_in_code=False)

    assert build.policy_model_config(settings(8, 8)).rope_scaling_dict["rope_type"] == "longrope"
    with pytest.raises(ConfigError, match="= 17 passes 16, where the policy's longrope rope scaling switches"):
        build.policy_model_config(settings(8, 9))
