"""Splash attention, the TPU's fused kernel, against the einsum reference.

On this CPU machine the Pallas kernel runs in interpret mode (the kernel's own code, interpreted):
left padding, grouped-query heads, sliding windows (static, and chosen by a traced flag as in a
scanned body of mixed layers), soft-capping and Gemma's query scale, forward and gradient; then a
tiny model through it, on one device and on a mesh (the kernel runs under `shard_map`). Last, the
real thing compiled (not run) for a TPU chip through libtpu: the Mosaic kernel is in the program and
no [B, H, T, S] score buffer is.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh

from ppo_jax import sharding
from ppo_jax.config import ComputeSettings, ConfigError
from ppo_jax.models import CausalLM, ModelConfig, positions_from_mask
from ppo_jax.models.attention import attention_mask, einsum_attention, splash_attention, splash_interpret

B, H, K, DH = 2, 4, 2, 16
PADS = (0, 37)  # left padding per row


def _inputs(t, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((B, t, H, DH), (B, t, K, DH), (B, t, K, DH)))
    kv_mask = jnp.asarray(np.arange(t)[None, :] >= np.asarray(PADS)[:, None])
    return q, k, v, kv_mask


CASES = {  # (T, window, sliding as traced, cap, scale)
    "causal": (128, None, False, None, None),
    "window": (128, 48, False, None, None),
    "window-traced-cap-scale": (128, 48, True, 5.0, 0.3),
    "odd-length-padded": (100, None, False, 5.0, None),
}


@pytest.mark.parametrize("case", CASES)
def test_splash_equals_einsum_reference(case):
    """Every real query's output and the gradients of q, k, v (through real queries only, as the
    losses see them) match the einsum kernel; padding queries stay finite."""
    t, window, traced, cap, scale = CASES[case]
    q, k, v, kv_mask = _inputs(t)
    mask = attention_mask(kv_mask, jnp.arange(t), window)
    real = np.asarray(kv_mask)
    weights = jnp.asarray(np.random.default_rng(1).standard_normal((B, t, H, DH)), jnp.float32)

    def reference(q, k, v):
        return einsum_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, scale, cap)

    def fused(q, k, v):
        sliding = jnp.asarray(True) if traced else window is not None  # traced: lax.cond between kernels
        return splash_attention(q, k, v, kv_mask, sliding, window, scale, cap, interpret=True)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(kv_mask[:, :, None, None], fn(q, k, v) * weights, 0.0))

    want, got = np.asarray(reference(q, k, v)), np.asarray(jax.jit(fused)(q, k, v))
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got[real], want[real], atol=2e-5)
    want_grads = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    got_grads = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2)))(q, k, v)
    for name, w, g in zip("qkv", want_grads, got_grads):
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-5, err_msg=name)


# A tiny Gemma-3-like model: sliding layers mixed with full ones (the scanned body chooses the kernel
# by a traced flag), grouped-query heads, query scale and soft-capping.
MIXED = ModelConfig(arch="gemma3_text", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, intermediate_size=48, sliding_window=24, sliding_layers=(True, False),
                    rope_local_theta=1e4, qk_norm=True, scale_embeddings=True, norm_unit_offset=True,
                    post_norms=True, query_pre_attn_scalar=10, attn_logit_softcap=5.0,
                    max_position_embeddings=128)
LLAMA = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=48, max_position_embeddings=128)


def _logits(config, params, tokens, mask):
    model = CausalLM(config)
    return np.asarray(jax.jit(lambda p: model.apply({"params": p}, tokens, positions_from_mask(mask), mask)[0])(params))


@pytest.mark.parametrize("base, mesh_shape", [(LLAMA, None), (MIXED, None), (MIXED, (2, 1, 2))],
                         ids=["llama", "mixed", "mixed-mesh2x1x2"])
def test_model_with_splash_gives_the_einsum_models_logits(base, mesh_shape):
    t = 64  # padded to 128 inside the kernel
    rng = np.random.default_rng(2)
    mask = jnp.asarray((np.arange(t)[None, :] >= np.asarray([0, 20, 5, 50])[:, None]).astype(np.int32))
    tokens = jnp.asarray(rng.integers(1, base.vocab_size, (4, t)), jnp.int32) * mask
    params = nn.unbox(CausalLM(base).init(jax.random.key(0), tokens, positions_from_mask(mask), mask)["params"])
    want = _logits(base, params, tokens, mask)
    with splash_interpret():
        if mesh_shape is None:
            got = _logits(base.replace(attention="splash"), params, tokens, mask)
        else:
            with sharding.mesh_context(make_test_mesh(mesh_shape)):
                got = _logits(base.replace(attention="splash"), params, tokens, mask)
    real = np.asarray(mask, bool)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[real], want[real], atol=5e-5)


def test_auto_takes_splash_on_a_tpu_and_splash_is_refused_elsewhere():
    assert ComputeSettings().execution(LLAMA, platform="tpu")["attention"] == "splash"
    assert ComputeSettings().execution(MIXED, platform="tpu")["attention"] == "splash"  # soft-capped too
    assert ComputeSettings(attention="splash").apply(LLAMA, platform="tpu").attention == "splash"
    ComputeSettings(attention="splash").validate()
    with pytest.raises(ConfigError, match="compute.attention='splash' needs a TPU, but this run's platform is cpu"):
        ComputeSettings(attention="splash").apply(LLAMA)


def _tpu_chip():
    from ppo_jax.accelerators import libtpu_installed, tpu_devices

    if not libtpu_installed():
        pytest.skip("libtpu is not installed (pip install -e '.[tpu]'): cannot compile for a TPU")

    return tpu_devices("v5e:2x2")  # the smallest slice libtpu describes without host settings


def test_splash_compiles_for_a_tpu_with_the_mosaic_kernel_and_no_score_buffer():
    """Forward and backward of a tiny bf16 model, compiled by XLA:TPU for 4 v5e chips (2-way batch, 2-way
    heads): the attention is Pallas (Mosaic) custom calls, and no buffer has the einsum's score shape."""
    devices = _tpu_chip()
    b, t = 4, 256
    config = LLAMA.replace(attention="splash", dtype="bfloat16", head_dim=128, num_heads=4, num_kv_heads=2)
    mesh = sharding.make_mesh((2, 1, 2), devices)
    tokens = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=sharding.data_sharding(mesh))
    model = CausalLM(config)
    with sharding.mesh_context(mesh):
        params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), jnp.zeros((b, t), jnp.int32),
                                                            jnp.zeros((b, t), jnp.int32), jnp.ones((b, t)))))
        params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sharding.replicated(mesh)),
                              params["params"])

        def loss(params, tokens):
            mask = (tokens > 0).astype(jnp.int32)
            logits, _ = model.apply({"params": params}, tokens, positions_from_mask(mask), mask)
            return logits.sum()

        # conftest's "highest" precision would ask Mosaic for float32 dots on bf16 operands: refused
        with jax.default_matmul_precision("default"):
            hlo = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile().as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') >= 2  # forward and fused backward kernels
    # Every [.., T, S]-shaped buffer: the einsum's scores and probabilities ([B, K, G, T, S], f32 and
    # bf16) are gone; what stays is the [B, T, S] bool mask (whose diagonal is the key padding) and
    # its [T, S] pieces.
    square = re.findall(rf"(\w+)\[((?:\d+,)*){t},{t}\]", hlo)
    assert square and all(dtype in ("pred", "s32") and prefix.count(",") <= 1 for dtype, prefix in square), \
        sorted(set(square))
