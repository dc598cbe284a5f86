"""The demo's PPO stage alone, on a finished demo run's SFT policy and reward model, with overrides:
how the collapses of docs/demo.md ("The spike") were reproduced without re-running SFT and the reward
model each time.

    python -m ppo_jax.demo --workdir=runs/demo                      # once: SFT, reward model, PPO
    python bench/demo_ppo_stage.py runs/demo runs/spike_21 21 \\
        ppo.train.sample_every=1 ppo.optim.policy_lr=0.001 ppo.train.iterations=40

Arguments: the finished demo workdir, a new output directory (replaced), the PPO seed, then any
number of demo-config overrides FIELD=VALUE (the demo config's dotted names, as after --config.).
Prints the first and last gold evaluation and the final KL as one JSON line; the stage's metrics,
samples and evaluations are in <out>/ppo/.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from ppo_jax.demo.settings import DemoSettings, get_config
from ppo_jax.demo.stages import train_ppo


def with_overrides(config, overrides):
    for item in overrides:
        field, value = item.split("=", 1)
        *path, last = field.split(".")
        node = config
        for name in path:
            node = node[name]
        current = node[last]
        node[last] = value == "True" if isinstance(current, bool) else type(current)(value)
    return config


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    source, out, seed = argv[0], argv[1], int(argv[2])
    config = get_config()
    config.seed, config.progress = seed, False
    settings = DemoSettings.from_config(with_overrides(config, argv[3:]))
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    result = train_ppo(settings, os.path.join(source, "sft", "hf"), os.path.join(source, "reward_model", "hf"), out)
    print(json.dumps({"first_gold": result.evals[0].gold, "last_gold": result.evals[-1].gold,
                      "final_kl": result.evals[-1].kl}))


if __name__ == "__main__":
    main(sys.argv[1:])
