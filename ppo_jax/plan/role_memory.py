"""The memory planner's roles (issue 31): what each device holds when the sampler has its own mesh.

`rl/roles.py` places the sampler (rollout decoding) on its own mesh: colocated (all devices, another
layout: `roles.sampler_mesh`) or disaggregated (a device subset of its own: `roles.sampler_devices`).
The planner then lowers the sampler on the sampler's mesh (its own copy of the policy, KV cache and
temps) and the experience / update on the trainer's, and reports per role:

    trainer devices: train state (trainable params + optimizer states) + frozen trees + the larger of
                     the experience / update temps
    sampler devices: the sampler's copy of the policy (with LoRA: the base + adapters) + KV cache
                     (inside the sampler's temps) + the sampler's temps

With roles.scoring="sampler" the reference and reward model move from the trainer's frozen trees to
the sampler's devices (the sampler's "frozen"; with LoRA the reference is the sampler's base copy),
and the scoring program that runs them there right after each sample is the sampler role's second
phase, "scoring": a program of its own, with its own temps (the reference's logits, the reward
model's activations), so its row shows whether decoding or scoring sets the sampler devices' peak.

Colocated, both roles' trees sit on the same devices: every phase's live bytes count the trainer's
trees and the sampler's copy, so both roles report the same per-device peak. Disaggregated, each
role's peak is over the phases its own devices run.
"""

from __future__ import annotations

import dataclasses

from ppo_jax.rl import roles as roles_lib

SAMPLER_PHASES = ("sampler", "scoring")  # "scoring" only with roles.scoring="sampler"
TRAINER_PHASES = ("experience", "update")


def layout(meshes: roles_lib.RoleMeshes) -> str:
    """"shared" (one mesh), "colocated" (same devices, another layout) or "disaggregated"."""
    return "shared" if meshes.shared else "disaggregated" if meshes.disaggregated else "colocated"


@dataclasses.dataclass(frozen=True)
class Holdings:
    """Per-device bytes a run holds outside a phase's own arguments, by shape arithmetic.

    trainer_resident: trees + state scalars (trainer's devices); held: the previous iteration's
    rollout + experience, kept for samples (trainer's devices); rollout / experience: this
    iteration's batch (trainer's devices); prompts: [B, Lq] tokens and mask (sampler's devices);
    policy_copy: the sampler's copy of the policy (0 when it reads the trainer's); sample: one
    SampleOutput on the sampler's mesh (on a shared mesh these are the rollout's own arrays);
    roles.scoring="sampler" (else 0): scorer_frozen, the reference and reward model on the sampler's
    mesh; scores, one sample's reference log-probs [R, Lr] and model scores [R] there.
    """

    trainer_resident: int
    held: int
    rollout: int
    experience: int
    prompts: int
    policy_copy: int
    sample: int
    scorer_frozen: int = 0
    scores: int = 0


def phase_live(h: Holdings, where: str, samples_in_flight: int, engine_state: int = 0) -> dict[str, int]:
    """Per-device live bytes when each phase starts, on the devices that run it.

    The trainer keeps the sample it scores (on the sampler's mesh) until its iteration ends. With
    k-step off-policy rollouts (samples_in_flight = rollout.off_policy_steps = k) k samples (with their
    scores) are in flight throughout: the next k during the experience and update, and while batch
    i+k decodes and is scored, batches i .. i+k-1 (the current one still referenced). The scoring
    program starts with the sampler's holdings and the sample it scores. Off-policy, the sync of θ_i
    to the sampler lands while batch i+k-1 may still decode with θ_{i-1}: the sampler's devices hold
    two policy copies then (the older one goes when that decode ends). With partial rollouts each
    rollout in flight is an engine state mid-decode: `engine_state` more bytes each (its KV cache).
    """
    in_flight = samples_in_flight * (h.sample + h.scores + engine_state)
    syncing = h.policy_copy if samples_in_flight else 0
    scored = h.sample if where != "shared" else 0  # shared: the rollout *is* the sample
    trainer = h.trainer_resident + h.held
    sampler_own = h.policy_copy + h.scorer_frozen + h.prompts + in_flight
    # The sampler's own holdings on the trainer's devices, unless it has devices of its own.
    beside = h.policy_copy + h.scorer_frozen + scored + in_flight if where != "disaggregated" else 0
    sampler = sampler_own + syncing + (trainer if where != "disaggregated" else 0)
    return {
        "sampler": sampler,
        "scoring": sampler + h.sample,
        "experience": trainer + h.rollout + beside,
        "update": trainer + h.rollout + h.experience + beside,
    }


