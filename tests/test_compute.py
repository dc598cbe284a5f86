"""How the models execute, never what they compute: the fused attention call against the einsum
reference, per-layer (unscanned) params against the scanned stack, remat policies, and the
`compute.*` settings that choose them. The cuDNN kernel itself needs a GPU (bench/probe_gpu_layers.py);
here its plumbing (layouts, mask form, GQA, padding rows) runs through the same call with
implementation="xla"."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh
from tiny_configs import tiny_config

from ppo_jax.config import ComputeSettings, ConfigError, from_config
from ppo_jax.models import CausalLM, ModelConfig, init_cache, positions_from_mask
from ppo_jax.models.attention import attention_mask, einsum_attention, fused_attention
from ppo_jax.models.transformer import split_layer_params
from ppo_jax.rl import build
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.trainer import PPOTrainer

B, T, H, K, DH = 4, 9, 4, 2, 8
PADS = (0, 3, 8, 5)  # left padding per row; row 2 has one real token


def _mask(window=None):
    kv_mask = jnp.asarray(np.arange(T)[None, :] >= np.asarray(PADS)[:, None])
    return kv_mask, attention_mask(kv_mask, jnp.arange(T), window)


@pytest.mark.parametrize("window", [None, 3])
def test_fused_attention_equals_einsum_reference(window):
    """Left padding, grouped-query heads (4 query heads on 2 KV heads) and a sliding window, forward
    and gradient, on every real query; padding queries (no visible key) stay finite."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((B, T, H, DH), (B, T, K, DH), (B, T, K, DH)))
    kv_mask, mask = _mask(window)
    real = np.asarray(kv_mask)

    def reference(q, k, v):  # the einsum reads keys and values in the cache layout [B, K, S, Dh]
        return einsum_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)

    def fused(q, k, v):
        return fused_attention(q, k, v, mask, "xla")

    want, got = np.asarray(reference(q, k, v)), np.asarray(fused(q, k, v))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[real], want[real], atol=1e-5)

    def loss(fn):  # gradient through real queries only, as the losses see it
        return lambda q, k, v: jnp.sum(jnp.where(kv_mask[:, :, None, None], fn(q, k, v), 0.0) ** 2)

    want_grads = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    got_grads = jax.grad(loss(fused), argnums=(0, 1, 2))(q, k, v)
    for name, w, g in zip("qkv", want_grads, got_grads):
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(np.asarray(g)[real], np.asarray(w)[real], atol=1e-5, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Per-layer params and remat compute the scanned model's function.

MISTRAL = ModelConfig(arch="mistral", vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                      intermediate_size=48, sliding_window=4, tie_word_embeddings=False,
                      max_position_embeddings=32)
# Every block option at once: q/k norms, biases, sliding layers mixed with full ones with their own
# rope base (the scanned body chooses each layer's mask and rope by a scanned flag, the unscanned loop
# in Python), Gemma's norms, embedding scale, query scale and soft-capping (which keeps the "xla"
# variants on the einsum kernel).
MIXED = ModelConfig(arch="gemma3_text", vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=12, intermediate_size=48, sliding_window=4, sliding_layers=(True, False, True),
                    rope_theta=1e6, rope_local_theta=1e4, qk_norm=True, attention_bias=True,
                    attention_out_bias=True, mlp_bias=True, scale_embeddings=True, norm_unit_offset=True,
                    post_norms=True, query_pre_attn_scalar=10, attn_logit_softcap=5.0, final_logit_softcap=3.0,
                    tie_word_embeddings=False, max_position_embeddings=32)
# The same without soft-capping: the "xla" variants take the fused call with the query scale.
FUSED = MIXED.replace(attn_logit_softcap=None)
BASES = {"mistral": MISTRAL, "mixed": MIXED, "mixed-fused": FUSED}
VARIANTS = {
    "unscanned": dict(scan_layers=False),
    "unscanned+fused": dict(scan_layers=False, attention="xla"),
    "unscanned+remat-dots": dict(scan_layers=False, remat=True, remat_policy="dots"),
    "scanned+remat-full+fused": dict(remat=True, remat_policy="full", attention="xla"),
}


def _batch():
    rng = np.random.default_rng(1)
    mask = (np.arange(T)[None, :] >= np.asarray(PADS)[:, None]).astype(np.int32)
    tokens = rng.integers(1, MISTRAL.vocab_size, (B, T)) * mask
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)


