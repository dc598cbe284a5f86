"""Score processing and per-token reward shaping vs float64 NumPy."""

import numpy as np
import pytest

from ppo_jax.ppo.shaping import overlong_penalty, process_scores, shape_rewards, whiten_rewards
from ppo_jax.ppo.stats import last_token_index


def random_scores(seed, batch=10):
    rng = np.random.default_rng(seed)
    scores = rng.normal(0, 3, batch).astype(np.float32)
    stopped = rng.random(batch) < 0.6
    stopped[:2] = [True, False]
    return scores, stopped


def reference_process_scores(scores, stopped, missing_stop, value, gain, bias, clip):
    out = gain * scores.astype(np.float64) + bias
    if clip is not None:
        out = np.minimum(np.maximum(out, -clip), clip)
    for i in range(len(out)):
        if not stopped[i]:
            if missing_stop == "replace":
                out[i] = value
            elif missing_stop == "penalty":
                out[i] = out[i] - value
    return out


@pytest.mark.parametrize("missing_stop, value", [("none", -1.0), ("replace", -1.0), ("penalty", 1.0),
                                                 ("replace", -3.0)])
@pytest.mark.parametrize("gain, bias, clip", [(1.0, 0.0, None), (0.5, -0.25, None), (2.0, 1.0, 4.0)])
def test_process_scores_matches_numpy(missing_stop, value, gain, bias, clip):
    scores, stopped = random_scores(0)
    out = process_scores(scores, stopped, missing_stop=missing_stop, missing_stop_value=value,
                         gain=gain, bias=bias, clip=clip)
    expected = reference_process_scores(scores, stopped, missing_stop, value, gain, bias, clip)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


def test_eos_trick_replaces_only_unstopped_scores():
    out = np.asarray(process_scores(np.array([2.0, 5.0, -4.0]), np.array([True, False, False]),
                                    missing_stop="replace"))
    np.testing.assert_array_equal(out, [2.0, -1.0, -1.0])


def test_process_scores_errors():
    with pytest.raises(ValueError, match="none, replace, penalty"):
        process_scores(np.zeros(2), np.ones(2, bool), missing_stop="drop")
    with pytest.raises(ValueError, match="clip"):
        process_scores(np.zeros(2), np.ones(2, bool), clip=0.0)
    with pytest.raises(ValueError, match="stopped has shape"):
        process_scores(np.zeros(2), np.ones(3, bool))


def prefix_mask(lengths, length):
    return np.arange(length)[None, :] < np.asarray(lengths)[:, None]


def test_shape_rewards_matches_numpy_loop():
    rng = np.random.default_rng(1)
    lengths = [7, 3, 0, 1, 5]  # never stops, ends early, empty, single token
    mask = prefix_mask(lengths, 7)
    scores = rng.normal(size=5).astype(np.float32)
    kl = np.where(mask, rng.normal(0, 0.2, (5, 7)), np.nan).astype(np.float32)  # garbage in padding
    kl_coef = 0.05
    expected = np.zeros((5, 7))
    for row, n in enumerate(lengths):
        for t in range(n):
            expected[row, t] = -kl_coef * float(kl[row, t])
        if n > 0:
            expected[row, n - 1] += float(scores[row])
    rewards = np.asarray(shape_rewards(scores, kl, mask, kl_coef))
    np.testing.assert_allclose(rewards, expected, rtol=1e-6, atol=1e-7)
    # Per row: sum of rewards = score - beta * sum(kl), the "RLHF reward".
    rlhf = scores - kl_coef * np.where(mask, kl, 0).sum(1)
    np.testing.assert_allclose(rewards.sum(1)[np.array(lengths) > 0],
                               rlhf[np.array(lengths) > 0], rtol=1e-5)


def test_last_token_index_any_mask():
    mask = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]], bool)
    np.testing.assert_array_equal(last_token_index(mask), [2, -1, 2, 3])


def test_reward_whitening_scales_real_tokens_only():
    rng = np.random.default_rng(2)
    mask = prefix_mask([4, 2, 6], 6)
    rewards = np.where(mask, rng.normal(0.5, 2.0, (3, 6)), 99.0).astype(np.float32)
    real = rewards[mask].astype(np.float64)
    out = np.asarray(whiten_rewards(rewards, mask))
    expected = (real - real.mean()) / np.sqrt(real.var() + 1e-8) + real.mean()
    np.testing.assert_allclose(out[mask], expected, rtol=1e-5)
    assert np.all(out[~mask] == 0)


def test_overlong_penalty_matches_dapo_soft_punishment():
    # DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) written out: 0 up to L_max - L_cache,
    # linear in between, the whole penalty for a row the budget cut (no stop token).
    max_length, buffer, penalty = 16, 4, 1.5
    lengths = np.array([1, 11, 12, 13, 14, 15, 16, 16, 9], np.int32)
    stopped = np.array([True, True, True, True, True, True, True, False, False])

    def reference(n, stop):
        if not stop:
            return penalty
        if n <= max_length - buffer:
            return 0.0
        return penalty * (n - (max_length - buffer)) / buffer

    expected = [reference(n, s) for n, s in zip(lengths, stopped)]
    got = overlong_penalty(lengths, stopped, max_length=max_length, buffer=buffer, penalty=penalty)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)
    assert np.asarray(got)[4] == pytest.approx(0.75)  # halfway through the buffer: half the penalty


def test_overlong_penalty_rejects_a_buffer_outside_the_budget():
    for buffer in (0, 17):
        with pytest.raises(ValueError, match="overlong buffer"):
            overlong_penalty(np.array([3]), np.array([True]), max_length=16, buffer=buffer, penalty=1.0)
