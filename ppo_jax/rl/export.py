"""Export a trained policy (or value model) from a PPO checkpoint as a Hugging Face directory.

The output holds config.json, model.safetensors and the run's tokenizer; `transformers` loads it
with `from_pretrained`. A LoRA value model (value.lora.rank > 0) is written merged: its adapters
folded into its frozen base (rebuilt from its source and checksum-checked), with its head. A LoRA policy (policy.lora.rank > 0) is written either merged (full weights,
adapters folded into the frozen base: the same kind of directory) or as a PEFT adapter directory
(adapter_config.json + adapter_model.safetensors, for `peft.PeftModel.from_pretrained` on the base).
The directory is written beside its destination and renamed at the end, so an interrupted export
leaves nothing half-written. Command line: `ppo_jax.cli.export`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from ppo_jax import sharding
from ppo_jax.checkpoint import CheckpointManager, verify
from ppo_jax.config import from_config, model_config_from_dict
from ppo_jax.models import CausalLM, ScalarModel, hf
from ppo_jax.rl import build, initial_weights
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import Modules, value_variables


def checkpoint_dirs(path: str) -> tuple[str, str]:
    """(workdir, checkpoints dir) from either of them."""
    path = os.path.abspath(path)
    if os.path.basename(path.rstrip("/")) == "checkpoints":
        return os.path.dirname(path), path
    return path, os.path.join(path, "checkpoints")


def nonfinite_tensors(params) -> list[str]:
    """Paths of the tensors of `params` holding a NaN or an infinity."""
    flags = jax.jit(lambda t: jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)), t))(params)
    return [jax.tree_util.keystr(path) for path, ok in jax.tree_util.tree_leaves_with_path(flags) if not bool(ok)]


LORA_FORMATS = ("merged", "adapter")  # a LoRA policy as full weights, or as a PEFT adapter directory


def export_checkpoint(checkpoint: str, out: str, *, step: int | None = None, which: str = "policy",
                      mesh=None, lora_format: str = "merged") -> str:
    """Restores `which` ("policy" or "value") from a PPO checkpoint and writes it as a Hugging Face
    directory; returns its path. lora_format (LORA_FORMATS) says how a LoRA policy is written;
    ignored otherwise."""
    if lora_format not in LORA_FORMATS:
        raise ValueError(f"lora_format={lora_format!r}: use one of {', '.join(LORA_FORMATS)}")
    workdir, ckpt_dir = checkpoint_dirs(checkpoint)
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir} does not exist: --checkpoint must be a PPO workdir or its "
                                "checkpoints/ directory")
    manager = CheckpointManager(ckpt_dir)
    try:
        step, extra = manager.read_extra(step)
        settings = from_config(Settings, extra["config"])  # as the run saved it; validated when it ran
        policy_cfg = model_config_from_dict(extra["policy_model"])
        value = None
        if extra.get("value_model"):
            value = ScalarModel(model_config_from_dict(extra["value_model"]), head_init=extra["value_head_init"])
        elif which == "value":
            raise ValueError(f"the run in {workdir} has no value model (advantage estimator "
                             f"{settings.ppo.advantage_estimator!r})")
        modules = Modules(policy=CausalLM(policy_cfg), value=value, reward=None)
        policy_tx, value_tx = build.make_optimizers(settings)
        mesh = mesh or sharding.make_mesh((1, -1, 1))
        abstract, _ = build.abstract_train_state(settings.ppo, modules, policy_tx, value_tx, mesh)
        state, _ = manager.restore(step, abstract_state=abstract)
        base = None
        if which == "policy" and policy_cfg.lora is not None and lora_format == "merged":
            base = initial_weights.rebuild_lora_base(settings, modules, mesh, build.run_keys(settings.seed).init,
                                           extra.get("frozen_checksums", {}).get("policy_base"), ckpt_dir)
        if which == "value" and build.value_lora(modules):
            base = lora_value_base(settings, modules, extra, abstract, manager, mesh, ckpt_dir)
    finally:
        manager.close()
    params = state.policy if which == "policy" else state.value
    bad = nonfinite_tensors(params)
    if bad:
        raise ValueError(f"checkpoint step {step} in {ckpt_dir} holds non-finite {which} parameters (NaN or inf "
                         f"in {len(bad)} of {len(jax.tree.leaves(params))} tensors, e.g. {bad[0]}); refusing to "
                         "export them")
    tokenizer = hf.load_tokenizer(os.path.join(workdir, "tokenizer"))
    if which == "policy" and policy_cfg.lora is not None:  # state.policy holds the adapters
        if lora_format == "adapter":
            return str(hf.export_adapter(out, policy_cfg, state.policy,
                                         base_model_name_or_path=settings.policy.path or None))
        return str(hf.export_model(out, policy_cfg, base, kind="causal_lm", tokenizer=tokenizer,
                                   adapters=state.policy))
    if which == "policy":
        return str(hf.export_model(out, policy_cfg, state.policy, kind="causal_lm", tokenizer=tokenizer))
    if build.value_lora(modules):  # state.value holds adapters + head: merged into the shared base's copy
        params, adapters = value_variables(state.value, base)
        return str(hf.export_model(out, value.config, params, kind="reward", tokenizer=tokenizer, adapters=adapters))
    return str(hf.export_model(out, value.config, state.value, kind="reward", tokenizer=tokenizer))


def lora_value_base(settings: Settings, modules: Modules, extra: dict, abstract, manager: CheckpointManager,
                    mesh, ckpt_dir: str):
    """The frozen transformer a LoRA value model was trained on, rebuilt from its source (the reward
    model, the policy's LoRA base, or the saved reference) and checked against the checkpoint's
    `frozen_checksums["value_base"]`."""
    recorded = extra.get("frozen_checksums", {})
    if settings.value.init == "reward":
        # The base is the reward model as the run held it: in the value model's parameter dtype.
        tree = build.load_reward_params(settings.reward, modules.value.config, mesh)
    elif modules.policy.config.lora is not None:
        tree = initial_weights.rebuild_lora_base(settings, modules, mesh, build.run_keys(settings.seed).init,
                                       recorded.get("policy_base"), ckpt_dir)
    else:
        tree = manager.restore_frozen("reference", build.as_reference(settings.policy, abstract.policy),
                                      checksums=recorded.get("reference"))
    base = tree["transformer"]
    verify.check_rebuilt(base, recorded.get("value_base"), ckpt_dir, "value base", "value base",
                        f"value.init={settings.value.init}", "use the original policy, reward model and seed")
    return base
