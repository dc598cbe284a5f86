"""Export a trained policy (or value model) as a Hugging Face directory.

    python -m ppo_jax.export --checkpoint=WORKDIR [--step=N] [--which=policy|value] --out=DIR

WORKDIR is a PPO run's workdir (or its `checkpoints/` directory). The output holds config.json,
model.safetensors and the run's tokenizer; `transformers` loads it with `from_pretrained`. The
directory is written beside DIR and renamed at the end, so an interrupted export leaves nothing
half-written.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "PPO workdir (or its checkpoints/ directory).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest complete one).")
_WHICH = flags.DEFINE_enum("which", "policy", ["policy", "value"], "Which model to export.")
_OUT = flags.DEFINE_string("out", None, "Output Hugging Face directory.")


def _checkpoint_dir(path: str) -> tuple[str, str]:
    """(workdir, checkpoints dir) from either of them."""
    path = os.path.abspath(path)
    if os.path.basename(path.rstrip("/")) == "checkpoints":
        return os.path.dirname(path), path
    return path, os.path.join(path, "checkpoints")


def export_checkpoint(checkpoint: str, out: str, *, step: int | None = None, which: str = "policy",
                      mesh=None) -> str:
    """Restores `which` from a PPO checkpoint and writes it as a Hugging Face directory."""
    import jax
    import ml_collections

    from ppo_jax import config as config_lib, sharding
    from ppo_jax.checkpoint import CheckpointManager
    from ppo_jax.models import CausalLM, ScalarModel, hf
    from ppo_jax import trainer as trainer_lib

    workdir, ckpt_dir = _checkpoint_dir(checkpoint)
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"{ckpt_dir} does not exist: --checkpoint must be a PPO workdir or its "
                                "checkpoints/ directory")
    manager = CheckpointManager(ckpt_dir)
    try:
        step, extra = manager.read_extra(step)
        config = ml_collections.ConfigDict(extra["config"])
        policy_cfg = config_lib.model_config_from_dict(extra["policy_model"])
        value = None
        if extra.get("value_model"):
            value = ScalarModel(config_lib.model_config_from_dict(extra["value_model"]),
                                head_init=extra["value_head_init"])
        elif which == "value":
            raise ValueError(f"the run in {workdir} has no value model (advantage estimator "
                             f"{config.ppo.advantage_estimator!r})")
        modules = trainer_lib.Modules(policy=CausalLM(policy_cfg), value=value, reward=None)
        policy_tx, value_tx = trainer_lib.make_optimizers(config, value is not None)
        mesh = mesh or sharding.make_mesh((1, -1, 1))
        abstract, _ = trainer_lib.abstract_train_state(config, modules, policy_tx, value_tx, mesh)
        state, _ = manager.restore(step, abstract_state=abstract)
    finally:
        manager.close()
    tokenizer = hf.load_tokenizer(os.path.join(workdir, "tokenizer"))
    if which == "policy":
        return str(hf.export_model(out, policy_cfg, state.policy, kind="causal_lm", tokenizer=tokenizer))
    return str(hf.export_model(out, value.config, state.value, kind="reward", tokenizer=tokenizer))


def main(argv):
    del argv
    try:
        path = export_checkpoint(_CHECKPOINT.value, _OUT.value, step=_STEP.value, which=_WHICH.value)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"exported the {_WHICH.value} to {path}")


if __name__ == "__main__":
    flags.mark_flags_as_required(["checkpoint", "out"])
    app.run(main)
