"""The PPO trainer's checkpoints: what a step saves (trainable state, data position, frozen-tree
checksums, the frozen reference once), and how a run resumes: the newest step that verifies, its
reference restored or rebuilt from its source and checked, a LoRA base or value base rebuilt and
checked. A mixin of `PPOTrainer` (ppo_jax/rl/trainer.py), which owns the attributes it reads."""

from __future__ import annotations

import dataclasses
from typing import Any

from ppo_jax import metrics as metrics_lib
from ppo_jax.checkpoint import CheckpointCorruptError, CheckpointError, CheckpointManager
from ppo_jax.checkpoint import verify
from ppo_jax.config import ConfigError, to_dict
from ppo_jax.models import hf
from ppo_jax.rl import build
from ppo_jax.rl.trainer_rollouts import IN_FLIGHT_ITEM


class TrainerCheckpoints:
    """Checkpoint save / restore of a `PPOTrainer` (settings, mesh, modules, shardings, state and
    frozen trees are the trainer's)."""

    def _checkpoint_manager(self, directory: str) -> CheckpointManager:
        t = self.settings.train
        return CheckpointManager(directory, max_to_keep=int(t.keep_checkpoints),
                                 best_metric=t.best_metric or None, best_mode=t.best_mode)

    def _restore(self):
        """(state, reference, LoRA base, step) of the newest checkpoint that verifies, and the data
        position. With LoRA the reference is None and the base is rebuilt from its source."""
        restored = self.checkpoints.restore_newest_valid(abstract_state=self.abstract_state)
        for line in restored.skipped:
            metrics_lib.warn(line)
        extra = restored.extra
        if extra.get("reward_source") != self._reward_source():
            raise ConfigError(
                f"the checkpoint in {self.workdir} was trained against reward {extra.get('reward_source')} "
                f"but the config now names {self._reward_source()}; resume with the original reward or use a "
                "new workdir")
        recorded = self._recorded = extra.get("frozen_checksums", {})
        if self.lora:
            self._base_record = recorded.get("policy_base")
            reference, base = None, build.rebuild_lora_base(self.settings, self.modules, self.mesh, self._init_key,
                                                            self._base_record, self.checkpoints.directory)
            if self.imported:  # the reference adapters: re-read from policy.lora.init_from and checked
                self._imported_record = recorded.get("policy_init_adapters")
                reference = build.initial_adapters(self.settings, self.modules, self.state_shardings.policy,
                                                   self.mesh, self._init_key)
                verify.check_rebuilt(reference, self._imported_record, self.checkpoints.directory,
                                    "imported adapters", "set of imported adapters",
                                    f"policy.lora.init_from={self.settings.policy.lora.init_from}",
                                    "use the original adapter directory")
        else:
            reference, base = self._restore_reference(recorded.get("reference")), None
        self.prompts.restore(extra["data"])
        self.restore_in_flight(extra.get(IN_FLIGHT_ITEM))
        if self.eval_prompts is not None and extra.get("eval_data"):
            self.eval_prompts.restore(extra["eval_data"])
        return restored.state, reference, base, restored.step

    def _value_base_checksums(self) -> dict:
        """The LoRA value base's checksums, recorded in every checkpoint; on resume, those the
        checkpoint recorded, after checking the base the run now holds against them (for
        value.init="reward" the reward files' fingerprint reads no weights, so only this check sees a
        reward model rewritten with other weights of the same shapes)."""
        if self.resumed_from is None:
            return verify.record(self.frozen.value)
        recorded = self._recorded.get("value_base")
        verify.check_rebuilt(self.frozen.value, recorded, self.checkpoints.directory, "value base", "value base",
                            f"value.init={self.settings.value.init}", "use the original policy, reward model and seed")
        return recorded

    def _restore_reference(self, recorded: dict | None):
        """The frozen reference the restored steps were trained against (their checksums prove it).

        The reference is the initial policy, so a damaged, missing or foreign one (a kill between
        its save and the first step's, a reused workdir) is rebuilt from its source, and adopted only
        if it matches the checksums the steps recorded: KL is never measured against another tree.
        """
        self._reference_saved = True
        try:
            reference = self.checkpoints.restore_frozen("reference", self.abstract_reference, checksums=recorded)
            self._reference_record = recorded or verify.record(reference)  # older runs recorded none
            return reference
        except CheckpointError as err:  # missing, damaged, or another model's (shapes differ)
            problem = str(err)
        source = f"policy.path={self.settings.policy.path}" if self.settings.policy.path else "the seed"
        rebuilt = build.as_reference(self.settings, build.initial_policy(
            self.settings, self.modules, self.state_shardings.policy, self.mesh, self._init_key))
        if recorded is None or verify.mismatches(rebuilt, recorded):
            raise CheckpointCorruptError(
                f"{problem}; rebuilding the reference policy from {source} does not give the tree the "
                f"checkpoints were trained against, so their KL reference is lost; start the run in a new workdir")
        if self.checkpoints.has_frozen("reference"):
            self.checkpoints.set_aside_frozen("reference")
        self._reference_record, self._reference_saved = recorded, False  # saved again with the next step
        metrics_lib.warn(f"{problem}; rebuilt the reference policy from {source} (it matches the checkpoints' checksums)")
        return rebuilt

    def _adopt_saved_reference(self, reference) -> bool:
        """Starting from scratch over a frozen reference with no step beside it (an attempt killed
        after saving it, or another run's): keep it if it is exactly this run's reference, else move
        it aside. Returns whether the run's reference is already saved."""
        if not self.checkpoints.has_frozen("reference"):
            return False
        self._reference_record = verify.record(reference)
        try:
            self.checkpoints.restore_frozen("reference", self.abstract_reference, checksums=self._reference_record)
            return True
        except CheckpointError:  # another model's, another seed's, or damaged
            moved = self.checkpoints.set_aside_frozen("reference", ".stale")
            metrics_lib.warn(f"the frozen reference in {self.checkpoints.directory} is not this run's initial policy "
                       f"(another seed or policy, or damaged); moved it to {moved}")
            return False

    def _reward_source(self) -> dict[str, Any]:
        """What scores this run (recorded in checkpoints; a resume must use the same)."""
        r = self.settings.reward
        source: dict[str, Any] = {"path": r.path, "functions": r.functions}
        if r.path:
            source["files"] = hf.fingerprint(r.path)
        return source

    def save_checkpoint(self, force: bool = False) -> bool:
        """Saves trainable state + data position (the reference once, in frozen/; a LoRA base, imported
        adapters and a LoRA value base never, only their checksums: they are rebuilt from their sources)."""
        step = int(self.state.step)
        if self.lora:
            frozen_checksums = {"policy_base": self._base_record}
            if self.imported:
                frozen_checksums["policy_init_adapters"] = self._imported_record
        else:
            if not self._reference_saved:
                self._reference_record = self.checkpoints.save_frozen("reference", self.reference_params)
                self._reference_saved = True
            frozen_checksums = {"reference": self._reference_record}
        if self.value_lora:
            frozen_checksums["value_base"] = self._value_base_record
        extra = {
            "data": self.prompts.state(),
            "eval_data": self.eval_prompts.state() if self.eval_prompts is not None else None,
            "config": to_dict(self.settings),
            "policy_model": dataclasses.asdict(self.policy_config),
            "value_model": dataclasses.asdict(self.modules.value.config) if self.modules.value else None,
            "value_head_init": self.modules.value.head_init if self.modules.value else None,
            "reward_source": self._reward_source(),
            # Ties the steps to the frozen tree they were trained against (checked on resume and export).
            "frozen_checksums": frozen_checksums,
            # Off-policy: the sample started with the weights before this step's update (waits for it).
            IN_FLIGHT_ITEM: self.in_flight_record(),
        }
        metrics = self.history[-1] if self.history else None
        best = self.settings.train.best_metric
        metrics = {best: metrics[best]} if (best and metrics and best in metrics) else None
        return self.checkpoints.save(step, self.state, extra=extra, metrics=metrics, force=force)
