"""Packing (models/packing.py): the plan against a NumPy reference, packed forwards of every family
against the padded ones, and the PPO experience and update packed against padded, to fp32
round-off, on one device, sharded meshes and LoRA."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_test_mesh, varied_rollout
from tiny_configs import tiny_config

from ppo_jax import sharding
from ppo_jax.config import ConfigError
from ppo_jax.models import CausalLM, ModelConfig, packing
from ppo_jax.models.attention import splash_interpret
from ppo_jax.models.forward import response_logits, response_scores, response_values, token_logprobs
from ppo_jax.models.transformer import ScalarModel
from ppo_jax.rl.hyper import PPOHyper
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.sizes import derive_sizes
from ppo_jax.rl.trainer import PPOTrainer

LQ, LR = 6, 7
PROMPT_LENGTHS = (6, 1, 3, 2, 5, 4, 1, 6)
RESPONSE_LENGTHS = (7, 2, 1, 4, 0, 3, 7, 5)  # 0: a row whose response is all padding


def _rows(vocab: int, seed: int = 0):
    """prompt_tokens, prompt_mask [8, LQ] (left-padded), tokens, mask [8, LR] (right-padded)."""
    rng = np.random.default_rng(seed)
    prompt_mask = (np.arange(LQ)[None, :] >= LQ - np.asarray(PROMPT_LENGTHS)[:, None]).astype(np.int32)
    mask = (np.arange(LR)[None, :] < np.asarray(RESPONSE_LENGTHS)[:, None]).astype(np.int32)
    prompt = rng.integers(1, vocab, (8, LQ)) * prompt_mask
    tokens = rng.integers(1, vocab, (8, LR)) * mask
    return tuple(jnp.asarray(x, jnp.int32) for x in (prompt, prompt_mask, tokens, mask))


# ---------------------------------------------------------------------------------------------
# The plan.

def _reference_first_fit_decreasing(lengths, num_rows, row_length):
    """(row, offset) of each sequence: longest first (ties by index), each into the first row it fits."""
    used = [0] * num_rows
    placed = {}
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = next(r for r in range(num_rows) if used[r] + lengths[i] <= row_length)
        placed[i] = (row, used[row])
        used[row] += lengths[i]
    return placed, sum(u > 0 for u in used)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_is_first_fit_decreasing_and_packs_every_real_token_once(seed):
    rng = np.random.default_rng(seed)
    batch, length, shape = 13, 11, (4, 4, 11)
    mask = (rng.random((batch, length)) < rng.random((batch, 1))).astype(np.int32)  # any pattern, some empty
    tokens = rng.integers(1, 50, (batch, length)) * mask
    layout = packing.plan(jnp.asarray(mask), shape)
    rows = packing.pack_rows(jnp.asarray(tokens), layout)
    lengths = mask.sum(1)
    placed, used = _reference_first_fit_decreasing(list(lengths), 16, length)
    assert int(layout.rows_used) == used
    assert int(layout.microbatches_used) == -(-used // 4)
    flat_tokens, flat_pos, flat_seg = (np.asarray(x).reshape(-1) for x in (rows.tokens, rows.positions,
                                                                           rows.segment_ids))
    for b in range(batch):
        row, offset = placed[b]
        start = row * length + offset
        span = slice(start, start + lengths[b])
        np.testing.assert_array_equal(flat_tokens[span], tokens[b][mask[b] == 1])  # in order, contiguous
        np.testing.assert_array_equal(flat_pos[span], np.arange(lengths[b]))  # positions restart
        assert (flat_seg[span] == b + 1).all()
    assert (flat_seg > 0).sum() == lengths.sum()  # nothing else is marked real
    assert float(layout.token_efficiency) == pytest.approx(lengths.sum() / (-(-used // 4) * 4 * length))
    # Round trip: every real token read back from its slot.
    back = np.asarray(packing.gather(rows.tokens, layout.slots))
    np.testing.assert_array_equal(back, tokens)


def test_plan_refuses_a_shape_that_could_overflow():
    with pytest.raises(ValueError, match="could overflow"):
        packing.plan(jnp.ones((9, 4), jnp.int32), (2, 4, 4))
    with pytest.raises(ValueError, match="could overflow"):
        packing.plan(jnp.ones((8, 5), jnp.int32), (2, 4, 4))


# ---------------------------------------------------------------------------------------------
# Packed forwards of every family == the padded forwards.

BASE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=32)
FAMILIES = {
    "gpt2": ModelConfig(arch="gpt2", **BASE),
    "llama": ModelConfig(arch="llama", **BASE, num_kv_heads=2, intermediate_size=48, tie_word_embeddings=False,
                         rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                       ("original_max_position_embeddings", 16.0), ("rope_type", "llama3"))),
    "mistral": ModelConfig(arch="mistral", **BASE, num_kv_heads=2, intermediate_size=48, sliding_window=3,
                           tie_word_embeddings=False),
    "qwen2": ModelConfig(arch="qwen2", **BASE, num_kv_heads=2, intermediate_size=48, attention_bias=True),
    "qwen3": ModelConfig(arch="qwen3", **BASE, num_kv_heads=2, intermediate_size=48, qk_norm=True, head_dim=16,
                         sliding_window=3, sliding_layers=(True, False)),
    "phi3": ModelConfig(arch="phi3", **BASE, num_kv_heads=4, intermediate_size=48, sliding_window=3,
                        tie_word_embeddings=False),
    "gemma": ModelConfig(arch="gemma", **BASE, num_kv_heads=1, intermediate_size=48, head_dim=16,
                         scale_embeddings=True, norm_unit_offset=True),
    "gemma2": ModelConfig(arch="gemma2", **BASE, num_kv_heads=2, intermediate_size=48, head_dim=16,
                          scale_embeddings=True, norm_unit_offset=True, post_norms=True, query_pre_attn_scalar=20,
                          attn_logit_softcap=5.0, final_logit_softcap=3.0, sliding_window=3,
                          sliding_layers=(True, False)),
    "gemma3": ModelConfig(arch="gemma3_text", **BASE, num_kv_heads=2, intermediate_size=48, head_dim=16,
                          qk_norm=True, post_norms=True, scale_embeddings=True, norm_unit_offset=True,
                          rope_local_theta=1e4, sliding_window=3, sliding_layers=(True, False)),
}


def _random_params(module, config, seed):
    """Every weight, bias and norm scale random (init leaves biases 0 and scales 1)."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    abstract = jax.eval_shape(lambda: module.init(jax.random.key(0), tokens, tokens, jnp.ones_like(tokens)))
    rng = np.random.default_rng(seed)

    def one(path, leaf):
        offset = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
        return jnp.asarray((offset + 0.2 * rng.standard_normal(leaf.shape)).astype(leaf.dtype))

    return jax.tree_util.tree_map_with_path(one, nn.unbox(abstract)["params"])