def _as_config(params, config: ModelConfig):
    """Scanned params in the layout `config` wants (per-layer trees when unscanned)."""
    if config.scan_layers:
        return params
    layers = split_layer_params(params)
    backbone = {k: v for k, v in params["transformer"].items() if k != "layers"}
    backbone.update({f"layers_{i}": layer for i, layer in enumerate(layers)})
    return {**params, "transformer": backbone}


def _loss_and_grads(config: ModelConfig, params, tokens, mask):
    model = CausalLM(config)

    def loss(params):
        logits, _ = model.apply({"params": params}, tokens, positions_from_mask(mask), mask)
        logp = jax.nn.log_softmax(logits[:, :-1])
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        # Next-token loss where both the predicting slot and the target are real: a padding slot's
        # output is nobody's function (each kernel leaves its own finite values there).
        pairs = mask[:, :-1] * mask[:, 1:]
        return -(picked * pairs).sum() / pairs.sum(), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return value, logits, grads


def _scanned(base: ModelConfig):
    tokens, mask = _batch()
    params = nn.unbox(CausalLM(base).init(jax.random.key(0), tokens, positions_from_mask(mask), mask)["params"])
    return params, tokens, mask, _loss_and_grads(base, params, tokens, mask)


@pytest.fixture(scope="module")
def scanned():
    return _scanned(MISTRAL)


@pytest.fixture(scope="module", params=BASES)
def scanned_base(request):
    return BASES[request.param], _scanned(BASES[request.param])


@pytest.mark.parametrize("variant", VARIANTS)
def test_execution_variants_give_the_scanned_models_loss_logits_and_gradients(scanned_base, variant):
    base, (params, tokens, mask, (want_loss, want_logits, want_grads)) = scanned_base
    config = base.replace(**VARIANTS[variant])
    loss, logits, grads = _loss_and_grads(config, _as_config(params, config), tokens, mask)
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(want_logits)[real], atol=2e-5)
    want_flat = jax.tree_util.tree_leaves_with_path(_as_config(want_grads, config))
    got_flat = dict(jax.tree_util.tree_leaves_with_path(grads))
    assert len(want_flat) == len(got_flat)
    for path, w in want_flat:
        # The tolerance scales with the leaf: Gemma's scaled embeddings make some gradients ~5, where
        # float32 rounding of a reordered sum exceeds a fixed 2e-6.
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(got_flat[path]), w, atol=2e-6 * max(1.0, np.abs(w).max()),
                                   err_msg=jax.tree_util.keystr(path))


