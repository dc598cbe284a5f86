"""The update phase: PPO epochs x shuffled minibatches x gradient-accumulated microbatches, with the
optimizer step behind a non-finite guard, as one pure function (the train state donated). The loss of
a microbatch is `rl/objective.py`'s; this module is the loop around it: the shuffles, the gradient
accumulation, the guarded optimizer step and the iteration's metrics.

Shapes: B rollout rows, Lq prompt length, Lr response length, V vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ppo_jax import ppo
from ppo_jax.models import packing
from ppo_jax.models.forward import sequence_inputs
from ppo_jax.rl.objective import LossBatch, packed_loss, padded_loss
from ppo_jax.rl.hyper import PPOHyper
from ppo_jax.rl.state import Experience, FrozenParams, Modules, PackedExperience, Trainable, PPOState
from ppo_jax.traced import trace_once

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
    "dense_kl": "loss/dense_kl_avg",
    "approxkl": "policy/approxkl_avg",
    "clipfrac": "policy/clipfrac_avg",
    "dual_clipfrac": "policy/dual_clipfrac_avg",
    "kl_cov_frac": "policy/kl_cov_frac_avg",
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


def constrain(tree, where: NamedSharding | None):
    """`tree`'s leaves constrained to `where` (None: left to the compiler)."""
    return tree if where is None else jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, where), tree)


def pack_minibatch(exp: Experience, idx: Array, hp: PPOHyper) -> tuple[PackedExperience, packing.Packing]:
    """The minibatch rows `idx` [R] packed: (PackedExperience [K, M, T], Packing)."""
    picked = jax.tree.map(lambda x: x[idx], exp)
    seq, _, seq_mask = sequence_inputs(picked.prompt_tokens, picked.prompt_mask, picked.tokens, picked.mask)
    layout = packing.plan(seq_mask, hp.packed_shape(idx.shape[0]))
    slots = packing.prediction_slots(layout, picked.prompt_tokens.shape[1], picked.mask)
    at_slots = functools.partial(packing.scatter, slots=slots, packing=layout)
    packed = PackedExperience(
        rows=packing.pack_rows(seq, layout, picked.routed_experts),
        mask=at_slots(picked.loss_mask.astype(jnp.float32)),
        old_logprobs=at_slots(picked.old_logprobs), ref_logprobs=at_slots(picked.ref_logprobs),
        values=at_slots(picked.values), advantages=at_slots(picked.advantages), returns=at_slots(picked.returns),
        ref_vocab_logprobs=None if picked.ref_vocab_logprobs is None else at_slots(picked.ref_vocab_logprobs))
    return packed, layout


def accumulate(grads_of: Callable, items, used: Array | None = None):
    """Summed (grads, metrics) over microbatches, grads_of(item k) for the [K, ...] leaves of `items`:
    a `lax.scan` over all K, or with `used` (packed: the others hold no token) a `fori_loop` over the
    first `used` only (a while loop with the accumulator updated in place; a `lax.cond` per microbatch
    made XLA:GPU copy and transpose the weights in every step, and hold a second gradient tree)."""
    grads_of = trace_once(grads_of, jax.tree.map(lambda x: x[0], items))  # one trace for shapes and body
    zeros = grads_of.zeros()
    if used is not None:
        return jax.lax.fori_loop(
            0, used, lambda k, acc: jax.tree.map(jnp.add, acc, grads_of(packing.microbatch(items, k))), zeros)
    acc, _ = jax.lax.scan(lambda acc, item: (jax.tree.map(jnp.add, acc, grads_of(item)), None), zeros, items)
    return acc


def guarded_step(state: PPOState, grads: Trainable, ok: Array, policy_tx: optax.GradientTransformation,
                 value_tx: optax.GradientTransformation | None) -> PPOState:
    """One optimizer step on the policy (and value) where `ok` [] bool, else `state` exactly as it was.

    where(ok, new, old) leaf by leaf, not lax.cond(ok, apply, identity): XLA fuses the select into
    the optimizer's elementwise update, written in place into the donated state. A cond's branches
    each write a separate output, and its identity branch copies every leaf: one more whole train
    state in the temps (ppo-jax-plan, XLA:GPU for one H100, TinyLlama shape, 32-row minibatches, fp32
    master weights: update temps 31.8 -> 24.0 GiB; a small model's temps on XLA:TPU 13% lower, on
    XLA:CPU within 4%).
    """
    updates, policy_opt = policy_tx.update(grads.policy, state.policy_opt, state.policy)
    new = state.replace(policy=optax.apply_updates(state.policy, updates), policy_opt=policy_opt)
    if state.value is not None:
        updates, value_opt = value_tx.update(grads.value, state.value_opt, state.value)
        new = new.replace(value=optax.apply_updates(state.value, updates), value_opt=value_opt)
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)


