"""The experience phase: every forward over the rollout (policy, reference, value, reward model),
scores, per-token KL-shaped rewards and advantages, as one pure function.

Shapes: B rollout rows (prompts x samples), Lq prompt length, Lr response length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax.sharding import NamedSharding

from ppo_jax import ppo
from ppo_jax.models import packing
from ppo_jax.models.forward import (response_logits, response_scores, response_values, sequence_inputs,
                                    token_logprobs)
from ppo_jax.models.transformer import CausalLM, ScalarModel
from ppo_jax.rl.settings import PPOHyper
from ppo_jax.rl.state import (Experience, FrozenParams, Rollout, TrainState, policy_variables, reference_variables,
                              value_variables)

def microbatched(fn: Callable, num_chunks: int, *args):
    """Applies fn to `num_chunks` row slices with lax.map and stitches the results back.

    Rows are dealt round-robin (chunk i = rows i, i + n, ...), so with a batch-sharded input every
    chunk still spans all data-parallel devices instead of landing on a few of them.
    """
    if num_chunks == 1:
        return fn(*args)

    def split(x):
        x = x.reshape((x.shape[0] // num_chunks, num_chunks) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    def merge(x):
        x = jnp.swapaxes(x, 0, 1)
        return x.reshape((-1,) + x.shape[2:])

    out = jax.lax.map(lambda chunk: fn(*chunk), jax.tree.map(split, args))
    return jax.tree.map(merge, out)


def packed_outputs(forward: Callable, hp: PPOHyper, prompt_tokens, prompt_mask, tokens, mask):
    """Runs `forward` on the padded rows packed (`models/packing.py`), only on the microbatches
    holding tokens. forward(PackedRows [M, T]) -> (per-slot outputs..., per-slot scores), each
    [M, T]; returns (the per-slot outputs read at each response token's prediction slot, each
    [B, Lr], 0 on padding), the scores read at each row's last real token [B], and the Packing."""
    seq, _, seq_mask = sequence_inputs(prompt_tokens, prompt_mask, tokens, mask)
    layout = packing.plan(seq_mask, hp.packed_shape(seq.shape[0]))
    *per_slot, slot_scores = packing.map_used(forward, layout.microbatches_used, packing.pack_rows(seq, layout))
    slots = packing.prediction_slots(layout, prompt_tokens.shape[1], mask)
    scores = packing.gather(slot_scores, packing.last_slots(layout, seq_mask))[:, 0]
    return tuple(packing.gather(x, slots) for x in per_slot), scores, layout


# ----------------------------------------------------------------------------------------------
# Experience.

def explained_variance(values, returns, mask):
    var_returns = ppo.masked_var(returns, mask)
    return 1.0 - ppo.masked_var(returns - values, mask) / jnp.maximum(var_returns, 1e-8)


def off_policy_correction(hp: PPOHyper, logp, behaviour_logp, mask):
    """How the update corrects for rollouts sampled by older weights (rollout.off_policy_steps=1):
    (the log-probs the PPO ratio divides by [B, Lr], per-token advantage weights [B, Lr], metrics).

    logp: the recomputed log-probs of the weights about to be updated; behaviour_logp: the sampler's
    (the weights one update older). On-policy both are the same weights: the recomputed log-probs and
    weight 1. "behaviour": the ratio to the behaviour policy itself, so PPO's clip bounds the step
    from the policy that sampled. "truncated_is" (decoupled PPO, Hilton et al. 2021; the async peers'
    truncated importance sampling): the ratio to the recomputed policy, which keeps ratio == 1 on the
    first minibatch, and each token's advantage weighted by min(pi / pi_behaviour, is_cap), a
    constant of the update. Weighting the advantage equals weighting the token's clipped loss (the
    weight is positive), and leaves the value targets alone.
    """
    ones = jnp.ones_like(logp)
    if not hp.off_policy_ratio:
        return logp, ones, {}
    log_w = (logp - behaviour_logp) * mask
    weights = jnp.exp(log_w)
    metrics = {
        # k1 estimate of KL(behaviour || current) per token, under the behaviour's samples.
        "off_policy/behaviour_kl": ppo.masked_mean(-log_w, mask),
        "off_policy/is_weight_mean": ppo.masked_mean(weights, mask),
        "off_policy/is_weight_max": (weights * mask).max(),
        "off_policy/is_truncated_frac": ppo.masked_mean((weights > hp.is_cap).astype(jnp.float32), mask),
    }
    if hp.off_policy_ratio == "behaviour":
        return behaviour_logp * mask, ones, metrics
    return logp, jax.lax.stop_gradient(jnp.minimum(weights, hp.is_cap)), metrics


