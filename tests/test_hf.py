"""Hugging Face checkpoints: PyTorch parity, sharded loading, export round trip, bad checkpoints.

Every reference is a `transformers` PyTorch model built from a tiny config with random weights
(biases and norm scales included, so a misplaced bias or a swapped norm shows), saved to a temp dir.
Each tiny model is built, loaded and run once per module; tests share those results.
"""

import dataclasses
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import make_test_mesh
from jax.sharding import PartitionSpec as P

from ppo_jax import sharding
from ppo_jax.models import ModelConfig, init_cache, positions_from_mask, score_at_last_token
from ppo_jax.models.cache import split_cache
from ppo_jax.models import hf
from ppo_jax.models.hf import HFModelError
from ppo_jax.models.transformer import split_layer_params

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, MLP, MAX_POS = 128, 64, 2, 4, 2, 96, 64
PAD = 0  # pad token: appears only as left padding
LENGTHS = (10, 7, 3, 1)  # real tokens per row of the left-padded batch
T = max(LENGTHS)
# Llama-3 scaling whose three frequency bands (kept, smoothed, divided) all occur at head_dim 16.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

SMALL_PARAM = 1024  # elements; params at least this big must be sharded on a (1, 8, 1) mesh


def _llama_family(cls, **kw):
    base = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, vocab_size=VOCAB, intermediate_size=MLP,
                max_position_embeddings=MAX_POS, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    return cls(**{**base, **kw}, attn_implementation="eager")