def update_metrics(metrics: dict[str, Array], state: PPOState) -> dict[str, Array]:
    """The logged scalars of one update from the per-minibatch metrics ([epochs, minibatches] each):
    averages under TRL's names, plus the very first minibatch, where the policy has not moved yet (its
    ratio must be exactly 1, DESIGN.md §5)."""
    out = {name: metrics[key].mean() for key, name in UPDATE_METRIC_NAMES.items() if key in metrics}
    out.update({f"first_minibatch/{key}": metrics[key][0, 0]
                for key in ("ratio", "ratio_var", "approxkl", "clipfrac") if key in metrics})
    out["nonfinite/skipped_minibatches"] = metrics["skipped"].sum()
    out["perf/token_efficiency"] = metrics["token_efficiency"].mean()
    # Finite gradients can still produce non-finite parameters (an infinite learning rate, an
    # overflowing update): one fused reduction over the new trainable state says so, and the
    # trainer then refuses to save, evaluate or export it.
    out["nonfinite/state"] = 1.0 - all_finite((state.policy, state.value)).astype(jnp.float32)
    return out


def step_kl_controller(state: PPOState, exp: Experience, exp_finite: Array, rows: int) -> PPOState:
    """The KL controller stepped on the rollout's mean sequence KL of the policy being updated
    (unchanged after a non-finite experience), and the iteration counted."""
    kl = ppo.update_kl_controller(state.kl, exp.sequence_kl.mean(), rows)
    kl = jax.tree.map(lambda new, old: jnp.where(exp_finite, new, old), kl, state.kl)
    return state.replace(kl=kl, step=state.step + 1)


def rollout_entropy(exp: Experience) -> Array:
    """[] the rollout's mean token entropy (over the tokens trained on) under the policy being updated."""
    return exp.sequence_entropy.sum() / jnp.maximum(exp.loss_mask.sum(), 1).astype(jnp.float32)


def step_entropy_controller(state: PPOState, entropy: Array, exp_finite: Array) -> PPOState:
    """The adaptive entropy coefficient stepped on the rollout's entropy (unchanged after a non-finite
    experience); the state as it was without one."""
    if state.entropy is None:
        return state
    new = ppo.update_entropy_controller(state.entropy, entropy)
    return state.replace(entropy=jax.tree.map(lambda n, o: jnp.where(exp_finite, n, o), new, state.entropy))


def minibatch_batch(exp: Experience, picked: Array, hp: PPOHyper, kl_coef: Array, ent_coef: Array | None):
    """The minibatch-wide numbers of the rows `picked` [R] that every microbatch's `LossBatch` carries
    (its experience left None): the token count, the loss aggregation's normaliser and KL-Cov's
    selection, each known before any microbatch runs (so the microbatches add up to the minibatch)."""
    mask = exp.loss_mask[picked]
    num_tokens = jnp.maximum(mask.sum().astype(jnp.float32), 1.0)  # the tokens trained on
    kl_cov = None
    if hp.policy_objective == "kl_cov":
        kl_cov = ppo.covariance_selection(exp.old_logprobs[picked], exp.advantages[picked], mask, hp.kl_cov_fraction)
    return LossBatch(None, num_tokens, kl_coef, ppo.minibatch_normaliser(hp.loss_aggregation, mask), ent_coef, kl_cov)


def minibatch_order(key: Array, hp: PPOHyper, rows: int) -> Array:
    """[epochs, num_minibatches, num_microbatches, micro_rows] int: the rollout rows each epoch's
    minibatches (and their microbatches) take, a random split of 0..rows-1 per epoch; with
    `hp.fixed_minibatches` the first epoch's split every epoch (TRL's GRPOTrainer)."""
    epoch_keys = jax.random.split(key, 1 if hp.fixed_minibatches else hp.epochs)
    splits = jax.vmap(lambda k: jax.random.permutation(k, rows))(epoch_keys)
    splits = jnp.broadcast_to(splits, (hp.epochs, rows))
    return splits.reshape(hp.epochs, hp.num_minibatches, hp.num_microbatches, -1)


