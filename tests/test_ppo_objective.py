"""The PPO objective and the experience math as pure functions (`rl/objective.py`, `rl/experience.py`,
`rl/forwards.py`), each called directly on tiny hand-made batches and checked against float64 NumPy
written from the definitions (PPO, Schulman et al. 2017; GAE, Schulman et al. 2016)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.config import ConfigError
from ppo_jax.models import init_params
from ppo_jax.models.forward import response_logits, token_logprobs
from ppo_jax.ppo import stats
from ppo_jax.rl import build
from ppo_jax.rl.experience import experience_from_outputs
from ppo_jax.rl.forwards import ForwardOutputs, ResponseRows, padded_forwards
from ppo_jax.rl.objective import LossBatch, TokenOutputs, padded_loss, ppo_loss
from ppo_jax.rl.hyper import PPOHyper
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import Experience, FrozenParams, Rollout, Trainable

from conftest import make_test_mesh
from tiny_configs import tiny_config


def hyper(**overrides) -> PPOHyper:
    fields = dict(temperature=1.0, estimator="gae", gamma=1.0, lam=0.95, whiten_advantages=False,
                  whiten_rewards=False, kl_estimator="k1", kl_in_reward=True, model_weight=1.0, missing_stop="none",
                  missing_stop_value=-1.0, score_gain=1.0, score_bias=0.0, score_clip=0.0, group_size=1, epochs=1,
                  num_minibatches=1, num_microbatches=1, forward_microbatches=1, clip_eps=0.2, clip_eps_high=None,
                  dual_clip=None, value_clip=0.2, vf_coef=0.1, ent_coef=0.01)
    return PPOHyper(**{**fields, **overrides})


# A tiny hand-made microbatch: 2 rows, 4 response positions, a vocabulary of 3; row 1 ends after two tokens.
MASK = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.float32)
LOGITS = np.array([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.5], [-1.0, 3.0, 0.0], [0.0, 1.0, 2.0]],
                   [[1.0, -2.0, 0.0], [0.0, 0.0, 4.0], [9.0, 9.0, 9.0], [9.0, 9.0, 9.0]]], np.float32)
TOKENS = np.array([[0, 2, 1, 2], [0, 2, 0, 0]], np.int32)
OLD_LOGP = np.array([[-0.3, -1.0, -0.5, -0.2], [-0.5, -0.3, 0.0, 0.0]], np.float32)
REF_LOGP = np.array([[-0.4, -1.2, -0.1, -0.5], [-0.6, -0.1, 0.0, 0.0]], np.float32)
ADVANTAGES = np.array([[1.0, -0.5, 2.0, -1.5], [0.7, -2.0, 0.0, 0.0]], np.float32)
VALUES = np.array([[0.1, 0.4, -0.2, 0.9], [0.0, 0.5, 0.0, 0.0]], np.float32)
OLD_VALUES = np.array([[0.0, 0.0, 0.3, 0.5], [0.2, 0.0, 0.0, 0.0]], np.float32)
RETURNS = np.array([[1.0, 0.2, 0.1, 0.6], [-0.3, 1.0, 0.0, 0.0]], np.float32)
NUM_TOKENS = 10.0  # the minibatch's tokens: this microbatch holds 6 of them


def log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


def hand_made_logp():
    """The sampled tokens' log-probs under LOGITS, 0 off the mask (as the forwards give them)."""
    return (np.take_along_axis(log_softmax(LOGITS), TOKENS[..., None], -1)[..., 0] * MASK).astype(np.float32)