# Variant name -> config factory; a variant is a model type (its key when they are the same) or a
# model type with the options named after its underscore ("llama_bias" is Llama with biases).
HF_CONFIGS = {
    "gpt2": lambda **kw: transformers.GPT2Config(
        n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=MAX_POS,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=2, attn_implementation="eager", **kw),
    # GQA, untied head, Llama-3 rope scaling.
    "llama": lambda **kw: _llama_family(transformers.LlamaConfig, rope_parameters=dict(LLAMA3_ROPE),
                                        tie_word_embeddings=False, **kw),
    # A sliding window shorter than the batch's rows, so the window really masks keys.
    "mistral": lambda **kw: _llama_family(transformers.MistralConfig, sliding_window=4,
                                          tie_word_embeddings=False, **kw),
    # q/k/v biases, tied embeddings.
    "qwen2": lambda **kw: _llama_family(transformers.Qwen2Config, tie_word_embeddings=True, **kw),
    # Llama's attention_bias (q/k/v and o_proj) and mlp_bias (gate/up/down).
    "llama_bias": lambda **kw: _llama_family(transformers.LlamaConfig, attention_bias=True,
                                             mlp_bias=True, tie_word_embeddings=False, **kw),
    # q/k norms, an explicit head_dim (not hidden / heads), and a sliding layer before a full one.
    "qwen3": lambda **kw: _llama_family(transformers.Qwen3Config, head_dim=24, use_sliding_window=True,
                                        sliding_window=4, tie_word_embeddings=False,
                                        layer_types=["sliding_attention", "full_attention"], **kw),
    # Qwen2's mixed layers as a transformers-4 config writes them: windows from max_window_layers on.
    "qwen2_mixed": lambda **kw: _llama_family(transformers.Qwen2Config, use_sliding_window=True,
                                              sliding_window=4, max_window_layers=1, **kw),
    # Fused qkv_proj and gate_up_proj, GQA, a sliding window shorter than the rows.
    "phi3": lambda **kw: _llama_family(transformers.Phi3Config, sliding_window=4,
                                       tie_word_embeddings=False, **kw),
    # (1 + w) norms, sqrt(D)-scaled embeddings, GeGLU, explicit head_dim, tied embeddings.
    "gemma": lambda **kw: _llama_family(transformers.GemmaConfig, head_dim=24, **kw),
    # Gemma 2: post norms, query_pre_attn_scalar, attention and final soft-capping small enough to
    # bite on these scores and logits, alternating sliding (4) and full layers.
    "gemma2": lambda **kw: _llama_family(transformers.Gemma2Config, head_dim=16, query_pre_attn_scalar=20,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                         sliding_window=4, **kw),
    # Gemma 3: q/k norms, a local rope base for the sliding layers, linear rope scaling on the full ones.
    "gemma3": lambda **kw: _llama_family(
        transformers.Gemma3TextConfig, head_dim=16, query_pre_attn_scalar=20, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **kw),
    # Mixture of experts: Qwen3-MoE (q/k norms, top-2 of 4 experts, weights not renormalised) and
    # Mixtral (renormalised top-2, a sliding window shorter than the rows).
    "qwen3_moe": lambda **kw: _llama_family(transformers.Qwen3MoeConfig, head_dim=24, num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                            norm_topk_prob=False, tie_word_embeddings=False, **kw),
    "mixtral": lambda **kw: _llama_family(transformers.MixtralConfig, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=4, tie_word_embeddings=False, **kw),
    # GPT-OSS: attention sinks, q/k/v/o biases, a sliding layer then a full one, YaRN past its
    # original 8 positions, a biased router with the softmax over the top 2 of 4, clamped SwiGLU
    # experts with biases and a limit low enough to clamp these activations.
    "gpt_oss": lambda **kw: _llama_family(
        transformers.GptOssConfig, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        swiglu_limit=2.0, tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 8, "rope_theta": 150000.0}, **kw),
    # Qwen3-MoE with a dense first layer (intermediate_size wide) before an MoE one: always per-layer params.
    "qwen3_moe_mixed": lambda **kw: HF_CONFIGS["qwen3_moe"](mlp_only_layers=[0], **kw),
}
# Config fields each variant must map to (beyond the shared sizes checked for every case).
EXPECTED_FIELDS = {
    "gpt2": dict(tie_word_embeddings=True),
    "llama": dict(attention_bias=False, sliding_window=None, tie_word_embeddings=False),
    "mistral": dict(attention_bias=False, sliding_window=4, tie_word_embeddings=False),
    "qwen2": dict(attention_bias=True, attention_out_bias=False, sliding_window=None,
                  tie_word_embeddings=True),
    "llama_bias": dict(attention_bias=True, attention_out_bias=True, mlp_bias=True),
    "qwen3": dict(qk_norm=True, head_dim=24, attention_bias=False, sliding_window=4,
                  sliding_layers=(True, False)),
    "qwen2_mixed": dict(attention_bias=True, sliding_window=4, sliding_layers=(False, True)),
    "phi3": dict(attention_bias=False, sliding_window=4, tie_word_embeddings=False),
    "gemma": dict(scale_embeddings=True, norm_unit_offset=True, post_norms=False, head_dim=24,
                  sliding_window=None, tie_word_embeddings=True),
    "gemma2": dict(scale_embeddings=True, norm_unit_offset=True, post_norms=True, qk_norm=False,
                   query_pre_attn_scalar=20, attn_logit_softcap=5.0, final_logit_softcap=3.0,
                   sliding_window=4, sliding_layers=(True, False), head_dim=None),
    "qwen3_moe_mixed": dict(num_experts=4, moe_layers=(False, True), scan_layers=False),
    "qwen3_moe": dict(qk_norm=True, head_dim=24, num_experts=4, experts_per_token=2, moe_intermediate_size=32,
                      norm_topk_prob=False, sliding_window=None),
    "mixtral": dict(num_experts=4, experts_per_token=2, moe_intermediate_size=None, norm_topk_prob=True,
                    sliding_window=4, attention_bias=False),
    "gpt_oss": dict(num_experts=4, experts_per_token=2, router_softmax="topk", router_bias=True,
                    expert_kind="clamped_swiglu", swiglu_limit=2.0, attention_sinks=True, attention_bias=True,
                    attention_out_bias=True, sliding_window=4, sliding_layers=(True, False), norm_scale_float32=True),
    "gemma3": dict(qk_norm=True, post_norms=True, attn_logit_softcap=None, rope_theta=1e6,
                   rope_scaling=(("factor", 2.0), ("rope_type", "linear")), rope_local_theta=1e4,
                   sliding_window=4, sliding_layers=(True, False)),
}
HF_CLASSES = {
    ("gpt2", "causal_lm"): transformers.GPT2LMHeadModel,
    ("llama", "causal_lm"): transformers.LlamaForCausalLM,
    ("mistral", "causal_lm"): transformers.MistralForCausalLM,
    ("qwen2", "causal_lm"): transformers.Qwen2ForCausalLM,
    ("qwen3", "causal_lm"): transformers.Qwen3ForCausalLM,
    ("phi3", "causal_lm"): transformers.Phi3ForCausalLM,
    ("gemma", "causal_lm"): transformers.GemmaForCausalLM,
    ("gemma2", "causal_lm"): transformers.Gemma2ForCausalLM,
    ("gemma3_text", "causal_lm"): transformers.Gemma3ForCausalLM,
    ("gpt2", "reward"): transformers.GPT2ForSequenceClassification,
    ("llama", "reward"): transformers.LlamaForSequenceClassification,
    ("qwen2", "reward"): transformers.Qwen2ForSequenceClassification,
    ("qwen3", "reward"): transformers.Qwen3ForSequenceClassification,
    ("phi3", "reward"): transformers.Phi3ForSequenceClassification,
    ("mistral", "reward"): transformers.MistralForSequenceClassification,
    ("gemma", "reward"): transformers.GemmaForSequenceClassification,
    ("gemma2", "reward"): transformers.Gemma2ForSequenceClassification,
    ("gemma3_text", "reward"): transformers.Gemma3TextForSequenceClassification,
}
MOE_CLASSES = {
    ("qwen3_moe", "causal_lm"): transformers.Qwen3MoeForCausalLM,
    ("mixtral", "causal_lm"): transformers.MixtralForCausalLM,
    ("qwen3_moe", "reward"): transformers.Qwen3MoeForSequenceClassification,
    ("mixtral", "reward"): transformers.MixtralForSequenceClassification,
    ("gpt_oss", "causal_lm"): transformers.GptOssForCausalLM,
    ("gpt_oss", "reward"): transformers.GptOssForSequenceClassification,
}
# (A case's random weights are seeded by its index here: new cases go at the end.)
CASES = [f"{'gemma3' if arch == 'gemma3_text' else arch}-{kind}" for arch, kind in HF_CLASSES] + [
    "llama_bias-causal_lm", "llama_bias-reward", "qwen2_mixed-causal_lm"] + [
    f"{arch}-{kind}" for arch, kind in MOE_CLASSES] + ["qwen3_moe_mixed-causal_lm"]
HF_CLASSES.update(MOE_CLASSES)

CAUSAL_CASES = [c for c in CASES if c.endswith("-causal_lm")]


def arch_of(variant: str) -> str:
    archs = {arch for arch, _ in HF_CLASSES}
    if variant in archs:  # qwen3_moe: an architecture, not qwen3 with options
        return variant
    for arch in sorted(archs, key=len, reverse=True):  # qwen3_moe_mixed: qwen3_moe with options
        if variant.startswith(arch + "_"):
            return arch
    base = variant.split("_")[0]
    return "gemma3_text" if base == "gemma3" else base


