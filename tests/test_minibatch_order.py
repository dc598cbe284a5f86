"""ppo.minibatch_order: a new split of the rollout into minibatches every epoch ("reshuffle", PPO's
and the default), or one split visited again every epoch ("fixed", TRL's GRPOTrainer, whose
num_iterations go over the same buffered minibatches)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.config import ConfigError
from ppo_jax.rl import build
from ppo_jax.rl.hyper import DerivedSizes, PPOHyper
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import Experience, FrozenParams, PPOState
from ppo_jax.rl.update import make_update_fn, minibatch_order

from test_ppo_objective import hyper, tiny_run
from tiny_configs import tiny_config

ROWS = 8


@pytest.mark.parametrize("fixed", [False, True])
def test_each_epoch_splits_every_row_once_and_fixed_repeats_the_first_split(fixed):
    hp = hyper(epochs=3, num_minibatches=2, num_microbatches=2, fixed_minibatches=fixed)
    key = jax.random.key(7)
    order = np.asarray(minibatch_order(key, hp, ROWS))
    assert order.shape == (3, 2, 2, 2)
    for epoch in order:
        np.testing.assert_array_equal(np.sort(epoch.reshape(-1)), np.arange(ROWS))
    # the first epoch's split is the default's (a resumed run's minibatches do not move)
    first = np.asarray(jax.random.permutation(jax.random.split(key, 3)[0], ROWS)).reshape(2, 2, 2)
    np.testing.assert_array_equal(order[0], first)
    same = [np.array_equal(order[0], epoch) for epoch in order[1:]]
    assert same == ([True, True] if fixed else [False, False])


def _state_and_experience():
    s, modules, params, rows = tiny_run(**{"optim.policy_lr": 3e-3})
    policy_tx, _ = build.make_optimizers(s)
    state = PPOState(step=jnp.zeros((), jnp.int32), policy=params, policy_opt=policy_tx.init(params), value=None,
                     value_opt=None, kl=build.init_kl(s.ppo), key=jax.random.key(0))
    b = rows.mask.shape[0]
    logp = jnp.zeros(rows.mask.shape, jnp.float32) - 1.5
    advantages = jnp.asarray(np.random.default_rng(1).normal(size=rows.mask.shape), jnp.float32) * rows.mask
    exp = Experience(prompt_tokens=rows.prompt_tokens, prompt_mask=rows.prompt_mask, tokens=rows.tokens, mask=rows.mask,
                     old_logprobs=logp, ref_logprobs=logp, values=jnp.zeros_like(logp), advantages=advantages,
                     returns=jnp.zeros_like(logp), scores=jnp.zeros(b), sequence_kl=jnp.zeros(b))
    return modules, policy_tx, state, exp, b


def test_fixed_order_trains_on_the_first_epochs_minibatches_again():
    """Two fixed-order epochs move the policy as two one-epoch updates made at the same step (the
    same key, so the same split), one after the other; two reshuffled epochs do not."""
    modules, policy_tx, state, exp, b = _state_and_experience()
    frozen = FrozenParams(reference=None, reward=None)

    def update(**overrides):
        hp = hyper(estimator="grpo", num_minibatches=2, ent_coef=0.0, **overrides)
        return jax.jit(make_update_fn(modules, policy_tx, None, hp, b, None))

    one_epoch = update(epochs=1)
    once, _ = one_epoch(state, frozen, exp)
    twice, _ = one_epoch(dataclasses.replace(once, step=state.step), frozen, exp)
    fixed, _ = update(epochs=2, fixed_minibatches=True)(state, frozen, exp)
    reshuffled, _ = update(epochs=2)(state, frozen, exp)

    for got, want in zip(jax.tree.leaves(fixed.policy), jax.tree.leaves(twice.policy)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    gaps = [float(jnp.max(jnp.abs(r - w))) for r, w in zip(jax.tree.leaves(reshuffled.policy),
                                                           jax.tree.leaves(twice.policy))]
    assert max(gaps) > 1e-4, "a reshuffled second epoch took the first epoch's minibatches"


def test_a_bad_minibatch_order_fails_in_one_line():
    with pytest.raises(ConfigError, match="ppo.minibatch_order must be one of reshuffle, fixed, got 'once'") as err:
        Settings.from_config(tiny_config(**{"ppo.minibatch_order": "once"}), reward_in_code=False)
    assert "\n" not in str(err.value)


def test_the_setting_reaches_the_update():
    for order, fixed in (("reshuffle", False), ("fixed", True)):
        s = Settings.from_config(tiny_config(**{"ppo.minibatch_order": order}), reward_in_code=False)
        sizes = DerivedSizes(rollout_rows=8, minibatch_rows=8, microbatch_rows=8, forward_rows=8)
        assert PPOHyper.from_settings(s, sizes).fixed_minibatches is fixed
