"""A function traced once and replayed: the body of a microbatch loop whose output shapes the loop
needs before it starts.

A loop that accumulates `fn`'s outputs starts from zeros of their shapes. `jax.eval_shape(fn, ...)`
gets them by tracing `fn`, and the loop body then traces it again: for the PPO update's microbatch
gradient (two unrolled 22-layer models, forward and backward) that doubled the update's trace, 6.9 of
its 10.7 s (TinyLlama shape, compile-only for an H200, on this project's CPU machine). `trace_once`
traces `fn` one time into a jaxpr, and the loop body evaluates that jaxpr: the same operations, without
running Flax's modules or JAX's differentiation again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax


@dataclasses.dataclass(frozen=True)
class Traced:
    """`fn` traced on an example's shapes: `shapes`, its output as ShapeDtypeStructs; called with
    arguments of the example's structure and shapes, it evaluates the traced operations."""

    jaxpr: Any  # ClosedJaxpr; its constants may be tracers of the enclosing trace (closed-over values)
    out_tree: Any
    shapes: Any

    def __call__(self, *args) -> Any:
        out = jax.core.eval_jaxpr(self.jaxpr.jaxpr, self.jaxpr.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(self.out_tree, out)

    def zeros(self, leading: tuple[int, ...] = ()) -> Any:
        """Zeros of the output's shapes and dtypes, each with `leading` axes in front."""
        return jax.tree.map(lambda s: jax.numpy.zeros(leading + s.shape, s.dtype), self.shapes)


def trace_once(fn: Callable[..., Any], *example: Any) -> Traced:
    """`fn` traced once on the shapes of `example` (arrays or ShapeDtypeStructs). Called inside an
    enclosing trace (a jitted step), values `fn` closes over stay that trace's values."""
    jaxpr, shapes = jax.make_jaxpr(fn, return_shape=True)(*example)
    return Traced(jaxpr, jax.tree.structure(shapes), shapes)
