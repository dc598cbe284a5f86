"""The rollout corrections (`rl/corrections.py`, issue 44 items 4 and 6) against float64 NumPy written
from their definitions: token / sequence truncated IS (TIS) and masked IS (MIS), w = pi_train /
pi_behaviour. Each test pins one thing a broken correction gets wrong: the cap applied exactly, the
tokens / rows a mask drops, the weight on the policy-gradient term only, numerator over denominator,
and the metrics (mismatch KL, truncated / dropped shares, policy lag)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from test_ppo_objective import hyper

from ppo_jax.config import ConfigError
from ppo_jax.rl import corrections
from ppo_jax.rl.experience import experience_from_outputs
from ppo_jax.rl.forwards import ForwardOutputs
from ppo_jax.rl.objective import LossBatch, TokenOutputs, ppo_loss
from ppo_jax.rl.hyper import PPOHyper
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.sizes import derive_sizes
from ppo_jax.ppo.stats import SumCount
from ppo_jax.rl.state import Experience, Rollout

from tiny_configs import tiny_config

CAP = 1.5  # MIS keeps ratios in [1/1.5, 1.5] = [0.667, 1.5]
# 3 rows x 4 tokens. Per token log w = log pi_train - log pi_behaviour (masked positions hold junk that
# must not count):
#   row 0: [0.1, -0.2, 0.05, 0.0]  all within the bounds; the row's sum -0.05 (w = 0.95) too
#   row 1: [0.9, -0.1, 0.3 | junk]  token 0 above the cap (2.46); the row's sum 1.1 (3.0) above it
#   row 2: [-0.6, -0.8 | junk]      both tokens below 1/cap (0.55, 0.45); the row's sum -1.4 (0.25) too
MASK = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
LOG_W = np.array([[0.1, -0.2, 0.05, 0.0], [0.9, -0.1, 0.3, 5.0], [-0.6, -0.8, -7.0, 3.0]])
BEHAVIOUR = np.array([[-1.0, -0.5, -2.0, -0.3], [-2.5, -0.4, -1.2, -0.9], [-0.2, -0.1, -1.5, -2.0]])
TRAIN = BEHAVIOUR + LOG_W  # the trainer's recomputed log-probs: numerator
ADVANTAGES = np.array([[1.0, -0.5, 2.0, -1.5], [0.7, -2.0, 1.1, 0.0], [-0.3, 0.9, 0.0, 0.0]])


def numpy_weights(kind, cap=CAP):
    """Float64 reference: (weights [B, Lr] 0 off the mask, capped [B, Lr] bool, dropped [B, Lr] bool)."""
    log_w = (TRAIN - BEHAVIOUR) * MASK
    if kind.startswith("sequence_"):
        log_w = np.repeat(log_w.sum(-1, keepdims=True), log_w.shape[1], axis=1)
    w = np.exp(log_w)
    if kind.endswith("truncated_is"):
        return np.minimum(w, cap) * MASK, (w > cap) & (MASK > 0), np.zeros(w.shape, bool)
    keep = (w >= 1 / cap) & (w <= cap)
    return np.where(keep, w, 0.0) * MASK, np.zeros(w.shape, bool), ~keep & (MASK > 0)


def correct(kind, cap=CAP):
    return corrections.off_policy_correction(kind, cap, jnp.asarray(TRAIN * MASK, jnp.float32),
                                             jnp.asarray(BEHAVIOUR * MASK, jnp.float32), jnp.asarray(MASK))


# What each correction must do to this batch, written out by hand (not from numpy_weights): which
# tokens it caps at exactly CAP, which it drops.
CAPPED = {"truncated_is": [(1, 0)], "sequence_truncated_is": [(1, 0), (1, 1), (1, 2)],
          "masked_is": [], "sequence_masked_is": []}
DROPPED = {"truncated_is": [], "sequence_truncated_is": [],
           "masked_is": [(1, 0), (2, 0), (2, 1)], "sequence_masked_is": [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]}


@pytest.mark.parametrize("kind", corrections.WEIGHTING)
def test_each_correction_weights_as_numpy_caps_exactly_and_drops_exactly_the_listed_tokens(kind):
    c = correct(kind)
    weights = np.asarray(c.pg_weights)
    expected, capped, dropped = numpy_weights(kind)
    np.testing.assert_allclose(weights, expected, rtol=1e-6, atol=1e-7)
    assert sorted(zip(*np.nonzero(capped))) == CAPPED[kind]  # the reference agrees with the hand-made lists
    assert sorted(zip(*np.nonzero(dropped))) == DROPPED[kind]
    for i, j in CAPPED[kind]:
        assert weights[i, j] == np.float32(CAP)  # clipped to the cap itself, not just "some weight > 1"
    real = MASK > 0
    assert sorted(zip(*np.nonzero((weights == 0) & real))) == DROPPED[kind]
    assert not np.any(weights[~real])  # padding has no weight
    # Kept and not capped: the plain ratio, the token's or its row's (the weight of an IS estimator).
    log_w = (TRAIN - BEHAVIOUR) * MASK
    ratio = np.exp(np.broadcast_to(log_w.sum(-1, keepdims=True), MASK.shape) if kind.startswith("sequence_") else log_w)
    untouched = real & ~dropped & ~capped
    np.testing.assert_allclose(weights[untouched], ratio[untouched], rtol=1e-6)
    np.testing.assert_allclose(float(c.metrics["rollout/truncated_frac"]), capped[real].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(c.metrics["rollout/masked_frac"]), dropped[real].mean(), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(c.ratio_logprobs), np.asarray(jnp.asarray(TRAIN * MASK, jnp.float32)))


@pytest.mark.parametrize("kind", corrections.WEIGHTING)
def test_the_weight_is_train_over_behaviour_not_the_reverse(kind):
    """A token the trainer finds likelier than the sampler did gets a weight above 1 (with a cap and
    bounds wide enough to keep it): row 1's first token, w = e^0.9; its sequence, e^1.1."""
    c = correct(kind, cap=10.0)
    expected = np.exp(1.1 if kind.startswith("sequence_") else 0.9)
    np.testing.assert_allclose(float(c.pg_weights[1, 0]), expected, rtol=1e-6)
    assert float(c.pg_weights[1, 0]) > 1


