"""The PPO loss of one microbatch, as pure functions: what a researcher reads to see what PPO optimises.

    ppo_loss(outputs, batch, hp)                 the loss terms from the models' outputs
    padded_loss(modules, params, frozen, batch, hp)  the forwards on padded rows, then ppo_loss
    packed_loss(modules, params, frozen, batch, hp)  the same on packed rows (`models/packing.py`)

Each returns (loss [], metrics). The loss is clipped policy loss + ent_coef * (-entropy)
[+ kl_coef * KL when the KL is a loss term] [+ dense_kl_coef * the whole-vocabulary KL] [+ vf_coef * clipped value loss] [+ an MoE policy's
router losses]; the policy loss is `hp.policy_objective`'s (PPO, GSPO, GSPO-token, CISPO, KL-Cov), and
every term is a token sum over this microbatch of each token's loss divided by its denominator
(`hp.loss_aggregation`, `ppo/aggregation.py`: for token_mean `LossBatch.num_tokens`, the token count
of the whole minibatch), so microbatch losses and gradients add up to the minibatch's exactly.
Metrics are `SumCount` / `Moments` (pooled exactly across microbatches) or token-weighted scalars
(their sum over microbatches is the minibatch's mean).

Shapes: b rows of a microbatch, Lq prompt length, Lr response length, V vocabulary; packed: M rows
of T slots, each per-token field at the slot that predicts the token.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax import ppo
from ppo_jax.models import packing
from ppo_jax.models.forward import response_logits, response_values, token_logprobs
from ppo_jax.models.moe import RouterCoefs, RouterLosses
from ppo_jax.rl.hyper import PPOHyper
from ppo_jax.rl.state import (Experience, FrozenParams, Modules, PackedExperience, Trainable, policy_variables,
                              reference_variables, value_variables)

Array = jax.Array
Params = Any


@flax.struct.dataclass
class LossBatch:
    """One microbatch and the minibatch-wide numbers its loss is scaled by."""

    experience: Experience | PackedExperience  # [b, Lr] padded rows, or [M, T] packed slots
    num_tokens: Array  # [] real response tokens of the whole minibatch (token_mean: each term's token sum / this)
    kl_coef: Array  # [] the KL controller's beta (used when the KL is a loss term: hp.kl_in_reward=False)
    # [] the minibatch-wide part of hp.loss_aggregation's denominators (`ppo.minibatch_normaliser`);
    # None: num_tokens (token_mean)
    normaliser: Array | None = None
    ent_coef: Array | None = None  # [] the adaptive entropy coefficient (hp.entropy_target); None: hp.ent_coef
    kl_cov: ppo.CovarianceSelection | None = None  # the minibatch's KL-Cov selection (hp.policy_objective="kl_cov")


@flax.struct.dataclass
class TokenOutputs:
    """The trained models' outputs over a microbatch's response tokens ([b, Lr] or [M, T])."""

    logits: Array  # [..., V] the policy's, temperature applied
    logprobs: Array  # the sampled tokens' log-probs under the policy, 0 off the mask
    values: Array | None = None  # the value model's predictions, 0 off the mask; None without a critic
    router: RouterLosses | None = None  # an MoE policy's router losses of this forward
    # [..., V] the reference's logits (or log-probs, as the experience keeps them), temperature applied; only
    # with hp.dense_kl_coef
    ref_logits: Array | None = None


def policy_term(out: TokenOutputs, batch: LossBatch, hp: PPOHyper, mask: Array,
                denominators: Array) -> tuple[Array, dict[str, Any]]:
    """The policy loss of `hp.policy_objective` (`ppo/losses.py`, `ppo/policy_objectives.py`,
    `ppo/entropy_control.py`) over `mask` [b, Lr] (or [M, T]), each token's loss / `denominators`."""
    exp, objective = batch.experience, hp.policy_objective
    args = (out.logprobs, exp.old_logprobs, exp.advantages, mask)
    if objective in ("gspo", "gspo_token"):
        return ppo.gspo_loss(*args, clip_eps=hp.clip_eps, clip_eps_high=hp.clip_eps_high,
                             token_level=objective == "gspo_token", segment_ids=exp.segment_ids,
                             num_tokens=denominators)
    if objective == "cispo":
        return ppo.cispo_loss(*args, clip_eps_low=hp.clip_eps, clip_eps_high=hp.clip_eps_high or hp.clip_eps,
                              num_tokens=denominators)
    if objective == "kl_cov":
        return ppo.kl_cov_loss(*args, batch.kl_cov, coef=hp.kl_cov_coef, num_tokens=denominators)
    return ppo.policy_loss(*args, clip_eps=hp.clip_eps, clip_eps_high=hp.clip_eps_high, dual_clip=hp.dual_clip,
                           num_tokens=denominators)