def _randomize(model: torch.nn.Module, seed: int):
    """Every weight random (HF init leaves biases 0 and norm scales 1, which would hide mistakes)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _batch():
    rng = np.random.default_rng(0)
    mask = np.zeros((len(LENGTHS), T), np.int32)
    for row, n in enumerate(LENGTHS):
        mask[row, T - n:] = 1
    tokens = rng.integers(PAD + 1, VOCAB, mask.shape) * mask + PAD * (1 - mask)
    return tokens.astype(np.int32), mask


TOKENS, MASK = _batch()
REAL = MASK.astype(bool)


def hf_outputs(model: torch.nn.Module, tokens=TOKENS, mask=MASK) -> np.ndarray:
    """PyTorch logits [B, T, V] (causal LM) or scores [B] (sequence classifier)."""
    positions = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(positions, dtype=torch.long)).logits.numpy()
    return out[:, 0] if out.ndim == 2 else out


_FORWARDS = {}


def ours(loaded: hf.LoadedModel, mesh, params=None) -> np.ndarray:
    """Our logits [B, T, V] or scores at the last real token [B]; one compile per model and mesh."""
    key = (loaded.config, loaded.kind, mesh.devices.shape)
    if key not in _FORWARDS:
        module = loaded.module

        def forward(params, tokens, mask):
            out, _ = module.apply({"params": params}, tokens, positions_from_mask(mask), mask)
            return score_at_last_token(out, mask) if loaded.kind == "reward" else out

        _FORWARDS[key] = jax.jit(forward)
    with jax.set_mesh(mesh), sharding.activation_rules():
        batch = sharding.put_batch((jnp.asarray(TOKENS), jnp.asarray(MASK)), mesh)
        return np.asarray(_FORWARDS[key](loaded.params if params is None else params, *batch))


@dataclasses.dataclass
class Case:
    variant: str  # a key of HF_CONFIGS
    arch: str
    kind: str
    path: str  # the saved PyTorch checkpoint
    torch_model: torch.nn.Module
    reference: np.ndarray  # PyTorch outputs on (TOKENS, MASK)
    loaded: hf.LoadedModel  # loaded onto MESH_222
    outputs: np.ndarray  # ours on (TOKENS, MASK)


@pytest.fixture(scope="module")
def mesh_222():
    return make_test_mesh((2, 2, 2))


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory, mesh_222):
    variant, kind = request.param.rsplit("-", 1)
    arch = arch_of(variant)
    config = HF_CONFIGS[variant](**({"num_labels": 1} if kind == "reward" else {}))
    torch_model = HF_CLASSES[(arch, kind)](config).eval()
    _randomize(torch_model, seed=CASES.index(request.param))
    path = str(tmp_path_factory.mktemp(request.param))
    torch_model.save_pretrained(path)
    loaded = hf.load_model(path, mesh_222)
    return Case(variant, arch, kind, path, torch_model, hf_outputs(torch_model), loaded,
                ours(loaded, mesh_222))


def _flat(params) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


# ---------------------------------------------------------------------------------------------
# Acceptance 1 and 4: parity with PyTorch on a left-padded batch.


def test_outputs_match_pytorch(case):
    assert case.loaded.kind == case.kind
    if case.kind == "causal_lm":
        assert case.outputs.shape == (len(LENGTHS), T, VOCAB)
        # Only real tokens: padded queries see no keys and their outputs are never used.
        err = np.abs(case.outputs[REAL] - case.reference[REAL]).max()
        # The comparison is not between tiny numbers (GPT-OSS's sinks and clamped experts, and the mixed
        # Qwen3-MoE's weights, keep these random logits just under 1).
        assert np.abs(case.reference[REAL]).max() > (0.5 if case.variant in ("gpt_oss", "qwen3_moe_mixed") else 1.0)
    else:
        # HF reads the score at the last non-pad token, ours at the last real token of the mask.
        assert case.outputs.shape == (len(LENGTHS),)
        err = np.abs(case.outputs - case.reference).max()
    assert err <= 1e-5, f"{case.arch} {case.kind}: max abs difference {err}"


def test_loaded_config(case):
    cfg = case.loaded.config
    assert (cfg.arch, cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (case.arch, HIDDEN, LAYERS,
                                                                             VOCAB)
    assert cfg.pad_token_id == PAD
    if case.arch != "gpt2":
        assert cfg.kv_heads == KV_HEADS and cfg.intermediate_size == MLP
    expected = dict(EXPECTED_FIELDS[case.variant])
    if case.kind == "reward":  # a sequence classifier has no LM head to tie
        expected.pop("tie_word_embeddings", None)
    assert {name: getattr(cfg, name) for name in expected} == expected
    if case.variant == "llama":
        assert cfg.rope_theta == 500000.0
        assert cfg.rope_scaling_dict == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64.0}
    if case.kind == "causal_lm":
        assert ("lm_head" in case.loaded.params) != cfg.tie_word_embeddings
    else:
        assert set(case.loaded.params) == {"transformer", "score"}
        np.testing.assert_array_equal(np.asarray(case.loaded.params["score"]["bias"]), 0.0)


CHUNKS = (4, 3, 1, 1, 1)  # a prefill shorter than the rows, a multi-token chunk, then single tokens


def _chunk_logits(module, tokens, positions, kv_mask, cache, layer_params):
    """Logits [B, t, V] of one chunk written into the cache: through the stacked layers, or (with
    per-layer `layer_params`, the sampler's unrolled decode) one layer at a time."""
    if layer_params is None:
        hidden, cache = module.transformer(tokens, positions, kv_mask, cache)
    else:
        hidden, cache = module.transformer.unrolled(tokens, positions, kv_mask, cache, layer_params)
    return module.project(hidden), cache


# The unrolled (per-layer) decode differs from the stacked one in how each layer picks its params, its
# window and its rope base: checked on the families that exercise each (learned positions and biases,
# rope scaling, alternating sliding layers with soft-capping and post-norms, local rope bases and q/k
# norms, mixed layer_types, attention sinks, dense and MoE layers); every family runs the stacked
# decode (the mixed Qwen3-MoE, whose params are always per layer, its Python layer loop).
UNROLLED_CASES = ["gpt2-causal_lm", "llama-causal_lm", "gemma2-causal_lm", "gemma3-causal_lm",
                  "qwen2_mixed-causal_lm", "gpt_oss-causal_lm", "qwen3_moe_mixed-causal_lm"]
DECODE_CASES = ([pytest.param(c, False, id=f"{c}-stacked") for c in CAUSAL_CASES]
                + [pytest.param(c, True, id=f"{c}-unrolled") for c in UNROLLED_CASES])


@pytest.mark.parametrize("case,unrolled", DECODE_CASES, indirect=["case"])
def test_chunked_cached_decode_matches_pytorch(case, unrolled):
    """Prefill, a chunk and single tokens through the KV cache give PyTorch's full-sequence logits
    (the sampler's path: the rollout's log-probs are the training forward's)."""
    module, params = case.loaded.module, case.loaded.params
    tokens, mask = jnp.asarray(TOKENS), jnp.asarray(MASK)
    positions = positions_from_mask(mask)
    cache = init_cache(case.loaded.config, len(LENGTHS), T)
    layer_params = None
    if unrolled:
        layer_params, cache = split_layer_params(params), split_cache(cache)

    @jax.jit
    def step(params, layer_params, tokens, positions, cache):
        return module.apply({"params": params}, tokens, positions, mask, cache, layer_params,
                            method=_chunk_logits)

    logits, start = [], 0
    for size in CHUNKS:
        chunk = slice(start, start + size)
        out, cache = step(params, layer_params, tokens[:, chunk], positions[:, chunk], cache)
        logits.append(np.asarray(out))
        start += size
    logits = np.concatenate(logits, axis=1)
    err = np.abs(logits[REAL] - case.reference[REAL]).max()
    assert err <= 1e-5, f"{case.variant}: cached decode differs from PyTorch by {err}"


def test_num_params_counts_pytorch_parameters(case):
    """ModelConfig.num_params (what the memory planner uses) counts what transformers holds; its
    score head has no bias, ours one (loaded as 0)."""
    torch_count = sum(p.numel() for p in case.torch_model.parameters())  # a tied head counts once
    cfg = case.loaded.config
    ours_count = cfg.num_params() if case.kind == "causal_lm" else cfg.num_params(False) + HIDDEN
    assert ours_count == torch_count
    assert ours_count + (case.kind == "reward") == sum(x.size for x in jax.tree.leaves(case.loaded.params))


# ---------------------------------------------------------------------------------------------
# Acceptance 3: export -> transformers -> the same model; sharded checkpoints load.


def test_export_round_trip(case, tmp_path):
    out = tmp_path / "exported"
    hf.export_model(out, case.loaded.config, case.loaded.params, kind=case.kind)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert not [p for p in os.listdir(tmp_path) if p != "exported"]  # no temp dirs left behind
    auto = (transformers.AutoModelForCausalLM if case.kind == "causal_lm"
            else transformers.AutoModelForSequenceClassification)
    reloaded = auto.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded) is type(case.torch_model)
    original = case.torch_model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=0, msg=name)
    real = REAL if case.kind == "causal_lm" else slice(None)
    assert np.abs(hf_outputs(reloaded)[real] - case.outputs[real]).max() <= 1e-5


