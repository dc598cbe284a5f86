"""Where each role of a PPO run computes (issue 31): the sampler on its own mesh, colocated with
training (all devices, another layout) or disaggregated (a device subset of its own), and the weight
sync that copies the policy from the training layout to the sampler's after every update.

Roles: the *sampler* (rollout decoding), the *scorer* (the frozen reference and reward model's
forwards) and the *trainer* (the policy and value forwards of the experience step, and the update).
The scorer runs with the trainer by default (the experience step runs all four forwards in one
program), or with roles.scoring="sampler" on the sampler's mesh, each rollout scored there as soon
as it is sampled, so the trainer's devices hold neither frozen tree.

    roles.sampler_devices = 0, roles.sampler_mesh = ()       one mesh for everything (the default)
    roles.sampler_devices = 0, roles.sampler_mesh = (1,1,8)  colocated: all devices, the sampler
                                                              tensor-parallel, training FSDP
    roles.sampler_devices = 4                                 disaggregated: 4 devices decode, the
                                                              rest train (each process gives its last
                                                              sampler_devices / processes devices)
    roles.sampler_devices = 4, roles.scoring = "sampler"     ... and the 4 also score
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from ppo_jax import sharding
from ppo_jax.config import check
from ppo_jax.models import boxed_params
from ppo_jax.rl.state import FrozenParams, PPOState
from ppo_jax.sampling.weights import cast_for_sampler, sampler_dtype


LORA_SYNC = ("adapters", "merged")
SCORING = ("trainer", "sampler")


@dataclasses.dataclass(frozen=True)
class RolesSettings:
    """Per-role placement: where the sampler runs (training, scoring and the update use mesh.shape)."""

    sampler_devices: int = 0  # 0 = the sampler shares all devices with training (colocated); k > 0 = k devices of its own (the last k / processes of each process's), training on the rest
    lora_sync: str = "adapters"  # a LoRA policy on the sampler: "adapters" (the sampler decodes its base copy + the synced adapters) or "merged" (the adapters travel and are folded into a decoding copy there: no low-rank matmuls in the decode, one more copy of the weights on the sampler's devices)
    scoring: str = "trainer"  # where the reference and reward-model forwards run: "trainer" (in the experience step) or "sampler" (the frozen trees live on the sampler's mesh, each rollout scored there as soon as it is sampled: the trainer's devices hold neither; needs a sampler mesh of its own)
    sampler_mesh: tuple = ()  # the sampler's (data, fsdp, tensor[, expert]) on its devices, one entry may be -1; () = mesh.shape (colocated: the very same mesh, no weight sync)

    def validate(self) -> None:
        check(self.sampler_devices >= 0, f"roles.sampler_devices must be >= 0 (0 = all devices, colocated), got "
              f"{self.sampler_devices}")
        check(self.lora_sync in LORA_SYNC, f"roles.lora_sync={self.lora_sync!r}: use one of {', '.join(LORA_SYNC)}")
        check(self.scoring in SCORING, f"roles.scoring={self.scoring!r}: use one of {', '.join(SCORING)}")
        check(self.scoring == "trainer" or self.sampler_devices or self.sampler_mesh,
              "roles.scoring=sampler scores on the sampler's own mesh, and the sampler shares the trainer's: set "
              "roles.sampler_devices or roles.sampler_mesh")
        if self.sampler_mesh:
            check(len(self.sampler_mesh) in (3, 4) and all(isinstance(n, int) and (n > 0 or n == -1)
                                                          for n in self.sampler_mesh)
                  and list(self.sampler_mesh).count(-1) <= 1,
                  f"roles.sampler_mesh={tuple(self.sampler_mesh)}: give 3 or 4 positive sizes (data, fsdp, tensor"
                  "[, expert]), at most one of them -1")


@dataclasses.dataclass(frozen=True)
class RoleMeshes:
    """The meshes of a run's roles: `trainer` (experience forwards and update), `sampler` (rollouts).
    The same Mesh object when the sampler shares training's (no weight sync)."""

    trainer: Mesh
    sampler: Mesh

    @property
    def shared(self) -> bool:
        return self.sampler is self.trainer

    @property
    def disaggregated(self) -> bool:
        return not (set(self.trainer.devices.flat) & set(self.sampler.devices.flat))

    def describe(self) -> str:
        """'trainer (1, 8, 1, 1) on 8 devices; sampler (1, 1, 8, 1) on the same devices'."""
        where = ("the same mesh" if self.shared else f"its own {self.sampler.size} devices" if self.disaggregated
                 else "the same devices")
        return (f"trainer {tuple(self.trainer.devices.shape)} on {self.trainer.size} devices; sampler "
                f"{tuple(self.sampler.devices.shape)} on {where}")