def ppo_loss(out: TokenOutputs, batch: LossBatch, hp: PPOHyper) -> tuple[Array, dict[str, Any]]:
    """The microbatch loss [] and metrics from the models' outputs and the experience. Every term is a
    token sum over `mask` of the token's loss / its denominator (`hp.loss_aggregation`: token_mean
    divides by `batch.num_tokens`), so the layout (padded or packed) does not matter."""
    exp = batch.experience
    mask = exp.loss_mask.astype(jnp.float32)  # multi-turn rows: the policy's tokens only
    num_tokens = ppo.token_denominators(hp.loss_aggregation,
                                        batch.num_tokens if batch.normaliser is None else batch.normaliser,
                                        mask, exp.segment_ids)
    loss, metrics = policy_term(out, batch, hp, mask, num_tokens)
    ent_loss, ent_metrics = ppo.entropy_loss(out.logits, mask, num_tokens=num_tokens)
    metrics.update(ent_metrics)
    loss = loss + (hp.ent_coef if batch.ent_coef is None else batch.ent_coef) * ent_loss
    if not hp.kl_in_reward:
        kl_loss, kl_metrics = ppo.kl_loss(out.logprobs, exp.ref_logprobs, mask, hp.kl_estimator, num_tokens=num_tokens)
        loss = loss + batch.kl_coef * kl_loss
        metrics.update(kl_metrics)
    if out.ref_logits is not None:
        dense_loss, dense_metrics = ppo.dense_kl_loss(out.logits, out.ref_logits, mask, num_tokens=num_tokens)
        loss = loss + hp.dense_kl_coef * dense_loss
        metrics.update(dense_metrics)
    if out.values is not None:
        v_loss, v_metrics = ppo.value_loss(out.values, exp.values, exp.returns, mask, clip_range=hp.value_clip,
                                           num_tokens=num_tokens)
        loss = loss + hp.vf_coef * v_loss
        metrics.update(v_metrics)
    if out.router is not None:
        # Each router loss is its microbatch's (as transformers computes it per forward), weighted by
        # the microbatch's share of the minibatch's tokens: the sums over microbatches are
        # token-weighted means.
        share = mask.sum() / batch.num_tokens
        loss = loss + share * RouterCoefs(hp.router_aux_coef, hp.router_z_coef).penalty(out.router)
        metrics.update(router_balance=share * out.router.balance, router_z=share * out.router.z,
                       router_load_max=share * out.router.load_max, router_dropped=out.router.dropped)
    return loss, metrics


def _split_router(out, moe: bool):
    return out if moe else (out, None)


def padded_outputs(modules: Modules, params: Trainable, frozen: FrozenParams, mb: Experience,
                   hp: PPOHyper) -> TokenOutputs:
    """The policy's logits [b, Lr, V] and log-probs [b, Lr] (and the value model's values [b, Lr]) of
    padded rows [b, Lq + Lr]. Gradients reach the trainable trees only (`frozen.policy`,
    `frozen.value`: the LoRA bases, None without LoRA)."""
    policy_model, value_model = modules.policy, modules.value
    moe = bool(policy_model.config.num_experts)
    policy_params, adapters = policy_variables(params.policy, frozen.policy)
    logits, router = _split_router(response_logits(policy_model, policy_params, mb.prompt_tokens, mb.prompt_mask,
                                                   mb.tokens, mb.mask, hp.temperature, adapters=adapters,
                                                   router=moe, experts=mb.routed_experts), moe)
    values = None
    if params.value is not None:
        value_params, value_adapters = value_variables(params.value, frozen.value)
        values = response_values(value_model, value_params, mb.prompt_tokens, mb.prompt_mask, mb.tokens, mb.mask,
                                 adapters=value_adapters)
    ref_logits = mb.ref_vocab_logprobs if hp.dense_kl_stored else None
    if hp.recomputes_reference:
        ref_params, ref_adapters = reference_variables(frozen)
        ref_logits = jax.lax.stop_gradient(response_logits(policy_model, ref_params, mb.prompt_tokens, mb.prompt_mask,
                                                           mb.tokens, mb.mask, hp.temperature, adapters=ref_adapters))
    return TokenOutputs(logits, token_logprobs(logits, mb.tokens, mb.mask), values, router, ref_logits)


def packed_outputs(modules: Modules, params: Trainable, frozen: FrozenParams, mb: PackedExperience,
                   hp: PPOHyper) -> TokenOutputs:
    """`padded_outputs` on packed rows [M, T]: each slot's outputs predict the next slot's token."""
    policy_model, value_model = modules.policy, modules.value
    moe = bool(policy_model.config.num_experts)
    policy_params, adapters = policy_variables(params.policy, frozen.policy)
    logits, router = _split_router(packing.next_token_logits(policy_model, policy_params, mb.rows, hp.temperature,
                                                             adapters, router=moe), moe)
    values = None
    if params.value is not None:
        value_params, value_adapters = value_variables(params.value, frozen.value)
        values = packing.scalar_outputs(value_model, value_params, mb.rows, value_adapters) * mb.mask
    ref_logits = mb.ref_vocab_logprobs if hp.dense_kl_stored else None
    if hp.recomputes_reference:  # the reference routes by its own router: replay is the policy's
        ref_params, ref_adapters = reference_variables(frozen)
        ref_logits = jax.lax.stop_gradient(packing.next_token_logits(
            policy_model, ref_params, mb.rows.replace(experts=None), hp.temperature, ref_adapters))
    return TokenOutputs(logits, packing.next_token_logprobs(logits, mb.rows.tokens) * mb.mask, values, router,
                        ref_logits)


def padded_loss(modules: Modules, params: Trainable, frozen: FrozenParams, batch: LossBatch,
                hp: PPOHyper) -> tuple[Array, dict[str, Any]]:
    """The microbatch loss on padded rows (`batch.experience` an `Experience` [b, ...])."""
    return ppo_loss(padded_outputs(modules, params, frozen, batch.experience, hp), batch, hp)


def packed_loss(modules: Modules, params: Trainable, frozen: FrozenParams, batch: LossBatch,
                hp: PPOHyper) -> tuple[Array, dict[str, Any]]:
    """The microbatch loss on packed rows (`batch.experience` a `PackedExperience` [M, T])."""
    return ppo_loss(packed_outputs(modules, params, frozen, batch.experience, hp), batch, hp)