def make_experience_fn(policy_model: CausalLM, value_model: ScalarModel | None,
                       reward_model: ScalarModel | None, hp: PPOHyper,
                       batch_sharding: NamedSharding | None = None) -> Callable:
    """Pure experience function: (state, frozen, rollout) -> (Experience, metrics).

    With `hp.packed` the forwards run on packed rows (`models/packing.py`), only on the microbatches
    that hold tokens, and their outputs are read back into the padded [B, Lr] layout the rest of the
    step works in. batch_sharding: how a packed microbatch's rows split over the mesh (None: no
    constraint, e.g. one device).
    """

    def forwards(policy, base, reference, value, value_base, reward, pt, pm, tokens, mask):
        params, adapters = policy_variables(policy, base)
        logits = response_logits(policy_model, params, pt, pm, tokens, mask, hp.temperature, adapters=adapters)
        old_logp = token_logprobs(logits, tokens, mask)
        entropy = ppo.entropy_from_logits(logits, mask)
        ref_logp = jnp.zeros(tokens.shape, jnp.float32)  # scored on the sampler's mesh (roles.scoring)
        if reference is not None:
            ref_params, ref_adapters = reference
            ref_logits = response_logits(policy_model, ref_params, pt, pm, tokens, mask, hp.temperature,
                                         adapters=ref_adapters)
            ref_logp = token_logprobs(ref_logits, tokens, mask)
        value_params, value_adapters = value_variables(value, value_base)
        values = (response_values(value_model, value_params, pt, pm, tokens, mask, adapters=value_adapters)
                  if value is not None else jnp.zeros(tokens.shape, jnp.float32))
        scores = (response_scores(reward_model, reward, pt, pm, tokens, mask) if reward is not None
                  else jnp.zeros(tokens.shape[:1], jnp.float32))
        return old_logp, ref_logp, entropy, values, scores

    def packed_forwards(policy, base, reference, value, value_base, reward, rows: packing.PackedRows):
        """`forwards` on one packed microbatch [M, T]: per-slot outputs (slot t predicts t + 1) and
        the reward model's per-slot scores, read at the right slots by the caller."""
        if batch_sharding is not None:
            rows = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, batch_sharding), rows)
        params, adapters = policy_variables(policy, base)
        logits = packing.next_token_logits(policy_model, params, rows, hp.temperature, adapters)
        logp = packing.next_token_logprobs(logits, rows.tokens)
        entropy = ppo.entropy_from_logits(logits)
        ref_logp = jnp.zeros(rows.tokens.shape, jnp.float32)
        if reference is not None:
            ref_params, ref_adapters = reference
            ref_logp = packing.next_token_logprobs(
                packing.next_token_logits(policy_model, ref_params, rows, hp.temperature, ref_adapters), rows.tokens)
        value_params, value_adapters = value_variables(value, value_base)
        values = (packing.scalar_outputs(value_model, value_params, rows, value_adapters)
                  if value is not None else jnp.zeros(rows.tokens.shape, jnp.float32))
        rewards = (packing.scalar_outputs(reward_model, reward, rows) if reward is not None
                   else jnp.zeros(rows.tokens.shape, jnp.float32))
        return logp, ref_logp, entropy, values, rewards

    def run_forwards(state: TrainState, frozen: FrozenParams, rollout: Rollout):
        """(old_logp, ref_logp, entropy, values) [B, Lr], model scores [B], token efficiency [].
        With hp.scored_outside the reference log-probs and model scores come with the rollout (the
        sampler's mesh computed them: roles.scoring) and only the policy and value forwards run."""
        scored = hp.scored_outside
        models = (state.policy, frozen.policy, None if scored else reference_variables(frozen), state.value,
                  frozen.value, None if scored else frozen.reward)
        if not hp.packed:
            outputs = microbatched(lambda *a: forwards(*models, *a), hp.forward_microbatches,
                                   rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens, rollout.mask)
            efficiency = packing.padded_token_efficiency(rollout.prompt_mask, rollout.mask)
        else:
            (logp, ref_logp, entropy, values), scores, layout = packed_outputs(
                lambda rows: packed_forwards(*models, rows), hp, rollout.prompt_tokens, rollout.prompt_mask,
                rollout.tokens, rollout.mask)
            outputs, efficiency = (logp, ref_logp, entropy, values, scores), layout.token_efficiency
        if scored:
            logp, _, entropy, values, _ = outputs
            outputs = (logp, rollout.ref_logprobs, entropy, values, rollout.model_scores)
        return outputs, efficiency

    def experience(state: TrainState, frozen: FrozenParams, rollout: Rollout):
        mask = rollout.mask.astype(jnp.float32)
        (old_logp, ref_logp, entropy, values, model_scores), token_efficiency = run_forwards(state, frozen, rollout)
        raw_scores = hp.model_weight * model_scores + rollout.host_scores
        scores = ppo.process_scores(
            raw_scores, rollout.stopped, missing_stop=hp.missing_stop,
            missing_stop_value=hp.missing_stop_value, gain=hp.score_gain, bias=hp.score_bias,
            clip=hp.score_clip or None)
        kl = ppo.kl_penalty(old_logp, ref_logp, hp.kl_estimator) * mask
        kl_coef = state.kl.coef if hp.kl_in_reward else jnp.zeros((), jnp.float32)
        rewards = ppo.shape_rewards(scores, kl, mask, kl_coef)
        if hp.whiten_rewards:
            rewards = ppo.masked_whiten(rewards, mask, shift_mean=False)
        adv = ppo.estimate_advantages(
            hp.estimator, rewards=rewards, values=values, mask=mask, scores=scores, kl=kl,
            kl_coef=kl_coef, group_size=hp.group_size, gamma=hp.gamma, lam=hp.lam,
            # Critic-free estimators normalise in their own way (group or batch statistics).
            whiten=hp.whiten_advantages if hp.estimator == "gae" else None)
        advantages, returns = adv
        ratio_logp, is_weights, off_policy_metrics = off_policy_correction(hp, old_logp, rollout.sampler_logprobs, mask)
        exp = Experience(
            prompt_tokens=rollout.prompt_tokens, prompt_mask=rollout.prompt_mask,
            tokens=rollout.tokens, mask=rollout.mask, old_logprobs=ratio_logp, ref_logprobs=ref_logp,
            values=values, advantages=advantages * is_weights * mask, returns=returns * mask, scores=scores)

        lengths = mask.sum(-1)
        seq_kl = kl.sum(-1)
        non_score = -(state.kl.coef * kl).sum(-1)
        metrics = {
            "objective/scores": scores.mean(),
            "objective/raw_scores": raw_scores.mean(),
            "objective/model_scores": model_scores.mean(),
            "objective/function_scores": rollout.host_scores.mean(),
            "objective/kl": seq_kl.mean(),
            "objective/kl_coef": state.kl.coef,
            "objective/entropy": (entropy * mask).sum(-1).mean(),
            "objective/non_score_reward": non_score.mean(),
            "objective/rlhf_reward": (scores + non_score).mean(),
            "val/num_eos_tokens": rollout.stopped.sum().astype(jnp.float32),
            "val/eos_rate": rollout.stopped.mean(),
            "response/length_mean": lengths.mean(),
            "response/length_p50": jnp.quantile(lengths, 0.5),
            "response/length_p90": jnp.quantile(lengths, 0.9),
            "response/length_max": lengths.max(),
            "perf/experience_token_efficiency": token_efficiency,
            "policy/rollout_logprob_diff_max": jnp.abs(old_logp - rollout.sampler_logprobs * mask).max(),
            "policy/rollout_logprob_diff_mean": ppo.masked_mean(jnp.abs(old_logp - rollout.sampler_logprobs), mask),
            "advantages/mean": ppo.masked_mean(advantages, mask),
            "advantages/std": jnp.sqrt(ppo.masked_var(advantages, mask)),
            "returns/mean": ppo.masked_mean(returns, mask),
            "returns/std": jnp.sqrt(ppo.masked_var(returns, mask)),
        }
        metrics.update(off_policy_metrics)
        if hp.uses_critic:
            metrics.update({
                "values/mean": ppo.masked_mean(values, mask),
                "values/std": jnp.sqrt(ppo.masked_var(values, mask)),
                "val/explained_variance": explained_variance(values, returns, mask),
            })
        return exp, metrics

    return experience



