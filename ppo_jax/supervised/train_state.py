"""The supervised trainers' train state (the params an optimizer step changes, and its Adam state,
sharded like them) and their batches: the batch-size check, microbatches dealt round-robin, and
gradient accumulation whose sums are exactly the full batch's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from ppo_jax import sharding
from ppo_jax.config import ConfigError
from ppo_jax.traced import trace_once

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# Train state.


@flax.struct.dataclass
class TrainState:
    """Everything an optimizer step changes; donated to the step."""

    step: Array  # [] int32, optimizer steps done
    params: Any
    opt_state: Any


def init_train_state(params, param_shardings, boxed_abstract, tx: optax.GradientTransformation,
                     mesh) -> tuple[TrainState, TrainState]:
    """(state, shardings): optimizer state sharded like the params it mirrors.

    boxed_abstract: the model's abstract params with logical axis names (`hf.abstract_params`), so
    Adam's moments get the same shardings as the params.
    """
    opt_shardings = sharding.tree_shardings(jax.eval_shape(tx.init, boxed_abstract), mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    replicated = sharding.replicated(mesh)
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)
    state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), replicated), params=params,
                       opt_state=opt_state)
    return state, shardings


def apply_gradients(tx, state: TrainState, grads) -> TrainState:
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                      opt_state=opt_state)


def abstract_state(state: TrainState, shardings: TrainState):
    """Restore target: shapes, dtypes and shardings of `state`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


# ----------------------------------------------------------------------------------------------
# Batches.


def check_batch_size(batch_size: int, mesh, what: str) -> None:
    divisor = sharding.batch_divisor(mesh)
    if batch_size % divisor:
        raise ConfigError(
            f"{what}: train.batch_size={batch_size} does not split over the {divisor} data-parallel "
            f"devices (mesh {sharding.batch_axes_text(mesh)}); use a multiple of {divisor}")


def split_microbatches(tree, num_microbatches: int):
    """Leaves [B, ...] -> [num_microbatches, B / num_microbatches, ...].

    Rows are dealt round-robin (microbatch i = rows i, i + n, ...), so with a batch-sharded input
    every microbatch still spans all data-parallel devices instead of landing on a few of them.
    """

    def split(x):
        x = x.reshape((x.shape[0] // num_microbatches, num_microbatches) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, tree)


def accumulate_gradients(loss_fn: Callable, params, microbatches, batch_sharding):
    """(loss, metrics, grads), each summed over the microbatches with one `lax.scan`.

    loss_fn(params, microbatch) -> (loss [], metrics): every loss term and metric must be a sum over
    the microbatch divided by a whole-batch count (or a `SumCount`), so that the sums are exactly the
    full-batch loss, gradient and metrics however the rows fall into microbatches.
    microbatches: leaves [n, b, ...] (`split_microbatches`).
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def totals_of(microbatch):
        microbatch = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, batch_sharding), microbatch)
        (loss, metrics), grads = grad_fn(params, microbatch)
        return loss, metrics, grads

    totals_of = trace_once(totals_of, jax.tree.map(lambda x: x[0], microbatches))  # one trace for shapes and body
    totals, _ = jax.lax.scan(lambda acc, mb: (jax.tree.map(jnp.add, acc, totals_of(mb)), None), totals_of.zeros(),
                             microbatches)
    return totals
