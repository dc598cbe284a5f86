"""The programs a PPO run compiles, built and lowered on abstract inputs: no weight is read, nothing is
allocated. `planned_run` builds what the trainer would (settings, meshes, modules, optimizers, the
abstract train state and frozen trees, all with their shardings) through `rl/build.py`;
`lower_programs` lowers the run's own jitted phases (sampler, [scoring,] experience, update) on
them. `ppo_jax.plan.memory` compiles those and reads what each holds.

Shapes: B prompts, R = B * n rollout rows, Lq prompt length, Lr response length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax

from ppo_jax import sharding
from ppo_jax.config import from_config
from ppo_jax.models import ModelConfig, boxed_params, init_cache
from ppo_jax.models.cache import SPLIT_KV_CACHE_AXES
from ppo_jax.rl import build, roles
from ppo_jax.rl.phase_inputs import (SamplerInputs, ScorerInputs, lowered_phases, prompts_and_key, sampled_rollout,
                                     sampler_inputs, scorer_inputs)
from ppo_jax.rl.hyper import DerivedSizes, PPOHyper
from ppo_jax.rl.settings import Settings, stop_token_ids
from ppo_jax.rl.sizes import derive_sizes
from ppo_jax.rl.state import FrozenParams, Modules, Rollout, PPOState


def abstract_params(boxed: Any, mesh) -> Any:
    """Boxed abstract params -> ShapeDtypeStructs carrying their shardings."""
    shardings = sharding.tree_shardings(boxed, mesh)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        nn.unbox(boxed), shardings)


def planned_reward_config(s: Settings, policy_cfg: ModelConfig, mesh=None) -> tuple[ModelConfig, str]:
    """The reward model architecture to plan with, and where it came from.

    `plan.reward_model` (a model section, as policy.model) if the settings have one; else the
    config.json of reward.path (no weights read); else the policy's architecture. Each is held and
    run as the trainer would hold a checkpoint: in reward.param_dtype / reward.dtype ("" = the policy's).
    """
    if s.plan.reward_model is None and s.reward.path:
        return build.reward_model_config(s.reward, s.compute, policy_cfg, mesh), f"reward.path={s.reward.path}"
    cfg, source = ((s.plan.reward_model, "plan.reward_model") if s.plan.reward_model is not None
                   else (policy_cfg, "same as the policy"))
    if s.reward.param_dtype and s.reward.param_dtype != policy_cfg.param_dtype:
        source += f", held in {s.reward.param_dtype}"
    return s.compute.apply(build.in_reward_dtypes(s.reward, cfg, policy_cfg), *build.mesh_platform(mesh)), source


def planned_settings(config) -> Settings:
    """The settings, validated with the planned reward model standing in for a reward source."""
    s = config if isinstance(config, Settings) else from_config(Settings, config)
    if not s.reward.path:
        # Only the reward path's presence is validated; the planner never reads it.
        s = s.replace(reward=dataclasses.replace(s.reward, path="<planned reward model>"))
        s.validate()
        return s.replace(reward=dataclasses.replace(s.reward, path=""))
    s.validate()
    return s


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """What a run of the settings builds before it loads a weight, as abstract trees
    (ShapeDtypeStructs carrying shardings) on the meshes a run would make."""

    settings: Settings
    meshes: roles.RoleMeshes
    platform: str  # the planned devices' ("cpu", "gpu", "tpu"): "auto" choices resolve for it
    policy_config: ModelConfig
    reward_config: ModelConfig
    reward_source: str  # where the reward architecture came from
    sizes: DerivedSizes
    hp: PPOHyper
    modules: Modules
    policy_tx: Any
    value_tx: Any
    state: PPOState  # abstract
    state_shardings: PPOState
    base: Any  # a LoRA policy's frozen base (None for full fine-tuning)
    frozen: FrozenParams  # every frozen tree
    kept: FrozenParams  # those the trainer's devices keep (roles.scoring="sampler": not the reference, reward)

    @property
    def mesh(self):
        return self.meshes.trainer


def planned_run(s: Settings, mesh=None, devices=None) -> PlannedRun:
    """The abstract run of validated settings `s` on `mesh` (the trainer's; see `plan_memory`)."""
    # The split a run makes (a ConfigError names the field, before any compile): fake CPU,
    # compile-only GPU / TPU devices or this machine's; a disaggregated split picks the trainer's.
    meshes = roles.make_role_meshes(s.roles, s.mesh.shape, devices, trainer_mesh=mesh)
    mesh = meshes.trainer
    # "auto" execution choices (attention kernel, layer loop, decode loop) resolve for the devices
    # compiled for, not this host: a GPU plan made on a CPU machine compiles a GPU run's programs.
    platform = mesh.devices.flat[0].platform
    policy_cfg = build.policy_model_config(s, mesh)
    reward_cfg, reward_source = planned_reward_config(s, policy_cfg, mesh)
    sizes = derive_sizes(s, batch_divisor=sharding.batch_divisor(mesh),
                         max_positions=policy_cfg.max_position_embeddings, vocab_size=policy_cfg.vocab_size,
                         platform=platform, sampler_divisor=sharding.batch_divisor(meshes.sampler))
    hp = PPOHyper.from_settings(s, sizes)
    # On-policy distillation: the teacher's config.json (no weights read), held as a run holds it.
    teacher_cfg = build.teacher_model_config(s.distill, s.compute, policy_cfg, mesh)
    modules = build.make_modules(s.ppo, s.value, policy_cfg, reward_cfg, teacher_cfg)
    policy_tx, value_tx = build.make_optimizers(s)
    state, state_shardings = build.abstract_train_state(s.ppo, modules, policy_tx, value_tx, mesh)
    reward = abstract_params(boxed_params(modules.reward), mesh)
    # With LoRA the trainable policy is its adapters, beside a frozen base that is also the reference
    # (with imported adapters the reference is base + a frozen copy of them). A LoRA value model's
    # base is a subtree of these trees (FrozenParams.value), held once: counted under its owner only.
    base = abstract_params(boxed_params(modules.policy), mesh) if policy_cfg.lora is not None else None
    reference = (build.as_reference(s.policy, state.policy) if base is None
                 else state.policy if s.policy.lora.init_from else None)
    teacher = abstract_params(boxed_params(modules.teacher), mesh) if modules.teacher is not None else None
    frozen = build.frozen_params(s.value, modules, reference, reward, base, teacher)
    # roles.scoring="sampler": the reference and reward model live on the sampler's mesh; the trainer
    # keeps the rest (a LoRA base, a LoRA value base).
    kept = roles.trainer_frozen(frozen) if hp.scored_outside else frozen
    return PlannedRun(s, meshes, platform, policy_cfg, reward_cfg, reward_source, sizes, hp, modules, policy_tx,
                      value_tx, state, state_shardings, base, frozen, kept)


@dataclasses.dataclass(frozen=True)
class LoweredRun:
    """The run's phases lowered (by name), with the abstract arrays that pass between them."""

    lowered: dict[str, Any]  # "sampler", ["scoring",] "experience", "update" -> jax Lowered
    steps: build.Steps
    prompts: jax.ShapeDtypeStruct  # [B, Lq] on the sampler's mesh
    sample: Any  # the sampler's SampleOutput [R, ...] on its mesh
    scores: tuple  # roles.scoring="sampler": reference log-probs [R, Lr] and model scores [R] there; else ()
    rollout: Rollout  # on the trainer's mesh
    experience: Any  # Experience [R, ...]
    decoded: SamplerInputs  # what the sampler decodes with
    scorer: ScorerInputs | None  # roles.scoring="sampler": the frozen trees it scores with


def lower_programs(run: PlannedRun) -> LoweredRun:
    """The run's own jitted phases (`build.build_steps`) lowered on the abstract trees, each on the
    mesh that runs it."""
    s, hp, meshes, mesh = run.settings, run.hp, run.meshes, run.mesh
    sampler_mesh = meshes.sampler
    stop_ids = stop_token_ids(s.rollout, run.policy_config.eos_token_id) or (0,)
    pad_id = run.policy_config.pad_token_id if run.policy_config.pad_token_id is not None else 0
    # The decode loop a run on the planned mesh picks (rollout.decode); a CPU plan stands in for a
    # TPU's and gets its scanned decode (the CPU default unrolls it, with a copy of the layer weights
    # an accelerator run does not make).
    unroll = False if run.platform == "cpu" and s.rollout.decode == "auto" else None
    frozen_shardings = jax.tree.map(lambda x: x.sharding, run.frozen)
    steps = build.build_steps(s, mesh, run.sizes, hp, run.modules, run.policy_tx, run.value_tx, run.state_shardings,
                              frozen_shardings, stop_ids, pad_id, unroll_layers=unroll, sampler_mesh=sampler_mesh)

    # Sampler, on its mesh: prompts [B, Lq] in, SampleOutput with R = B * n rows out. It reads the
    # trainer's own policy when it shares the mesh, else its copy (synced there after every update).
    # roles.scoring="sampler": the scorer's trees score the sample on the sampler's mesh, and its
    # reference log-probs [R, Lr] and model scores [R] travel with the rollout to the trainer's mesh.
    decoded = sampler_inputs(run.state.policy, run.base, steps.sampler_shardings, meshes.shared)
    scorer = scorer_inputs(run.frozen, steps.scorer_shardings) if hp.scored_outside else None
    lowered = dict(lowered_phases(steps, s, hp, meshes, run.state, run.kept, decoded, scorer and scorer.frozen))
    prompts, _ = prompts_and_key(s, sampler_mesh)
    sample = lowered["sampler"].out_info
    scores = tuple(lowered["scoring"].out_info) if "scoring" in lowered else ()
    rollout = sampled_rollout(s, meshes, sample, scores)
    experience = lowered["experience"].out_info[0]
    return LoweredRun(lowered, steps, prompts, sample, scores, rollout, experience, decoded, scorer)


def kv_cache_bytes(run: PlannedRun, steps: build.Steps, rows: int) -> int:
    """Per-device bytes of the sampler's k and v caches [L, rows, K, Lq + Lr - 1, Dh]: the static
    engine caches every row, the continuous one its decode slots only."""
    s, sampler_mesh = run.settings, run.meshes.sampler
    cache_rows = run.sizes.decode_slots or rows
    width = s.data.prompt_length + s.rollout.response_length - 1
    width += -width % sharding.context_axis_size(sampler_mesh)  # split over the context axis (sampling/loop.py)
    cache = jax.eval_shape(lambda: init_cache(run.policy_config, cache_rows, width, steps.sampling_config.cache_dtype))
    cache_sh = jax.sharding.NamedSharding(sampler_mesh, sharding.logical_to_spec(SPLIT_KV_CACHE_AXES, cache.k.shape,
                                                                                 sampler_mesh))
    return 2 * sharding.device_bytes(jax.ShapeDtypeStruct(cache.k.shape, cache.k.dtype, sharding=cache_sh))