def numpy_ppo_loss(logp, kl_in_reward, with_values, clip_eps=0.2, value_clip=0.2, vf_coef=0.1, ent_coef=0.01):
    """Float64: token sums over the mask / NUM_TOKENS of the clipped policy loss, -entropy, k1 KL and
    the clipped value loss 0.5 * max((v - R)^2, (v_clip - R)^2)."""
    m, f64 = MASK.astype(bool), np.float64
    ratio = np.exp(logp.astype(f64) - OLD_LOGP)
    adv = ADVANTAGES.astype(f64)
    policy = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - clip_eps, 1 + clip_eps))
    p = np.exp(log_softmax(LOGITS))
    entropy = -(p * np.log(p)).sum(-1)
    loss = policy[m].sum() / NUM_TOKENS - ent_coef * entropy[m].sum() / NUM_TOKENS
    if not kl_in_reward:
        loss += 0.05 * (logp.astype(f64) - REF_LOGP)[m].sum() / NUM_TOKENS
    if with_values:
        v, old, ret = VALUES.astype(f64), OLD_VALUES.astype(f64), RETURNS.astype(f64)
        clipped = old + np.clip(v - old, -value_clip, value_clip)
        loss += vf_coef * (0.5 * np.maximum((v - ret) ** 2, (clipped - ret) ** 2))[m].sum() / NUM_TOKENS
    return loss, policy[m].mean(), entropy[m].mean()


def microbatch() -> LossBatch:
    b, lq = MASK.shape[0], 2
    exp = Experience(prompt_tokens=np.ones((b, lq), np.int32), prompt_mask=np.ones((b, lq), np.int32),
                     tokens=TOKENS, mask=MASK.astype(np.int32), old_logprobs=OLD_LOGP, ref_logprobs=REF_LOGP,
                     values=OLD_VALUES, advantages=ADVANTAGES * MASK, returns=RETURNS, scores=np.zeros(b, np.float32),
                     sequence_kl=np.zeros(b, np.float32))
    return LossBatch(experience=jax.tree.map(jnp.asarray, exp), num_tokens=jnp.float32(NUM_TOKENS),
                     kl_coef=jnp.float32(0.05))


@pytest.mark.parametrize("kl_in_reward, with_values", [(True, True), (False, True), (True, False)])
def test_ppo_loss_is_the_token_weighted_clipped_policy_value_and_entropy_loss(kl_in_reward, with_values):
    logp = hand_made_logp()
    out = TokenOutputs(logits=jnp.asarray(LOGITS), logprobs=jnp.asarray(logp),
                       values=jnp.asarray(VALUES * MASK) if with_values else None)
    loss, metrics = ppo_loss(out, microbatch(), hyper(kl_in_reward=kl_in_reward))
    expected, policy_mean, entropy_mean = numpy_ppo_loss(logp, kl_in_reward, with_values)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-7)
    final = stats.finalize_metrics(metrics)
    # Metrics are token means over this microbatch's own tokens, whatever num_tokens is.
    np.testing.assert_allclose(float(final["policy_loss"]), policy_mean, rtol=1e-5)
    np.testing.assert_allclose(float(final["entropy"]), entropy_mean, rtol=1e-5)
    assert ("value_loss" in final) == with_values and ("kl_loss" in final) == (not kl_in_reward)


def test_ppo_loss_gradient_is_the_numpy_gradient_of_the_policy_term():
    """d loss / d logp on each real token, by float64 central differences of the NumPy loss (the
    logits held fixed: entropy does not depend on logp)."""
    logp = hand_made_logp()
    batch, hp = microbatch(), hyper()
    grad = jax.grad(lambda lp: ppo_loss(TokenOutputs(jnp.asarray(LOGITS), lp), batch, hp)[0])(jnp.asarray(logp))
    eps = 1e-4
    for i, j in zip(*np.nonzero(MASK)):
        up, down = logp.astype(np.float64), logp.astype(np.float64)
        up[i, j] += eps
        down[i, j] -= eps
        numeric = (numpy_ppo_loss(up, True, False)[0] - numpy_ppo_loss(down, True, False)[0]) / (2 * eps)
        np.testing.assert_allclose(float(grad[i, j]), numeric, rtol=1e-3, atol=1e-6)
    assert not np.any(np.asarray(grad)[MASK == 0])  # padding gets no gradient


