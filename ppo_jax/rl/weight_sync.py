"""The weight sync: the trainer's policy on the sampler's mesh, once per train step (`rl/roles.py`
says where the sampler reads it and in which dtype).

Nothing is copied when the sampler shares the trainer's mesh. With LoRA the frozen base is copied to
the sampler's mesh once, at start, and each step moves only the adapters; with
roles.lora_sync="merged" they are folded into a decoding copy there (the base stays).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ppo_jax import metrics as metrics_lib
from ppo_jax import sharding
from ppo_jax.models import LoraConfig
from ppo_jax.models import lora as lora_lib
from ppo_jax.rl import roles
from ppo_jax.rl.state import PPOState


class WeightSync:
    """The policy's copy on the sampler's mesh (`weights`), and the log of the syncs since the last
    iteration (`pop_metrics`)."""

    def __init__(self, sampler_mesh, where: roles.SamplerShardings, lora: LoraConfig | None, frozen_base):
        """where: the sampler's shardings of the policy; lora: the policy's adapters' config (None
        without LoRA), whose frozen base `frozen_base` (on the trainer's mesh) is copied over now."""
        self.mesh, self.where, self.lora = sampler_mesh, where, lora
        self.synced: roles.SyncedWeights | None = None
        self.log: list[tuple[float, int]] = []  # (seconds, bytes) of the syncs since the last iteration
        self.base = None  # LoRA: the frozen base on the sampler's mesh (copied once: it never changes)
        self._merge_jit = None
        if lora is not None:
            self.base, seconds, nbytes = roles.sync_to(frozen_base, where.params, where.dtype)
            if nbytes:
                metrics_lib.warn(f"copied the frozen LoRA base to the sampler's mesh once ({nbytes / 2**30:.3f} GiB, "
                                 f"{seconds:.2f} s); each iteration syncs only the adapters")

    def weights(self, state: PPOState) -> roles.SyncedWeights:
        """`state`'s policy on the sampler's mesh: synced at most once per train step (none where the
        step decodes nothing, `InFlightPipeline.decodes`)."""
        step = int(state.step)
        if self.synced is not None and self.synced.step == step:
            return self.synced
        self.synced = None  # the older copy goes before the new one arrives (a batch in flight keeps its own)
        if self.lora is not None:  # the trainable tree is the adapters, on the base copied there once
            adapters, seconds, nbytes = roles.sync_to(state.policy, self.where.synced_adapters, self.where.dtype)
            params = self.base
            if self.where.merged:  # folded into the decoding copy on the sampler's devices (the base stays)
                params, adapters = self._merged(params, adapters), None
        else:
            (params, seconds, nbytes), adapters = roles.sync_to(state.policy, self.where.params, self.where.dtype), None
        self.log.append((seconds, nbytes))
        self.synced = roles.SyncedWeights(step, params, adapters)
        return self.synced

    def _merged(self, base, adapters):
        """base + scale * A @ B on the sampler's shardings (roles.lora_sync="merged")."""
        if self._merge_jit is None:
            config = self.lora
            self._merge_jit = jax.jit(lambda p, a: lora_lib.merge_lora(p, a, config), out_shardings=self.where.params)
        with sharding.mesh_context(self.mesh):
            return self._merge_jit(base, adapters)

    def pop_metrics(self) -> dict[str, float]:
        """The syncs since the last call: `time/weight_sync` (seconds), `perf/weight_sync_bytes`."""
        seconds, nbytes = sum(s for s, _ in self.log), sum(b for _, b in self.log)
        self.log = []
        return {"time/weight_sync": seconds, "perf/weight_sync_bytes": float(nbytes)}


def not_donated(weights: roles.SyncedWeights, state: PPOState) -> roles.SyncedWeights:
    """`weights` with a copy of every array that is the train state's own (the sampler on the
    trainer's mesh in its dtype: nothing was copied): for work that runs beside the update, which
    donates those arrays while it still decodes with them."""
    owned = {id(leaf) for leaf in jax.tree.leaves(state)}
    copy = lambda tree: jax.tree.map(lambda x: jnp.copy(x) if id(x) in owned else x, tree)  # noqa: E731
    return dataclasses.replace(weights, params=copy(weights.params), adapters=copy(weights.adapters))
