"""Memory planner: per-device bytes of the four trees, optimizer states, KV cache and every jitted phase.

    ppo-jax-plan --config=configs/plan_llama7b.py --config.mesh.shape=1,8,1 --device_memory_gb=141
    ppo-jax-plan --config=configs/plan_llama7b.py --device_memory_gib=95 \
        --platform=tpu --tpu_topology=v5p:2x4x4          # XLA:TPU itself, no TPU needed (libtpu)

Nothing is allocated. The planner builds the trainer's own modules, optimizers, abstract train state
(shapes, dtypes and shardings from the logical axis rules) and the trainer's own jitted programs
(sampler, [scoring,] experience, update), lowers them on abstract inputs, compiles them, and reads
`compiled.memory_analysis()`, which is per device.

What the numbers mean:
  * Parameter, optimizer-state, KV-cache and batch-array bytes are shape arithmetic on the shardings
    (per-device shard shape x itemsize): exact by construction, whatever the compiler. They agree
    with the compiler's argument bytes (tests/test_plan.py checks it).
  * A phase's argument / output / aliased (donated) / temp bytes come from `memory_analysis()`.
    Arguments, outputs and aliases are the same on every backend. Temps are the compiler's own buffer
    assignment, so they depend on which compiler ran:
      - `--platform=tpu --tpu_topology=...`: XLA:TPU compiling for compile-only devices of that slice
        (libtpu installed, no TPU attached): the numbers a TPU run of these programs gets.
      - `--platform=cpu` (default): XLA:CPU with one fake CPU device per mesh device, so any mesh size
        plans on any machine. Its temps are an estimate of an accelerator's, not a measurement: XLA:CPU
        computes bf16 dots in f32 (f32 copies of gathered weights), fuses less and has no flash-style
        attention; see CPU_COMPILER_OPTIONS. Measured against XLA:TPU they come out higher.
      - `--platform=gpu|tpu|default` without a topology: this machine's own devices (enough of them).
  * A phase's peak = live + outputs - aliased + temps, where live is everything the trainer holds on
    the devices when the phase starts (all four trees, optimizer states, the state's scalars, this
    phase's batch inputs and the previous iteration's rollout and experience, which it keeps for
    samples), by shape arithmetic. Not the compiler's argument bytes: jit prunes arguments a program
    does not read (the experience step never reads the optimizer states), yet they stay in memory.
  * With roles.* (issue 31) the sampler is lowered on its own mesh, with its own copy of the policy
    (`rl/plan_roles.py`), and each phase's live bytes are those of the devices that run it: colocated
    (roles.sampler_mesh), the trainer's trees and the sampler's copy share every device; disaggregated
    (roles.sampler_devices), the sampler's devices hold its copy, prompts and samples only.
    `MemoryPlan.roles` reports each role's bytes per device. With roles.scoring=sampler the reference
    and reward model sit on the sampler's mesh too (`rl/plan_inputs.py`) and score each sample there,
    a fourth program, the "scoring" phase, counted with the sampler's role; the trainer's devices keep
    no frozen tree but a LoRA base, and `params` (the trainer's devices) shows the reference and
    reward model at 0.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax import sharding
from ppo_jax.accelerators.hlo import ProgramStructure
from ppo_jax.config import ConfigError, from_config
from ppo_jax.models import KV_CACHE_AXES, ModelConfig, boxed_params, init_cache
from ppo_jax.rl import build, plan_roles, roles
from ppo_jax.rl.plan_inputs import device_bytes, placed, sampler_inputs, scorer_inputs
from ppo_jax.rl.plan_roles import RolesPlan
from ppo_jax.rl.plan_shapes import MODEL_SHAPES, model_shape  # noqa: F401 (configs import them from here)
from ppo_jax.rl.settings import PPOHyper, Settings, stop_token_ids
from ppo_jax.rl.sizes import derive_sizes
from ppo_jax.rl.state import Rollout

GB = 10**9
GIB = 2**30

# XLA:CPU has no bf16 matmuls: it converts bf16 weights to f32 next to each dot, and its loop-invariant
# code motion then hoists those converts out of the layer scan, materialising an f32 copy of every
# stacked weight (measured: 157 GiB of temps instead of 24 for a 70B experience step on 8 devices). TPU and
# GPU multiply in bf16 and have no such copies, so CPU estimates are compiled without that pass.
# Measured against XLA:TPU (Llama-2-7B shape, v5p-64), the CPU temps stay above the TPU's.
CPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


# ----------------------------------------------------------------------------------------------
# Results.


@dataclasses.dataclass(frozen=True)
class PhaseMemory:
    """Per-device bytes of one jitted phase.

    argument/output/alias/temp: `compiled.memory_analysis()`; arguments are those the program reads
    (jit prunes unused ones), alias = outputs written into donated arguments. live: everything on the
    device when the phase starts (shape arithmetic), whether the program reads it or not.
    """

    name: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    live_bytes: int
    compile_seconds: float
    structure: ProgramStructure  # kernels, transposes, copies and loops of the optimised program

    @property
    def peak_bytes(self) -> int:
        """Live buffers, plus new outputs (those not written into donated inputs), plus temps."""
        return self.live_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclasses.dataclass(frozen=True)
class ModelSummary:
    arch: str
    num_params: int  # whole model, all devices
    param_dtype: str
    dtype: str
    remat: bool


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device memory of a PPO run (bytes unless named otherwise). Trees, batch arrays and the
    experience / update phases are the trainer's mesh's; the KV cache and the sampler (and scoring)
    phases the sampler's mesh's (the same mesh unless `roles` says otherwise)."""

    mesh_shape: tuple[int, ...]  # (data, fsdp, tensor, expert): the trainer's (mesh.shape)
    platform: str  # the compiler whose temp bytes these are ("cpu", "tpu", "gpu")
    device_kind: str  # e.g. "cpu", "TPU v5" (v5p)
    compiler_options: dict[str, Any]  # XLA options the phases were compiled with
    policy_model: ModelSummary
    reward_model: ModelSummary
    reward_source: str  # where the reward architecture came from
    value_model: ModelSummary | None  # None for critic-free estimators
    value_init: str
    reference: str  # how the reference is held: "copy" (of the policy), "<dtype> copy", "lora base", "lora base + imported"
    value_lora: bool  # adapters + head on a frozen base shared with the policy / reference / reward model
    batch: dict[str, int]  # prompts, samples, rows, prompt/response length, minibatch sizes
    # policy, reference, reward, value -> per-device bytes (roles.scoring=sampler: reference and reward 0,
    # held on the sampler's mesh instead: roles.sampler.frozen_bytes)
    params: dict[str, int]
    optimizer: dict[str, int]  # policy, value -> per-device bytes of the optax states
    kv_cache_bytes: int  # the sampler's [L, rows (continuous: decode slots), K, Lq + Lr - 1, Dh] k and v (inside its temps)
    batch_arrays: dict[str, int]  # rollout, experience -> per-device bytes
    phases: tuple[PhaseMemory, ...]
    roles: RolesPlan | None = None  # per-role memory when the sampler has its own mesh (roles.*)

    @property
    def scored_by_sampler(self) -> bool:
        """roles.scoring="sampler": the reference and reward model score on the sampler's mesh."""
        return self.roles is not None and self.roles.scoring == "sampler"

    @property
    def run_phases(self) -> tuple[str, ...]:
        """The programs this run compiles (`phases` holds those the plan compiled of them)."""
        return run_phases(self.scored_by_sampler)

    @property
    def resident_bytes(self) -> int:
        """Trees that stay on the trainer's devices for the whole run."""
        return sum(self.params.values()) + sum(self.optimizer.values())

    @property
    def peak_phase(self) -> PhaseMemory:
        return max(self.phases, key=lambda p: p.peak_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak_phase.peak_bytes

    @property
    def num_devices(self) -> int:
        """The trainer's devices (with a disaggregated sampler: plus roles.sampler.num_devices)."""
        return int(np.prod(self.mesh_shape))

    def fits(self, device_memory_bytes: float) -> bool:
        """Whether every phase's peak fits in `device_memory_bytes` per device (each phase's peak is
        on the devices that run it, so this holds for both roles' devices)."""
        return self.peak_bytes <= device_memory_bytes

    def to_dict(self, device_memory_bytes: float | None = None) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["phases"] = [dict(dataclasses.asdict(p), peak_bytes=p.peak_bytes) for p in self.phases]
        d["resident_bytes"] = self.resident_bytes
        d["peak_bytes"] = self.peak_bytes
        d["peak_phase"] = self.peak_phase.name
        d["num_devices"] = self.num_devices
        d["device_memory_bytes"] = device_memory_bytes
        d["fits"] = None if device_memory_bytes is None else self.fits(device_memory_bytes)
        if self.roles is None:
            del d["roles"]  # a one-mesh plan's JSON is what it was before roles existed
        elif not self.scored_by_sampler:
            del d["roles"]["scoring"]  # nor does a plan whose trainer scores change with roles.scoring
        return d


def _summary(cfg: ModelConfig) -> ModelSummary:
    return ModelSummary(arch=cfg.arch, num_params=cfg.num_params(), param_dtype=cfg.param_dtype,
                        dtype=cfg.dtype, remat=cfg.remat)


def _abstract(boxed: Any, mesh) -> Any:
    """Boxed abstract params -> ShapeDtypeStructs carrying their shardings."""
    shardings = sharding.tree_shardings(boxed, mesh)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        nn.unbox(boxed), shardings)


