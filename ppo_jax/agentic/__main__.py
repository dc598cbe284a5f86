"""`python -m ppo_jax.agentic [--workdir DIR] [--seed N] [--quick]`: the arithmetic task end to end
(ppo_jax/agentic/pipeline.py); prints and writes <workdir>/summary.json."""

import argparse
import dataclasses
import json

from ppo_jax.agentic import pipeline


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default="runs/agentic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run (seconds of training)")
    args = parser.parse_args(argv)
    settings = pipeline.PipelineSettings(seed=args.seed)
    if args.quick:
        settings = dataclasses.replace(settings, demonstrations=256, sft_steps=20, ppo_iterations=2, eval_batches=1)
    print(json.dumps(pipeline.run(args.workdir, settings), indent=2))


if __name__ == "__main__":
    main()
