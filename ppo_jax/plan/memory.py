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
    (`plan/role_memory.py`), and each phase's live bytes are those of the devices that run it: colocated
    (roles.sampler_mesh), the trainer's trees and the sampler's copy share every device; disaggregated
    (roles.sampler_devices), the sampler's devices hold its copy, prompts and samples only.
    `MemoryPlan.roles` reports each role's bytes per device. With roles.scoring=sampler the reference
    and reward model sit on the sampler's mesh too (`rl/phase_inputs.py`) and score each sample there,
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

import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.accelerators.hlo import ProgramStructure
from ppo_jax.config import ConfigError
from ppo_jax.models import ModelConfig
from ppo_jax.plan import role_memory
from ppo_jax.plan.programs import LoweredRun, PlannedRun, kv_cache_bytes, lower_programs, planned_run, planned_settings
from ppo_jax.plan.role_memory import Holdings, RolesPlan
from ppo_jax.rl import build, roles
from ppo_jax.sampling import weights

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

    mesh_shape: tuple[int, ...]  # (data, fsdp, tensor, expert, context): the trainer's (mesh.shape)
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




@dataclasses.dataclass(frozen=True)
class TreeBytes:
    """Per-device bytes of what a run holds for its whole length, by shape arithmetic."""

    params: dict[str, int]  # policy (+ a LoRA base), reference, reward, value: on the trainer's devices
    optimizer: dict[str, int]  # policy, value: the optax states
    scalars: int  # the state's step, KL controller and key (replicated)
    base: int  # a LoRA policy's frozen base (inside params["policy"]), 0 without LoRA

    @property
    def resident(self) -> int:
        return sum(self.params.values()) + sum(self.optimizer.values()) + self.scalars

    @property
    def train_state(self) -> int:
        """Trainable params (the policy's without its base, the value's) + optimizer states + scalars."""
        return self.params["policy"] - self.base + self.params["value"] + sum(self.optimizer.values()) + self.scalars


def tree_bytes(run: PlannedRun) -> TreeBytes:
    state, kept = run.state, run.kept
    base = sharding.device_bytes(run.base) if run.base is not None else 0
    params = {"policy": sharding.device_bytes(state.policy) + base,
              "reference": sharding.device_bytes(kept.reference) if kept.reference is not None else 0,
              "reward": sharding.device_bytes(kept.reward),
              "teacher": sharding.device_bytes(kept.teacher),  # on-policy distillation (0: none)
              # With value LoRA: its adapters + head (the trainable tree), no base of its own.
              "value": sharding.device_bytes(state.value) if state.value is not None else 0}
    optimizer = {"policy": sharding.device_bytes(state.policy_opt),
                 "value": sharding.device_bytes(state.value_opt) if state.value_opt is not None else 0}
    key_data = jax.eval_shape(jax.random.key_data, state.key)  # the key is replicated: every device holds it
    scalars = sharding.device_bytes((state.step, state.kl)) + math.prod(key_data.shape) * key_data.dtype.itemsize
    return TreeBytes(params, optimizer, scalars, base)


def holdings(trees: TreeBytes, low: LoweredRun) -> Holdings:
    """On the devices when each phase starts: every tree and the state's scalars for the whole run, the
    previous iteration's (rollout, experience) that the trainer keeps for samples, and the phase's
    batch inputs (the update runs while the current rollout is still referenced)."""
    rollout, experience = sharding.device_bytes(low.rollout), sharding.device_bytes(low.experience)
    return Holdings(
        trainer_resident=trees.resident, held=rollout + experience, rollout=rollout, experience=experience,
        prompts=sharding.device_bytes((low.prompts, low.prompts)), policy_copy=low.decoded.copy_bytes,
        sample=sharding.device_bytes(low.sample), scorer_frozen=low.scorer.frozen_bytes if low.scorer else 0,
        scores=sharding.device_bytes(low.scores))


def reference_kind(s, lora: bool) -> str:
    """How the reference is held (`MemoryPlan.reference`)."""
    if s.policy.lora.init_from:
        return "lora base + imported"
    if lora:
        return "lora base"
    return f"{s.policy.reference_dtype} copy" if s.policy.reference_dtype else "copy"


def batch_figures(run: PlannedRun) -> dict[str, int]:
    s, sizes = run.settings, run.sizes
    return {"prompts": s.rollout.batch_size, "samples_per_prompt": s.rollout.num_samples,
            "rows": sizes.rollout_rows, "prompt_length": s.data.prompt_length,
            "response_length": s.rollout.response_length,
            "minibatch_rows": sizes.minibatch_rows, "microbatch_rows": sizes.microbatch_rows,
            "forward_rows": sizes.forward_rows, "epochs": s.ppo.epochs, "packed_rows": sizes.packed_rows,
            "engine": s.rollout.engine, "decode_slots": sizes.decode_slots}


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
    run = planned_run(s, mesh, devices)
    low = lower_programs(run)
    trees = tree_bytes(run)
    held = holdings(trees, low)
    kv_cache = kv_cache_bytes(run, low.steps, low.sample.tokens.shape[0])
    # rollout.partial_rollouts: each rollout in flight keeps its slots' KV cache between segments.
    live = role_memory.phase_live(held, role_memory.layout(run.meshes), s.rollout.off_policy_steps,
                                  engine_state=kv_cache if s.rollout.partial_rollouts else 0)
    options = dict(CPU_COMPILER_OPTIONS) if run.platform == "cpu" else {}
    compiled = tuple(_compile(name, low.lowered[name], live[name], options, inspect)
                     for name in programs if name in phases)
    sync_dtype = low.steps.sampler_shardings.dtype
    role_plan = role_memory.roles_plan(
        run.meshes, compiled, held, train_state=trees.train_state, frozen=trees.resident - trees.train_state,
        kv_cache=kv_cache,
        # the trainable policy (full params, or with LoRA the adapters) in the dtype the sync sends
        sync_bytes=roles.tree_bytes(weights.cast_for_sampler(run.state.policy, sync_dtype)),
        base_sync_bytes=roles.tree_bytes(weights.cast_for_sampler(run.base, sync_dtype)) if run.base is not None else 0,
        scoring=s.roles.scoring)
    mesh = run.mesh
    return MemoryPlan(
        mesh_shape=tuple(int(mesh.shape[a]) for a in sharding.MESH_AXES),
        platform=run.platform, device_kind=mesh.devices.flat[0].device_kind, compiler_options=options,
        policy_model=_summary(run.policy_config), reward_model=_summary(run.reward_config),
        reward_source=run.reward_source,
        value_model=_summary(run.modules.value.config) if run.modules.value is not None else None,
        value_init=s.value.init, value_lora=build.value_lora(run.modules),
        reference=reference_kind(s, run.base is not None), batch=batch_figures(run),
        params=trees.params, optimizer=trees.optimizer, kv_cache_bytes=kv_cache,
        batch_arrays={"rollout": held.rollout, "experience": held.experience}, phases=compiled, roles=role_plan)