def _role_mesh(shape: Sequence[int], devices: list, field: str, role: str) -> Mesh:
    """sharding.make_mesh with the error naming the config field that sets this role's shape."""
    shape = list(shape)
    known = math.prod(n for n in shape if n != -1)
    fits = len(devices) % known == 0 if -1 in shape else known == len(devices)
    check(fits, f"{field}={tuple(shape)} does not fit the {role}'s {len(devices)} devices: use sizes whose product "
          f"is {len(devices)} (one may be -1)")
    return sharding.make_mesh(shape, devices)


def split_devices(sampler_devices: int, devices: Sequence[jax.Device]) -> tuple[list, list]:
    """(trainer devices, sampler devices): each process gives its last sampler_devices / processes
    local devices to the sampler, so both roles span every process (each loads its own rows of
    both). Raises ConfigError when that split is impossible."""
    devices = list(devices)
    processes = sorted({d.process_index for d in devices})
    k, n = sampler_devices, len(devices)
    check(0 < k < n, f"roles.sampler_devices={k} leaves no devices for training: use 1 to {n - 1} of the {n} "
          "devices (or 0: the sampler shares them)")
    check(k % len(processes) == 0,
          f"roles.sampler_devices={k} does not split over the {len(processes)} processes: each gives the sampler "
          f"the same number of its devices, so use a multiple of {len(processes)}")
    if len(processes) > 1:
        # jax moves arrays between hosts only within one device set, or (sharding.reshard) between two
        # disjoint sets of equal size.
        check(2 * k == n, f"roles.sampler_devices={k}: across {len(processes)} processes the sampler and the trainer "
              f"must hold the same number of devices (the weight sync copies between equal device sets); use {n // 2}")
    per_process = k // len(processes)
    trainer, sampler = [], []
    for p in processes:
        local = sorted((d for d in devices if d.process_index == p), key=lambda d: d.id)
        trainer += local[:len(local) - per_process]
        sampler += local[len(local) - per_process:]
    return trainer, sampler


def make_role_meshes(roles: RolesSettings, mesh_shape: Sequence[int], devices: Sequence[jax.Device] | None = None,
                     trainer_mesh: Mesh | None = None) -> RoleMeshes:
    """The trainer's mesh (mesh.shape, or `trainer_mesh` when the caller made it) and the sampler's.
    Errors name the field to change."""
    devices = list(devices if devices is not None else jax.devices())
    if roles.sampler_devices:
        check(trainer_mesh is None, "roles.sampler_devices picks the trainer's devices itself; pass no mesh")
        trainer_devices, sampler_devices = split_devices(roles.sampler_devices, devices)
        trainer = _role_mesh(mesh_shape, trainer_devices, "mesh.shape", "trainer")
        return RoleMeshes(trainer, _role_mesh(roles.sampler_mesh or mesh_shape, sampler_devices,
                                              "roles.sampler_mesh" if roles.sampler_mesh else "mesh.shape (the "
                                              "sampler's shape when roles.sampler_mesh is unset)", "sampler"))
    if trainer_mesh is None:
        trainer_mesh = _role_mesh(mesh_shape, devices, "mesh.shape", "trainer")
    if not roles.sampler_mesh:
        return RoleMeshes(trainer_mesh, trainer_mesh)
    return RoleMeshes(trainer_mesh, _role_mesh(roles.sampler_mesh, list(trainer_mesh.devices.flat),
                                               "roles.sampler_mesh", "sampler"))


@dataclasses.dataclass(frozen=True)
class SyncedWeights:
    """The policy on the sampler's mesh after one sync: what the sampler decodes with."""

    step: int  # the train step whose weights these are
    params: Any  # full params (the LoRA base, synced once, with LoRA; or the merged copy)
    adapters: Any  # LoRA adapters (None without LoRA, or merged)


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@functools.partial(jax.jit, static_argnums=1)
def _cast_where_held(tree: Any, dtype: str) -> Any:
    """`cast_for_sampler` on the trainer's devices (each shard cast where it lies, before the copy)."""
    return cast_for_sampler(tree, dtype)


