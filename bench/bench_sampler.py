"""Rollout sampler throughput: ppo_jax.sampling against transformers `generate` (PyTorch, CPU).

Run by hand (not a test), on an otherwise idle machine:

    python bench/bench_sampler.py                                  # the two GPT-2 shapes
    python bench/bench_sampler.py --shapes tiny-moe --vocab 1024   # a tiny Qwen3-MoE (8 experts, top 2)
    python bench/bench_sampler.py --shapes tiny --vocab 1024       # override the vocabulary
    python bench/bench_sampler.py --threads 1 --xla-threads 1      # both sides single-threaded
    python bench/bench_sampler.py --engines --shapes tiny gpt2-small  # static vs continuous engine (below)

For each shape a GPT-2 (or Qwen3-MoE) model with random weights is built in transformers, saved with
`save_pretrained` and read back with `ppo_jax.models.hf.load_model`, so both sides run the same
weights. Both sample (temperature 1, no top-k/top-p) the same number of new tokens for the same
left-padded batch with stopping disabled, so both produce every token. Reported: tokens/s of each
(median of --repeats timed runs after a warm-up, the runs alternating so that both see the same
background load), their ratio, our compile time separately, and the CPU seconds of each run (on a
loaded machine the CPU time of a single-threaded run is the steadier measure of the work done).

`--engines` compares ppo_jax's two rollout engines instead, on the same weights, prompts and key:
the static engine (every row decoded until the longest stops) and the continuous one (`--slots`
decode rows fed from the queue of rows). Response lengths are forced per row (`response_limits`,
no stop tokens) by a schedule: `long-tailed` (lognormal, median 10% and 99th percentile 100% of
`--new`), `spread` (uniform on 1..new) or `equal` (every row `--new`: nothing to gain, the
continuous engine's overhead alone). Reported per schedule: generated tokens/s (median of
--repeats), slot occupancy, and each program's memory (XLA's buffer assignment: arguments +
outputs + temps), and how many rows' tokens differ from the static engine's (float round-off, above).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

SHAPES = {
    # name: (layers, hidden, heads, vocab); GPT-2 unless named in MOE_SHAPES
    "tiny": (2, 128, 2, 50257),
    "gpt2-small": (12, 768, 12, 50257),
    "tiny-moe": (2, 128, 2, 50257),
}
# Qwen3-MoE shapes: (experts, experts per token, expert MLP width).
MOE_SHAPES = {"tiny-moe": (8, 2, 128)}
# Llama shapes for --engines only (no transformers peer): (layers, hidden, heads, kv heads, MLP, vocab).
ENGINE_SHAPES = {"tinyllama": (22, 2048, 32, 4, 5632, 32000)}
PAD = 0


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["tiny", "gpt2-small"], choices=[*SHAPES, *ENGINE_SHAPES],
                        help="model shapes (tinyllama: --engines only, for an accelerator)")
    parser.add_argument("--vocab", type=int, default=0, help="override the shapes' vocabulary size")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count()}),
                        help="PyTorch intra-op thread counts to try (the fastest is the baseline)")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"],
                        help="transformers attention implementation (sdpa: its default)")
    parser.add_argument("--xla-threads", type=int, default=0,
                        help="1: run XLA single-threaded (default 0: XLA's own choice, all cores)")
    parser.add_argument("--engines", action="store_true", help="static vs continuous engine (see above)")
    parser.add_argument("--lengths", nargs="+", default=["long-tailed", "equal"],
                        choices=["long-tailed", "spread", "equal"], help="--engines: length schedules")
    parser.add_argument("--slots", type=int, nargs="+", default=[0],
                        help="--engines: continuous decode slots to try (0: a quarter of the rows)")
    parser.add_argument("--prefill", type=int, default=0, help="--engines: prompts per prefill (0: the default)")
    parser.add_argument("--dtype", default="float32", help="--engines: params and compute dtype (bfloat16 on a GPU)")
    parser.add_argument("--tail-halvings", type=int, default=None, help="--engines: SamplingConfig.tail_halvings "
                        "(default: the library's)")
    return parser.parse_args()


def configure_jax(xla_threads: int, accelerator: bool = False) -> None:
    """Environment for JAX; must run before jax is imported. The transformers comparison runs on the
    CPU (its peer does); `accelerator`: leave JAX its default backend (--engines on a GPU)."""
    if not accelerator:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if xla_threads == 1:
        flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    elif xla_threads:
        raise SystemExit("--xla-threads supports 0 (XLA's default) or 1")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def left_padded_prompts(batch: int, length: int, vocab: int, seed: int = 0):
    """Random prompts [batch, length]; every other row has a quarter of its slots as left padding."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), np.int32)
    mask[1::2, : length // 4] = 0
    return np.where(mask == 1, tokens, PAD).astype(np.int32), mask


def time_once(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def our_runner(path: str, prompts, new_tokens: int):
    """(compile seconds, run) for our sampler on one CPU device; run() samples once."""
    import jax

    from ppo_jax import sharding
    from ppo_jax.models import CausalLM, hf
    from ppo_jax.sampling import SamplingConfig, make_sampler

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


def torch_model_for(name: str, layers: int, hidden: int, heads: int, vocab: int, attention: str):
    """The transformers model of a shape, random weights: GPT-2, or Qwen3-MoE for MOE_SHAPES."""
    import transformers

    common = dict(vocab_size=vocab, attn_implementation=attention, bos_token_id=None, eos_token_id=None,
                  pad_token_id=PAD)
    if name in MOE_SHAPES:
        experts, per_token, width = MOE_SHAPES[name]
        config = transformers.Qwen3MoeConfig(
            num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
            head_dim=hidden // heads, intermediate_size=4 * hidden, moe_intermediate_size=width, num_experts=experts,
            num_experts_per_tok=per_token, norm_topk_prob=True, max_position_embeddings=1024,
            tie_word_embeddings=False, **common)
        return transformers.Qwen3MoeForCausalLM(config).eval()
    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=1024, **common)
    return transformers.GPT2LMHeadModel(config).eval()


def bench_shape(name: str, args) -> dict:
    import torch

    layers, hidden, heads, vocab = SHAPES[name]
    vocab = args.vocab or vocab
    torch.manual_seed(0)
    torch_model = torch_model_for(name, layers, hidden, heads, vocab, args.attention)
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
    ours_runs, theirs_runs = [], {n: [] for n in args.threads}
    for _ in range(args.repeats):
        ours_runs.append(time_once(ours))
        for n in args.threads:
            torch.set_num_threads(n)
            theirs_runs[n].append(time_once(theirs))
    tokens = args.batch * args.new

    def summary(runs):
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        return {"tps": tokens / wall, "cpu_tps": tokens / cpu, "runs": runs}

    theirs_summary = {n: summary(r) for n, r in theirs_runs.items()}
    best = max(theirs_summary, key=lambda n: theirs_summary[n]["tps"])
    ours_summary = summary(ours_runs)
    return {"shape": f"{name} (vocab {vocab})", "ours": ours_summary, "theirs": theirs_summary,
            "best_threads": best, "ratio": ours_summary["tps"] / theirs_summary[best]["tps"],
            "cpu_ratio": ours_summary["cpu_tps"] / theirs_summary[best]["cpu_tps"], "compile_s": compile_s}


def response_lengths(schedule: str, rows: int, new: int, seed: int = 0):
    """Per-row response lengths [rows] int32 in 1..new by `schedule` (see the module docstring)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if schedule == "equal":
        return np.full(rows, new, np.int32)
    if schedule == "spread":
        return rng.integers(1, new + 1, rows).astype(np.int32)
    # Lognormal with median 0.1 * new and 99th percentile new: sigma = ln(10) / z_0.99.
    sigma = np.log(10.0) / 2.3263
    return np.clip(np.round(0.1 * new * np.exp(sigma * rng.standard_normal(rows))), 1, new).astype(np.int32)


def engine_runner(model, params, prompts, config, limits):
    """(compiled program's memory in bytes, run) for one engine; run(key) -> SampleOutput on host."""
    import jax

    from ppo_jax.sampling import sample, sample_continuous

    engine = sample_continuous if config.engine == "continuous" else sample
    jitted = jax.jit(lambda p, t, m, k, lim: engine(p, t, m, k, model=model, config=config, response_limits=lim))
    compiled = jitted.lower(params, *prompts, jax.random.key(0), limits).compile()
    memory = compiled.memory_analysis()
    peak = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    return peak, lambda key: jax.device_get(compiled(params, *prompts, key, limits))


def bench_engines(name: str, args) -> list[dict]:
    """Static vs continuous engine on one shape, for every length schedule and slot count."""
    import dataclasses

    import jax
    import numpy as np

    from ppo_jax import sharding
    from ppo_jax.models import CausalLM, ModelConfig, init_params
    from ppo_jax.sampling import SamplingConfig, slot_occupancy

    common = dict(max_position_embeddings=args.prompt + args.new, param_dtype=args.dtype, dtype=args.dtype)
    if name in ENGINE_SHAPES:
        layers, hidden, heads, kv_heads, mlp, vocab = ENGINE_SHAPES[name]
        vocab = args.vocab or vocab
        config = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                             num_kv_heads=kv_heads, intermediate_size=mlp, tie_word_embeddings=False, **common)
    else:
        layers, hidden, heads, vocab = SHAPES[name]
        vocab = args.vocab or vocab
        config = ModelConfig(arch="gpt2", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                             **common)
    model = CausalLM(config)
    params, _ = init_params(model, jax.random.key(0), sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    prompts = left_padded_prompts(args.batch, args.prompt, vocab)
    static = SamplingConfig(max_new_tokens=args.new, pad_token_id=PAD, stop_token_ids=())
    results = []
    for schedule in args.lengths:
        limits = response_lengths(schedule, args.batch, args.new)
        engines = [("static", static)] + [
            (f"continuous, {s or max(1, args.batch // 4)} slots", dataclasses.replace(
                static, engine="continuous", slots=s or max(1, args.batch // 4), prefill_prompts=args.prefill,
                **({} if args.tail_halvings is None else {"tail_halvings": args.tail_halvings})))
            for s in args.slots]
        runs = {label: engine_runner(model, params, prompts, cfg, limits) for label, cfg in engines}
        # Warm-up, and each engine's tokens beside the static engine's: the same up to float round-off
        # (a row's logits computed in another batch shape can differ in the last bit, which moves a
        # draw across a token boundary now and then, and the row differs from there on).
        outputs = {label: run(jax.random.key(1)) for label, (_, run) in runs.items()}
        reference = outputs["static"]
        for label, out in outputs.items():
            assert np.array_equal(out.lengths, limits), label
        times = {label: [] for label in runs}
        for repeat in range(args.repeats):  # alternating, so every engine sees the same load
            for label, (_, run) in runs.items():
                times[label].append(time_once(lambda run=run, r=repeat: run(jax.random.key(2 + r)))[0])
        generated = int(limits.sum())
        for label, cfg in engines:
            wall = statistics.median(times[label])
            out = outputs[label]
            results.append({"shape": f"{name} (vocab {vocab})", "lengths": schedule, "engine": label,
                            "tokens_per_s": generated / wall, "runs": times[label],
                            "occupancy": float(slot_occupancy(out, cfg, args.batch)),
                            "memory_mib": runs[label][0] / 2**20, "generated": generated,
                            "rows_differing": int((out.tokens != reference.tokens).any(axis=1).sum()),
                            "p50": int(np.median(limits)), "p90": int(np.quantile(limits, 0.9)),
                            "max": int(limits.max())})
    return results


def print_engines(results: list[dict]) -> None:
    base = {(r["shape"], r["lengths"]): r for r in results if r["engine"] == "static"}
    for r in results:
        static = base[(r["shape"], r["lengths"])]
        runs = ", ".join(f"{w:.3f}" for w in r["runs"])
        print(f"  {r['shape']}, {r['lengths']} lengths (p50 {r['p50']}, p90 {r['p90']}, max {r['max']}; "
              f"{r['generated']} tokens), {r['engine']}: {r['tokens_per_s']:.0f} tok/s "
              f"({r['tokens_per_s'] / static['tokens_per_s']:.2f}x static), occupancy {r['occupancy']:.3f}, "
              f"memory {r['memory_mib']:.1f} MiB ({r['memory_mib'] / static['memory_mib']:.2f}x); rows whose "
              f"tokens differ from static: {r['rows_differing']}; runs s: {runs}",
              flush=True)


def describe(label: str, s: dict) -> str:
    runs = ", ".join(f"{w:.2f}/{c:.2f}" for w, c in s["runs"])
    return f"{label}: {s['tps']:.1f} tok/s ({s['cpu_tps']:.1f} per CPU-second; runs wall/CPU s: {runs})"


def main():
    args = parse_args()
    configure_jax(args.xla_threads, accelerator=args.engines)
    import jax

    if args.engines:  # ppo_jax alone: no torch needed
        print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {args.dtype}; batch {args.batch}, prompt "
              f"{args.prompt}, new tokens {args.new}, repeats {args.repeats}; load average {load_average()}",
              flush=True)
        for name in args.shapes:
            print_engines(bench_engines(name, args))
        print(f"load average after: {load_average()}")
        return
    import torch
    import transformers

    print(f"jax {jax.__version__} ({jax.devices()[0].platform}, XLA threads: "
          f"{'1' if args.xla_threads == 1 else 'default'}), torch {torch.__version__} (threads tried: "
          f"{args.threads}), transformers {transformers.__version__}, {os.cpu_count()} CPUs")
    print(f"batch {args.batch}, prompt {args.prompt}, new tokens {args.new}, repeats {args.repeats}, "
          f"transformers attention {args.attention}")
    print(f"load average before: {load_average()}", flush=True)
    for name in args.shapes:
        row = bench_shape(name, args)
        print(row["shape"])
        print("  " + describe(f"ours (compile {row['compile_s']:.1f} s)", row["ours"]))
        for n, s in row["theirs"].items():
            print("  " + describe(f"transformers, {n} thread(s)", s))
        print(f"  ratio to the fastest transformers ({row['best_threads']} thread(s)): {row['ratio']:.2f}x "
              f"wall, {row['cpu_ratio']:.2f}x per CPU-second", flush=True)
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
