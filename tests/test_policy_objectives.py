"""GSPO, GSPO-token, CISPO, KL-Cov, the adaptive entropy coefficient and Dr. GRPO's advantage, each
against a float64 NumPy transcription of its paper's equation written here with loops (random inputs,
padding masks, a row with no token), values and gradients; GSPO on packed rows as well.

Each test went red under the mutation its docstring names (tried, then reverted)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import ppo
from ppo_jax.ppo import stats

B, L = 6, 7
LENGTHS = np.array([7, 3, 0, 5, 1, 6])  # row 2 holds no token


def random_batch(seed, per_token_advantages, spread=0.3):
    rng = np.random.default_rng(seed)
    mask = np.arange(L)[None, :] < LENGTHS[:, None]
    logp = -rng.exponential(1.0, (B, L)).astype(np.float32)
    old = (logp + rng.normal(0, spread, (B, L))).astype(np.float32)
    adv = rng.normal(size=(B, L) if per_token_advantages else (B, 1)) * np.ones((B, L))
    return logp * mask, old * mask, (adv * mask).astype(np.float32), mask


def numpy_gspo(logp, old, adv, mask, lo, hi, token_level):
    """Zheng et al. 2025: s_i = exp(mean_t log(pi/pi_old)); GSPO (eq. 5) -(1/G) sum_i min(s_i A_i,
    clip(s_i) A_i), GSPO-token (eq. 13) -(1/G) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it)
    with s_it = sg[s_i] pi_t / sg[pi_t]. Returns (loss, d loss / d logp), float64."""
    logp, old, adv = (x.astype(np.float64) for x in (logp, old, adv))
    sequences = [i for i in range(B) if mask[i].any()]
    G, loss, grad = len(sequences), 0.0, np.zeros((B, L))
    for i in sequences:
        tokens = np.nonzero(mask[i])[0]
        n = len(tokens)
        s = np.exp(np.mean([logp[i, t] - old[i, t] for t in tokens]))
        for t in tokens:
            a = adv[i, t]
            unclipped, clipped = s * a, np.clip(s, 1 - lo, 1 + hi) * a
            loss -= min(unclipped, clipped) / (G * n)
            if unclipped <= clipped or 1 - lo <= s <= 1 + hi:  # the min's gradient is the unclipped term's
                if token_level:  # d s_it / d logp_it = s_i
                    grad[i, t] -= a * s / (G * n)
                else:  # d s_i / d logp_ij = s_i / n, for every j of the sequence
                    for j in tokens:
                        grad[i, j] -= a * s / n / (G * n)
    return loss, grad


def pack_by_hand(arrays, mask):
    """The sequences of padded rows laid out packed: 2 packed rows, each sequence a run behind one
    prompt-like slot (mask 0, same id), ids 1 + the row; zeros (id 0) after. Returns the packed
    arrays, the packed mask and the segment ids."""
    rows = [[0, 1, 2], [3, 4, 5]]
    width = 1 + max(sum(LENGTHS[r] + 1 for r in row) for row in rows)
    out = [np.zeros((2, width), a.dtype) for a in arrays]
    packed_mask, ids = np.zeros((2, width), bool), np.zeros((2, width), np.int32)
    for p, row in enumerate(rows):
        at = 0
        for r in row:
            n = LENGTHS[r]
            ids[p, at:at + n + 1] = r + 1
            for a, o in zip(arrays, out):
                o[p, at + 1:at + 1 + n] = a[r, :n]
            packed_mask[p, at + 1:at + 1 + n] = True
            at += n + 1
    return out, packed_mask, ids


@pytest.mark.parametrize("token_level", [False, True], ids=["gspo", "gspo_token"])
def test_gspo_is_the_papers_clipped_sequence_ratio_on_padded_and_packed_rows(token_level):
    """Red with: the sequence ratio's log summed instead of averaged (no length normalisation); the
    stop-gradients of GSPO-token dropped (the gradient then reaches every token of the sequence);
    the packed rows' runs read as one sequence per packed row."""
    lo, hi = 0.05, 0.08
    logp, old, adv, mask = random_batch(0, per_token_advantages=token_level)
    G = mask.any(-1).sum()
    # sequence_mean: each token's denominator is G times its sequence's length.
    denominators = G * np.maximum(mask.sum(-1, keepdims=True), 1) * np.ones((B, L))

    def loss(lp, o, a, m, ids, d):
        return ppo.gspo_loss(lp, o, a, m, clip_eps=lo, clip_eps_high=hi, token_level=token_level, segment_ids=ids,
                             num_tokens=d)

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp, old, adv, mask, None, denominators)
    expected, expected_grad = numpy_gspo(logp, old, adv, mask, lo, hi, token_level)
    np.testing.assert_allclose(float(value), expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-4, atol=1e-7)
    s = np.exp(np.asarray(ppo.sequence_mean(logp - old, mask)))[:, 0]
    assert np.any(mask.any(-1) & ((s < 1 - lo) | (s > 1 + hi))) and np.any((1 - lo < s) & (s < 1 + hi))  # both
    np.testing.assert_allclose(float(stats.finalize_metrics(metrics)["ratio"]), s.repeat(LENGTHS).mean(), rtol=1e-5)

    (p_logp, p_old, p_adv, p_den), p_mask, ids = pack_by_hand([logp, old, adv, denominators], mask)
    (packed, _), p_grad = jax.value_and_grad(loss, has_aux=True)(p_logp, p_old, p_adv, p_mask, ids,
                                                                 np.maximum(p_den, 1))
    np.testing.assert_allclose(float(packed), expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(p_grad)[p_mask], expected_grad[mask], rtol=1e-4, atol=1e-7)