def sync_to(tree: Any, shardings: Any, dtype: str | None = None) -> tuple[Any, float, int]:
    """(tree on `shardings`, seconds until the copy finished, bytes copied): the weight sync. dtype
    (`sampler_dtype`): cast on the trainer's side first, so the copy moves (and the sampler holds) the
    narrower tree; a tree that does not move (the sampler reads the trainer's) is never cast."""
    if not any(x.sharding != sh for x, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))):
        return tree, 0.0, 0
    start = time.perf_counter()
    tree = tree if dtype is None else _cast_where_held(tree, dtype)
    moved = sum(tree_bytes(x) for x, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)) if x.sharding != sh)
    out = jax.block_until_ready(sharding.reshard(tree, shardings))
    return out, time.perf_counter() - start, moved


# ------------------------------------------------------------------ shardings of the roles' trees
# (`modules`: `rl.build.Modules`)

def policy_shardings(modules, mesh):
    """The policy's full params (with LoRA: its frozen base) on `mesh`, by the logical rules."""
    return sharding.tree_shardings(boxed_params(modules.policy), mesh)


@dataclasses.dataclass(frozen=True)
class SamplerShardings:
    """Where the sampler reads the policy: `params` (full params: with LoRA the frozen base, or with
    roles.lora_sync="merged" the merged copy) and `adapters` (what the sampler is called with: LoRA's
    adapters, None without LoRA or merged), on the sampler's mesh; the trainer's own shardings when
    the sampler shares its mesh. `synced_adapters`: where a LoRA policy's adapters travel each step
    (None without LoRA). `dtype`: `sampler_dtype` on a mesh of the sampler's own (None when shared,
    or for a merged LoRA copy, merged from the trainer's dtype)."""

    params: Any
    adapters: Any
    synced_adapters: Any = None
    merged: bool = False
    dtype: str | None = None  # what the policy travels and is held in on the sampler's own mesh (`sampler_dtype`)


def sampler_shardings(modules, state_shardings: PPOState, frozen_shardings: FrozenParams,
                      sampler_mesh, shared: bool, merged: bool = False) -> SamplerShardings:
    """The policy's shardings on the sampler's mesh (`rl/roles.py`), by the same logical rules;
    merged: the sampler decodes a merged copy of a LoRA policy (roles.lora_sync)."""
    lora = frozen_shardings.policy is not None
    dtype = None if shared or merged else sampler_dtype(modules.policy.config)
    if not lora:
        return SamplerShardings(state_shardings.policy if shared else policy_shardings(modules, sampler_mesh), None,
                                dtype=dtype)
    params = frozen_shardings.policy if shared else policy_shardings(modules, sampler_mesh)
    adapters = (state_shardings.policy if shared else
                sharding.tree_shardings(boxed_params(modules.policy, collection="lora"), sampler_mesh))
    return SamplerShardings(params, None if merged else adapters, synced_adapters=adapters, merged=merged, dtype=dtype)


def trainer_frozen(frozen: FrozenParams) -> FrozenParams:
    """The frozen trees the trainer keeps when the sampler's mesh scores (roles.scoring="sampler"):
    no reference (nor imported reference adapters) and no reward model; a LoRA base stays (the
    policy trains on it), and so does a LoRA value base (settings refuse one inside the others)."""
    return frozen.replace(reference=None, reward=None)


def scorer_shardings(modules, frozen_shardings: FrozenParams, where: SamplerShardings,
                     sampler_mesh) -> FrozenParams:
    """Shardings of the scorer's frozen trees on the sampler's mesh: the reference (with LoRA the
    sampler's base copy, and imported reference adapters laid out as the synced ones), the reward
    model."""
    lora = frozen_shardings.policy is not None
    if lora:
        reference = where.synced_adapters if frozen_shardings.reference is not None else None
    else:
        reference = policy_shardings(modules, sampler_mesh)
    reward = (sharding.tree_shardings(boxed_params(modules.reward), sampler_mesh)
              if frozen_shardings.reward is not None else None)
    return FrozenParams(reference=reference, reward=reward, policy=where.params if lora else None)