@dataclasses.dataclass(frozen=True)
class RoleMemory:
    """Per-device bytes on one role's devices (colocated: the same devices for both roles).

    train_state: the trainer's (0 for the sampler); frozen: the trainer's, or with
    roles.scoring="sampler" the sampler's (the reference and reward model; the trainer keeps a LoRA
    base only); policy_copy / kv_cache: the sampler's (0 for the trainer). temp_bytes: the largest
    temps among `phases`, the programs this role runs;
    peak_bytes: the largest phase peak on these devices (colocated: the other role's phases too, on
    the same devices), in `peak_phase` ("" if none was compiled: then peak_bytes is what the devices
    hold between phases).
    """

    role: str  # "trainer" or "sampler"
    mesh_shape: tuple[int, ...]  # (data, fsdp, tensor, expert, context)
    num_devices: int
    train_state_bytes: int  # trainable params + optimizer states + step / KL / key
    frozen_bytes: int  # reference, reward model, LoRA base (roles.scoring=sampler: reference + reward on the sampler)
    policy_copy_bytes: int  # the sampler's own copy of the policy
    kv_cache_bytes: int  # inside the sampler's temps
    phases: tuple[str, ...]
    temp_bytes: int
    peak_bytes: int
    peak_phase: str


@dataclasses.dataclass(frozen=True)
class RolesPlan:
    """Per-role memory of a run whose sampler has its own mesh (None in a plan when it shares)."""

    layout: str  # "colocated", "disaggregated" or "shared" (one mesh, with a merged LoRA copy)
    description: str  # RoleMeshes.describe()
    trainer: RoleMemory
    sampler: RoleMemory
    sync_bytes: int  # global bytes the weight sync copies per train step (LoRA: the adapters)
    base_sync_bytes: int  # global bytes of the LoRA base, copied once (0 without LoRA)
    scoring: str = "trainer"  # where the reference and reward model run (roles.scoring)


def _mesh_shape(mesh) -> tuple[int, ...]:
    return tuple(int(n) for n in mesh.devices.shape)


def role_memory(role: str, mesh, phases, names: tuple[str, ...], on_devices: tuple[str, ...], idle_bytes: int,
                **trees: int) -> RoleMemory:
    """One role's figures from the compiled phases (PhaseMemory): `names` are its own programs,
    `on_devices` every program its devices run. idle_bytes: what the devices hold when none of
    those was compiled."""
    own = [p for p in phases if p.name in names]
    peak = max((p for p in phases if p.name in on_devices), key=lambda p: p.peak_bytes, default=None)
    return RoleMemory(role=role, mesh_shape=_mesh_shape(mesh), num_devices=int(mesh.size), phases=names,
                      temp_bytes=max((p.temp_bytes for p in own), default=0),
                      peak_bytes=peak.peak_bytes if peak else idle_bytes, peak_phase=peak.name if peak else "",
                      **{f"{k}_bytes": v for k, v in trees.items()})


def roles_plan(meshes: roles_lib.RoleMeshes, phases, h: Holdings, train_state: int, frozen: int,
               kv_cache: int, sync_bytes: int, base_sync_bytes: int, scoring: str = "trainer") -> RolesPlan | None:
    """The per-role report of a plan's compiled `phases`; None when the sampler shares the trainer's
    mesh and its trees (the plan's own figures are then the whole story; a merged LoRA copy,
    roles.lora_sync="merged", is reported even there). frozen: the trainer's frozen trees (the
    sampler's are h.scorer_frozen); scoring: roles.scoring."""
    where = layout(meshes)
    if where == "shared" and not h.policy_copy:
        return None
    sampler_phases = SAMPLER_PHASES if scoring == "sampler" else SAMPLER_PHASES[:1]
    # Colocated: the devices run every phase, so both roles' peaks are the devices' one peak.
    everything = sampler_phases + TRAINER_PHASES
    trainer_on = TRAINER_PHASES if where == "disaggregated" else everything
    sampler_on = sampler_phases if where == "disaggregated" else everything
    sampler_trees = h.policy_copy + h.scorer_frozen
    idle_trainer = h.trainer_resident + h.held + (sampler_trees if where != "disaggregated" else 0)
    idle_sampler = sampler_trees + (h.trainer_resident + h.held if where != "disaggregated" else 0)
    trainer = role_memory("trainer", meshes.trainer, phases, TRAINER_PHASES, trainer_on, idle_trainer,
                          train_state=train_state, frozen=frozen, policy_copy=0, kv_cache=0)
    sampler = role_memory("sampler", meshes.sampler, phases, sampler_phases, sampler_on, idle_sampler,
                          train_state=0, frozen=h.scorer_frozen, policy_copy=h.policy_copy, kv_cache=kv_cache)
    return RolesPlan(layout=where, description=meshes.describe(), trainer=trainer, sampler=sampler,
                     sync_bytes=sync_bytes, base_sync_bytes=base_sync_bytes, scoring=scoring)