# Off the mask the forwards may leave anything: log-probs of padding, of tokens after the stop. Wild
# but finite values, whose log ratio (+-160) overflows exp in float32 to inf or 0.
JUNK_TRAIN = np.array([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 80.0], [0.0, 0.0, -80.0, 80.0]])
JUNK_BEHAVIOUR = np.array([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, -80.0], [0.0, 0.0, 80.0, -80.0]])


@pytest.mark.parametrize("shift", [0.0, -1.0], ids=["as_is", "every_ratio_below_1"])
@pytest.mark.parametrize("kind", ("", "behaviour") + corrections.WEIGHTING)
def test_junk_off_the_mask_changes_nothing(kind, shift):
    """off_policy_correction fed log-probs that are not zeroed off the mask (every other test masks
    them first) returns what it returns for the zeroed batch: the weights (also against NumPy),
    every metric, and the ratio's log-probs on the mask (behaviour's: 0 off it). The shift moves
    every real token's ratio below 1, so a max taken over the padding (ratio 1 there once log w is
    masked) would show. Red with `* mask` dropped from `log_w = (logp - behaviour_logp) * mask`
    (the sequence weights sum the junk, is_weight_max is NaN), from `w.weights * mask` (padding
    weighted), from `behaviour_logp * mask` and from `(ratio * mask).max()` (the shifted batch)."""
    train = (TRAIN + shift) * MASK
    behaviour = BEHAVIOUR * MASK
    clean = corrections.off_policy_correction(kind, CAP, jnp.asarray(train, jnp.float32),
                                              jnp.asarray(behaviour, jnp.float32), jnp.asarray(MASK))
    junk = corrections.off_policy_correction(kind, CAP, jnp.asarray(train + JUNK_TRAIN, jnp.float32),
                                             jnp.asarray(behaviour + JUNK_BEHAVIOUR, jnp.float32), jnp.asarray(MASK))
    np.testing.assert_array_equal(np.asarray(junk.pg_weights), np.asarray(clean.pg_weights))
    assert set(junk.metrics) == set(clean.metrics)
    for name, value in clean.metrics.items():
        assert np.isfinite(float(junk.metrics[name])) and float(junk.metrics[name]) == float(value), name
    real = MASK > 0
    np.testing.assert_array_equal(np.asarray(junk.ratio_logprobs)[real], np.asarray(clean.ratio_logprobs)[real])
    if kind == "behaviour":
        assert not np.any(np.asarray(junk.ratio_logprobs)[~real])
    if kind in corrections.WEIGHTING:
        log_w = (train - behaviour) * MASK
        if kind.startswith("sequence_"):
            log_w = np.repeat(log_w.sum(-1, keepdims=True), log_w.shape[1], axis=1)
        w = np.exp(log_w)
        expected = (np.minimum(w, CAP) if kind.endswith("truncated_is")
                    else np.where((w >= 1 / CAP) & (w <= CAP), w, 0.0)) * MASK
        np.testing.assert_allclose(np.asarray(junk.pg_weights), expected, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(float(junk.metrics["off_policy/is_weight_max"]), np.exp(log_w[real]).max()
                                   if not kind.startswith("sequence_") else np.exp((train - behaviour)[real]).max(),
                                   rtol=1e-6)


@pytest.mark.parametrize("kind", corrections.WEIGHTING)
def test_the_sequence_modes_log_each_rows_weight(kind):
    """`off_policy/sequence_weight_mean` / `_min` / `_max`: the one weight a sequence mode gives each row
    (row sums of log w: -0.05, 1.1, -1.4; TIS caps row 1 at 1.5, MIS drops rows 1 and 2), over the rows
    with a response token: a fourth row of padding (junk log-probs) is not a row. The token modes log
    none. Red with the empty row counted (mean over 4 rows, min 0)."""
    mask = np.concatenate([MASK, np.zeros((1, 4), np.float32)])
    train = np.concatenate([TRAIN * MASK, np.full((1, 4), 9.0)])
    behaviour = np.concatenate([BEHAVIOUR * MASK, np.full((1, 4), -9.0)])
    c = corrections.off_policy_correction(kind, CAP, jnp.asarray(train, jnp.float32),
                                          jnp.asarray(behaviour, jnp.float32), jnp.asarray(mask))
    names = ("off_policy/sequence_weight_mean", "off_policy/sequence_weight_min", "off_policy/sequence_weight_max")
    if not kind.startswith("sequence_"):
        assert not set(names) & set(c.metrics)
        return
    ratio = np.exp(np.array([-0.05, 1.1, -1.4]))
    rows = np.minimum(ratio, CAP) if kind.endswith("truncated_is") else np.where((ratio >= 1 / CAP) & (ratio <= CAP),
                                                                                ratio, 0.0)
    expected = {"truncated_is": [ratio[0], CAP, ratio[2]], "masked_is": [ratio[0], 0.0, 0.0]}[kind.split("_", 1)[1]]
    np.testing.assert_allclose(rows, expected, rtol=1e-12)  # the reference agrees with the hand-made rows
    got = [float(c.metrics[name]) for name in names]
    np.testing.assert_allclose(got, [rows.mean(), rows.min(), rows.max()], rtol=1e-6)
    # The trainer logs them: the experience step's metrics carry the correction's.
    _, metrics = experience(hyper(off_policy_ratio=kind, is_cap=CAP))
    np.testing.assert_allclose([float(metrics[name]) for name in names], [rows.mean(), rows.min(), rows.max()],
                               rtol=1e-6)


def test_mismatch_kl_is_the_masked_mean_k3_of_behaviour_against_train():
    """KL(pi_behaviour || pi_train) under the sampler's tokens, k3 = w - 1 - log w per token, the mean
    over real tokens only (the junk off the mask would dominate it). Logged with no correction too."""
    log_w = (TRAIN - BEHAVIOUR) * MASK
    expected = (np.expm1(log_w) - log_w)[MASK > 0].mean()
    for kind in ("", "behaviour", "truncated_is"):
        np.testing.assert_allclose(float(correct(kind).metrics["rollout/mismatch_kl"]), expected, rtol=1e-5)


def experience(hp: PPOHyper, step=None, policy_version=None):
    rollout = Rollout(prompt_tokens=jnp.ones((3, 2), jnp.int32), prompt_mask=jnp.ones((3, 2), jnp.int32),
                      tokens=jnp.ones((3, 4), jnp.int32), mask=jnp.asarray(MASK, jnp.int32),
                      sampler_logprobs=jnp.asarray(BEHAVIOUR * MASK, jnp.float32),
                      behaviour_logprobs=jnp.asarray(BEHAVIOUR * MASK, jnp.float32),
                      stopped=jnp.array([True, True, True]), host_scores=jnp.asarray([0.5, 2.0, -1.0], jnp.float32),
                      policy_version=policy_version)
    out = ForwardOutputs(logprobs=jnp.asarray(TRAIN * MASK, jnp.float32),
                         ref_logprobs=jnp.asarray((TRAIN - 0.3) * MASK, jnp.float32), entropy=jnp.zeros(MASK.shape),
                         values=jnp.asarray(0.1 * MASK, jnp.float32), scores=jnp.array([1.0, -3.0, 0.5]))
    return experience_from_outputs(out, rollout, jnp.float32(0.1), hp, step=step)


@pytest.mark.parametrize("kind", corrections.WEIGHTING)
def test_the_weight_multiplies_the_advantages_and_nothing_else(kind):
    """Against the same batch uncorrected: the advantages times the weights; the ratio's log-probs, the
    value targets, the values, the reference log-probs and the KL the controller reads unchanged."""
    plain, _ = experience(hyper())
    corrected, _ = experience(hyper(off_policy_ratio=kind, is_cap=CAP))
    expected, _, _ = numpy_weights(kind)
    np.testing.assert_allclose(np.asarray(corrected.advantages), np.asarray(plain.advantages) * expected,
                               rtol=1e-5, atol=1e-7)
    for field in ("old_logprobs", "returns", "values", "ref_logprobs", "sequence_kl", "scores"):
        np.testing.assert_array_equal(np.asarray(getattr(corrected, field)), np.asarray(getattr(plain, field)),
                                      err_msg=field)


@pytest.mark.parametrize("kind", corrections.WEIGHTING)
def test_in_the_loss_the_weight_scales_the_policy_term_only(kind):
    """ppo_loss on the weighted advantages: the policy term is the float64 token sum of w * clipped
    loss / N; the value loss, the KL loss term and the entropy are those of the unweighted batch."""
    weights, _, _ = numpy_weights(kind)
    logp = (TRAIN + np.array([0.3, -0.3, 0.1, 0.0])) * MASK  # a moved policy: ratios on both clip sides
    sums = {}
    for name, adv in (("plain", ADVANTAGES * MASK), ("weighted", ADVANTAGES * weights)):
        exp = Experience(prompt_tokens=jnp.ones((3, 2), jnp.int32), prompt_mask=jnp.ones((3, 2), jnp.int32),
                         tokens=jnp.zeros((3, 4), jnp.int32), mask=jnp.asarray(MASK, jnp.int32),
                         old_logprobs=jnp.asarray(TRAIN * MASK, jnp.float32),
                         ref_logprobs=jnp.asarray((TRAIN - 0.3) * MASK, jnp.float32),
                         values=jnp.zeros(MASK.shape), advantages=jnp.asarray(adv, jnp.float32),
                         returns=jnp.asarray(MASK, jnp.float32), scores=jnp.zeros(3), sequence_kl=jnp.zeros(3))
        out = TokenOutputs(logits=jnp.zeros((3, 4, 5)), logprobs=jnp.asarray(logp, jnp.float32),
                           values=jnp.asarray(0.5 * MASK, jnp.float32))
        _, metrics = ppo_loss(out, LossBatch(exp, jnp.float32(MASK.sum()), jnp.float32(0.05)),
                              hyper(kl_in_reward=False))
        # Token sums (SumCount.total): what the microbatches add up to the minibatch's loss.
        sums[name] = {k: float(v.total) for k, v in metrics.items() if isinstance(v, SumCount)}
    ratio = np.exp(logp - TRAIN * MASK)
    per_token = np.maximum(-ADVANTAGES * ratio, -ADVANTAGES * np.clip(ratio, 0.8, 1.2))
    np.testing.assert_allclose(sums["weighted"]["policy_loss"], (weights * per_token)[MASK > 0].sum(), rtol=1e-5)
    np.testing.assert_allclose(sums["plain"]["policy_loss"], per_token[MASK > 0].sum(), rtol=1e-5)
    for term in ("value_loss", "kl_loss", "entropy"):
        assert sums["weighted"][term] == sums["plain"][term], term


def test_policy_lag_is_the_step_minus_each_rows_version():
    _, metrics = experience(hyper(), step=jnp.int32(7), policy_version=jnp.array([5, 5, 7], jnp.int32))
    assert float(metrics["rollout/policy_lag_mean"]) == pytest.approx(4 / 3)
    assert float(metrics["rollout/policy_lag_max"]) == 2.0
    _, unstamped = experience(hyper(), step=jnp.int32(7))
    assert "rollout/policy_lag_mean" not in unstamped


def test_auto_means_truncated_is_off_policy_and_none_on_policy_and_any_correction_runs_on_policy():
    """"auto" follows docs/off_policy.md: no correction on-policy; off-policy token TIS (the ratio 1 on
    the first minibatch), sequence TIS for GSPO (one weight per response, the only kind it accepts)."""
    def hp(**overrides):
        s = Settings.from_config(tiny_config(**overrides), reward_in_code=False)
        return PPOHyper.from_settings(s, derive_sizes(s, batch_divisor=1, max_positions=32, vocab_size=32,
                                                      platform="cpu", sampler_divisor=1))
    assert hp().off_policy_ratio == ""
    for k in (1, 2, 4):
        assert hp(**{"rollout.off_policy_steps": k}).off_policy_ratio == "truncated_is"
    gspo = {"ppo.policy_objective": "gspo", "ppo.advantage_estimator": "grpo", "rollout.num_samples": 2}
    assert hp(**gspo, **{"rollout.off_policy_steps": 1}).off_policy_ratio == "sequence_truncated_is"
    assert hp(**gspo).off_policy_ratio == ""
    assert hp(**{"rollout.off_policy_steps": 2, "ppo.off_policy_ratio": "none"}).off_policy_ratio == ""
    assert hp(**{"rollout.off_policy_steps": 2, "ppo.off_policy_ratio": "behaviour"}).off_policy_ratio == "behaviour"
    assert hp(**{"ppo.off_policy_ratio": "sequence_masked_is"}).off_policy_ratio == "sequence_masked_is"


@pytest.mark.parametrize("overrides,message", [
    ({"rollout.off_policy_steps": 5}, "rollout.off_policy_steps=5: use 0 (on-policy) to 4"),
    ({"rollout.off_policy_steps": -1}, "rollout.off_policy_steps=-1: use 0 (on-policy) to 4"),
    ({"ppo.off_policy_ratio": "tis"}, "ppo.off_policy_ratio='tis': use one of auto, none, behaviour, truncated_is, "
                                      "sequence_truncated_is, masked_is, sequence_masked_is"),
    ({"ppo.is_cap": 0.5}, "ppo.is_cap must be a finite number >= 1, got 0.5"),
    ({"ppo.is_cap": 1, "ppo.off_policy_ratio": "masked_is"},
     "ppo.is_cap=1 with ppo.off_policy_ratio=masked_is: the kept band [1/is_cap, is_cap] is the single ratio 1, so "
     "nearly every token is dropped; use ppo.is_cap > 1 (e.g. 2), or truncated_is"),
    ({"ppo.is_cap": 1.0, "ppo.off_policy_ratio": "sequence_masked_is", "rollout.off_policy_steps": 1},
     "ppo.is_cap=1 with ppo.off_policy_ratio=sequence_masked_is: the kept band"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_staleness_and_correction_settings_fail_in_one_line(overrides, message):
    """Each refused when the config is read, before anything compiles. ppo.is_cap = 1 with masked IS
    keeps only tokens whose ratio is exactly 1 (red with that check removed: the settings are accepted)."""
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        Settings.from_config(tiny_config(**overrides), reward_in_code=False)
    assert "\n" not in str(err.value)


def test_is_cap_one_is_accepted_where_it_drops_nothing():
    """The cap of 1 is a valid truncation (IMPALA's rho-bar = 1): weights min(w, 1). Only the masked
    kinds refuse it."""
    for ratio in ("truncated_is", "sequence_truncated_is", "behaviour", "none"):
        Settings.from_config(tiny_config(**{"ppo.is_cap": 1, "ppo.off_policy_ratio": ratio}), reward_in_code=False)
    c = correct("masked_is", cap=1.0)  # what it would do: all but row 0's last token (w exactly 1) dropped
    assert float(c.metrics["rollout/masked_frac"]) == pytest.approx(8 / 9)
