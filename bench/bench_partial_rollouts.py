"""Partial rollouts (rollout.partial_rollouts, issue 44 item 2): what a weight sync in the middle of a
rollout costs the sampler, keeping the rows' KV caches (what sampling/segments.py does) or
re-prefilling them under the new weights (the alternative).

Keep-KV costs nothing at a sync: the next segment just goes on. Re-prefill would, at every sync,
recompute each busy slot's keys and values over its prompt and the response so far: one forward over
[S, Lq + N - 1] cache positions (the cache width, as a static-shape engine must). This times that
forward against one segment of decoding (`segment_budget` decode steps, k + 1 segments per rollout)
on one CPU device, and prints what re-prefilling would add per rollout (k syncs land in it).

Run (from the repository root):
    python bench/bench_partial_rollouts.py --hidden 256 --layers 4 --slots 32 --response 64 --k 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _median_seconds(fn, calls: int) -> float:
    import jax
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=32, help="prompts (one sample each): R rows")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--k", type=int, default=2, help="rollout.off_policy_steps")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ppo_jax import sharding
    from ppo_jax.models import CausalLM, ModelConfig, init_params, positions_from_mask
    from ppo_jax.models.cache import init_cache
    from ppo_jax.sampling import SamplingConfig, segments
    from ppo_jax.sampling.loop import forward_last

    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    config = ModelConfig(arch="llama", vocab_size=512, hidden_size=args.hidden, num_layers=args.layers,
                         num_heads=max(2, args.hidden // 64), num_kv_heads=max(1, args.hidden // 128),
                         max_position_embeddings=args.prompt_length + args.response)
    model = CausalLM(config)
    params, _ = init_params(model, jax.random.key(0), mesh)
    sc = SamplingConfig(max_new_tokens=args.response, pad_token_id=0, engine="continuous", slots=args.slots)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 512, (args.prompts, args.prompt_length)), jnp.int32)
    mask = jnp.ones_like(tokens)
    budget = segments.segment_budget(args.prompts, sc, args.k + 1)
    static = dict(model=model, config=sc)
    begin = jax.jit(lambda p, t, m, k, b: segments.begin(p, t, m, k, 0, b, **static))
    advance = jax.jit(lambda p, s, b: segments.advance(p, s, 1, b, **static))
    state = begin(params, tokens, mask, jax.random.key(0), budget)
    segment = _median_seconds(lambda: advance(params, state, budget), args.calls)

    width = args.prompt_length + args.response - 1  # the cache positions a slot holds
    rows = jnp.asarray(rng.integers(1, 512, (args.slots, width)), jnp.int32)
    row_mask = jnp.ones_like(rows)

    @jax.jit
    def reprefill(p, toks, m):
        cache = init_cache(config, args.slots, width, sc.cache_dtype)
        return model.apply({"params": p}, toks, positions_from_mask(m), m, cache,
                           jnp.full((args.slots,), width - 1, jnp.int32), method=forward_last)

    prefill = _median_seconds(lambda: reprefill(params, rows, row_mask), args.calls)
    per_rollout = args.k * prefill
    print(f"model hidden {args.hidden} x {args.layers} layers; {args.prompts} rows on {args.slots} slots, "
          f"Lq {args.prompt_length}, N {args.response}, k {args.k}: {budget} decode steps per segment")
    print(f"one segment (keep-KV: all a sync costs is the segment itself): {segment * 1e3:.1f} ms "
          f"({segment / budget * 1e3:.2f} ms per decode step)")
    print(f"re-prefill of every slot at a sync: {prefill * 1e3:.1f} ms = {prefill / segment:.2f} segments = "
          f"{prefill / segment * budget:.1f} decode steps; x k = {args.k} syncs per rollout: +{per_rollout * 1e3:.1f} "
          f"ms on (k + 1) segments = {(args.k + 1) * segment * 1e3:.1f} ms of decoding "
          f"(+{per_rollout / ((args.k + 1) * segment) * 100:.0f} %)")


if __name__ == "__main__":
    main()