def _packed_outputs(lm, scalar, lm_params, scalar_params, rows, shape, temperature=0.7):
    """Per-token log-probs and values [B, LR] and scores [B] through the packed path."""
    prompt, prompt_mask, tokens, mask = rows
    seq = jnp.concatenate([prompt, tokens], 1)
    seq_mask = jnp.concatenate([prompt_mask, mask], 1)
    layout = packing.plan(seq_mask, shape)
    packed = packing.pack_rows(seq, layout)

    def chunk(rows):
        logits = packing.next_token_logits(lm, lm_params, rows, temperature)
        return (packing.next_token_logprobs(logits, rows.tokens), packing.scalar_outputs(scalar, scalar_params, rows))

    logp, values = packing.map_used(chunk, layout.microbatches_used, packed)
    slots = packing.prediction_slots(layout, LQ, mask)
    scores = packing.gather(values, packing.last_slots(layout, seq_mask))[:, 0]
    return packing.gather(logp, slots), packing.gather(values, slots), scores, layout.microbatches_used


def _padded_outputs(lm, scalar, lm_params, scalar_params, rows, temperature=0.7):
    logits = response_logits(lm, lm_params, *rows, temperature)
    return (token_logprobs(logits, rows[2], rows[3]), response_values(scalar, scalar_params, *rows),
            response_scores(scalar, scalar_params, *rows))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_forwards_equal_padded_forwards(family):
    config = FAMILIES[family]
    lm, scalar = CausalLM(config), ScalarModel(config)
    lm_params, scalar_params = _random_params(lm, config, 0), _random_params(scalar, config, 1)
    rows = _rows(config.vocab_size)
    want = jax.jit(lambda a, b: _padded_outputs(lm, scalar, a, b, rows))(lm_params, scalar_params)
    # Two packed rows per microbatch: 8 sequences of <= 13 tokens fill 5 rows, so the last
    # microbatch holds no token and is skipped.
    *got, used = jax.jit(lambda a, b: _packed_outputs(lm, scalar, a, b, rows, (4, 2, LQ + LR)))(
        lm_params, scalar_params)
    assert int(used) == 3
    mask = np.asarray(rows[3], bool)
    for name, w, g in zip(("logprobs", "values", "scores"), want, got):
        w, g = np.asarray(w), np.asarray(g)
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, w * (mask if name != "scores" else 1), atol=2e-5, err_msg=name)