def test_unscanned_params_have_no_layer_axis_and_decode_with_a_cache(scanned):
    """Per-layer params are separate leaves (nothing to slice), and the cached decode through them
    gives the full forward's logits."""
    params, tokens, mask, (_, want_logits, _) = scanned
    config = MISTRAL.replace(scan_layers=False, attention="xla")
    unscanned = _as_config(params, config)
    assert sorted(k for k in unscanned["transformer"] if k.startswith("layers")) == ["layers_0", "layers_1",
                                                                                   "layers_2"]
    q = unscanned["transformer"]["layers_0"]["attn"]["q"]["kernel"]
    assert q.shape == (32, 4, 8)
    assert split_layer_params(unscanned)[1] is unscanned["transformer"]["layers_1"]  # no copy
    model = CausalLM(config)
    positions = positions_from_mask(mask)
    step = jax.jit(lambda p, t, pos, c: model.apply({"params": p}, t, pos, mask, c))
    cache = init_cache(config, B, T)
    # A prefill of 5 tokens and a chunk of 3 at a cache offset (both on the fused kernel), then
    # one-token decode steps (einsum).
    logits, cache = step(unscanned, tokens[:, :5], positions[:, :5], cache)
    outputs = [logits]
    logits, cache = step(unscanned, tokens[:, 5:8], positions[:, 5:8], cache)
    outputs.append(logits)
    for t in range(8, T):
        logits, cache = step(unscanned, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
        outputs.append(logits)
    got = np.concatenate([np.asarray(o) for o in outputs], axis=1)
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(got[real], np.asarray(want_logits)[real], atol=2e-5)


# ---------------------------------------------------------------------------------------------
# The compute.* settings.


def test_auto_resolves_to_the_reference_kernels_off_gpu():
    assert jax.default_backend() == "cpu"
    bf16 = MISTRAL.replace(dtype="bfloat16")
    assert ComputeSettings().execution(bf16) == {"attention": "einsum", "scan_layers": True,
                                                 "merge_decode_projections_above": None}
    chosen = ComputeSettings(attention="xla", layer_loop="unrolled", remat="dots").apply(MISTRAL)
    assert (chosen.attention, chosen.scan_layers, chosen.remat, chosen.remat_policy) == ("xla", False, True, "dots")
    assert not ComputeSettings(remat="none").apply(MISTRAL.replace(remat=True)).remat
    assert ComputeSettings().apply(MISTRAL.replace(remat=True)).remat  # "keep"


def test_auto_on_a_gpu_takes_cudnn_remat_and_the_unrolled_loop_except_for_soft_capped_attention(monkeypatch):
    monkeypatch.setattr("ppo_jax.config.jax.default_backend", lambda: "gpu")
    assert ComputeSettings().execution(MISTRAL.replace(dtype="bfloat16")) == {
        "attention": "cudnn", "scan_layers": False, "remat": True, "remat_policy": "full",
        "merge_decode_projections_above": 32 << 20}
    assert "remat" not in ComputeSettings().execution(MISTRAL.replace(remat=True, remat_policy="dots"))  # the model's own
    assert "remat" not in ComputeSettings(remat="keep").execution(MISTRAL)
    # FSDP-sharded layers stay scanned on a GPU: unrolled, XLA:GPU gathers every layer's weights at once.
    assert ComputeSettings().execution(MISTRAL, fsdp=8)["scan_layers"]
    assert not ComputeSettings().execution(MISTRAL, fsdp=1)["scan_layers"]
    assert ComputeSettings().execution(MISTRAL)["attention"] == "einsum"  # float32: no flash attention
    assert ComputeSettings().execution(MIXED.replace(dtype="bfloat16"))["attention"] == "einsum"  # Gemma 2 soft-caps
    # (FUSED's 12-feature heads are no multiple of 8: cuDNN refuses them, see below.)
    assert ComputeSettings().execution(FUSED.replace(dtype="bfloat16", head_dim=16))["attention"] == "cudnn"
    # cuDNN takes heads of at most 128 features (Gemma 3's 256 are refused by it): einsum for those.
    wide = MISTRAL.replace(dtype="bfloat16", head_dim=256)
    assert ComputeSettings().execution(wide)["attention"] == "einsum"
    with pytest.raises(ConfigError, match="at most 128 features"):
        ComputeSettings(attention="cudnn").apply(wide)


def test_auto_resolves_for_the_mesh_it_runs_on():
    s = from_config(Settings, tiny_config())
    cpu = make_test_mesh((1, 8, 1))
    assert build.mesh_platform(cpu) == ("cpu", 8) and build.mesh_platform(None) == (None, 1)
    # The context axis shards the weights like fsdp: on 8 GPUs at (1, 1, 1, 1, 8), "auto" scans the
    # layers (unrolled, XLA:GPU gathers every layer's weights: compile-only, Llama-3-8B's update temps
    # were 34.8 GiB unrolled, 17.4 scanned; docs/benchmarks.md).
    assert build.mesh_platform(make_test_mesh((1, 1, 1, 1, 8))) == ("cpu", 8)
    assert build.mesh_platform(make_test_mesh((1, 2, 1, 2, 2))) == ("cpu", 8)
    assert build.decode_unrolled(s.rollout, cpu) is True  # CPU: per-layer decode (measured 2x faster here)
    assert build.decode_unrolled(s.rollout, None) is None  # no mesh: the sampler decides
    scan = s.replace(rollout=dataclasses.replace(s.rollout, decode="scan"))
    assert build.decode_unrolled(scan.rollout, cpu) is False


@pytest.mark.parametrize("settings, message", [
    (ComputeSettings(attention="flash"), "compute.attention='flash'"),
    (ComputeSettings(layer_loop="loop"), "compute.layer_loop='loop'"),
    (ComputeSettings(remat="some"), "compute.remat='some'"),
])
def test_bad_compute_settings_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        settings.validate()


def test_cudnn_attention_off_gpu_is_refused_when_applied():
    ComputeSettings(attention="cudnn").validate()  # validate() must not touch the backend (multi-host)
    with pytest.raises(ConfigError, match="compute.attention='cudnn' needs a GPU, but this run's platform is cpu"):
        ComputeSettings(attention="cudnn").apply(MISTRAL.replace(dtype="bfloat16"))


_CACHE_FLAGS = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size",
                "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture
def cache_flags():
    """jax's persistent-cache flags, restored after the test (the suite's own cache lives in them)."""
    saved = {name: getattr(jax.config, name) for name in _CACHE_FLAGS}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_compilation_cache_is_on_by_default_and_keeps_a_configured_one(cache_flags, tmp_path, monkeypatch):
    assert ComputeSettings().compilation_cache == "auto"
    configured = jax.config.jax_compilation_cache_dir  # the suite's (JAX_COMPILATION_CACHE_DIR)
    assert configured and ComputeSettings().enable_compilation_cache() == configured
    assert jax.config.jax_compilation_cache_dir == configured

    # Nothing configured: the per-user directory, with a size bound.
    monkeypatch.setattr("ppo_jax.config.AUTO_CACHE_DIR", str(tmp_path / "user_cache"))
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_compilation_cache_max_size", -1)
    assert ComputeSettings().enable_compilation_cache() == str(tmp_path / "user_cache")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "user_cache")
    assert jax.config.jax_compilation_cache_max_size == 4 << 30

    # An explicit directory wins; "" turns the cache off and leaves jax's settings alone.
    chosen = str(tmp_path / "mine")
    assert ComputeSettings(compilation_cache=chosen).enable_compilation_cache() == chosen
    assert jax.config.jax_compilation_cache_dir == chosen
    assert ComputeSettings(compilation_cache="").enable_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir == chosen


def test_cudnn_attention_needs_a_half_precision_compute_dtype():
    with pytest.raises(ValueError, match="computes in bfloat16 or float16"):
        MISTRAL.replace(attention="cudnn")


def test_ppo_with_per_layer_params_and_fused_attention_keeps_the_invariants(tmp_path):
    """A PPO run on unscanned params with the fused attention call and remat: the first minibatch's
    ratio is 1 and the sampler's log-probs equal the training forward's (the sampler decodes with the
    einsum kernel on the cache, the update uses the fused call)."""
    config = tiny_config(**{"compute.attention": "xla", "compute.layer_loop": "unrolled",
                            "compute.remat": "dots"})
    config.train.iterations = 1
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((2, 2, 1)))
    assert "layers_1" in trainer.state.policy["transformer"]
    history = trainer.train()
    row = history[-1]
    assert abs(row["first_minibatch/ratio"] - 1.0) < 1e-6
    assert row["policy/rollout_logprob_diff_max"] < 1e-5
    assert row["val/ratio"] != 1.0  # the update did move the policy
    assert all(np.isfinite(v) for v in row.values() if isinstance(v, float))