def numpy_gae(rewards, values, mask, gamma, lam):
    adv = np.zeros_like(rewards, np.float64)
    for b in range(rewards.shape[0]):
        last, next_value = 0.0, 0.0
        for t in reversed(range(int(mask[b].sum()))):
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t], next_value = last, values[b, t]
    return adv, (adv + values) * mask


def test_experience_from_outputs_shapes_kl_rewards_and_gae_advantages_as_numpy():
    """Per-token rewards -beta * (logp - ref) plus the score at the last real token, then GAE
    (gamma 1, lambda 0.95, no whitening); the missing-stop row gets the replacement score."""
    beta, host = 0.1, np.array([0.5, 2.0], np.float32)
    rollout = Rollout(prompt_tokens=jnp.ones((2, 2), jnp.int32), prompt_mask=jnp.ones((2, 2), jnp.int32),
                      tokens=jnp.asarray(TOKENS), mask=jnp.asarray(MASK, jnp.int32),
                      sampler_logprobs=jnp.asarray(OLD_LOGP * MASK), behaviour_logprobs=jnp.asarray(OLD_LOGP * MASK),
                      stopped=jnp.array([True, False]),
                      host_scores=jnp.asarray(host))
    out = ForwardOutputs(logprobs=jnp.asarray(OLD_LOGP * MASK), ref_logprobs=jnp.asarray(REF_LOGP * MASK),
                         entropy=jnp.zeros(MASK.shape), values=jnp.asarray(VALUES * MASK),
                         scores=jnp.array([1.0, -3.0]))
    exp, metrics = experience_from_outputs(out, rollout, jnp.float32(beta), hyper(missing_stop="replace"))

    scores = np.array([1.0 + 0.5, -1.0])  # model + function scores; row 1 has no stop token: replaced
    kl = (OLD_LOGP - REF_LOGP).astype(np.float64) * MASK
    rewards = -beta * kl
    rewards[0, 3] += scores[0]
    rewards[1, 1] += scores[1]
    advantages, returns = numpy_gae(rewards, VALUES.astype(np.float64) * MASK, MASK, gamma=1.0, lam=0.95)
    np.testing.assert_allclose(np.asarray(exp.scores), scores, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(exp.advantages), advantages * MASK, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(exp.returns), returns, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["objective/kl"]), kl.sum(-1).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["objective/non_score_reward"]), -beta * kl.sum(-1).mean(), rtol=1e-5)


def tiny_run(**overrides):
    s = Settings.from_config(tiny_config(**{"ppo.advantage_estimator": "grpo", "rollout.num_samples": 2,
                                            **overrides}), reward_in_code=False)
    policy_cfg = build.policy_model_config(s)
    modules = build.make_modules(s.ppo, s.value, policy_cfg, None)
    params, _ = init_params(modules.policy, jax.random.key(0), make_test_mesh((1, 1, 1)))
    rng = np.random.default_rng(0)
    b, lq, lr = 4, s.data.prompt_length, s.rollout.response_length
    prompt_mask = (np.arange(lq)[None] >= np.array([[0], [3], [5], [1]])).astype(np.int32)  # left-padded
    mask = (np.arange(lr)[None] < np.array([[lr], [2], [5], [1]])).astype(np.int32)
    rows = ResponseRows(jnp.asarray(rng.integers(0, 32, (b, lq)) * prompt_mask, jnp.int32), jnp.asarray(prompt_mask),
                        jnp.asarray(rng.integers(0, 32, (b, lr)) * mask, jnp.int32), jnp.asarray(mask))
    return s, modules, params, rows


