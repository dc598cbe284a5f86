"""`python -m ppo_jax.arithmetic [--workdir DIR] [--seed N] [--estimator gae|grpo|rloo --samples N] [--quick]`:
the arithmetic task end to end (ppo_jax/arithmetic/pipeline.py); prints and writes <workdir>/summary.json."""

import argparse
import dataclasses
import json

from ppo_jax.arithmetic import pipeline


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default="runs/arithmetic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--estimator", default="gae", choices=("gae", "grpo", "rloo"),
                        help="advantages: GAE with a value model, or groups of episodes per prompt")
    parser.add_argument("--samples", type=int, default=1, help="episodes per prompt (grpo / rloo: at least 2)")
    parser.add_argument("--quick", action="store_true", help="a smoke run (seconds of training)")
    args = parser.parse_args(argv)
    if args.estimator != "gae" and args.samples < 2:
        parser.error(f"--estimator {args.estimator} compares the episodes of one prompt: pass --samples 2 or more")
    settings = pipeline.PipelineSettings(seed=args.seed, estimator=args.estimator, samples_per_prompt=args.samples)
    if args.quick:
        settings = dataclasses.replace(settings, demonstrations=256, sft_steps=20, ppo_iterations=2, eval_batches=1)
    print(json.dumps(pipeline.run(args.workdir, settings), indent=2))


if __name__ == "__main__":
    main()
