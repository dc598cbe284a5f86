"""A PPO run's checkpoints: what a step saves (trainable state, data position, frozen-tree checksums,
the frozen reference once), and how a run resumes: the newest step that verifies, its reference
restored or rebuilt from its source and checked, a LoRA base or value base rebuilt and checked.

`Checkpointing` holds the run's `CheckpointManager` (`manager`), the checksums that tie every saved
step to the frozen trees it was trained against (`frozen_checksums`: the reference, or a LoRA base and
imported adapters, and a LoRA value base), those the checkpoint resumed from recorded, whether the
reference is saved yet, and the step the run resumed from.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from etils import epath

from ppo_jax import metrics as metrics_lib
from ppo_jax.checkpoint import CheckpointCorruptError, CheckpointError, CheckpointManager
from ppo_jax.checkpoint import verify
from ppo_jax.config import ConfigError, to_dict
from ppo_jax.models import hf
from ppo_jax.rl import build, initial_weights
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import Modules, PPOState


def reward_source(s: Settings) -> dict[str, Any]:
    """What scores a run (recorded in checkpoints; a resume must use the same)."""
    source: dict[str, Any] = {"path": s.reward.path, "functions": s.reward.functions}
    if s.reward.path:
        source["files"] = hf.fingerprint(s.reward.path)
    return source


class Checkpointing:
    """Checkpoint save / restore of a PPO run (see the module docstring for what it holds)."""

    def __init__(self, settings: Settings, workdir: str, modules: Modules, mesh, abstract_state: PPOState,
                 state_shardings: PPOState, init_key):
        """abstract_state: the restore target; init_key: rebuilds the reference (or a LoRA base) from its source."""
        self.settings, self.workdir, self.modules, self.mesh = settings, workdir, modules, mesh
        self.abstract_state, self.state_shardings, self.init_key = abstract_state, state_shardings, init_key
        self.abstract_reference = build.as_reference(settings.policy, abstract_state.policy)  # a restore's target
        self.lora = modules.policy.config.lora is not None
        self.directory = os.path.join(workdir, "checkpoints")
        # Opening the manager writes nothing; the first save does, after every input was read and checked.
        self.manager: CheckpointManager | None = self._open() if epath.Path(self.directory).is_dir() else None
        self.frozen_checksums: dict[str, dict | None] = {}  # saved with every step
        self.recorded: dict = {}  # the frozen checksums of the checkpoint resumed from
        self.reference_saved = True  # a full fine-tuning run's frozen reference, in frozen/
        self.resumed_from: int | None = None

    def _open(self) -> CheckpointManager:
        t = self.settings.train
        return CheckpointManager(self.directory, max_to_keep=int(t.keep_checkpoints),
                                 best_metric=t.best_metric or None, best_mode=t.best_mode)

    @property
    def resumable(self) -> bool:
        return self.manager is not None and bool(self.manager.all_steps())

    def start_fresh(self, weights: initial_weights.StartWeights) -> None:
        """Records the checksums of a fresh run's frozen trees (the LoRA base and imported adapters;
        the reference is recorded when first saved, or now if this very reference is saved already)."""
        if self.manager is None:
            self.manager = self._open()
        if self.lora:  # identifies the base (and the imported adapters) in every checkpoint
            self.frozen_checksums["policy_base"] = verify.record(weights.base)
            if self.settings.policy.lora.init_from:
                self.frozen_checksums["policy_init_adapters"] = verify.record(weights.reference)
        else:
            self.frozen_checksums["reference"] = None  # its checksums, from the first save (or the check below)
            self.reference_saved = self._adopt_saved_reference(weights.reference)

    def restore(self) -> tuple[initial_weights.StartWeights, dict[str, Any]]:
        """(the weights of the newest checkpoint that verifies, its extra items: data position, sample
        in flight). With LoRA the reference is None (or the imported adapters, re-read) and the base is
        rebuilt from its source."""
        s = self.settings
        restored = self.manager.restore_newest_valid(abstract_state=self.abstract_state)
        for line in restored.skipped:
            metrics_lib.warn(line)
        extra = restored.extra
        if extra.get("reward_source") != reward_source(s):
            raise ConfigError(
                f"the checkpoint in {self.workdir} was trained against reward {extra.get('reward_source')} "
                f"but the config now names {reward_source(s)}; resume with the original reward or use a "
                "new workdir")
        recorded = self.recorded = extra.get("frozen_checksums", {})
        if self.lora:
            base_record = self.frozen_checksums["policy_base"] = recorded.get("policy_base")
            reference, base = None, initial_weights.rebuild_lora_base(s, self.modules, self.mesh, self.init_key, base_record,
                                                            self.manager.directory)
            if s.policy.lora.init_from:  # the reference adapters: re-read from policy.lora.init_from and checked
                imported = self.frozen_checksums["policy_init_adapters"] = recorded.get("policy_init_adapters")
                reference = initial_weights.initial_adapters(s, self.modules, self.state_shardings.policy, self.mesh,
                                                   self.init_key)
                verify.check_rebuilt(reference, imported, self.manager.directory, "imported adapters",
                                     "set of imported adapters", f"policy.lora.init_from={s.policy.lora.init_from}",
                                     "use the original adapter directory")
        else:
            reference, base = self._restore_reference(recorded.get("reference")), None
        self.resumed_from = restored.step
        return initial_weights.StartWeights(restored.state, reference, base), extra

    def record_value_base(self, value_base) -> None:
        """A LoRA value base's checksums, recorded in every checkpoint; on resume, those the checkpoint
        recorded, after checking the base the run now holds against them (for value.init="reward" the
        reward files' fingerprint reads no weights, so only this check sees a reward model rewritten
        with other weights of the same shapes)."""
        if self.resumed_from is None:
            self.frozen_checksums["value_base"] = verify.record(value_base)
            return
        recorded = self.recorded.get("value_base")
        verify.check_rebuilt(value_base, recorded, self.manager.directory, "value base", "value base",
                             f"value.init={self.settings.value.init}", "use the original policy, reward model and seed")
        self.frozen_checksums["value_base"] = recorded

    def _restore_reference(self, recorded: dict | None):
        """The frozen reference the restored steps were trained against (their checksums prove it).

        The reference is the initial policy, so a damaged, missing or foreign one (a kill between
        its save and the first step's, a reused workdir) is rebuilt from its source, and adopted only
        if it matches the checksums the steps recorded: KL is never measured against another tree.
        """
        s = self.settings
        self.reference_saved = True
        try:
            reference = self.manager.restore_frozen("reference", self.abstract_reference, checksums=recorded)
            self.frozen_checksums["reference"] = recorded or verify.record(reference)  # older runs recorded none
            return reference
        except CheckpointError as err:  # missing, damaged, or another model's (shapes differ)
            problem = str(err)
        source = f"policy.path={s.policy.path}" if s.policy.path else "the seed"
        rebuilt = build.as_reference(s.policy, initial_weights.initial_policy(s, self.modules, self.state_shardings.policy, self.mesh,
                                                             self.init_key))
        if recorded is None or verify.mismatches(rebuilt, recorded):
            raise CheckpointCorruptError(
                f"{problem}; rebuilding the reference policy from {source} does not give the tree the "
                f"checkpoints were trained against, so their KL reference is lost; start the run in a new workdir")
        if self.manager.has_frozen("reference"):
            self.manager.set_aside_frozen("reference")
        self.frozen_checksums["reference"], self.reference_saved = recorded, False  # saved again with the next step
        metrics_lib.warn(f"{problem}; rebuilt the reference policy from {source} (it matches the checkpoints' checksums)")
        return rebuilt

    def _adopt_saved_reference(self, reference) -> bool:
        """Starting from scratch over a frozen reference with no step beside it (an attempt killed
        after saving it, or another run's): keep it if it is exactly this run's reference, else move
        it aside. Returns whether the run's reference is already saved."""
        if not self.manager.has_frozen("reference"):
            return False
        record = self.frozen_checksums["reference"] = verify.record(reference)
        try:
            self.manager.restore_frozen("reference", self.abstract_reference, checksums=record)
            return True
        except CheckpointError:  # another model's, another seed's, or damaged
            moved = self.manager.set_aside_frozen("reference", ".stale")
            metrics_lib.warn(f"the frozen reference in {self.manager.directory} is not this run's initial policy "
                             f"(another seed or policy, or damaged); moved it to {moved}")
            return False

    def save(self, state: PPOState, reference, items: dict[str, Any], metrics: dict[str, float] | None,
             force: bool = False, arrays: dict[str, Any] | None = None) -> bool:
        """Saves trainable state + `items` (the data position, the samples in flight, JSON) + `arrays`
        (the samples' host arrays, Orbax's binary item); the reference once,
        in frozen/ (a LoRA base, imported adapters and a LoRA value base never, only their checksums:
        they are rebuilt from their sources). metrics: the step's logged scalars (for train.best_metric)."""
        if not self.lora and not self.reference_saved:
            self.frozen_checksums["reference"] = self.manager.save_frozen("reference", reference)
            self.reference_saved = True
        value = self.modules.value
        extra = {
            **items,
            "config": to_dict(self.settings),
            "policy_model": dataclasses.asdict(self.modules.policy.config),
            "value_model": dataclasses.asdict(value.config) if value else None,
            "value_head_init": value.head_init if value else None,
            "reward_source": reward_source(self.settings),
            # Ties the steps to the frozen tree they were trained against (checked on resume and export).
            "frozen_checksums": dict(self.frozen_checksums),
        }
        best = self.settings.train.best_metric
        metrics = {best: metrics[best]} if (best and metrics and best in metrics) else None
        return self.manager.save(int(state.step), state, extra=extra, metrics=metrics, force=force, arrays=arrays)