def make_scoring_fn(policy_model: CausalLM, reward_model: ScalarModel | None, hp: PPOHyper) -> Callable:
    """Pure scoring of given responses by the frozen models: (frozen, rollout-like arrays) ->
    (reference log-probs [B, Lr] under the rollout temperature, the reward model's raw scores [B],
    before gain and bias as the experience step takes them; 0 without a reward model). The reference
    and reward forwards of the experience step (packed when it is): its scorer with
    roles.scoring="sampler", and evaluation outside the training loop."""

    def packed_score(frozen: FrozenParams, prompt_tokens, prompt_mask, tokens, mask):
        """`score` on packed rows, as the packed experience step computes them."""
        ref_params, ref_adapters = reference_variables(frozen)

        def forward(rows: packing.PackedRows):
            logits = packing.next_token_logits(policy_model, ref_params, rows, hp.temperature, ref_adapters)
            rewards = (packing.scalar_outputs(reward_model, frozen.reward, rows) if reward_model is not None
                       else jnp.zeros(rows.tokens.shape, jnp.float32))
            return packing.next_token_logprobs(logits, rows.tokens), rewards

        (ref_logp,), scores, _ = packed_outputs(forward, hp, prompt_tokens, prompt_mask, tokens, mask)
        return ref_logp, scores

    def score(frozen: FrozenParams, prompt_tokens, prompt_mask, tokens, mask):
        if hp.packed:
            return packed_score(frozen, prompt_tokens, prompt_mask, tokens, mask)
        ref_params, ref_adapters = reference_variables(frozen)
        ref_logits = response_logits(policy_model, ref_params, prompt_tokens, prompt_mask, tokens, mask,
                                     hp.temperature, adapters=ref_adapters)
        ref_logp = token_logprobs(ref_logits, tokens, mask)
        if reward_model is None:
            return ref_logp, jnp.zeros(tokens.shape[:1], jnp.float32)
        return ref_logp, response_scores(reward_model, frozen.reward, prompt_tokens, prompt_mask, tokens, mask)

    return score