@pytest.mark.parametrize("attention", ["xla", "splash"])
def test_fused_kernels_respect_segments(attention):
    """The fused call (`xla`: cuDNN's plumbing on CPU) and splash (interpret mode) give the packed
    einsum model's log-probs: one sequence never sees another."""
    config = FAMILIES["gemma3" if attention == "splash" else "mistral"]
    lm = CausalLM(config)
    params = _random_params(lm, config, 0)
    rows = _rows(config.vocab_size)
    seq_mask = jnp.concatenate([rows[1], rows[3]], 1)
    layout = packing.plan(seq_mask, (1, 8, LQ + LR))
    packed = jax.tree.map(lambda x: x[0], packing.pack_rows(jnp.concatenate([rows[0], rows[2]], 1), layout))

    def logp(config):
        model = CausalLM(config)
        return np.asarray(jax.jit(lambda p: packing.next_token_logprobs(
            packing.next_token_logits(model, p, packed, 1.0), packed.tokens))(params))

    want = logp(config)
    with splash_interpret():
        got = logp(config.replace(attention=attention))
    real = np.asarray(packed.segment_ids) > 0
    np.testing.assert_allclose(got[real], want[real], atol=5e-5)


# ---------------------------------------------------------------------------------------------
# The PPO experience and update, packed against padded.

def _trainer(tmp_path, mesh_shape, name, **overrides):
    c = tiny_config(**{"train.iterations": 1, "ppo.packing": "off", **overrides})
    return PPOTrainer(c, str(tmp_path / name), mesh=make_test_mesh(mesh_shape))


def _step(trainer, rollout):
    rollout = jax.device_put(rollout, sharding.data_sharding(trainer.mesh))
    exp, exp_metrics = trainer.steps.experience_jit(trainer.state, trainer.frozen, rollout)
    state, metrics = trainer.steps.update_jit(trainer.state, trainer.frozen, exp)
    return jax.device_get((exp, exp_metrics, state.policy, state.value, metrics))


