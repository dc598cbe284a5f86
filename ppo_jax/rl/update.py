"""The update phase: PPO epochs x shuffled minibatches x gradient-accumulated microbatches, with the
optimizer step behind a non-finite guard, as one pure function (the train state donated).

Shapes: B rollout rows, Lq prompt length, Lr response length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ppo_jax import ppo
from ppo_jax.models import packing
from ppo_jax.models.forward import response_logits, response_values, sequence_inputs, token_logprobs
from ppo_jax.models.moe import RouterCoefs, RouterLosses
from ppo_jax.models.transformer import CausalLM, ScalarModel
from ppo_jax.rl.settings import PPOHyper
from ppo_jax.rl.state import Experience, PackedExperience, TrainState, policy_variables, value_variables

Array = jax.Array

def all_finite(tree) -> Array:
    """[] bool: every floating-point leaf of `tree` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


# loss metric key -> logged name (TRL's names where they exist).
UPDATE_METRIC_NAMES = {
    "policy_loss": "loss/policy_avg",
    "value_loss": "loss/value_avg",
    "kl_loss": "loss/kl_avg",
    "approxkl": "policy/approxkl_avg",
    "clipfrac": "policy/clipfrac_avg",
    "dual_clipfrac": "policy/dual_clipfrac_avg",
    "entropy": "policy/entropy_avg",
    "value_clipfrac": "val/clipfrac_avg",
    "values": "val/values_avg",
    "ratio": "val/ratio",
    "ratio_var": "val/ratio_var",
    "grad_norm/policy": "grad_norm/policy",
    "grad_norm/value": "grad_norm/value",
    "router_balance": "moe/balance_loss",
    "router_z": "moe/z_loss",
    "router_load_max": "moe/expert_load_max",
    "router_dropped": "moe/dropped_tokens",
}