def test_padded_loss_on_its_own_log_probs_has_ratio_one_and_is_minus_the_mean_advantage():
    """The update's first minibatch (DESIGN.md §5): old log-probs from an independent forward at the
    rollout temperature give ratio 1, so the loss (no critic, no entropy, KL in the reward) is
    -sum(A) / num_tokens and nothing is clipped."""
    s, modules, params, rows = tiny_run(**{"rollout.temperature": 0.7})
    hp = hyper(temperature=0.7, ent_coef=0.0, estimator="grpo")
    logits = response_logits(modules.policy, params, rows.prompt_tokens, rows.prompt_mask, rows.tokens, rows.mask, 0.7)
    old = token_logprobs(logits, rows.tokens, rows.mask)
    adv = jnp.asarray(np.random.default_rng(1).normal(size=rows.mask.shape), jnp.float32) * rows.mask
    exp = Experience(prompt_tokens=rows.prompt_tokens, prompt_mask=rows.prompt_mask, tokens=rows.tokens,
                     mask=rows.mask, old_logprobs=old, ref_logprobs=old, values=jnp.zeros_like(old), advantages=adv,
                     returns=jnp.zeros_like(old), scores=jnp.zeros(4), sequence_kl=jnp.zeros(4))
    loss, metrics = padded_loss(modules, Trainable(params, None), FrozenParams(None, None), LossBatch(exp, 20.0, 0.0),
                                hp)
    final = stats.finalize_metrics(metrics)
    np.testing.assert_allclose(float(loss), -np.asarray(adv, np.float64).sum() / 20.0, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(final["ratio"]), 1.0, atol=1e-6)
    assert float(final["clipfrac"]) == 0.0 and abs(float(final["approxkl"])) < 1e-10


def test_padded_forwards_reference_equal_to_the_policy_gives_equal_log_probs_and_scored_outside_runs_no_reference():
    s, modules, params, rows = tiny_run()
    hp = hyper()
    frozen = FrozenParams(reference=params, reward=None)
    out = padded_forwards(modules, Trainable(params, None), frozen, rows, hp)
    mask = np.asarray(rows.mask, bool)
    np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(out.ref_logprobs))
    assert np.all(np.asarray(out.logprobs)[mask] < 0) and not np.any(np.asarray(out.logprobs)[~mask])
    assert np.all(np.asarray(out.entropy)[mask] > 0) and not np.any(np.asarray(out.values))
    outside = padded_forwards(modules, Trainable(params, None), frozen, rows, dataclasses.replace(hp, scored_outside=True))
    np.testing.assert_array_equal(np.asarray(outside.logprobs), np.asarray(out.logprobs))
    assert not np.any(np.asarray(outside.ref_logprobs)) and not np.any(np.asarray(outside.scores))


def test_a_non_finite_gradient_leaves_the_train_state_exactly_as_it_was():
    """The update's guard: a finite experience whose loss is NaN (one NaN weight in the policy) gives
    NaN gradients; the optimizer step is skipped, parameters and optimizer state stay bit for bit,
    and the metrics say so (the guard reads the gradient norms)."""
    from ppo_jax.rl.state import PPOState
    from ppo_jax.rl.update import make_update_fn

    s, modules, params, rows = tiny_run(**{"optim.policy_lr": 1e-2})
    hp = hyper(estimator="grpo", num_minibatches=2)
    first_mlp = next(path for path in jax.tree_util.tree_leaves_with_path(params) if "mlp" in jax.tree_util.keystr(path[0]))
    broken = jax.tree_util.tree_map_with_path(
        lambda path, x: x.at[(0,) * x.ndim].set(jnp.nan) if path == first_mlp[0] else x, params)
    policy_tx, _ = build.make_optimizers(s)
    state = PPOState(step=jnp.zeros((), jnp.int32), policy=broken, policy_opt=policy_tx.init(broken), value=None,
                       value_opt=None, kl=build.init_kl(s.ppo), key=jax.random.key(0))
    zeros = jnp.zeros(rows.mask.shape, jnp.float32)
    exp = Experience(prompt_tokens=rows.prompt_tokens, prompt_mask=rows.prompt_mask, tokens=rows.tokens, mask=rows.mask,
                     old_logprobs=zeros - 1.0, ref_logprobs=zeros - 1.0, values=zeros, advantages=zeros + rows.mask,
                     returns=zeros, scores=jnp.zeros(4), sequence_kl=jnp.zeros(4))
    update = jax.jit(make_update_fn(modules, policy_tx, None, hp, 4, None))
    before = jax.device_get((state.policy, state.policy_opt))
    new, metrics = update(state, FrozenParams(reference=None, reward=None), exp)
    after = jax.device_get((new.policy, new.policy_opt))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)  # NaN == NaN here: the NaN weight is the one we put in
    assert float(metrics["nonfinite/skipped_minibatches"]) == 2
    assert int(new.step) == 1  # the iteration counts; only the optimizer steps were skipped