@pytest.mark.parametrize("case", ["gpt2-causal_lm", "llama-reward", "mistral-causal_lm",
                                  "llama_bias-causal_lm", "qwen3-causal_lm", "qwen2_mixed-causal_lm",
                                  "phi3-causal_lm", "gemma2-causal_lm", "gemma3-causal_lm",
                                  "qwen3_moe-causal_lm", "mixtral-reward", "gpt_oss-causal_lm"],
                         indirect=True)
def test_per_layer_params_load_run_and_export(case, tmp_path, mesh_222):
    """`scan_layers=False` (per-layer params, the GPU layout) reads each layer's tensors into its own
    leaves, matches PyTorch with the fused attention call, and exports the identical checkpoint."""
    loaded = hf.load_model(case.path, mesh_222, execution={"scan_layers": False, "attention": "xla"})
    assert "layers" not in loaded.params["transformer"]
    for i, layer in enumerate(split_layer_params(case.loaded.params)):
        per_layer = _flat(loaded.params["transformer"][f"layers_{i}"])
        for name, value in _flat(layer).items():
            np.testing.assert_array_equal(per_layer[name], value, err_msg=f"layer {i} {name}")
    real = REAL if case.kind == "causal_lm" else slice(None)
    assert np.abs(ours(loaded, mesh_222)[real] - case.reference[real]).max() <= 1e-5
    out = tmp_path / "exported"
    hf.export_model(out, loaded.config, loaded.params, kind=case.kind)
    auto = (transformers.AutoModelForCausalLM if case.kind == "causal_lm"
            else transformers.AutoModelForSequenceClassification)
    reloaded = auto.from_pretrained(out, attn_implementation="eager").eval()
    original = case.torch_model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=0, msg=name)


def test_sharded_checkpoint_loads(case, tmp_path, mesh_222):
    case.torch_model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    loaded = hf.load_model(tmp_path, mesh_222)
    single, sharded = _flat(case.loaded.params), _flat(loaded.params)
    assert single.keys() == sharded.keys()
    for name in single:
        np.testing.assert_array_equal(sharded[name], single[name], err_msg=name)