# ----------------------------------------------------------------------------------------------
# Configuration.


def planned_reward_config(s: Settings, policy_cfg: ModelConfig, mesh=None) -> tuple[ModelConfig, str]:
    """The reward model architecture to plan with, and where it came from.

    `plan.reward_model` (a model section, as policy.model) if the settings have one; else the
    config.json of reward.path (no weights read); else the policy's architecture.
    """
    if s.plan.reward_model is not None:
        return s.compute.apply(s.plan.reward_model, *build.mesh_platform(mesh)), "plan.reward_model"
    if s.reward.path:
        return build.reward_model_config(s, mesh), f"reward.path={s.reward.path}"
    if s.policy.reference_dtype:  # a frozen tree, held like the reference
        return (policy_cfg.replace(param_dtype=s.policy.reference_dtype),
                f"the policy's architecture, {s.policy.reference_dtype} like the reference")
    return policy_cfg, "same as the policy"


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


def _compile(name: str, lowered, live: int, compiler_options: dict[str, Any], inspect=None) -> PhaseMemory:
    start = time.perf_counter()
    compiled = lowered.compile(compiler_options=compiler_options or None)
    seconds = time.perf_counter() - start
    if inspect is not None:
        inspect(name, compiled)
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError(f"the {jax.default_backend()} compiler gives no memory analysis for {name}")
    return PhaseMemory(name=name, argument_bytes=int(m.argument_size_in_bytes),
                       output_bytes=int(m.output_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes),
                       temp_bytes=int(m.temp_size_in_bytes), live_bytes=int(live),
                       compile_seconds=round(seconds, 2), structure=ProgramStructure.from_hlo(compiled.as_text()))