# The off-policy correction (issue 44 items 3 and 6): weights pi_current / pi_behaviour of the tokens
# as sampled, the behaviour being the distribution actually sampled (top-k / top-p truncated).
BEHAVIOUR_LOGP = np.array([[-0.1, -2.0, -0.5, -1.5], [-1.9, -0.3, -4.0, -4.0]], np.float32)  # row 1 ends at 2
FULL_LOGP = BEHAVIOUR_LOGP - 0.7  # the full tempered distribution: truncation only lowers a token's log-prob


def off_policy_rollout():
    return Rollout(prompt_tokens=jnp.ones((2, 2), jnp.int32), prompt_mask=jnp.ones((2, 2), jnp.int32),
                   tokens=jnp.asarray(TOKENS), mask=jnp.asarray(MASK, jnp.int32),
                   sampler_logprobs=jnp.asarray(FULL_LOGP * MASK), behaviour_logprobs=jnp.asarray(BEHAVIOUR_LOGP * MASK),
                   stopped=jnp.array([True, True]), host_scores=jnp.asarray([0.5, 2.0], jnp.float32))


def test_truncated_is_weights_the_policy_gradient_by_the_capped_ratio_to_the_sampled_distribution():
    """Per token w = exp(logp_current - logp_behaviour) (current over behaviour, not the reverse), with
    the behaviour's log-probs those of the distribution sampled (not the full one, which the rollout
    carries for the mismatch metric only); capped at is_cap exactly; the advantages are multiplied by
    it and nothing else: the ratio's log-probs stay the current ones and the returns (value targets)
    are the uncorrected ones. Masked tokens have no weight in any metric."""
    cap = 1.5
    rollout = off_policy_rollout()
    out = ForwardOutputs(logprobs=jnp.asarray(OLD_LOGP * MASK), ref_logprobs=jnp.asarray(REF_LOGP * MASK),
                         entropy=jnp.zeros(MASK.shape), values=jnp.asarray(VALUES * MASK), scores=jnp.array([1.0, -3.0]))
    on_policy, _ = experience_from_outputs(out, rollout, jnp.float32(0.1), hyper())
    corrected, metrics = experience_from_outputs(out, rollout, jnp.float32(0.1),
                                                 hyper(off_policy_ratio="truncated_is", is_cap=cap))
    w = np.exp(OLD_LOGP.astype(np.float64) - BEHAVIOUR_LOGP)
    assert (w[MASK > 0] > cap).any() and (w[MASK > 0] < 1).any()  # the cap and the other side both tested
    capped = np.minimum(w, cap)
    np.testing.assert_allclose(np.asarray(corrected.advantages), np.asarray(on_policy.advantages) * capped * MASK,
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(corrected.old_logprobs), np.asarray(on_policy.old_logprobs))
    np.testing.assert_array_equal(np.asarray(corrected.returns), np.asarray(on_policy.returns))
    real = MASK > 0
    np.testing.assert_allclose(float(metrics["off_policy/is_weight_mean"]), w[real].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["off_policy/is_weight_max"]), w[real].max(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["rollout/truncated_frac"]), (w[real] > cap).mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["rollout/mismatch_kl"]), (w[real] - 1 - np.log(w[real])).mean(), rtol=1e-5)


