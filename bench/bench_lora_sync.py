"""How a LoRA policy's sampler should decode (roles.lora_sync, issue 31): the base with the adapters
applied in every step ("adapters"), or a merged copy ("merged"), same weights, same prompts, one run.

Builds a tiny PPO trainer with a LoRA policy on one CPU device, then times its sampler (base +
adapters) against a plain sampler on `merge_lora(base, adapters)`, calls alternating, and prints the
medians and the bytes each sync would move (the adapters either way; the whole policy if the merge
happened on the trainer's side).

Run (from the repository root):
    python bench/bench_lora_sync.py --hidden 128 --layers 4 --rank 8
    python bench/bench_lora_sync.py --hidden 512 --layers 4 --rank 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import jax
    from tiny_configs import tiny_config

    from ppo_jax import sampling, sharding
    from ppo_jax.models import lora as lora_lib
    from ppo_jax.rl.state import policy_variables
    from ppo_jax.rl.trainer import PPOTrainer

    config = tiny_config(**{"policy.lora.rank": args.rank, "policy.lora.alpha": 2.0 * args.rank,
                            "rollout.response_length": args.response, "train.iterations": 1})
    model = config.policy.model
    model.hidden_size, model.num_layers, model.num_heads = args.hidden, args.layers, max(2, args.hidden // 64)
    model.max_position_embeddings, model.vocab_size = 128, 512
    trainer = PPOTrainer(config, tempfile.mkdtemp(), mesh=sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    params, adapters = policy_variables(trainer.state.policy, trainer.frozen.policy)
    merged = jax.jit(lambda p, a: lora_lib.merge_lora(p, a, trainer.policy_config.lora))(params, adapters)
    plain = sampling.make_sampler(trainer.modules.policy, trainer.steps.sampling_config, trainer.mesh,
                                  trainer.steps.sampler_shardings.params)
    tokens, mask = sharding.put_local_batch(trainer.prompts.next_batch(), trainer.mesh)
    key = sharding.replicate(jax.random.key(0), trainer.mesh)
    runs = {"adapters": lambda: trainer.steps.sampler(params, tokens, mask, key, adapters=adapters),
            "merged": lambda: plain(merged, tokens, mask, key)}
    for run in runs.values():
        jax.block_until_ready(run())  # compile
    times = {name: [] for name in runs}
    for _ in range(args.calls):
        for name, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append(time.perf_counter() - start)
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(adapters))
    full_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    a, m = (statistics.median(times[k]) for k in ("adapters", "merged"))
    print(f"d={args.hidden} layers={args.layers} rank={args.rank}: adapters {a:.4f} s, merged {m:.4f} s "
          f"({a / m:.2f}x); sync bytes: adapters {adapter_bytes}, the whole policy {full_bytes} "
          f"({adapter_bytes / full_bytes:.1%})")


if __name__ == "__main__":
    main()