# ----------------------------------------------------------------------------------------------
# The plan.


# In the order an iteration runs them; "scoring" only with roles.scoring="sampler" (the reference and
# reward model score each sample on the sampler's mesh: `Steps.scoring_jit`).
PHASES = ("sampler", "scoring", "experience", "update")


def run_phases(scored_outside: bool) -> tuple[str, ...]:
    """The programs a run compiles: PHASES, without "scoring" when the experience step scores."""
    return PHASES if scored_outside else tuple(p for p in PHASES if p != "scoring")


def plan_memory(config, mesh=None, phases: tuple[str, ...] = PHASES,
                inspect: Callable[[str, Any], None] | None = None, devices=None) -> MemoryPlan:
    """Plans a PPO run of `config` (a ConfigDict or Settings) on `mesh` (the trainer's; default:
    mesh.shape over `devices`, default this process's). With roles.* the sampler gets its own mesh as a
    run would make it (`rl/roles.py`): roles.sampler_mesh on the same devices, or roles.sampler_devices
    of `devices` (then pass `devices`, not `mesh`: the split picks the trainer's).

    `phases`: the programs to compile (all the run has by default; the peak is over these). `inspect`, if
    given, sees each (phase name, compiled program) before it is dropped (tests read its HLO). Raises
    ConfigError for a config that cannot run, before anything is compiled.
    """
    unknown = sorted(set(phases) - set(PHASES))
    if unknown or not phases:
        raise ConfigError(f"phases {list(phases)}: name one or more of {', '.join(PHASES)}")
    s = planned_settings(config)
    programs = run_phases(s.roles.scoring == "sampler")
    if not set(phases) & set(programs):
        raise ConfigError(f"phases {list(phases)}: this run has no such program (roles.scoring={s.roles.scoring}); "
                          f"name one or more of {', '.join(programs)}")
    # The split a run makes (a ConfigError names the field, before any compile): fake CPU,
    # compile-only GPU / TPU devices or this machine's; a disaggregated split picks the trainer's.
    meshes = roles.make_role_meshes(s.roles, s.mesh.shape, devices, trainer_mesh=mesh)
    mesh, sampler_mesh = meshes.trainer, meshes.sampler
    # "auto" execution choices (attention kernel, layer loop, decode loop) resolve for the devices
    # compiled for, not this host: a GPU plan made on a CPU machine compiles a GPU run's programs.
    platform = mesh.devices.flat[0].platform
    policy_cfg = build.policy_model_config(s, mesh)
    reward_cfg, reward_source = planned_reward_config(s, policy_cfg, mesh)
    sizes = derive_sizes(s, batch_divisor=sharding.batch_divisor(mesh),
                         max_positions=policy_cfg.max_position_embeddings, vocab_size=policy_cfg.vocab_size,
                         platform=platform, sampler_divisor=sharding.batch_divisor(sampler_mesh))
    hp = PPOHyper.from_settings(s, sizes)

    modules = build.make_modules(s, policy_cfg, reward_cfg)
    policy_tx, value_tx = build.make_optimizers(s)
    state, state_shardings = build.abstract_train_state(s, modules, policy_tx, value_tx, mesh)
    reward = _abstract(boxed_params(modules.reward), mesh)
    # With LoRA the trainable policy is its adapters, beside a frozen base that is also the reference
    # (with imported adapters the reference is base + a frozen copy of them). A LoRA value model's
    # base is a subtree of these trees (FrozenParams.value), held once: counted under its owner only.
    base = _abstract(boxed_params(modules.policy), mesh) if policy_cfg.lora is not None else None
    reference = (build.as_reference(s, state.policy) if base is None
                 else state.policy if s.policy.lora.init_from else None)
    frozen = build.frozen_params(s, modules, reference, reward, base)
    frozen_shardings = jax.tree.map(lambda s: s.sharding, frozen)
    # roles.scoring="sampler": the reference and reward model live on the sampler's mesh; the trainer
    # keeps the rest (a LoRA base, a LoRA value base), and `params` counts the trainer's devices.
    kept = roles.trainer_frozen(frozen) if hp.scored_outside else frozen

    policy_bytes = device_bytes(state.policy) + (device_bytes(base) if base is not None else 0)
    params = {"policy": policy_bytes,
              "reference": device_bytes(kept.reference) if kept.reference is not None else 0,
              "reward": device_bytes(kept.reward),
              # With value LoRA: its adapters + head (the trainable tree), no base of its own.
              "value": device_bytes(state.value) if state.value is not None else 0}
    optimizer = {"policy": device_bytes(state.policy_opt),
                 "value": device_bytes(state.value_opt) if state.value_opt is not None else 0}

    stop_ids = stop_token_ids(s.rollout, policy_cfg.eos_token_id) or (0,)
    pad_id = policy_cfg.pad_token_id if policy_cfg.pad_token_id is not None else 0
    # The decode loop a run on the planned mesh picks (rollout.decode); a CPU plan stands in for a
    # TPU's and gets its scanned decode (the CPU default unrolls it, with a copy of the layer weights
    # an accelerator run does not make).
    unroll = False if platform == "cpu" and s.rollout.decode == "auto" else None
    steps = build.build_steps(s, mesh, sizes, hp, modules, policy_tx, value_tx, state_shardings,
                              frozen_shardings, stop_ids, pad_id, unroll_layers=unroll, sampler_mesh=sampler_mesh)

    # Sampler, on its mesh: prompts [B, Lq] in, SampleOutput with R = B * n rows out. It reads the
    # trainer's own policy when it shares the mesh, else its copy (synced there after every update).
    batch_sh = sharding.data_sharding(mesh)
    prompts = jax.ShapeDtypeStruct((s.rollout.batch_size, s.data.prompt_length),
                                   jnp.int32, sharding=sharding.data_sharding(sampler_mesh))
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=sharding.replicated(sampler_mesh))
    decoded = sampler_inputs(state.policy, base, steps.sampler_shardings, meshes.shared)
    sampler_lowered = steps.sampler.lower(decoded.params, prompts, prompts, key, adapters=decoded.adapters)
    sample = sampler_lowered.out_info
    rows = sample.tokens.shape[0]
    lowered = {"sampler": sampler_lowered}
    # roles.scoring="sampler": the scorer's trees score the sample on the sampler's mesh, and its
    # reference log-probs [R, Lr] and model scores [R] travel with the rollout.
    scorer, scored = None, {}
    if hp.scored_outside:
        scorer = scorer_inputs(frozen, steps.scorer_shardings)
        with sharding.mesh_context(sampler_mesh):
            lowered["scoring"] = steps.scoring_jit.lower(scorer.frozen, sample.prompt_tokens, sample.prompt_mask,
                                                         sample.tokens, sample.mask)
        scored = dict(zip(("ref_logprobs", "model_scores"), lowered["scoring"].out_info))
    # The trainer scores the sample on its own mesh (moved there when the sampler has its own).
    rollout = Rollout(
        prompt_tokens=sample.prompt_tokens, prompt_mask=sample.prompt_mask, tokens=sample.tokens,
        mask=sample.mask, sampler_logprobs=sample.logprobs, stopped=sample.stopped,
        host_scores=jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=batch_sh), **scored)
    rollout = rollout if meshes.shared else placed(rollout, batch_sh)

    with sharding.mesh_context(mesh):
        experience_lowered = steps.experience_jit.lower(state, kept, rollout)
        experience = experience_lowered.out_info[0]
        update_lowered = steps.update_jit.lower(state, base, frozen.value, experience)

    # The static engine caches every row, the continuous one its decode slots only.
    cache_rows = sizes.decode_slots or rows
    width = s.data.prompt_length + s.rollout.response_length - 1
    cache = jax.eval_shape(lambda: init_cache(policy_cfg, cache_rows, width, steps.sampling_config.cache_dtype))
    cache_sh = jax.sharding.NamedSharding(sampler_mesh, sharding.logical_to_spec(KV_CACHE_AXES, cache.k.shape,
                                                                                 sampler_mesh))
    kv_cache_bytes = 2 * device_bytes(jax.ShapeDtypeStruct(cache.k.shape, cache.k.dtype, sharding=cache_sh))
    batch_arrays = {"rollout": device_bytes(rollout), "experience": device_bytes(experience)}

    # On the devices when each phase starts: every tree and the state's scalars for the whole run, the
    # previous iteration's (rollout, experience) that the trainer keeps for samples, and the phase's
    # batch inputs (the update runs while the current rollout is still referenced).
    key_data = jax.eval_shape(jax.random.key_data, state.key)  # the key is replicated: every device holds it
    scalars = device_bytes((state.step, state.kl)) + math.prod(key_data.shape) * key_data.dtype.itemsize
    holdings = plan_roles.Holdings(
        trainer_resident=sum(params.values()) + sum(optimizer.values()) + scalars,
        held=batch_arrays["rollout"] + batch_arrays["experience"], rollout=batch_arrays["rollout"],
        experience=batch_arrays["experience"], prompts=device_bytes((prompts, prompts)),
        policy_copy=decoded.copy_bytes,
        sample=device_bytes(sample), scorer_frozen=scorer.frozen_bytes if scorer else 0,
        scores=device_bytes(tuple(scored.values())))
    live = plan_roles.phase_live(holdings, plan_roles.layout(meshes), s.rollout.off_policy_steps == 1)
    lowered.update(experience=experience_lowered, update=update_lowered)
    options = dict(CPU_COMPILER_OPTIONS) if platform == "cpu" else {}
    compiled = tuple(_compile(name, lowered[name], live[name], options, inspect) for name in programs if name in phases)
    trainable = params["policy"] - (device_bytes(base) if base is not None else 0) + params["value"]
    role_plan = plan_roles.roles_plan(
        meshes, compiled, holdings, train_state=trainable + sum(optimizer.values()) + scalars,
        frozen=holdings.trainer_resident - trainable - sum(optimizer.values()) - scalars,
        kv_cache=kv_cache_bytes,
        sync_bytes=roles.tree_bytes(state.policy),  # the trainable policy: full params, or with LoRA the adapters
        base_sync_bytes=roles.tree_bytes(base) if base is not None else 0, scoring=s.roles.scoring)
    return MemoryPlan(
        mesh_shape=tuple(int(mesh.shape[a]) for a in sharding.MESH_AXES),
        platform=platform, device_kind=mesh.devices.flat[0].device_kind, compiler_options=options,
        policy_model=_summary(policy_cfg), reward_model=_summary(reward_cfg), reward_source=reward_source,
        value_model=_summary(modules.value.config) if modules.value is not None else None,
        value_init=s.value.init, value_lora=build.value_lora(modules),
        reference=("lora base + imported" if s.policy.lora.init_from else "lora base" if base is not None
                   else f"{s.policy.reference_dtype} copy" if s.policy.reference_dtype else "copy"),
        batch={"prompts": s.rollout.batch_size, "samples_per_prompt": s.rollout.num_samples,
               "rows": sizes.rollout_rows, "prompt_length": s.data.prompt_length,
               "response_length": s.rollout.response_length,
               "minibatch_rows": sizes.minibatch_rows, "microbatch_rows": sizes.microbatch_rows,
               "forward_rows": sizes.forward_rows, "epochs": s.ppo.epochs, "packed_rows": sizes.packed_rows,
               "engine": s.rollout.engine, "decode_slots": sizes.decode_slots},
        params=params, optimizer=optimizer, kv_cache_bytes=kv_cache_bytes, batch_arrays=batch_arrays,
        phases=compiled, roles=role_plan)