def test_every_objectives_ratio_is_exactly_one_on_its_own_log_probs():
    """The first minibatch (DESIGN.md section 5): old log-probs equal to the new ones give ratio 1,
    variance 0, nothing clipped, approx-KL 0, and the gradient of -A r (CISPO: -A log pi). Red with
    KL-Cov's penalty as jnp.abs(log_ratio), whose gradient at 0 is 1 (it was, before this test)."""
    logp, _, adv, mask = random_batch(1, per_token_advantages=False)
    selection = ppo.covariance_selection(logp, adv, mask, 0.2)
    objectives = {
        "gspo": lambda lp: ppo.gspo_loss(lp, logp, adv, mask, clip_eps=3e-4, clip_eps_high=4e-4),
        "gspo_token": lambda lp: ppo.gspo_loss(lp, logp, adv, mask, clip_eps=3e-4, clip_eps_high=4e-4,
                                               token_level=True),
        "cispo": lambda lp: ppo.cispo_loss(lp, logp, adv, mask, clip_eps_low=1.0, clip_eps_high=0.28),
        "kl_cov": lambda lp: ppo.kl_cov_loss(lp, logp, adv, mask, selection, coef=1.0),
    }
    n = mask.sum()
    for name, loss in objectives.items():
        (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
        final = stats.finalize_metrics(metrics)
        assert final["ratio"] == 1 and final["ratio_var"] == 0 and final["clipfrac"] == 0, name
        assert final["approxkl"] == 0, name
        np.testing.assert_allclose(np.asarray(grad), -adv / n, rtol=1e-6, atol=1e-9, err_msg=name)
        if name != "cispo":
            np.testing.assert_allclose(float(value), -adv[mask].astype(np.float64).mean(), rtol=1e-6)


def test_cispo_is_the_stopped_clipped_weight_times_the_log_prob():
    """MiniMax-M1: J = 1/sum|o_i| sum_i sum_t sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi. Every
    token keeps a gradient, -r_hat A / N. Red with: the weight not stopped (its gradient adds
    r_hat * A * logp where the clip does not bind); the upper bound taken as eps_high instead of
    1 + eps_high."""
    logp, old, adv, mask = random_batch(2, per_token_advantages=True, spread=0.6)
    hi = 0.28
    (value, metrics), grad = jax.value_and_grad(
        lambda lp: ppo.cispo_loss(lp, old, adv, mask, clip_eps_low=1.0, clip_eps_high=hi), has_aux=True)(logp)
    n, loss, expected_grad, clipped = mask.sum(), 0.0, np.zeros((B, L)), 0
    for i, t in zip(*np.nonzero(mask)):
        r = np.exp(np.float64(logp[i, t]) - old[i, t])
        weight = min(r, 1 + hi)  # eps_low = 1: no lower bound
        clipped += weight != r
        loss -= weight * adv[i, t] * np.float64(logp[i, t]) / n
        expected_grad[i, t] = -weight * adv[i, t] / n
    np.testing.assert_allclose(float(value), loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-8)
    assert 0 < clipped < n and np.all(np.asarray(grad)[mask] != 0)  # clipped tokens keep a gradient
    np.testing.assert_allclose(float(stats.finalize_metrics(metrics)["clipfrac"]), clipped / n, rtol=1e-6)


def numpy_kl_cov(logp, old, adv, mask, fraction, coef):
    """Cui et al. 2025, KL-Cov, transcribed with the selection over this batch by the old log-probs:
    Cov_t = (log pi_old_t - mean) (A_t - mean), the top max(1, floor(fraction N)) get
    coef |log pi - log pi_old|; loss = mean over tokens of -A r (+ the penalty)."""
    tokens = list(zip(*np.nonzero(mask)))
    n = len(tokens)
    mean_logp = sum(np.float64(old[t]) for t in tokens) / n
    mean_adv = sum(np.float64(adv[t]) for t in tokens) / n
    cov = {t: (old[t] - mean_logp) * (adv[t] - mean_adv) for t in tokens}
    k = max(1, int(np.floor(fraction * n)))
    top = set(sorted(tokens, key=lambda t: -cov[t])[:k])
    loss, grad = 0.0, np.zeros(mask.shape)
    for t in tokens:
        d = np.float64(logp[t]) - old[t]
        loss += (-adv[t] * np.exp(d) + (coef * abs(d) if t in top else 0.0)) / n
        grad[t] = (-adv[t] * np.exp(d) + (coef * np.sign(d) if t in top else 0.0)) / n
    return loss, grad, len(top)


def test_kl_cov_penalises_the_top_covariance_tokens_of_the_minibatch_and_microbatches_add_up():
    """Red with: the threshold read at index k instead of k - 1 (one token too few); the covariance
    not centred on the advantage's mean. The selection is the minibatch's, so two microbatches with
    the minibatch's selection and token count add up to it."""
    logp, old, adv, mask = random_batch(3, per_token_advantages=True)
    fraction, coef = 0.15, 0.7  # 22 tokens: k = 3
    selection = ppo.covariance_selection(old, adv, mask, fraction)

    def loss(lp, o, a, m):
        return ppo.kl_cov_loss(lp, o, a, m, selection, coef=coef, num_tokens=mask.sum())

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp, old, adv, mask)
    expected, expected_grad, k = numpy_kl_cov(logp, old, adv, mask, fraction, coef)
    np.testing.assert_allclose(float(value), expected, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-8)
    final = stats.finalize_metrics(metrics)
    assert k == 3 and final["kl_cov_frac"] * mask.sum() == k and final["clipfrac"] == 0
    parts = [jax.value_and_grad(loss, has_aux=True)(*(x[rows] for x in (logp, old, adv, mask)))
             for rows in (slice(0, 4), slice(4, 6))]
    np.testing.assert_allclose(sum(float(v) for (v, _), _ in parts), expected, rtol=1e-5)
    np.testing.assert_allclose(np.concatenate([np.asarray(g) for _, g in parts]), expected_grad, rtol=1e-5, atol=1e-8)