# ---------------------------------------------------------------------------------------------
# Acceptance 5 (loading): a loaded model's big params are sharded, each device holding its part.


def _layer_spec(params, *axes):
    """(layer 0's attention params, the spec `axes` of one layer's param as they are held): stacked
    [L, ...] params put None first; a model mixing dense and MoE layers holds per-layer params."""
    backbone = params["transformer"]
    if "layers" in backbone:
        return backbone["layers"]["attn"], P(None, *axes)
    return backbone["layers_0"]["attn"], P(*axes)


def test_load_shards_every_large_param_on_fsdp_mesh(case):
    mesh = make_test_mesh((1, 8, 1))
    loaded = hf.load_model(case.path, mesh)
    reference = _flat(case.loaded.params)
    for (path, x) in jax.tree_util.tree_flatten_with_path(loaded.params)[0]:
        name = jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), reference[name], err_msg=name)
        # (GPT-OSS's gate_up_bias [E, 2F] has no embed axis to split over fsdp: it splits over tensor.)
        if x.size >= SMALL_PARAM and "gate_up_bias" not in name:
            assert not x.sharding.is_fully_replicated, f"{name} {x.shape} is replicated"
            assert x.addressable_shards[0].data.size == x.size // 8, name
    attn, spec = _layer_spec(loaded.params, "fsdp")
    assert attn["q"]["kernel"].sharding.spec == spec
    assert loaded.params["transformer"]["embed"]["embedding"].sharding.spec == P(None, "fsdp")


def test_load_with_head_dim_sharded_reads_the_same_values(case, mesh_222):
    """Rules that split head_dim make a shard non-contiguous in the HF layout (the reader then
    takes the whole window and slices it): values must not change."""
    rules = tuple((name, "tensor" if name == "head_dim" else None if name in ("heads", "kv_heads")
                   else axes) for name, axes in sharding.DEFAULT_RULES)
    loaded = hf.load_model(case.path, mesh_222, rules)
    attn, spec = _layer_spec(loaded.params, "fsdp", None, "tensor")
    assert attn["q"]["kernel"].sharding.spec == spec
    reference = _flat(case.loaded.params)
    for name, x in _flat(loaded.params).items():
        np.testing.assert_array_equal(x, reference[name], err_msg=name)


def test_loaded_param_specs_on_222(case):
    params = case.loaded.params
    attn, spec = _layer_spec(params, "fsdp", "tensor")
    assert attn["q"]["kernel"].sharding.spec == spec
    assert attn["k"]["kernel"].sharding.spec == spec  # 2 kv heads / 2-way tensor
    assert attn["o"]["kernel"].sharding.spec == _layer_spec(params, "tensor", None, "fsdp")[1]
    assert params["transformer"]["embed"]["embedding"].sharding.spec == P("tensor", "fsdp")
    if "lm_head" in params:
        assert params["lm_head"]["kernel"].sharding.spec == P("fsdp", "tensor")


# ---------------------------------------------------------------------------------------------
# Config mapping.


def test_config_round_trip(case):
    kind = case.kind
    hf_config = hf.config_to_hf(case.loaded.config, kind)
    assert hf_config.architectures == [HF_CLASSES[(case.arch, kind)].__name__]
    assert hf.config_from_hf(hf_config) == case.loaded.config
    assert hf.config_from_hf(hf_config.to_dict()) == case.loaded.config


def test_old_style_rope_config_is_read():
    """config.json written by transformers 4: rope_theta and rope_scaling with "type"."""
    new = hf.config_from_hf(HF_CONFIGS["llama"]().to_dict())
    old = HF_CONFIGS["llama"]().to_dict()
    del old["rope_parameters"]
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
    old.update(rope_theta=500000.0, rope_scaling={"type": "llama3", **scaling})
    assert hf.config_from_hf(old) == new
    linear = {**old, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert hf.config_from_hf(linear).rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("changes, message", [
    ({"scale_attn_by_inverse_layer_idx": True}, "unsupported GPT-2 options.*scale_attn_by_inverse"),
    ({"reorder_and_upcast_attn": True}, "unsupported GPT-2 options.*reorder_and_upcast_attn"),
    ({"activation_function": "quick_gelu"}, "unsupported activation_function='quick_gelu'"),
    ({"architectures": ["GPT2DoubleHeadsModel"]},
     "unsupported architecture 'GPT2DoubleHeadsModel'.*supported: GPT2LMHeadModel, LlamaForCausalLM"),
    ({"architectures": ["GPT2ForSequenceClassification"], "num_labels": 3}, "num_labels=1"),
    ({"architectures": ["LlamaForCausalLM"]}, "model_type='gpt2' but architectures=.*must agree"),
    ({"model_type": None}, "config.json has no model_type"),
])
def test_unsupported_gpt2_options(changes, message):
    data = {**HF_CONFIGS["gpt2"]().to_dict(), **changes}
    with pytest.raises(HFModelError, match=message):
        hf.config_from_hf(data)


@pytest.mark.parametrize("arch, changes, message", [
    # YaRN, dynamic NTK and LongRoPE are supported (tests/test_rope_scaling.py); this one is not.
    ("llama", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
     "unsupported rope type 'proportional'"),
    ("qwen2", {"layer_types": ["full_attention", "chunked_attention"]},
     "unsupported layer_types \\['chunked_attention'\\]"),
    ("mistral", {"model_type": "qwen2_moe"}, "unsupported model_type 'qwen2_moe'"),
    ("qwen3_moe", {"mlp_only_layers": [0, 1]}, "leave no MoE layer: this is a dense model"),
    ("mixtral", {"router_jitter_noise": 0.1}, "unsupported router_jitter_noise=0.1"),
    # GPT-OSS's release: MXFP4 blocks and scales instead of expert weights.
    ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}},
     "unsupported quantised checkpoint \\(quantization_config.quant_method='mxfp4'\\).*Mxfp4Config\\(dequantize=True\\)"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("gemma3", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}},
     "unsupported rope type 'yarn' on gemma3 sliding layers"),
])
def test_unsupported_llama_family_options(arch, changes, message):
    data = {**HF_CONFIGS[arch]().to_dict(), **changes}
    data = {k: v for k, v in data.items() if v is not None or k != "layer_types"}
    with pytest.raises(HFModelError, match=message):
        hf.config_from_hf(data)


