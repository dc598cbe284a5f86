"""ppo.dense_kl_reference: the dense KL's reference log-probs over the vocabulary kept by the experience
step ("experience") instead of a reference forward in every update microbatch ("recompute"). The kept
log-probs against NumPy's log-softmax of the reference's own logits, the update from them against the
recomputing one (padded rows on a sharded mesh, packed rows on one device), proof that the update no
longer reads the reference, and the "auto" rule."""

import jax
import numpy as np
import pytest
from conftest import make_test_mesh, varied_rollout
from tiny_configs import tiny_config

from ppo_jax import sharding
from ppo_jax.config import ConfigError
from ppo_jax.models.forward import response_logits
from ppo_jax.rl import sizes as rl_sizes
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.sizes import derive_sizes
from ppo_jax.rl.trainer import PPOTrainer

DENSE = {"ppo.dense_kl_coef": 0.5, "train.iterations": 1}


def _trainer(tmp_path, name, mesh_shape, **overrides):
    trainer = PPOTrainer(tiny_config(**{**DENSE, **overrides}), str(tmp_path / name), mesh=make_test_mesh(mesh_shape))
    # A reference other than the initial policy, so that the dense KL and its gradient are not 0 from the start.
    noisy = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(7), x.shape, x.dtype),
                         trainer.frozen.reference)
    trainer.frozen = trainer.frozen.replace(reference=noisy)
    return trainer


def _iteration(trainer, rollout, frozen=None):
    frozen = trainer.frozen if frozen is None else frozen
    rollout = jax.device_put(rollout, sharding.data_sharding(trainer.mesh))
    exp, _ = trainer.steps.experience_jit(trainer.state, trainer.frozen, rollout)
    state, metrics = trainer.steps.update_jit(jax.tree.map(lambda x: x.copy(), trainer.state), frozen, exp)
    return jax.device_get((exp, state.policy, state.value, metrics))


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.mark.parametrize("layout, mesh_shape", [("off", (1, 2, 4)), ("on", (1, 1, 1))])
def test_the_update_from_kept_reference_logprobs_equals_the_recomputing_one(layout, mesh_shape, tmp_path):
    kept = _trainer(tmp_path, "kept", mesh_shape, **{"ppo.packing": layout, "ppo.dense_kl_reference": "experience"})
    recomputed = _trainer(tmp_path, "recomputed", mesh_shape,
                          **{"ppo.packing": layout, "ppo.dense_kl_reference": "recompute"})
    assert kept.hp.dense_kl_stored and not recomputed.hp.dense_kl_stored
    assert kept.hp.packed == (layout == "on")
    rollout = varied_rollout(kept.modules.policy.config.vocab_size)
    exp, policy, value, metrics = _iteration(kept, rollout)
    want_exp, want_policy, want_value, want_metrics = _iteration(recomputed, rollout)
    assert want_exp.ref_vocab_logprobs is None

    # What the experience kept: the reference's own log-softmax over the vocabulary, in NumPy.
    ref_logits = response_logits(kept.modules.policy, jax.device_get(kept.frozen.reference), rollout.prompt_tokens,
                                 rollout.prompt_mask, rollout.tokens, rollout.mask, 1.0)
    real = rollout.mask.astype(bool)
    np.testing.assert_allclose(exp.ref_vocab_logprobs[real], _log_softmax(ref_logits)[real], atol=2e-5)

    # The update from it: the same dense KL, losses, gradients and steps as with the reference forward.
    assert metrics["loss/dense_kl_avg"] > 1e-3
    for key, expected in want_metrics.items():
        np.testing.assert_allclose(metrics[key], expected, atol=2e-5, rtol=1e-4, err_msg=key)
    for got, expected in zip(jax.tree.leaves((policy, value)), jax.tree.leaves((want_policy, want_value))):
        np.testing.assert_allclose(got, expected, atol=2e-6, rtol=1e-5)


def test_an_update_from_kept_logprobs_never_reads_the_reference(tmp_path):
    """The kept update gives the same step with the reference's weights replaced by zeros; the
    recomputing one does not (so the swap is one the loss would see)."""
    rollout = None
    for mode, moves in (("experience", False), ("recompute", True)):
        trainer = _trainer(tmp_path, mode, (1, 1, 1), **{"ppo.packing": "off", "ppo.dense_kl_reference": mode})
        rollout = rollout or varied_rollout(trainer.modules.policy.config.vocab_size)
        zeroed = trainer.frozen.replace(reference=jax.tree.map(lambda x: x * 0, trainer.frozen.reference))
        *_, metrics = _iteration(trainer, rollout)
        *_, swapped = _iteration(trainer, rollout, frozen=zeroed)
        same = np.allclose(swapped["loss/dense_kl_avg"], metrics["loss/dense_kl_avg"], rtol=1e-6)
        assert same != moves, mode


def test_auto_keeps_the_logprobs_while_they_fit_the_budget():
    s = Settings.from_config(tiny_config(**DENSE))
    assert s.ppo.dense_kl_reference == "auto"
    assert derive_sizes(s, vocab_size=32).dense_kl_stored  # 32 rows x 8 x 32 x 4 bytes
    rows, lr = 32, 8
    largest = rl_sizes.STORED_REFERENCE_BUDGET // (rows * lr * 4)
    assert derive_sizes(s, vocab_size=largest).dense_kl_stored
    assert not derive_sizes(s, vocab_size=largest + 1).dense_kl_stored
    assert derive_sizes(s, batch_divisor=2, vocab_size=largest + 1).dense_kl_stored  # per data-parallel device
    assert not derive_sizes(s).dense_kl_stored  # vocabulary unknown: recompute
    forced = Settings.from_config(tiny_config(**DENSE, **{"ppo.dense_kl_reference": "experience"}))
    assert derive_sizes(forced, vocab_size=largest + 1).dense_kl_stored
    never = Settings.from_config(tiny_config(**DENSE, **{"ppo.dense_kl_reference": "recompute"}))
    assert not derive_sizes(never, vocab_size=32).dense_kl_stored
    off = Settings.from_config(tiny_config(**{"ppo.dense_kl_reference": "experience"}))
    assert not derive_sizes(off, vocab_size=32).dense_kl_stored  # no dense KL: nothing to keep


def test_a_bad_dense_kl_reference_fails_in_one_line():
    with pytest.raises(ConfigError, match="ppo.dense_kl_reference='cache': use one of auto, experience, recompute"):
        Settings.from_config(tiny_config(**{"ppo.dense_kl_reference": "cache"}))
