"""Rewards no update can learn from (issue 48 item 7): a reward function that scores every sample 1e30
was accepted silently. Past |score| 1e6 float32 rounds the per-token KL penalty away beside the score
(`ppo_jax.reward_functions.SCORE_MAGNITUDE_LIMIT`); the run now says so once."""

import numpy as np
import pytest
from conftest import make_test_mesh
from tiny_configs import tiny_config

from ppo_jax import reward_functions
from ppo_jax.rl.trainer import PPOTrainer


def test_the_limit_is_where_float32_rounds_a_typical_kl_penalty_away():
    """The reason for the threshold, checked: beside a score of 1e6 a per-token penalty of 0.01 nats
    (β 0.1 × KL 0.1) is lost in float32, beside a score of 1e4 it is kept."""
    penalty = np.float32(0.1 * 0.1)
    assert np.float32(reward_functions.SCORE_MAGNITUDE_LIMIT) - penalty == np.float32(reward_functions.SCORE_MAGNITUDE_LIMIT)
    assert np.float32(1e4) - penalty != np.float32(1e4)


@pytest.mark.parametrize("scores, says", [
    ([0.0, 1.0, -3.5, 1e6], None),  # at the limit: still fine
    ([1e30] * 4, "4 of 4 have |score| > 1e+06 (largest 1e+30)"),
    ([1.0, -2e6, 0.5, 3.0], "1 of 4 have |score| > 1e+06 (largest 2e+06)"),
    ([1.0, np.nan, np.inf, 0.0], "2 of 4 are NaN or inf"),
])
def test_a_batch_of_scores_is_judged(scores, says):
    problem = reward_functions.score_magnitude_problem(np.asarray(scores, np.float32))
    if says is None:
        assert problem is None
    else:
        assert problem.startswith("reward-function scores: ") and says in problem


def test_it_warns_once_per_run(capsys):
    class Run:
        pass

    first, second = Run(), Run()
    for _ in range(3):
        reward_functions.warn_once_if_meaningless(np.full(4, 1e30, np.float32), run=first)
        reward_functions.warn_once_if_meaningless(np.ones(4, np.float32), run=second)  # fine: no line
    assert capsys.readouterr().out.count("warning: reward-function scores:") == 1
    reward_functions.warn_once_if_meaningless(np.full(4, -1e9, np.float32), run=second)
    assert capsys.readouterr().out.count("warning: reward-function scores: 4 of 4 have |score|") == 1


def test_a_ppo_run_with_a_reward_of_1e8_warns_once(tmp_path, capsys):
    """The trainer's rollouts call the check on the host scores of every batch (the wiring, not only
    the function): two iterations, one warning. (1e8 runs to the end, the silent case; 1e30 overflows
    the squared value error and the non-finite guard stops the run, after the same warning.)"""
    config = tiny_config(**{"train.iterations": 2})
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)),
                         reward_functions=[(lambda prompts, responses: [1e8] * len(responses), 1.0)])
    trainer.train()
    trainer.close()
    out = capsys.readouterr().out
    assert out.count("warning: reward-function scores:") == 1, out[-3000:]
    assert "have |score| > 1e+06 (largest 1e+08)" in out
