"""Rollout sampler throughput: ppo_jax.sampling against transformers `generate` (PyTorch, CPU).

Run by hand (not a test), on an otherwise idle machine:

    JAX_PLATFORMS=cpu python bench/bench_sampler.py                 # both shapes
    JAX_PLATFORMS=cpu python bench/bench_sampler.py --shapes tiny

For each shape a GPT-2 model with random weights is built in transformers, saved with
`save_pretrained` and read back with `ppo_jax.models.hf.load_model`, so both sides run the same
weights. Both sample (temperature 1, no top-k/top-p) the same number of new tokens for the same
left-padded batch with stopping disabled, so both produce every token. Reported: tokens/s of each
(median of --repeats timed runs after a warm-up, the two alternating so both see the same
background load), their ratio, and our compile time separately.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ppo_jax import sharding  # noqa: E402
from ppo_jax.models import CausalLM  # noqa: E402
from ppo_jax.models import hf  # noqa: E402
from ppo_jax.sampling import SamplingConfig, make_sampler  # noqa: E402

SHAPES = {
    # name: (layers, hidden, heads, vocab)
    "tiny": (2, 128, 2, 50257),
    "gpt2-small": (12, 768, 12, 50257),
}
PAD = 0


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def left_padded_prompts(batch: int, length: int, vocab: int, seed: int = 0):
    """Random prompts [batch, length]; every other row has a quarter of its slots as left padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), np.int32)
    mask[1::2, : length // 4] = 0
    return np.where(mask == 1, tokens, PAD).astype(np.int32), mask


def time_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def our_runner(path: str, prompts, new_tokens: int):
    """(compile seconds, run) for our sampler on one CPU device; run() samples once."""
    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    loaded = hf.load_model(path, mesh)
    config = SamplingConfig(max_new_tokens=new_tokens, pad_token_id=PAD, stop_token_ids=(), temperature=1.0)
    sampler = make_sampler(CausalLM(loaded.config), config, mesh,
                           jax.tree.map(lambda x: x.sharding, loaded.params))
    tokens, mask = jax.device_put(prompts, sharding.data_sharding(mesh))
    start = time.perf_counter()
    compiled = sampler.lower(loaded.params, tokens, mask, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - start
    seeds = iter(range(1, 10**6))

    def run():
        out = compiled(loaded.params, tokens, mask, jax.random.key(next(seeds)))
        jax.block_until_ready(out.tokens)
        assert int(out.lengths.min()) == new_tokens, "stopping should be disabled"

    return compile_s, run


def transformers_runner(torch_model, prompts, new_tokens: int):
    """run(n) samples n new tokens with transformers' generate (multinomial sampling, no top-k/p)."""
    import torch

    tokens, mask = (torch.tensor(x, dtype=torch.long) for x in prompts)

    def run(n=new_tokens):
        with torch.inference_mode():
            out = torch_model.generate(tokens, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                       top_p=1.0, max_new_tokens=n, min_new_tokens=0, eos_token_id=None,
                                       pad_token_id=PAD)
        assert out.shape[1] == tokens.shape[1] + n, "stopping should be disabled"

    return run


def bench_shape(name: str, args) -> dict:
    import torch
    import transformers

    layers, hidden, heads, vocab = SHAPES[name]
    vocab = args.vocab or vocab
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                        n_positions=1024, attn_implementation="eager", bos_token_id=None,
                                        eos_token_id=None, pad_token_id=PAD)
    torch_model = transformers.GPT2LMHeadModel(hf_config).eval()
    torch_model.generation_config.eos_token_id = None
    prompts = left_padded_prompts(args.batch, args.prompt, vocab)
    with tempfile.TemporaryDirectory() as path:
        torch_model.save_pretrained(path)
        compile_s, ours = our_runner(path, prompts, args.new)
    theirs = transformers_runner(torch_model, prompts, args.new)
    ours()  # warm-up
    theirs(4)  # warm-up
    # Alternate the timed runs so that all of them see the same background load; transformers runs
    # once per PyTorch thread count, and its fastest setting is the baseline.
    ours_times, theirs_times = [], {n: [] for n in args.threads}
    for _ in range(args.repeats):
        ours_times.append(time_once(ours))
        for n in args.threads:
            torch.set_num_threads(n)
            theirs_times[n].append(time_once(theirs))
    tokens = args.batch * args.new
    ours_tps = tokens / statistics.median(ours_times)
    theirs_tps = {n: tokens / statistics.median(t) for n, t in theirs_times.items()}
    best = max(theirs_tps, key=theirs_tps.get)
    return {"shape": f"{name} (vocab {vocab})", "ours_tps": ours_tps, "theirs_tps": theirs_tps,
            "best_threads": best, "ratio": ours_tps / theirs_tps[best], "compile_s": compile_s,
            "ours_times": ours_times, "theirs_times": theirs_times}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count()}),
                        help="PyTorch intra-op thread counts to try (the fastest is the baseline)")
    parser.add_argument("--vocab", type=int, default=0, help="override the shapes' vocabulary size")
    args = parser.parse_args()

    import torch
    import transformers

    print(f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
          f"(threads tried: {args.threads}), transformers {transformers.__version__}, {os.cpu_count()} CPUs")
    print(f"batch {args.batch}, prompt {args.prompt}, new tokens {args.new}, repeats {args.repeats}")
    print(f"load average before: {load_average()}")
    rows = []
    for name in args.shapes:
        row = bench_shape(name, args)
        rows.append(row)
        theirs = ", ".join(f"{tps:.1f} tok/s ({n} thr, runs {[round(t, 2) for t in row['theirs_times'][n]]} s)"
                           for n, tps in row["theirs_tps"].items())
        print(f"{row['shape']}: ours {row['ours_tps']:.1f} tok/s (runs {[round(t, 2) for t in row['ours_times']]} s, "
              f"compile {row['compile_s']:.1f} s); transformers {theirs}; ratio to the fastest transformers "
              f"({row['best_threads']} thr): {row['ratio']:.2f}x", flush=True)
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