def test_behaviour_ratio_divides_by_the_sampled_distributions_log_probs():
    """off_policy_ratio="behaviour": the PPO ratio's denominator is the behaviour's log-prob of each
    token under the distribution it was drawn from, 0 on masked tokens, and no advantage weight."""
    rollout = off_policy_rollout()
    out = ForwardOutputs(logprobs=jnp.asarray(OLD_LOGP * MASK), ref_logprobs=jnp.asarray(REF_LOGP * MASK),
                         entropy=jnp.zeros(MASK.shape), values=jnp.asarray(VALUES * MASK), scores=jnp.array([1.0, -3.0]))
    on_policy, _ = experience_from_outputs(out, rollout, jnp.float32(0.1), hyper())
    exp, _ = experience_from_outputs(out, rollout, jnp.float32(0.1), hyper(off_policy_ratio="behaviour"))
    np.testing.assert_array_equal(np.asarray(exp.old_logprobs), BEHAVIOUR_LOGP * MASK)
    np.testing.assert_array_equal(np.asarray(exp.advantages), np.asarray(on_policy.advantages))


def test_the_adaptive_kl_controller_reads_the_kl_of_the_policy_being_updated():
    """Off-policy with the "behaviour" ratio, the experience's old log-probs are the stale sampler's;
    the controller must step on the KL of the policy about to be updated (what the rewards were
    shaped with), Ziegler et al.'s rule written out here: beta * (1 + clip(KL / target - 1, ±0.2) * n / H)."""
    from ppo_jax import ppo
    from ppo_jax.rl.state import PPOState
    from ppo_jax.rl.update import step_kl_controller

    rollout = off_policy_rollout()
    out = ForwardOutputs(logprobs=jnp.asarray(OLD_LOGP * MASK), ref_logprobs=jnp.asarray(REF_LOGP * MASK),
                         entropy=jnp.zeros(MASK.shape), values=jnp.asarray(VALUES * MASK), scores=jnp.array([1.0, -3.0]))
    exp, _ = experience_from_outputs(out, rollout, jnp.float32(0.1), hyper(off_policy_ratio="behaviour"))
    beta, target, horizon, rows = 0.1, 0.04, 100.0, 2
    state = PPOState(step=jnp.zeros((), jnp.int32), policy=None, policy_opt=None, value=None, value_opt=None,
                     kl=ppo.init_kl_controller("adaptive", beta, target=target, horizon=horizon), key=jax.random.key(0))
    new = step_kl_controller(state, exp, jnp.array(True), rows)
    current_kl = ((OLD_LOGP - REF_LOGP).astype(np.float64) * MASK).sum(-1).mean()  # k1 of the current policy
    stale_kl = ((BEHAVIOUR_LOGP - REF_LOGP).astype(np.float64) * MASK).sum(-1).mean()
    expected = beta * (1 + np.clip(current_kl / target - 1, -0.2, 0.2) * rows / horizon)
    assert abs(np.clip(stale_kl / target - 1, -0.2, 0.2) - np.clip(current_kl / target - 1, -0.2, 0.2)) > 0.05
    np.testing.assert_allclose(float(new.kl.coef), expected, rtol=1e-6)
    assert int(new.step) == 1


