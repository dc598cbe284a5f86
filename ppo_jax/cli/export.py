"""`python -m ppo_jax.cli.export --checkpoint=WORKDIR [--step=N] [--which=policy|value] [--lora=merged|adapter]
--out=DIR` (also the console script `ppo-jax-export`): a PPO checkpoint's policy or value model as a Hugging
Face directory; a LoRA policy as merged full weights or as a PEFT adapter directory."""

from __future__ import annotations

import sys

from absl import app, flags

from ppo_jax.cli.common import USER_ERRORS, fail, help_and_exit, quiet_logging, wants_help
from ppo_jax.rl.export import LORA_FORMATS, export_checkpoint


def main(argv=None) -> None:
    checkpoint = flags.DEFINE_string("checkpoint", None, "PPO workdir (or its checkpoints/ directory).")
    step = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest complete one).")
    which = flags.DEFINE_enum("which", "policy", ["policy", "value"], "Which model to export.")
    lora = flags.DEFINE_enum("lora", "merged", list(LORA_FORMATS),
                             "A LoRA policy (policy.lora.rank > 0): 'merged' full weights (adapters folded into "
                             "the base) or 'adapter' (a PEFT adapter directory for the base).")
    out = flags.DEFINE_string("out", None, "Output Hugging Face directory.")
    flags.mark_flags_as_required(["checkpoint", "out"])
    if wants_help(sys.argv if argv is None else argv):
        help_and_exit(__doc__, "checkpoint")

    def run(args):
        if len(args) > 1:
            raise app.UsageError(f"unexpected arguments {args[1:]}")
        quiet_logging()
        try:
            path = export_checkpoint(checkpoint.value, out.value, step=step.value, which=which.value,
                                     lora_format=lora.value)
        except USER_ERRORS as e:
            fail(str(e))
        print(f"exported the {which.value} to {path}")

    app.run(run, argv=argv)


if __name__ == "__main__":
    main()