def test_qwen3_moe_dense_layers_as_transformers_chooses_them():
    """decoder_sparse_step=2 makes layers 1, 3 MoE layers; with mlp_only_layers=[3] only layer 1. Export
    writes the same layers back as mlp_only_layers (step 1)."""
    data = {**HF_CONFIGS["qwen3_moe"]().to_dict(), "num_hidden_layers": 4, "decoder_sparse_step": 2}
    assert hf.config_from_hf(data).moe_layers == (False, True, False, True)
    config = hf.config_from_hf({**data, "mlp_only_layers": [3]})
    assert config.moe_layers == (False, True, False, False) and not config.scan_layers
    written = hf.config_to_hf(config).to_dict()
    assert written["mlp_only_layers"] == [0, 2, 3] and written["decoder_sparse_step"] == 1
    assert hf.config_from_hf(written) == config
    with pytest.raises(HFModelError, match="moe_layers=\\(False, True\\) \\(dense layers\\) is expressible as qwen3_moe only"):
        hf.config_to_hf(hf.config_from_hf(HF_CONFIGS["mixtral"]().to_dict()).replace(moe_layers=(False, True)))


def test_qwen2_all_sliding_layers_map_to_a_window():
    data = {**HF_CONFIGS["qwen2"]().to_dict(), "use_sliding_window": True, "sliding_window": 4,
            "max_window_layers": 0}
    del data["layer_types"]
    config = hf.config_from_hf(data)
    assert config.sliding_window == 4
    assert hf.config_from_hf(hf.config_to_hf(config)) == config


def test_linear_rope_scaling_round_trips():
    data = {**HF_CONFIGS["llama"]().to_dict(),
            "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}
    config = hf.config_from_hf(data)
    assert config.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    assert hf.config_from_hf(hf.config_to_hf(config).to_dict()) == config


def test_config_to_hf_refuses_what_the_architecture_cannot_express():
    with pytest.raises(HFModelError, match="use arch='qwen2'"):
        hf.config_to_hf(ModelConfig(arch="llama", attention_bias=True))
    with pytest.raises(HFModelError, match="qwen2 always has q/k/v biases"):
        hf.config_to_hf(ModelConfig(arch="qwen2"))
    with pytest.raises(HFModelError, match="mistral has no projection biases"):
        hf.config_to_hf(ModelConfig(arch="mistral", mlp_bias=True))
    with pytest.raises(HFModelError, match=r"llama cannot express \{'post_norms': True\}"):
        hf.config_to_hf(ModelConfig(arch="llama", post_norms=True))
    with pytest.raises(HFModelError, match=r"gemma3_text cannot express \{'qk_norm': False\}"):
        hf.config_to_hf(ModelConfig(arch="gemma3_text", scale_embeddings=True, norm_unit_offset=True,
                                    post_norms=True))
    with pytest.raises(HFModelError, match=r"qwen3 has no \['attn_logit_softcap'\]"):
        hf.config_to_hf(ModelConfig(arch="qwen3", qk_norm=True, attn_logit_softcap=5.0))
    with pytest.raises(HFModelError, match="mistral slides every layer or none"):
        hf.config_to_hf(ModelConfig(arch="mistral", sliding_window=4, sliding_layers=(True, False)))
    with pytest.raises(HFModelError, match="llama has no sliding window"):
        hf.config_to_hf(ModelConfig(arch="llama", sliding_window=8))


# ---------------------------------------------------------------------------------------------
# dtypes, reward-head bias, tokenizer, atomic export.


def test_bfloat16_checkpoint_loads_bit_exact(tmp_path, mesh_222):
    model = transformers.Qwen2ForCausalLM(HF_CONFIGS["qwen2"]()).eval()
    _randomize(model, seed=7)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    loaded = hf.load_model(tmp_path / "bf16", mesh_222, param_dtype="bfloat16", dtype="bfloat16")
    assert loaded.config.param_dtype == "bfloat16" and loaded.config.dtype == "bfloat16"
    q = loaded.params["transformer"]["layers"]["attn"]["q"]["kernel"]  # [L, D, H, Dh]
    assert q.dtype == jnp.bfloat16
    torch_q = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # [H*Dh, D]
    np.testing.assert_array_equal(
        np.asarray(q[1]).astype(np.float32), torch_q.T.reshape(HIDDEN, HEADS, -1))
    upcast = hf.load_model(tmp_path / "bf16", mesh_222)  # default: float32 params
    assert upcast.params["transformer"]["ln_f"]["scale"].dtype == jnp.float32
    # Export keeps bfloat16, and transformers reads back the very same bits.
    hf.export_model(tmp_path / "out", loaded.config, loaded.params)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in reloaded.state_dict().items():
        assert tensor.dtype == torch.bfloat16, name
        torch.testing.assert_close(tensor, model.state_dict()[name], rtol=0, atol=0, msg=name)


def _reward_case_params(case, bias):
    params = dict(case.loaded.params)
    params["score"] = {**params["score"], "bias": jnp.full((1,), bias, jnp.float32)}
    return params


@pytest.mark.parametrize("case", ["gpt2-reward"], indirect=True)
def test_gpt2_score_bias_is_folded_into_final_norm_on_export(case, tmp_path, mesh_222):
    params = _reward_case_params(case, 0.37)
    expected = ours(case.loaded, mesh_222, params)
    np.testing.assert_allclose(expected, case.outputs + 0.37, atol=1e-5)
    hf.export_model(tmp_path, case.loaded.config, params, kind="reward")
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(hf_outputs(reloaded), expected, atol=1e-4)


@pytest.mark.parametrize("case", ["llama-reward"], indirect=True)
def test_llama_score_bias_cannot_be_exported(case, tmp_path):
    with pytest.raises(HFModelError, match="has no score bias"):
        hf.export_model(tmp_path / "out", case.loaded.config, _reward_case_params(case, 0.5),
                        kind="reward")
    assert not (tmp_path / "out").exists()


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("abcdefgh")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("case", ["qwen2-causal_lm"], indirect=True)
def test_export_with_tokenizer_and_replace_existing(case, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    hf.export_model(out, case.loaded.config, case.loaded.params, tokenizer=_tiny_tokenizer())
    assert not (out / "stale.txt").exists()
    tokenizer = hf.load_tokenizer(out)
    assert tokenizer("a b h")["input_ids"] == [3, 4, 10]
    assert tokenizer.pad_token_id == 0
    assert hf.load_config(out) == (case.loaded.config, "causal_lm")


@pytest.mark.parametrize("case", ["qwen2-causal_lm"], indirect=True)
def test_failed_export_leaves_existing_directory_untouched(case, tmp_path):
    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise OSError("disk full")

    out = tmp_path / "model"
    hf.export_model(out, case.loaded.config, case.loaded.params)
    before = {p: (out / p).read_bytes() for p in os.listdir(out)}
    with pytest.raises(OSError, match="disk full"):
        hf.export_model(out, case.loaded.config, case.loaded.params, tokenizer=BrokenTokenizer())
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == before
    assert os.listdir(tmp_path) == ["model"]  # the temp dir is gone


def test_export_of_params_missing_a_tensor_names_it(tmp_path):
    config = ModelConfig(arch="llama", vocab_size=VOCAB, hidden_size=32, num_heads=4,
                         tie_word_embeddings=False)
    abstract = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                            jax.eval_shape(lambda: hf.make_model(config, "causal_lm").init(
                                jax.random.key(0), jnp.zeros((1, 2), jnp.int32),
                                jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32))))
    params = dict(abstract["params"])
    del params["lm_head"]
    with pytest.raises(HFModelError, match="params lack.*lm_head/kernel"):
        hf.export_model(tmp_path / "out", config, params)
    assert not os.listdir(tmp_path)