def test_the_overlong_penalty_lowers_the_score_and_the_health_metrics_are_logged():
    """reward.overlong_buffer=2 over a 4-token budget: the full row (4 tokens, stopped) loses the whole
    penalty, the 2-token row nothing; the rollout's health metrics read the same KL as objective/kl."""
    rollout = Rollout(prompt_tokens=jnp.ones((2, 2), jnp.int32), prompt_mask=jnp.ones((2, 2), jnp.int32),
                      tokens=jnp.asarray(TOKENS), mask=jnp.asarray(MASK, jnp.int32),
                      sampler_logprobs=jnp.asarray(OLD_LOGP * MASK), behaviour_logprobs=jnp.asarray(OLD_LOGP * MASK),
                      stopped=jnp.array([True, True]), host_scores=jnp.zeros(2))
    out = ForwardOutputs(logprobs=jnp.asarray(OLD_LOGP * MASK), ref_logprobs=jnp.asarray(REF_LOGP * MASK),
                         entropy=jnp.zeros(MASK.shape), values=jnp.asarray(VALUES * MASK), scores=jnp.array([1.0, -3.0]))
    exp, metrics = experience_from_outputs(out, rollout, jnp.float32(0.1),
                                           hyper(overlong_buffer=2, overlong_penalty=0.7))
    np.testing.assert_allclose(np.asarray(exp.scores), [1.0 - 0.7, -3.0], rtol=1e-6)
    kl = (OLD_LOGP - REF_LOGP).astype(np.float64) * MASK
    np.testing.assert_allclose(float(metrics["objective/kl_max"]), kl.sum(-1).max(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["objective/kl_at_stop_token"]), (kl[0, 3] + kl[1, 1]) / 2, rtol=1e-5)
    assert float(metrics["response/repeated_token_share"]) == 0.0  # TOKENS hold no back-to-back repeat


def test_dense_kl_coef_adds_the_whole_vocabulary_kl_to_the_reference_at_the_visited_positions():
    """With ppo.dense_kl_coef the update runs the reference forward too: the loss grows by
    coef * sum over real response tokens of KL(pi || pi_ref) / num_tokens, computed here in NumPy from
    two independent response_logits calls (policy and a differently initialised reference)."""
    s, modules, params, rows = tiny_run()
    ref_params, _ = init_params(modules.policy, jax.random.key(1), make_test_mesh((1, 1, 1)))
    logits = response_logits(modules.policy, params, rows.prompt_tokens, rows.prompt_mask, rows.tokens, rows.mask, 1.0)
    ref_logits = response_logits(modules.policy, ref_params, rows.prompt_tokens, rows.prompt_mask, rows.tokens,
                                 rows.mask, 1.0)
    old = token_logprobs(logits, rows.tokens, rows.mask)
    zeros = jnp.zeros_like(old)
    exp = Experience(prompt_tokens=rows.prompt_tokens, prompt_mask=rows.prompt_mask, tokens=rows.tokens,
                     mask=rows.mask, old_logprobs=old, ref_logprobs=old, values=zeros, advantages=zeros,
                     returns=zeros, scores=jnp.zeros(4), sequence_kl=jnp.zeros(4))
    frozen, batch = FrozenParams(reference=ref_params, reward=None), LossBatch(exp, 20.0, 0.0)
    plain, _ = padded_loss(modules, Trainable(params, None), frozen, batch, hyper(ent_coef=0.0))
    with_kl, metrics = padded_loss(modules, Trainable(params, None), frozen, batch, hyper(ent_coef=0.0, dense_kl_coef=0.5))
    p, q = log_softmax(np.asarray(logits)), log_softmax(np.asarray(ref_logits))
    per_token = (np.exp(p) * (p - q)).sum(-1)
    mask = np.asarray(rows.mask, bool)
    assert per_token[mask].min() > 0
    np.testing.assert_allclose(float(with_kl) - float(plain), 0.5 * per_token[mask].sum() / 20.0, rtol=1e-4)
    np.testing.assert_allclose(float(stats.finalize_metrics(metrics)["dense_kl"]), per_token[mask].mean(), rtol=1e-4)
    assert "dense_kl" not in stats.finalize_metrics(padded_loss(modules, Trainable(params, None), frozen, batch,
                                                                hyper(ent_coef=0.0))[1])


@pytest.mark.parametrize("overrides,message", [
    ({"ppo.dense_kl_coef": -0.1}, "ppo.dense_kl_coef must be >= 0 (0 = off), got -0.1"),
    ({"ppo.dense_kl_coef": 0.1, "roles.scoring": "sampler", "roles.sampler_devices": 4},
     "ppo.dense_kl_coef needs the reference on the trainer's mesh"),
])
def test_bad_dense_kl_settings_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        Settings.from_config(tiny_config(**overrides), reward_in_code=False)
    assert "\n" not in str(err.value)