def make_update_fn(policy_model: CausalLM, value_model: ScalarModel | None,
                   policy_tx: optax.GradientTransformation, value_tx: optax.GradientTransformation | None,
                   hp: PPOHyper, rows: int, batch_sharding: NamedSharding) -> Callable:
    """Pure update: (state, base, value_base, experience) -> (state, metrics); base is a LoRA policy's
    frozen base (`FrozenParams.policy`), None for full fine-tuning; value_base a LoRA value model's
    frozen transformer (`FrozenParams.value`), None for a full value model. Neither is donated.

    `lax.scan` over epochs x shuffled minibatches; inside each minibatch a scan over microbatches
    accumulates gradients. Each microbatch loss is its token sum divided by the token count of the
    whole minibatch, so accumulated gradients and metrics equal the full-minibatch ones.

    With `hp.packed` each minibatch's rows are packed in the step (`models/packing.py`) into
    microbatches of `hp.packed_rows` packed rows, and only those holding tokens run: the same token
    sums over the same tokens, so gradients and metrics equal the padded path's to fp32 round-off.
    """
    mini_rows = rows // hp.num_minibatches
    micro_rows = mini_rows // hp.num_microbatches

    def ppo_terms(logits, logp, values, mb, mask, kl_coef, num_tokens):
        """The microbatch loss from the models' outputs and the experience fields of `mb` (an
        `Experience` [b, Lr] or a `PackedExperience` [M, T]: every term is a token sum, so the layout
        does not matter) / the minibatch's token count.

        Metrics are `SumCount`/`Moments` (pooled exactly across microbatches) or token-normalised
        scalars (which add up to the minibatch mean).
        """
        pg_loss, metrics = ppo.policy_loss(
            logp, mb.old_logprobs, mb.advantages, mask, clip_eps=hp.clip_eps,
            clip_eps_high=hp.clip_eps_high, dual_clip=hp.dual_clip, num_tokens=num_tokens)
        ent_loss, ent_metrics = ppo.entropy_loss(logits, mask, num_tokens=num_tokens)
        metrics.update(ent_metrics)
        loss = pg_loss + hp.ent_coef * ent_loss
        if not hp.kl_in_reward:
            kl_loss, kl_metrics = ppo.kl_loss(logp, mb.ref_logprobs, mask, hp.kl_estimator,
                                              num_tokens=num_tokens)
            loss = loss + kl_coef * kl_loss
            metrics.update(kl_metrics)
        if values is not None:
            v_loss, v_metrics = ppo.value_loss(values, mb.values, mb.returns, mask,
                                               clip_range=hp.value_clip, num_tokens=num_tokens)
            loss = loss + hp.vf_coef * v_loss
            metrics.update(v_metrics)
        return loss, metrics

    moe_policy = bool(policy_model.config.num_experts)

    def with_router_terms(loss, metrics, router: RouterLosses | None, mask, num_tokens):
        """An MoE policy's router losses added (weighted by their coefficients) and reported. Each
        is its microbatch's, as transformers computes it per forward, weighted by the microbatch's
        share of the minibatch's tokens: the sums over microbatches are token-weighted means."""
        if router is None:
            return loss, metrics
        share = mask.sum() / num_tokens
        loss = loss + share * RouterCoefs(hp.router_aux_coef, hp.router_z_coef).penalty(router)
        metrics.update(router_balance=share * router.balance, router_z=share * router.z,
                       router_load_max=share * router.load_max, router_dropped=router.dropped)
        return loss, metrics

    def loss_fn(policy, value, base, value_base, kl_coef, mb: Experience, num_tokens):
        """Microbatch loss on padded rows [b, Lq + Lr]."""
        mask = mb.mask.astype(jnp.float32)
        params, adapters = policy_variables(policy, base)  # gradients reach the trainable tree only
        out = response_logits(policy_model, params, mb.prompt_tokens, mb.prompt_mask, mb.tokens,
                              mb.mask, hp.temperature, adapters=adapters, router=moe_policy)
        logits, router = out if moe_policy else (out, None)
        logp = token_logprobs(logits, mb.tokens, mb.mask)
        values = None
        if value is not None:
            value_params, value_adapters = value_variables(value, value_base)  # gradients: adapters + head
            values = response_values(value_model, value_params, mb.prompt_tokens, mb.prompt_mask, mb.tokens,
                                     mb.mask, adapters=value_adapters)
        return with_router_terms(*ppo_terms(logits, logp, values, mb, mask, kl_coef, num_tokens), router, mask,
                                 num_tokens)

    def packed_loss_fn(policy, value, base, value_base, kl_coef, mb: PackedExperience, num_tokens):
        """Microbatch loss on packed rows [M, T]: the same token sums, over the prediction slots."""
        params, adapters = policy_variables(policy, base)
        out = packing.next_token_logits(policy_model, params, mb.rows, hp.temperature, adapters, router=moe_policy)
        logits, router = out if moe_policy else (out, None)
        logp = packing.next_token_logprobs(logits, mb.rows.tokens) * mb.mask
        values = None
        if value is not None:
            value_params, value_adapters = value_variables(value, value_base)
            values = packing.scalar_outputs(value_model, value_params, mb.rows, value_adapters) * mb.mask
        return with_router_terms(*ppo_terms(logits, logp, values, mb, mb.mask, kl_coef, num_tokens), router,
                                 mb.mask, num_tokens)

    grad_fn = jax.value_and_grad(packed_loss_fn if hp.packed else loss_fn, argnums=(0, 1), has_aux=True)
    packed_sharding = (None if batch_sharding is None else
                       NamedSharding(batch_sharding.mesh, PartitionSpec(None, *batch_sharding.spec)))

    def constrain(tree, where):
        return tree if where is None else jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, where), tree)

    def packed_minibatch(exp: Experience, idx):
        """The minibatch rows `idx` [R] packed: (PackedExperience [K, M, T], Packing)."""
        picked = jax.tree.map(lambda x: x[idx], exp)
        seq, _, seq_mask = sequence_inputs(picked.prompt_tokens, picked.prompt_mask, picked.tokens, picked.mask)
        layout = packing.plan(seq_mask, hp.packed_shape(idx.shape[0]))
        slots = packing.prediction_slots(layout, picked.prompt_tokens.shape[1], picked.mask)
        at_slots = functools.partial(packing.scatter, slots=slots, packing=layout)
        packed = PackedExperience(
            rows=packing.pack_rows(seq, layout), mask=at_slots(picked.mask.astype(jnp.float32)),
            old_logprobs=at_slots(picked.old_logprobs), ref_logprobs=at_slots(picked.ref_logprobs),
            values=at_slots(picked.values), advantages=at_slots(picked.advantages),
            returns=at_slots(picked.returns))
        return constrain(packed, packed_sharding), layout

    def accumulate(state, base, value_base, items, fetch, num_tokens, used=None):
        """Summed (grads, metrics) over microbatches, microbatch k being fetch(items[k]) for the
        [K, ...] leaves of `items`: a `lax.scan` over all K, or with `used` (packed: the others hold
        no token) a `fori_loop` over the first `used` only (a while loop with the accumulator
        updated in place; a `lax.cond` per microbatch made XLA:GPU copy and transpose the weights
        in every step, and hold a second gradient tree)."""
        def grads_of(item):
            mb = constrain(fetch(item), batch_sharding)
            (_, metrics), grads = grad_fn(state.policy, state.value, base, value_base, state.kl.coef, mb,
                                          num_tokens)
            return grads, metrics

        shapes = jax.eval_shape(grads_of, jax.tree.map(lambda x: x[0], items))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        if used is not None:
            return jax.lax.fori_loop(
                0, used, lambda k, acc: jax.tree.map(jnp.add, acc, grads_of(packing.microbatch(items, k))), zeros)

        def micro_step(acc, item):
            return jax.tree.map(jnp.add, acc, grads_of(item)), None

        acc, _ = jax.lax.scan(micro_step, zeros, items)
        return acc

    def minibatch_step(state: TrainState, base, value_base, exp: Experience, exp_finite, idx):
        """idx [num_microbatches, micro_rows] -> one optimizer step on the policy (and value).

        A non-finite experience or gradient skips the step: parameters and optimizer state stay
        exactly as they were, and `skipped` says so.
        """
        old_state = state
        num_tokens = jnp.maximum(exp.mask[idx.reshape(-1)].sum().astype(jnp.float32), 1.0)
        if hp.packed:
            packed, layout = packed_minibatch(exp, idx.reshape(-1))
            grads, metrics = accumulate(state, base, value_base, packed, lambda mb: mb, num_tokens,
                                        layout.microbatches_used)
            token_efficiency = layout.token_efficiency
        else:
            grads, metrics = accumulate(state, base, value_base, idx,
                                        lambda micro_idx: jax.tree.map(lambda x: x[micro_idx], exp), num_tokens)
            picked = idx.reshape(-1)
            token_efficiency = packing.padded_token_efficiency(exp.prompt_mask[picked], exp.mask[picked])
        metrics = ppo.finalize_metrics(metrics)
        policy_grads, value_grads = grads
        metrics["grad_norm/policy"] = optax.tree.norm(policy_grads)
        if state.value is not None:
            metrics["grad_norm/value"] = optax.tree.norm(value_grads)
        ok = exp_finite & all_finite(grads)

        def apply(state):
            updates, policy_opt = policy_tx.update(policy_grads, state.policy_opt, state.policy)
            state = state.replace(policy=optax.apply_updates(state.policy, updates), policy_opt=policy_opt)
            if state.value is not None:
                updates, value_opt = value_tx.update(value_grads, state.value_opt, state.value)
                state = state.replace(value=optax.apply_updates(state.value, updates), value_opt=value_opt)
            return state

        # where(ok, new, old) leaf by leaf, not lax.cond(ok, apply, identity): XLA fuses the select into
        # the optimizer's elementwise update, written in place into the donated state. A cond's
        # branches each write a separate output, and its identity branch copies every leaf: one more
        # whole train state in the temps (ppo-jax-plan, XLA:GPU for one H100, TinyLlama shape, 32-row
        # minibatches, fp32 master weights: update temps 31.8 -> 24.0 GiB; a small model's temps on
        # XLA:TPU 13% lower, on XLA:CPU within 4%).
        new_state = apply(old_state)
        state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, old_state)
        metrics["skipped"] = 1.0 - ok.astype(jnp.float32)
        metrics["token_efficiency"] = token_efficiency.astype(jnp.float32)
        return state, metrics

    def epoch_step(base, value_base, exp, exp_finite, state, epoch_key):
        perm = jax.random.permutation(epoch_key, rows)
        idx = perm.reshape(hp.num_minibatches, hp.num_microbatches, micro_rows)
        return jax.lax.scan(lambda s, i: minibatch_step(s, base, value_base, exp, exp_finite, i), state, idx)

    def update(state: TrainState, base, value_base, exp: Experience):
        iteration_key = jax.random.fold_in(state.key, state.step)
        epoch_keys = jax.random.split(jax.random.fold_in(iteration_key, 1), hp.epochs)
        exp_finite = all_finite(exp)
        state, metrics = jax.lax.scan(lambda s, k: epoch_step(base, value_base, exp, exp_finite, s, k), state,
                                      epoch_keys)
        # metrics: [epochs, minibatches] each. Averages under TRL's names, plus the very first
        # minibatch, where the policy has not moved yet (its ratio must be exactly 1, DESIGN.md §5).
        out = {name: metrics[key].mean() for key, name in UPDATE_METRIC_NAMES.items() if key in metrics}
        out.update({f"first_minibatch/{key}": metrics[key][0, 0]
                    for key in ("ratio", "ratio_var", "approxkl", "clipfrac") if key in metrics})
        mask = exp.mask.astype(jnp.float32)
        seq_kl = (ppo.kl_penalty(exp.old_logprobs, exp.ref_logprobs, hp.kl_estimator) * mask).sum(-1).mean()
        kl = ppo.update_kl_controller(state.kl, seq_kl, rows)
        kl = jax.tree.map(lambda new, old: jnp.where(exp_finite, new, old), kl, state.kl)
        state = state.replace(kl=kl, step=state.step + 1)
        out["nonfinite/skipped_minibatches"] = metrics["skipped"].sum()
        out["perf/token_efficiency"] = metrics["token_efficiency"].mean()
        # Finite gradients can still produce non-finite parameters (an infinite learning rate, an
        # overflowing update): one fused reduction over the new trainable state says so, and the
        # trainer then refuses to save, evaluate or export it.
        out["nonfinite/state"] = 1.0 - all_finite((state.policy, state.value)).astype(jnp.float32)
        return state, out

    return update