def test_adaptive_entropy_coefficient_follows_skywork_or1():
    """alpha_k = c_k 1[e_k <= tgt]; c_{k+1} = max(c_k + D sign(tgt - e_k), 0). Red with: alpha read
    from c_{k+1}; the indicator strict (e_k < tgt, wrong at e_k = tgt exactly)."""
    target, step, c = 0.5, 0.25, 0.0
    state = ppo.init_entropy_controller(c, target, step)
    for e in (0.9, 0.4, 0.3, 0.5, 0.7, 0.8, 0.8, 0.2):
        alpha = c if e <= target else 0.0
        c = max(c + step * (1 if e < target else -1 if e > target else 0), 0.0)
        assert float(ppo.entropy_coef(state, e)) == alpha
        state = ppo.update_entropy_controller(state, e)
        assert float(state.coef) == c


def test_dr_grpo_advantage_is_the_group_centred_reward():
    """Liu et al. 2025: A_i = R_i - mean_group R (no std division); GRPO's divides by std (n - 1) +
    1e-4. Red with the division kept."""
    rng = np.random.default_rng(4)
    n, rewards = 4, rng.normal(size=12).astype(np.float32)
    mask = np.ones((12, 3), np.float32)
    for divide, expected in ((False, []), (True, [])):
        for g in range(0, 12, n):
            group = rewards[g:g + n].astype(np.float64)
            for r in group:
                centred = r - group.mean()
                expected.append(centred / (group.std(ddof=1) + 1e-4) if divide else centred)
        est = ppo.estimate_advantages("grpo", mask=mask, scores=rewards, group_size=n, divide_by_std=divide)
        np.testing.assert_allclose(np.asarray(est.advantages), np.array(expected)[:, None] * mask, rtol=1e-5,
                                   atol=1e-6)


def test_sequence_sum_reads_runs_of_one_segment_id():
    x = jnp.arange(1.0, 9.0).reshape(1, 8)
    ids = jnp.array([[1, 1, 2, 2, 2, 5, 0, 0]])
    np.testing.assert_array_equal(np.asarray(ppo.sequence_sum(x, ids)), [[3, 3, 12, 12, 12, 6, 15, 15]])
    np.testing.assert_array_equal(np.asarray(ppo.sequence_sum(x)), np.full((1, 8), 36.0))
