"""The abstract inputs of a run's phases (ShapeDtypeStructs carrying shardings): what the memory
planner (`ppo_jax.plan`) lowers each role's programs on, and what a run compiles them on ahead of
its first iteration (`rl/precompile.py`). Each builder follows the call it stands for, so a program
lowered on its output is the program that call runs.

    abstract:         arrays -> their ShapeDtypeStructs (a run's own trees)
    sampler_inputs:   the sampler's policy (its own copy on its own mesh; with LoRA the base and adapters)
    scorer_inputs:    roles.scoring="sampler": the reference and reward model on the sampler's mesh
    prompts_and_key:  the sampler's prompt batch [B, Lq] and key
    sampled_rollout:  the experience step's `Rollout` of a sample, as `Rollouts.finish` hands it over
    lowered_phases:   the phases lowered on these, in order (the planner's and the run's one sequence)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax import sharding
from ppo_jax.rl import roles
from ppo_jax.rl.build import Steps
from ppo_jax.rl.hyper import PPOHyper
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import FrozenOutputs, FrozenParams, PPOState, Rollout, policy_variables
from ppo_jax.sampling import weights
from ppo_jax.sharding import device_bytes


def abstract(tree: Any) -> Any:
    """Arrays -> ShapeDtypeStructs of the same shape, dtype, weak type and sharding: what a jitted
    function is lowered on so that a later call with the arrays finds its program compiled."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                                       weak_type=getattr(x, "weak_type", False)), tree)


def placed(tree: Any, shardings: Any) -> Any:
    """A tree of ShapeDtypeStructs on other shardings (a tree of them, or one for every leaf)."""
    if tree is None:
        return None
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings)


@dataclasses.dataclass(frozen=True)
class SamplerInputs:
    """What the sampler decodes with (ShapeDtypeStructs on its shardings) and the per-device bytes its
    devices hold for it beyond the trainer's own trees."""

    params: Any
    adapters: Any  # None without LoRA or with a merged copy
    copy_bytes: int


def sampler_inputs(policy: Any, base: Any, where: roles.SamplerShardings, shared: bool) -> SamplerInputs:
    """The sampler's policy as a run holds it (`rl/weight_sync.WeightSync.weights`). `policy`: the
    trainable tree (full params, or LoRA adapters on `base`). On the trainer's own mesh the sampler
    reads the trainer's trees; on its own mesh it keeps a copy (with LoRA: of the base, synced once,
    and of the adapters, synced each step). roles.lora_sync="merged" decodes a merged copy of the
    base's shapes instead of the adapters (kept beside the base copy it is rebuilt from). A copy is
    held in `where.dtype` (bf16 beside fp32 master weights: `weights.sampler_dtype`)."""
    params, adapters = policy_variables(policy, base)
    held = functools.partial(weights.cast_for_sampler, dtype=where.dtype)  # the dtype the sync sends and it holds
    if base is None:
        params = params if shared else held(placed(params, where.params))
        return SamplerInputs(params, None, 0 if shared else device_bytes(params))
    base_copy = 0 if shared else device_bytes(held(placed(base, where.params)))
    if where.merged:
        merged = placed(base, where.params)
        return SamplerInputs(merged, None, base_copy + device_bytes(merged))
    if shared:
        return SamplerInputs(params, adapters, 0)
    adapters = held(placed(adapters, where.synced_adapters))
    return SamplerInputs(held(placed(base, where.params)), adapters, base_copy + device_bytes(adapters))


@dataclasses.dataclass(frozen=True)
class ScorerInputs:
    """What the scoring program reads on the sampler's mesh (roles.scoring="sampler"; ShapeDtypeStructs
    on `Steps.scorer_shardings`) and the per-device bytes its frozen trees add to the sampler's devices."""

    frozen: FrozenParams
    frozen_bytes: int  # reference (with LoRA: imported reference adapters, if any) + reward model