CASES = {  # three trainer pairs (each compiles two runs): every mesh axis, LoRA, both estimator kinds
    "gae-mesh2x2x2": ((2, 2, 2), {}),
    "lora-mesh1x2x4": ((1, 2, 4), {"policy.lora.rank": 4, "value.lora.rank": 2,
                                   "ppo.max_tokens_per_microbatch": 16 * 2}),
    "grpo-kl-loss-one-device": ((1, 1, 1), {"ppo.advantage_estimator": "grpo", "rollout.num_samples": 2,
                                            "rollout.batch_size": 16, "ppo.kl_in_reward": False,
                                            "ppo.dense_kl_coef": 0.1}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_experience_and_update_equal_padded(case, tmp_path):
    mesh_shape, overrides = CASES[case]
    padded = _trainer(tmp_path, mesh_shape, "padded", **overrides)
    packed = _trainer(tmp_path, mesh_shape, "packed", **{**overrides, "ppo.packing": "on"})
    assert packed.hp.packed and not padded.hp.packed
    rollout = varied_rollout(padded.modules.policy.config.vocab_size)
    want, got = _step(padded, rollout), _step(packed, rollout)
    (w_exp, w_emet, w_policy, w_value, w_met), (g_exp, g_emet, g_policy, g_value, g_met) = want, got
    for field in ("old_logprobs", "ref_logprobs", "values", "advantages", "returns", "scores"):
        np.testing.assert_allclose(getattr(g_exp, field), getattr(w_exp, field), atol=2e-5, rtol=1e-5,
                                   err_msg=field)
    for key, value in w_emet.items():
        if key != "perf/experience_token_efficiency":
            np.testing.assert_allclose(g_emet[key], value, atol=2e-5, rtol=1e-4, err_msg=key)
    for key, value in w_met.items():
        if key != "perf/token_efficiency":
            np.testing.assert_allclose(g_met[key], value, atol=2e-5, rtol=1e-4, err_msg=key)
    assert g_met["first_minibatch/ratio"] == pytest.approx(1.0, abs=1e-6)
    # The updated parameters: the same steps from the same gradients.
    for w, g in zip(jax.tree.leaves((w_policy, w_value)), jax.tree.leaves((g_policy, g_value))):
        np.testing.assert_allclose(g, w, atol=2e-6, rtol=1e-5)
    # Packing computed fewer token slots than the padded rows hold.
    assert g_met["perf/token_efficiency"] > w_met["perf/token_efficiency"]
    assert g_emet["perf/experience_token_efficiency"] > w_emet["perf/experience_token_efficiency"]


# ---------------------------------------------------------------------------------------------
# Configuration.

def _sizes(batch_divisor=1, **overrides):
    s = Settings.from_config(tiny_config(**overrides))
    return derive_sizes(s, batch_divisor=batch_divisor), s


def test_budget_sizes_the_packed_microbatches():
    sizes, s = _sizes(**{"ppo.packing": "on", "ppo.max_tokens_per_microbatch": 16 * 5})
    assert (sizes.packed_rows, sizes.packed_length) == (5, 16)  # a row is prompt 8 + response 8
    hp = PPOHyper.from_settings(s, sizes)
    assert hp.packed_shape(16) == (4, 5, 16)  # 16 rows of a minibatch: worst case one per packed row
    assert _sizes(batch_divisor=2, **{"ppo.packing": "on", "ppo.max_tokens_per_microbatch": 16 * 5})[0].packed_rows == 4
    default, _ = _sizes(**{"ppo.packing": "on", "ppo.num_microbatches": 1})  # an eighth of 16 padded rows
    assert default.packed_rows == 2
    assert _sizes(batch_divisor=4, **{"ppo.packing": "on"})[0].packed_rows == 4  # at least one per device
    assert _sizes(**{"ppo.packing": "off"})[0].packed_rows == 0


def test_auto_packs_on_a_cpu_only():
    """"auto" follows the measurements: packed on a CPU, padded on a GPU or TPU (an H200 ran the packed
    steps 1.5x slower without padding); "on" and "off" hold on any platform."""
    s = Settings.from_config(tiny_config())
    assert s.ppo.packing == "auto"
    assert derive_sizes(s, platform="cpu").packed_rows == 1  # an eighth of the tiny config's 8-row microbatch
    assert derive_sizes(s, platform="gpu").packed_rows == derive_sizes(s, platform="tpu").packed_rows == 0
    packed = Settings.from_config(tiny_config(**{"ppo.packing": "on"}))
    assert derive_sizes(packed, platform="gpu").packed_rows == 1
    padded = Settings.from_config(tiny_config(**{"ppo.packing": "off"}))
    assert derive_sizes(padded, platform="cpu").packed_rows == 0


@pytest.mark.parametrize("overrides, message", [
    ({"ppo.packing": "yes"}, "ppo.packing='yes': use one of auto, on, off"),
    ({"ppo.max_tokens_per_microbatch": -1}, "ppo.max_tokens_per_microbatch must be >= 0"),
])
def test_bad_packing_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Settings.from_config(tiny_config(**overrides))


def test_budget_below_one_row_per_device_is_refused_before_compiling(tmp_path):
    with pytest.raises(ConfigError, match=r"ppo.max_tokens_per_microbatch=20 is smaller than one packed row per "
                                          r"data-parallel device: a row holds .* = 16 tokens and 2 device"):
        _trainer(tmp_path, (2, 1, 1), "small", **{"ppo.packing": "on", "ppo.max_tokens_per_microbatch": 20})
