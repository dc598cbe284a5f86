"""Partial (interruptible) rollouts: the continuous engine run in segments, so that a weight sync can
land between two decode steps and the rows in progress go on under the new weights.

A segment is at most `budget` decode steps of the engine's first stage (`continuous.first_stage_steps`);
between segments the whole engine state travels as a pytree (`Segment`: the slots, their KV cache,
the rows prefilled and waiting, the queue position, the output buffers, and what the engine reads:
prompts, uniforms, limits). The last segment (`finish`) runs everything left, the tail stages
included, and returns the SampleOutput. Each segment takes the weights to decode with and their
version, which every token it chooses records (`SampleOutput.token_policy_version` [R, N]) beside its
log-probs: so a token's behaviour log-prob is always that of the weights that chose it.

Rows in progress keep their KV cache across a sync (keys and values of their prefix computed by the
older weights; likewise rows prefilled and still waiting): no work is repeated, and the recorded
log-prob is exactly that of the distribution the token was drawn from, which is what the off-policy
corrections divide by. Re-prefilling them under the new weights would make every later token's
context that of the new weights, at the price of one forward over every busy row's prompt and
response so far at each sync (bench/bench_partial_rollouts.py measures it against a segment's
decoding).

Randomness stays scheduling-invariant: row r's token t uses the uniform (r, t) of the key, so a
segmented run whose weights never change gives exactly the tokens and log-probs of one
`sample_continuous` call (the same steps, in the same order, on the same shapes).

Shapes: B prompts, n samples each, R = B * n rows, Lq prompt length, N = max_new_tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax import sharding
from ppo_jax.sampling.config import SampleOutput, validate_inputs
from ppo_jax.sampling.continuous import (Slots, first_stage_steps, initial_slots, make_engine, run_to_end,
                                         sample_output)
from ppo_jax.sampling.loop import row_limits
from ppo_jax.sampling.sampler import Sampler
from ppo_jax.sampling.token_choice import response_uniforms
from ppo_jax.sampling.weights import weights_in_compute_dtype

Array = jax.Array


@flax.struct.dataclass
class Segment:
    """A continuous-engine run between two segments: slots (the engine's carry, `continuous.Slots`),
    prompt_tokens, prompt_mask [B, Lq] int32, uniforms [R, N] float32 (row r's draw at step t),
    limits [R] int32 (each row's max new tokens)."""

    slots: Slots
    prompt_tokens: Array
    prompt_mask: Array
    uniforms: Array
    limits: Array


def _engine(params, segment: Segment, version, *, model, config, adapters):
    return make_engine(weights_in_compute_dtype(params, model), segment.prompt_tokens, segment.prompt_mask,
                       segment.uniforms, segment.limits,
                       model=model, config=config, adapters=adapters, version=jnp.asarray(version, jnp.int32))


def begin(params: Any, prompt_tokens: Array, prompt_mask: Array, key: Array, version: Array, budget: Array, *,
          model, config, adapters: Any = None, response_limits: Array | None = None) -> Segment:
    """The first segment: at most `budget` [] decode steps (and the prefills they need) under
    `params`, whose version [] int32 the tokens record."""
    validate_inputs(model, config, prompt_tokens.shape, prompt_mask.shape)
    rows = prompt_tokens.shape[0] * config.num_samples
    segment = Segment(slots=None, prompt_tokens=prompt_tokens.astype(jnp.int32),
                      prompt_mask=prompt_mask.astype(jnp.int32),
                      uniforms=response_uniforms(key, rows, config.max_new_tokens),
                      limits=row_limits(response_limits, rows, config))
    e = _engine(params, segment, version, model=model, config=config, adapters=adapters)
    return segment.replace(slots=first_stage_steps(e, initial_slots(e, versions=True), budget))


def advance(params: Any, segment: Segment, version: Array, budget: Array, *, model, config,
            adapters: Any = None) -> Segment:
    """The next segment: at most `budget` more decode steps under `params` (version [])."""
    e = _engine(params, segment, version, model=model, config=config, adapters=adapters)
    return segment.replace(slots=first_stage_steps(e, segment.slots, budget))


def finish(params: Any, segment: Segment, version: Array, *, model, config, adapters: Any = None) -> SampleOutput:
    """The last segment: every row decoded to its end under `params` (version []), the SampleOutput."""
    e = _engine(params, segment, version, model=model, config=config, adapters=adapters)
    return sample_output(e, run_to_end(e, segment.slots).out)


def segment_budget(rows: int, config, pieces: int) -> int:
    """Decode steps per segment so that a rollout of `rows` rows whose every row runs to
    max_new_tokens takes `pieces` segments: ceil(R / slots) * N decode steps, split evenly (shorter
    rows finish it in fewer; the last segment always runs to the end)."""
    return max(1, math.ceil(math.ceil(rows / config.slots) * config.max_new_tokens / pieces))


class SegmentedSampler:
    """`Sampler`'s continuous engine in segments, on its mesh, model and config: begin(params, prompt_tokens,
    prompt_mask, key, version, budget, adapters=None) -> Segment; advance(params, segment, version,
    budget, adapters=None) -> Segment; finish(params, segment, version, adapters=None) -> SampleOutput
    (batch-sharded like the Sampler's). Params and adapters keep the shardings they come with."""

    def __init__(self, sampler: Sampler):
        if sampler.config.engine != "continuous":
            raise ValueError("partial rollouts need the continuous engine (sampling.engine='continuous')")
        self.sampler = sampler
        model, config = sampler.model, sampler.config
        batch = sharding.data_sharding(sampler.mesh)
        out_shardings = SampleOutput(**{f.name: batch for f in dataclasses.fields(SampleOutput)})
        static = dict(model=model, config=config)
        self._begin = jax.jit(lambda p, t, m, k, v, b, a: begin(p, t, m, k, v, b, adapters=a, **static))
        self._advance = jax.jit(lambda p, s, v, b, a: advance(p, s, v, b, adapters=a, **static))
        self._finish = jax.jit(lambda p, s, v, a: finish(p, s, v, adapters=a, **static), out_shardings=out_shardings)

    @property
    def mesh(self):
        return self.sampler.mesh

    def begin(self, params, prompt_tokens, prompt_mask, key, version: int, budget: int, adapters=None) -> Segment:
        self.sampler._check(prompt_tokens, prompt_mask)
        with sharding.mesh_context(self.mesh):
            return self._begin(params, prompt_tokens, prompt_mask, key, np.int32(version), np.int32(budget), adapters)

    def advance(self, params, segment: Segment, version: int, budget: int, adapters=None) -> Segment:
        with sharding.mesh_context(self.mesh):
            return self._advance(params, segment, np.int32(version), np.int32(budget), adapters)

    def finish(self, params, segment: Segment, version: int, adapters=None) -> SampleOutput:
        with sharding.mesh_context(self.mesh):
            return self._finish(params, segment, np.int32(version), adapters)

    def abstract_segment(self, params, prompt_tokens, prompt_mask, key, adapters=None) -> Segment:
        """The Segment's shapes and dtypes (to rebuild one saved as host arrays)."""
        with sharding.mesh_context(self.mesh):
            return jax.eval_shape(self._begin, params, prompt_tokens, prompt_mask, key, np.int32(0), np.int32(0),
                                  adapters)