def scorer_inputs(frozen: FrozenParams, shardings: FrozenParams) -> ScorerInputs:
    """The scorer's trees as a run moves them (`rl/rollout_source.SamplerScorer`): `frozen`, the run's
    frozen trees (on the trainer's shardings), placed on the scorer's `shardings`. With LoRA the
    reference is the sampler's own base copy (already the sampler's policy copy, so not counted
    again); a LoRA value base never goes (the trainer's value forward reads it)."""
    scorer = placed(FrozenParams(reference=frozen.reference, reward=frozen.reward, policy=frozen.policy), shardings)
    return ScorerInputs(scorer, device_bytes((scorer.reference, scorer.reward)))


def prompts_and_key(s: Settings, sampler_mesh) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The prompt batch [B, Lq] int32 batch-sharded on the sampler's mesh (tokens and mask alike), and
    the replicated typed key: the sampler's inputs besides its weights (`WholeSamples.begin`)."""
    prompts = jax.ShapeDtypeStruct((s.rollout.batch_size, s.data.prompt_length), jnp.int32,
                                   sharding=sharding.data_sharding(sampler_mesh))
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=sharding.replicated(sampler_mesh))
    return prompts, key


def sampled_rollout(s: Settings, meshes: roles.RoleMeshes, sample: Any, scores: tuple = ()) -> Rollout:
    """The experience step's `Rollout` of an abstract sample [R, ...] (the sampler's output) as
    `Rollouts.finish` hands it over: the host scores and versions [R] beside it, all on the
    trainer's mesh; `scores`: roles.scoring="sampler"'s reference log-probs [R, Lr] and model
    scores [R], scored on the sampler's mesh."""
    batch = sharding.data_sharding(meshes.trainer)
    rows = sample.tokens.shape[0]
    rollout = Rollout(
        prompt_tokens=sample.prompt_tokens, prompt_mask=sample.prompt_mask, tokens=sample.tokens,
        mask=sample.mask, sampler_logprobs=sample.logprobs, behaviour_logprobs=sample.sampling_logprobs,
        stopped=sample.stopped, routed_experts=sample.routed_experts,
        host_scores=jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=batch),
        policy_version=jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=batch),
        # rollout.partial_rollouts: each token's policy version travels too (the run's experience program)
        token_policy_version=(jax.ShapeDtypeStruct(sample.tokens.shape, jnp.int32, sharding=batch)
                              if s.rollout.partial_rollouts else None),
        frozen_outputs=FrozenOutputs(*scores) if scores else None)
    return rollout if meshes.shared else placed(rollout, batch)


def lowered_phases(steps: Steps, s: Settings, hp: PPOHyper, meshes: roles.RoleMeshes, state: PPOState,
                   kept: FrozenParams, decoded: SamplerInputs, scorer: FrozenParams | None, *,
                   update: bool = True) -> Iterator[tuple[str, Any]]:
    """The run's jitted phases lowered on abstract trees, each on the mesh that runs it and yielded as
    soon as it is lowered (a caller may compile it while the next one lowers): "sampler", "scoring"
    (roles.scoring="sampler": `scorer` holds its frozen trees), "experience", then "update" unless
    `update` is False. Each later phase is lowered on the output shapes of the one before. state,
    kept: the train state and the frozen trees the trainer keeps; decoded: `sampler_inputs`."""
    prompts, key = prompts_and_key(s, meshes.sampler)
    lowered = steps.sampler.lower(decoded.params, prompts, prompts, key, adapters=decoded.adapters)
    yield "sampler", lowered
    sample, scores = lowered.out_info, ()
    if hp.scored_outside:  # the sample is scored on the sampler's mesh; its outputs travel with the rollout
        with sharding.mesh_context(meshes.sampler):
            lowered = steps.scoring_jit.lower(scorer, sample.prompt_tokens, sample.prompt_mask, sample.tokens,
                                              sample.mask)
        yield "scoring", lowered
        scores = tuple(lowered.out_info)
    with sharding.mesh_context(meshes.trainer):
        lowered = steps.experience_jit.lower(state, kept, sampled_rollout(s, meshes, sample, scores))
    yield "experience", lowered
    if update:
        with sharding.mesh_context(meshes.trainer):
            lowered = steps.update_jit.lower(state, kept, lowered.out_info[0])
        yield "update", lowered