def make_update_fn(modules: Modules, policy_tx: optax.GradientTransformation,
                   value_tx: optax.GradientTransformation | None, hp: PPOHyper, rows: int,
                   batch_sharding: NamedSharding) -> Callable:
    """Pure update: (state, frozen, experience) -> (state, metrics). Of the frozen trees it reads a
    LoRA policy's base (`FrozenParams.policy`, None for full fine-tuning), a LoRA value model's
    transformer (`FrozenParams.value`, None for a full value model) and, with `hp.dense_kl_coef` unless
    the experience keeps the reference's log-probs (`hp.dense_kl_stored`), the reference; none is
    donated, and the others never enter the program.

    `lax.scan` over epochs x shuffled minibatches; inside each minibatch microbatch gradients of
    `objective.padded_loss` are accumulated. Each microbatch loss is its token sum divided by the
    token count of the whole minibatch, so accumulated gradients and metrics equal the full-minibatch
    ones. With `hp.packed` each minibatch's rows are packed in the step (`models/packing.py`) into
    microbatches of `hp.packed_rows` packed rows and only those holding tokens run
    (`objective.packed_loss`): the same token sums over the same tokens, so gradients and metrics equal
    the padded path's to fp32 round-off.
    """
    loss = functools.partial(packed_loss if hp.packed else padded_loss, modules)
    grad_fn = jax.value_and_grad(loss, has_aux=True)  # by the Trainable trees
    packed_sharding = (None if batch_sharding is None else
                       NamedSharding(batch_sharding.mesh, PartitionSpec(None, *batch_sharding.spec)))

    def minibatch_step(state: PPOState, frozen: FrozenParams, exp: Experience, exp_finite, ent_coef, idx):
        """idx [num_microbatches, micro_rows] -> one optimizer step on the policy (and value). A
        non-finite experience or gradient skips it: `skipped` says so."""
        picked = idx.reshape(-1)
        minibatch = minibatch_batch(exp, picked, hp, state.kl.coef, ent_coef)

        def grads_of(mb):
            batch = minibatch.replace(experience=constrain(mb, batch_sharding))
            (_, metrics), grads = grad_fn(Trainable(state.policy, state.value), frozen, batch, hp)
            return grads, metrics

        if hp.packed:
            packed, layout = pack_minibatch(exp, picked, hp)
            grads, metrics = accumulate(grads_of, constrain(packed, packed_sharding), layout.microbatches_used)
            token_efficiency = layout.token_efficiency
        else:
            grads, metrics = accumulate(lambda micro: grads_of(jax.tree.map(lambda x: x[micro], exp)), idx)
            token_efficiency = packing.padded_token_efficiency(exp.prompt_mask[picked], exp.mask[picked])
        metrics = ppo.finalize_metrics(metrics)
        metrics["grad_norm/policy"] = optax.tree.norm(grads.policy)
        if state.value is not None:
            metrics["grad_norm/value"] = optax.tree.norm(grads.value)
        # The norms say whether every gradient is finite (a NaN or inf makes its sum of squares one):
        # no second pass over the gradients, whose per-leaf reductions were 622 kernels a minibatch
        # on the TinyLlama update (static profile, docs/benchmarks.md). A finite gradient above
        # ~1.8e19 overflows the square and skips the step too, which such a step deserves.
        norms = [metrics[name] for name in ("grad_norm/policy", "grad_norm/value") if name in metrics]
        ok = exp_finite & jnp.all(jnp.isfinite(jnp.stack(norms)))
        metrics["skipped"] = 1.0 - ok.astype(jnp.float32)
        metrics["token_efficiency"] = token_efficiency.astype(jnp.float32)
        return guarded_step(state, grads, ok, policy_tx, value_tx), metrics

    def update(state: PPOState, frozen: FrozenParams, exp: Experience):
        frozen = FrozenParams(reference=frozen.reference if hp.recomputes_reference else None, reward=None,
                              policy=frozen.policy, value=frozen.value)
        order = minibatch_order(jax.random.fold_in(jax.random.fold_in(state.key, state.step), 1), hp, rows)
        exp_finite = all_finite(exp)
        ent_coef, entropy = None, None
        if state.entropy is not None:  # this update's coefficient, from the rollout's entropy
            entropy = rollout_entropy(exp)
            ent_coef = ppo.entropy_coef(state.entropy, entropy)

        def epoch_step(state, idx):
            return jax.lax.scan(lambda s, i: minibatch_step(s, frozen, exp, exp_finite, ent_coef, i), state, idx)

        state, metrics = jax.lax.scan(epoch_step, state, order)
        state = step_entropy_controller(step_kl_controller(state, exp, exp_finite, rows), entropy, exp_finite)
        out = update_metrics(metrics, state)
        if ent_coef is not None:
            out.update({"policy/entropy_coef": ent_coef, "policy/entropy_coef_next": state.entropy.coef,
                        "policy/rollout_entropy": entropy})
        return state, out

    return update
