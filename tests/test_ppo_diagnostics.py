"""The rollout health metrics (ppo/diagnostics.py) against plain Python loops over each row."""

import numpy as np

from ppo_jax.ppo.diagnostics import repeated_token_share, response_diagnostics, stop_token_kl


def _rows(seed=0, batch=7, length=9):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 3, size=(batch, length))  # a 3-token vocabulary: many repeats
    lengths = rng.integers(0, length + 1, size=batch)
    lengths[0], lengths[1] = 0, 1  # an empty row and a one-token row
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
    stopped = rng.random(batch) < 0.6
    stopped[0] = True  # "stopped" but empty: has no stop token to read
    kl = rng.normal(size=(batch, length)).astype(np.float32) * mask
    return tokens, mask, stopped, kl, lengths


def test_repeated_token_share_counts_back_to_back_repeats_within_real_tokens():
    tokens, mask, _, _, lengths = _rows()
    tokens[2, lengths[2]:] = tokens[2, max(lengths[2] - 1, 0)]  # padding repeating the last token: not counted
    same = pairs = 0
    for row, n in zip(tokens, lengths):
        for i in range(1, n):
            pairs += 1
            same += int(row[i] == row[i - 1])
    np.testing.assert_allclose(float(repeated_token_share(tokens, mask)), same / pairs, rtol=1e-6)


def test_stop_token_kl_reads_the_last_real_token_of_stopped_rows_only():
    _, mask, stopped, kl, lengths = _rows(seed=1)
    values = [kl[b, n - 1] for b, n in enumerate(lengths) if stopped[b] and n > 0]
    np.testing.assert_allclose(float(stop_token_kl(kl, mask, stopped)), np.mean(values), rtol=1e-6)


def test_kl_max_is_the_largest_row_sum_and_padding_is_ignored():
    tokens, mask, stopped, kl, lengths = _rows(seed=2)
    noisy = kl + 100.0 * (1 - mask)  # garbage in padding must not count
    logprobs = -np.abs(kl) * mask
    out = response_diagnostics(tokens, mask, stopped, noisy, logprobs)
    expected = max(sum(kl[b, :n]) for b, n in enumerate(lengths))
    np.testing.assert_allclose(float(out["objective/kl_max"]), expected, rtol=1e-6)
    at_stop = [kl[b, n - 1] for b, n in enumerate(lengths) if stopped[b] and n > 0]
    np.testing.assert_allclose(float(out["objective/kl_at_stop_token"]), np.mean(at_stop), rtol=1e-6)
    stop_logprobs = [logprobs[b, n - 1] for b, n in enumerate(lengths) if stopped[b] and n > 0]
    np.testing.assert_allclose(float(out["objective/stop_token_logprob"]), np.mean(stop_logprobs), rtol=1e-6)
