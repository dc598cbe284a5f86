"""The experience phase: every forward over the rollout (policy, reference, value, reward model),
scores, per-token KL-shaped rewards and advantages, as one pure function. The forwards are
`rl/forwards.py`'s; `experience_from_outputs` is the math on their outputs; `make_experience_fn`
wires the two over a whole rollout (row slices, or packed microbatches).

Shapes: B rollout rows (prompts x samples), Lq prompt length, Lr response length, V vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from ppo_jax import ppo, sampling
from ppo_jax.models import packing
from ppo_jax.ppo.action_mask import action_rewards
from ppo_jax.ppo.diagnostics import response_diagnostics
from ppo_jax.rl.corrections import off_policy_correction, policy_lag_metrics
from ppo_jax.rl.forwards import (ForwardOutputs, ResponseRows, microbatched, packed_forwards, packed_scores,
                                 padded_forwards, run_packed, score_responses)
from ppo_jax.rl.router_replay import routing_mismatch
from ppo_jax.rl.hyper import PPOHyper
from ppo_jax.rl.state import Experience, FrozenParams, Modules, Rollout, PPOState, Trainable


def explained_variance(values, returns, mask):
    var_returns = ppo.masked_var(returns, mask)
    return 1.0 - ppo.masked_var(returns - values, mask) / jnp.maximum(var_returns, 1e-8)


def experience_from_outputs(out: ForwardOutputs, rollout: Rollout, kl_coef: jax.Array, hp: PPOHyper,
                            step: jax.Array | None = None) -> tuple[Experience, dict[str, jax.Array]]:
    """The models' outputs over the rollout [B, Lr] -> (Experience, metrics): scores, per-token
    KL-shaped rewards, advantages and returns, the rollout correction (`rl/corrections.py`: it
    weights the advantages, the policy-gradient term's only input). kl_coef: the KL controller's
    beta []; step: the train step being updated [] (the policy lag of a rollout stamped with the
    versions that sampled it)."""
    mask = rollout.mask.astype(jnp.float32)
    if rollout.action_mask is not None:
        # Multi-turn rows: the forwards read the observations as context; everything trained on or
        # logged per token (log-probs, KL, rewards, GAE, losses) reads the policy's tokens only.
        mask = rollout.action_mask.astype(jnp.float32)
        out = out.replace(logprobs=out.logprobs * mask, ref_logprobs=out.ref_logprobs * mask,
                          entropy=out.entropy * mask, values=out.values * mask)
    raw_scores = hp.model_weight * out.scores + rollout.host_scores
    scores = ppo.process_scores(
        raw_scores, rollout.stopped, missing_stop=hp.missing_stop,
        missing_stop_value=hp.missing_stop_value, gain=hp.score_gain, bias=hp.score_bias,
        clip=hp.score_clip or None)
    if hp.overlong_buffer:
        scores = scores - ppo.overlong_penalty(mask.sum(-1), rollout.stopped, max_length=mask.shape[-1],
                                               buffer=hp.overlong_buffer, penalty=hp.overlong_penalty)
    kl = ppo.kl_penalty(out.logprobs, out.ref_logprobs, hp.kl_estimator) * mask
    reward_kl_coef = kl_coef if hp.kl_in_reward else jnp.zeros((), jnp.float32)
    turns = rollout.turns
    if turns is None:
        rewards = ppo.shape_rewards(scores, kl, mask, reward_kl_coef)
    else:  # each turn's environment reward on its last action token, the score on the last one
        rewards = action_rewards(scores, kl, mask, reward_kl_coef, turns.rewards, turns.ends)
    # GRPO's and RLOO's sequence reward is the episode's: the score plus every turn's environment reward.
    episode_scores = scores if turns is None else scores + turns.rewards.sum(-1)
    teacher_kl = None
    if out.teacher_logprobs is not None:  # on-policy distillation: minus the reverse KL to the teacher, per token
        teacher_kl = distillation_kl(out.logprobs, out.teacher_logprobs, mask)
        rewards = rewards - hp.teacher_coef * teacher_kl
        episode_scores = episode_scores - hp.teacher_coef * teacher_kl.sum(-1)
    if hp.whiten_rewards:
        rewards = ppo.masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = ppo.estimate_advantages(
        hp.estimator, rewards=rewards, values=out.values, mask=mask, scores=episode_scores, kl=kl,
        kl_coef=reward_kl_coef, group_size=hp.group_size, gamma=hp.gamma, lam=hp.lam,
        # Critic-free estimators normalise in their own way (group or batch statistics).
        whiten=hp.whiten_advantages if hp.estimator == "gae" else None, divide_by_std=hp.grpo_divide_by_std)
    correction = off_policy_correction(hp.off_policy_ratio, hp.is_cap, out.logprobs, rollout.behaviour_logprobs, mask)
    exp = Experience(
        prompt_tokens=rollout.prompt_tokens, prompt_mask=rollout.prompt_mask,
        tokens=rollout.tokens, mask=rollout.mask, old_logprobs=correction.ratio_logprobs,
        ref_logprobs=out.ref_logprobs, values=out.values, advantages=advantages * correction.pg_weights * mask,
        returns=returns * mask, scores=scores,
        sequence_kl=kl.sum(-1), routed_experts=rollout.routed_experts, action_mask=rollout.action_mask,
        sequence_entropy=(out.entropy * mask).sum(-1), ref_vocab_logprobs=out.ref_vocab_logprobs)
    non_score = -(kl_coef * kl).sum(-1)
    metrics = {
        "objective/scores": scores.mean(),
        "objective/raw_scores": raw_scores.mean(),
        "objective/model_scores": out.scores.mean(),
        "objective/function_scores": rollout.host_scores.mean(),
        "objective/kl": kl.sum(-1).mean(),
        "objective/kl_coef": kl_coef,
        "objective/entropy": (out.entropy * mask).sum(-1).mean(),
        "objective/non_score_reward": non_score.mean(),
        "objective/rlhf_reward": (scores + non_score).mean(),
        **rollout_metrics(out, rollout, mask),
        **response_diagnostics(rollout.tokens, mask, rollout.stopped, kl, out.logprobs),
        "advantages/mean": ppo.masked_mean(advantages, mask),
        "advantages/std": jnp.sqrt(ppo.masked_var(advantages, mask)),
        "returns/mean": ppo.masked_mean(returns, mask),
        "returns/std": jnp.sqrt(ppo.masked_var(returns, mask)),
        **correction.metrics,
        **({} if step is None else policy_lag_metrics(step, rollout.policy_version, rollout.token_policy_version, mask)),
    }
    if teacher_kl is not None:  # the student's reverse KL to the teacher per response, and per token
        metrics["objective/teacher_kl"] = teacher_kl.sum(-1).mean()
        metrics["objective/teacher_kl_per_token"] = ppo.masked_mean(teacher_kl, mask)
    if turns is not None:  # multi-turn: what the environments paid, per episode
        metrics["objective/environment_rewards"] = turns.rewards.sum(-1).mean()
    if hp.uses_critic:
        metrics.update({
            "values/mean": ppo.masked_mean(out.values, mask),
            "values/std": jnp.sqrt(ppo.masked_var(out.values, mask)),
            "val/explained_variance": explained_variance(out.values, returns, mask),
        })
    return exp, metrics


def distillation_kl(logprobs: jax.Array, teacher_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """[B, Lr] the per-token estimate of the student's reverse KL to the teacher on the student's own
    samples, log pi(y_t) - log pi_teacher(y_t) (GKD, Agarwal et al. 2024, eq. 4 with the
    reverse-KL divergence; the on-policy distillation recipe's per-token reward is its negative), 0 off `mask`."""
    return (logprobs - teacher_logprobs) * mask


def rollout_metrics(out: ForwardOutputs, rollout: Rollout, mask: jax.Array) -> dict[str, jax.Array]:
    """Response lengths and stops, and how far the sampler's log-probs are from the training forward's."""
    lengths = mask.sum(-1)
    return {
        "val/num_eos_tokens": rollout.stopped.sum().astype(jnp.float32),
        "val/eos_rate": rollout.stopped.mean(),
        "response/length_mean": lengths.mean(),
        "response/length_p50": jnp.quantile(lengths, 0.5),
        "response/length_p90": jnp.quantile(lengths, 0.9),
        "response/length_max": lengths.max(),
        "policy/rollout_logprob_diff_max": jnp.abs(out.logprobs - rollout.sampler_logprobs * mask).max(),
        "policy/rollout_logprob_diff_mean": ppo.masked_mean(jnp.abs(out.logprobs - rollout.sampler_logprobs), mask),
        # What top-k / top-p / min_new_tokens truncation did to the sampled distribution (1 and 0 without).
        **sampling.truncation_metrics(rollout.sampler_logprobs, rollout.behaviour_logprobs, mask),
        **routing_mismatch(out.routing_flips, mask),
    }


def response_rows(rollout: Rollout) -> ResponseRows:
    return ResponseRows(rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens, rollout.mask,
                        rollout.routed_experts)


def make_experience_fn(modules: Modules, hp: PPOHyper, batch_sharding: NamedSharding | None = None) -> Callable:
    """Pure experience function: (state, frozen, rollout) -> (Experience, metrics).

    With `hp.packed` the forwards run on packed rows (`models/packing.py`), only on the microbatches
    that hold tokens, and their outputs are read back into the padded [B, Lr] layout the rest of the
    step works in. batch_sharding: how a packed microbatch's rows split over the mesh (None: no
    constraint, e.g. one device). With hp.scored_outside the reference log-probs and model scores
    come with the rollout (the sampler's mesh computed them: roles.scoring).
    """

    def packed(params: Trainable, frozen: FrozenParams, rows: packing.PackedRows):
        if batch_sharding is not None:
            rows = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, batch_sharding), rows)
        out = packed_forwards(modules, params, frozen, rows, hp)
        return out.replace(scores=None), out.scores

    def experience(state: PPOState, frozen: FrozenParams, rollout: Rollout):
        params, rows = Trainable(state.policy, state.value), response_rows(rollout)
        if hp.packed:
            out, scores, layout = run_packed(functools.partial(packed, params, frozen), rows, hp)
            out, efficiency = out.replace(scores=scores), layout.token_efficiency
        else:
            out = microbatched(lambda r: padded_forwards(modules, params, frozen, r, hp), hp.forward_microbatches, rows)
            efficiency = packing.padded_token_efficiency(rollout.prompt_mask, rollout.mask)
        if hp.scored_outside:
            out = out.replace(ref_logprobs=rollout.frozen_outputs.ref_logprobs,
                              scores=rollout.frozen_outputs.model_scores)
        exp, metrics = experience_from_outputs(out, rollout, state.kl.coef, hp, step=state.step)
        return exp, {**metrics, "perf/experience_token_efficiency": efficiency}

    return experience


def make_scoring_fn(modules: Modules, hp: PPOHyper) -> Callable:
    """Pure scoring of given responses by the frozen models: (frozen, prompt_tokens, prompt_mask,
    tokens, mask) -> (reference log-probs [B, Lr] under the rollout temperature, the reward model's
    raw scores [B], before gain and bias as the experience step takes them; 0 without a reward
    model). The reference and reward forwards of the experience step (packed when it is): its scorer
    with roles.scoring="sampler", and evaluation outside the training loop."""

    def score(frozen: FrozenParams, prompt_tokens, prompt_mask, tokens, mask):
        rows = ResponseRows(prompt_tokens, prompt_mask, tokens, mask)
        if not hp.packed:
            return score_responses(modules, frozen, rows, hp)
        ref_logp, scores, _ = run_packed(lambda r: packed_scores(modules, frozen, r, hp), rows, hp)
        return ref_logp, scores

    return score