# ---------------------------------------------------------------------------------------------
# Acceptance 6: each bad checkpoint has its own message.


@pytest.fixture
def bad(case, tmp_path):
    """A writable copy of a good checkpoint, to break."""
    path = tmp_path / "ckpt"
    shutil.copytree(case.path, path)
    return path


def _edit_config(path, **changes):
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))


def _rewrite_weights(path, transform):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    save_file(transform(tensors), path / "model.safetensors", metadata={"format": "pt"})


def test_missing_directory(tmp_path, mesh_222):
    with pytest.raises(HFModelError, match=r"checkpoint directory .*nowhere does not exist"):
        hf.load_model(tmp_path / "nowhere", mesh_222)


BAD_CASES = ["gpt2-causal_lm", "llama-causal_lm"]


@pytest.mark.parametrize("case", BAD_CASES, indirect=True)
class TestBadCheckpoints:
    def test_missing_config(self, bad, mesh_222):
        (bad / "config.json").unlink()
        with pytest.raises(HFModelError, match=r"has no config\.json"):
            hf.load_model(bad, mesh_222)

    def test_config_is_not_json(self, bad, mesh_222):
        (bad / "config.json").write_text("{not json")
        with pytest.raises(HFModelError, match=r"config\.json is not valid JSON"):
            hf.load_model(bad, mesh_222)

    def test_missing_weights(self, bad, mesh_222):
        (bad / "model.safetensors").unlink()
        with pytest.raises(HFModelError, match=r"has no weights: expected model\.safetensors"):
            hf.load_model(bad, mesh_222)

    def test_pickled_weights_are_refused(self, bad, mesh_222):
        (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
        with pytest.raises(HFModelError,
                           match=r"only pickled weights \(pytorch_model\.bin\).*never unpickles"):
            hf.load_model(bad, mesh_222)

    def test_unsupported_architecture(self, bad, mesh_222):
        _edit_config(bad, architectures=["GPTNeoXForCausalLM"])
        with pytest.raises(HFModelError, match=r"unsupported architecture 'GPTNeoXForCausalLM'"
                                                  r".*supported: GPT2LMHeadModel, LlamaForCausalLM, "
                                                  r"MistralForCausalLM, Qwen2ForCausalLM"):
            hf.load_model(bad, mesh_222)

    def test_truncated_safetensors(self, bad, mesh_222):
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
        with pytest.raises(HFModelError, match=r"model\.safetensors is not a readable safetensors "
                                                  r"file \(truncated or corrupt\?\)"):
            hf.load_model(bad, mesh_222)

    def test_corrupt_safetensors(self, bad, mesh_222):
        (bad / "model.safetensors").write_bytes(b"\x00\x01garbage" * 100)
        with pytest.raises(HFModelError, match=r"model\.safetensors is not a readable safetensors"):
            hf.load_model(bad, mesh_222)

    def test_shape_mismatch(self, bad, mesh_222, case):
        _edit_config(bad, vocab_size=VOCAB + 8)
        embed = "transformer.wte.weight" if case.arch == "gpt2" else "model.embed_tokens.weight"
        with pytest.raises(HFModelError, match=rf"shape mismatch: tensor '{embed}' in "
                                                  rf"model\.safetensors has shape \[{VOCAB}, {HIDDEN}\], "
                                                  rf"but config\.json implies \[{VOCAB + 8}, {HIDDEN}\]"):
            hf.load_model(bad, mesh_222)

    def test_missing_tensor(self, bad, mesh_222, case):
        name = ("transformer.h.1.mlp.c_fc.bias" if case.arch == "gpt2"
                else "model.layers.1.mlp.up_proj.weight")
        _rewrite_weights(bad, lambda t: {k: v for k, v in t.items() if k != name})
        with pytest.raises(HFModelError, match=rf"tensor '{name}' is missing from the checkpoint"):
            hf.load_model(bad, mesh_222)

    def test_weights_the_config_does_not_use(self, bad, mesh_222, case):
        _edit_config(bad, **({"n_layer": 1} if case.arch == "gpt2" else {"num_hidden_layers": 1}))
        layer = "transformer.h.1." if case.arch == "gpt2" else "model.layers.1."
        with pytest.raises(HFModelError, match=rf"has \d+ tensors that config\.json does not use "
                                                  rf"\({re.escape(layer)}"):
            hf.load_model(bad, mesh_222)

    def test_index_names_a_missing_shard(self, bad, mesh_222):
        (bad / "model.safetensors").rename(bad / "model-00001-of-00002.safetensors")
        (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
        with pytest.raises(HFModelError, match=r"lists shard files that do not exist: "
                                                  r"\['model-00002-of-00002\.safetensors'\]"):
            hf.load_model(bad, mesh_222)

    def test_wrong_kind_requested(self, bad, mesh_222):
        with pytest.raises(HFModelError, match=r"holds a causal_lm checkpoint.*kind='reward'"):
            hf.load_model(bad, mesh_222, kind="reward")


def test_tokenizer_directory_missing(tmp_path):
    with pytest.raises(HFModelError, match="tokenizer directory .* does not exist"):
        hf.load_tokenizer(tmp_path / "nowhere")


def test_a_word_level_tokenizer_beside_a_bpe_family_config_loads_and_exports_as_saved(tmp_path, capsys):
    """transformers 5's AutoTokenizer picks Qwen2Tokenizer from config.json, which rebuilds a BPE model
    from the vocabulary: a word-level tokenizer.json then encodes its words to nothing (issue 33).
    hf.load_tokenizer loads tokenizer.json as saved, and what it saves reloads the same."""
    import transformers

    from ppo_jax.data import build_word_tokenizer

    tok = build_word_tokenizer(["w1", "w2", "user"], extra_special_tokens=["<|im_start|>"],
                               chat_template="{% for m in messages %}<|im_start|> {{ m['content'] }} {% endfor %}")
    source = tmp_path / "model"
    transformers.Qwen2Config(vocab_size=len(tok)).save_pretrained(source)
    tok.save_pretrained(source)
    expected = tok("w1 w2 user")["input_ids"]
    loaded = hf.load_tokenizer(source)
    assert loaded("w1 w2 user")["input_ids"] == expected == [5, 6, 7]
    assert loaded.chat_template == tok.chat_template and loaded.pad_token_id == tok.pad_token_id
    auto = transformers.AutoTokenizer.from_pretrained(source)
    if type(auto.backend_tokenizer.model).__name__ != "WordLevel":  # the transformers behaviour worked around
        assert "using tokenizer.json as saved" in capsys.readouterr().err
    export = tmp_path / "export"
    hf.save_tokenizer(loaded, str(export))
    assert json.loads((export / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
    transformers.Qwen2Config(vocab_size=len(tok)).save_pretrained(export)
    assert hf.load_tokenizer(export)("w1 w2 user")["input_ids"] == expected


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_rmsnorm_rounds_in_bfloat16_as_transformers_does(arch):
    """In bfloat16 the order of the scale and the cast back decides the last bit: Llama casts, then
    scales (in bfloat16); GPT-OSS scales in float32, then casts (norm_scale_float32). Bit-equal."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from ppo_jax.models.layers import norm

    theirs = (GptOssRMSNorm if arch == "gpt_oss" else LlamaRMSNorm)(64, eps=1e-5).to(torch.bfloat16)
    rng = np.random.default_rng(0)
    weight = rng.normal(1.0, 0.3, size=64).astype(np.float32)
    x = rng.normal(size=(8, 64)).astype(np.float32)
    with torch.no_grad():
        theirs.weight.copy_(torch.tensor(weight))
        expected = theirs(torch.tensor(x).to(torch.bfloat16)).float().numpy()
    config = ModelConfig(arch="llama", norm_eps=1e-5, dtype="bfloat16", param_dtype="bfloat16",
                         norm_scale_float32=arch == "gpt_oss")
    params = {"scale": jnp.asarray(weight, jnp.bfloat16)}
    ours = norm(config, "norm").apply({"params": params}, jnp.asarray(x, jnp.bfloat16))
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), expected)
    other = norm(config.replace(norm_scale_float32=arch != "gpt_oss"), "norm").apply(
        {"params": params}, jnp.asarray(x, jnp.bfloat16))
    assert (np.asarray(other.astype(jnp.float32)) != expected).any()  # the other order is not the same numbers
