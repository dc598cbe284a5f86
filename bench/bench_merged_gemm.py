"""Decode-shaped projections as two GEMMs or one: does merging them pay where XLA does not (issue 63 item 2)?

XLA's dot merger joins dots that share an operand (q/k/v, gate/up) only up to 32 MiB of weights, so
at 8B (gate and up 117 MB each) the decode step runs them as separate GEMMs. Merging them by hand
costs either a new parameter layout (the HF export and LoRA name q/k/v and gate/up apart) or a merged
copy of the weights per rollout (~9 GB at 8B), so it is worth building only if one wide GEMM at
decode's small M streams the weights measurably faster than two. This times, on the default device:

- `apart`:  x @ W1, x @ W2 (..) in one jitted function (what XLA runs where it does not merge),
- `merged`: x @ [W1 | W2 ..], the weights concatenated once beforehand,

for bf16 decode rows x [M, D] and each shape below, reporting milliseconds per call (median of
--repeats timings of --calls calls each, `probe_gpu_layers.bench`), the bytes of weights streamed per call over that time, and
how many dot kernels the optimised HLO holds (whether XLA merged `apart` itself).

    python bench/bench_merged_gemm.py --json merged.json            # on the GPU
    python bench/bench_merged_gemm.py --rows 8 --scale 16           # a CPU smoke test (shapes / 16)

Not a test, and no figure of it is kept from a CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re

import jax
import jax.numpy as jnp
from probe_gpu_layers import bench  # median seconds of a call after warm-ups (bench/ is on the path)

# name: (D, the output widths of the projections sharing x)
SHAPES = {
    "llama3_8b_gate_up": (4096, (14336, 14336)),
    "llama3_8b_qkv": (4096, (4096, 1024, 1024)),
    "tinyllama_gate_up": (2048, (5632, 5632)),
    "tinyllama_qkv": (2048, (2048, 256, 256)),
}


def dot_kernels(compiled_text: str) -> int:
    """GEMM kernels in an XLA:GPU optimised HLO text: Triton GEMM fusions and cuBLAS calls (the ENTRY
    computation's; 0 on a CPU, whose dots are not counted)."""
    entry = compiled_text[compiled_text.index("ENTRY"):]
    return sum(bool(re.match(r"\s*(ROOT )?%gemm_fusion\S* = ", line)) or "__cublas$gemm" in line
               for line in entry.splitlines())


def measure(name: str, d: int, widths: tuple[int, ...], rows: int, calls: int, repeats: int) -> dict:
    keys = jax.random.split(jax.random.key(0), len(widths) + 1)
    x = jax.random.normal(keys[0], (rows, d), jnp.bfloat16)
    weights = [jax.random.normal(k, (d, n), jnp.bfloat16) * 0.02 for k, n in zip(keys[1:], widths)]
    merged_weight = jnp.concatenate(weights, axis=1)

    apart = jax.jit(lambda x, ws: tuple(x @ w for w in ws))
    cuts = list(itertools.accumulate(widths))[:-1]
    merged = jax.jit(lambda x, w: tuple(jnp.split(x @ w, cuts, axis=1)))
    weight_bytes = sum(w.size for w in weights) * 2
    out = {"d": d, "widths": list(widths), "rows": rows, "weight_bytes": weight_bytes}
    for kind, fn, args in (("apart", apart, (x, weights)), ("merged", merged, (x, merged_weight))):
        seconds = bench(fn, *args, reps=repeats, inner=calls)[0]
        out[kind] = {"ms": round(seconds * 1e3, 4), "gb_per_s": round(weight_bytes / seconds / 1e9, 1),
                     "dot_kernels": dot_kernels(fn.lower(*args).compile().as_text())}
    out["merged_speedup"] = round(out["apart"]["ms"] / out["merged"]["ms"], 3)
    print(f"{name:<20} M={rows:<4} apart {out['apart']['ms']:.4f} ms ({out['apart']['gb_per_s']} GB/s, "
          f"{out['apart']['dot_kernels']} dots)  merged {out['merged']['ms']:.4f} ms ({out['merged']['gb_per_s']} GB/s, "
          f"{out['merged']['dot_kernels']} dots)  x{out['merged_speedup']}", flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="decode rows M (the bench's batch)")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--scale", type=int, default=1, help="divide every width by this (a CPU smoke test)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    results = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "shapes": {}}
    for name in args.shapes:
        d, widths = SHAPES[name]
        results["shapes"][name] = measure(name, d // args.scale, tuple(n // args.scale for n in widths), args.rows,
                                          args.calls, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
