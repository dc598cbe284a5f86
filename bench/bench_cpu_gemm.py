"""The PPO update's GEMMs, XLA:CPU against PyTorch on the same CPU: the part of bench_ppo's gap that
is the GEMM library's, not ppo_jax's (issue 64).

`bench_ppo.py`'s update is one policy + one value model (GPT-2, --layers, --hidden) trained forward
and backward for --epochs epochs over --batch rows of --prompt + --response tokens. Its matmuls are
these GEMMs, each in three roles:

    forward          y = x · W        x [B, T, K], W [K, N]  -> [B, T, N]
    input gradient  dx = g · Wᵀ       g [B, T, N]            -> [B, T, K]
    weight gradient dW = xᵀ · g       contracted over B and T -> [K, N]

per layer and model: the q/k/v projection (N = 3K), the attention output, the MLP's up and down; and
the policy's tied LM head over the response positions (ppo_jax projects only those). Attention's own
batched score GEMMs (~6 % of the FLOPs at the default shapes) are left out.

Each GEMM and role runs alone on the same random operands in both libraries: in JAX as ppo_jax's
models state it (an einsum over [B, T, K] activations, the two gradients taken with `jax.vjp`, so XLA
sees the dots autodiff gives it), in PyTorch as `nn.Linear`'s forward and backward compute them
(2-D matmuls on the flattened rows). The script checks that the two libraries' products agree, times
each call (median of --reps calls, `probe_gpu_layers.bench`; the libraries alternate per role) and
prints ms, GFLOP/s and PyTorch's lead. The epoch's GEMM time at each library's rates, times --epochs,
is what each side's update spends in these GEMMs if they run there as fast as they run alone.

    python bench/bench_cpu_gemm.py --json gemm.json      # the bench_ppo shapes, float32 and bfloat16
    python bench/bench_cpu_gemm.py --hidden 32 --vocab 64 --batch 2 --prompt 4 --response 4 --reps 2   # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np
from bench_ppo import Shapes, add_shape_arguments, set_omp_wait_policy, versions
from probe_gpu_layers import bench  # median seconds of a call after warm-ups (bench/ is on the path)

# Agreement of the two libraries' products, relative to the reference's largest magnitude: float32 sums
# in different orders, bfloat16 rounds each product's output (8 bits of mantissa) the same way in both.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
ROLES = ("forward", "input_gradient", "weight_gradient")


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One of the update's GEMMs: `rows` [B, T] activations of width `k` into width `n`, `count` times per
    epoch (layers x models, or once for the LM head)."""

    name: str
    rows: tuple[int, int]
    k: int
    n: int
    count: int

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of one role (the three roles are the same size)."""
        return 2 * self.rows[0] * self.rows[1] * self.k * self.n


def update_gemms(shapes: Shapes) -> list[Gemm]:
    """The GEMMs of one epoch of bench_ppo's GPT-2 update: policy and value model forward and backward."""
    d, tokens = shapes.hidden, (shapes.batch, shapes.prompt + shapes.response)
    per_layer = shapes.layers * 2  # the policy's and the value model's
    return [
        Gemm("qkv", tokens, d, 3 * d, per_layer),
        Gemm("attention_out", tokens, d, d, per_layer),
        Gemm("mlp_up", tokens, d, 4 * d, per_layer),
        Gemm("mlp_down", tokens, 4 * d, d, per_layer),
        Gemm("lm_head", (shapes.batch, shapes.response), d, shapes.vocab, 1),
    ]


def operands(gemm: Gemm, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [B, T, K], W [K, N], g [B, T, N]: standard normal float32 (scaled so products stay O(1))."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*gemm.rows, gemm.k), np.float32)
    w = rng.standard_normal((gemm.k, gemm.n), np.float32) / np.sqrt(gemm.k)
    g = rng.standard_normal((*gemm.rows, gemm.n), np.float32)
    return x, w, g


def jax_calls(x, w, g, dtype: str) -> dict:
    """role -> () -> the product, in XLA:CPU; each a jitted function of its own, blocked on."""
    import jax
    import jax.numpy as jnp

    x, w, g = (jnp.asarray(a, dtype) for a in (x, w, g))

    def forward(x, w):
        return jnp.einsum("btk,kn->btn", x, w)

    fns = {
        "forward": (jax.jit(forward), (x, w)),
        "input_gradient": (jax.jit(lambda x, w, g: jax.vjp(lambda x: forward(x, w), x)[1](g)[0]), (x, w, g)),
        "weight_gradient": (jax.jit(lambda x, w, g: jax.vjp(lambda w: forward(x, w), w)[1](g)[0]), (x, w, g)),
    }
    return {role: (lambda f=f, a=a: jax.block_until_ready(f(*a))) for role, (f, a) in fns.items()}


def torch_calls(x, w, g, dtype: str) -> dict:
    """role -> () -> the product, in PyTorch, as `nn.Linear`'s forward and backward compute it."""
    import torch

    t = getattr(torch, dtype)
    x, w, g = (torch.from_numpy(a).to(t) for a in (x, w, g))
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    return {
        "forward": lambda: (x2 @ w).reshape(*g.shape),
        "input_gradient": lambda: (g2 @ w.T).reshape(*x.shape),
        "weight_gradient": lambda: x2.T @ g2,
    }


def check_agree(name: str, role: str, dtype: str, ours, theirs) -> float:
    """The largest difference of the JAX product from the PyTorch one, relative to the latter's largest
    magnitude; raises past TOLERANCE. (Converted here, outside the timed calls.)"""
    ours, theirs = np.asarray(ours, np.float32), theirs.float().numpy()
    error = float(np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-30))
    if not error <= TOLERANCE[dtype]:
        raise AssertionError(f"{name} {role} {dtype}: XLA and PyTorch differ by {error:.2e} "
                             f"(relative), above {TOLERANCE[dtype]:.0e}")
    return error


def measure(gemm: Gemm, dtype: str, reps: int) -> list[dict]:
    """One row per role: both libraries' median ms and GFLOP/s on the same operands."""
    arrays = operands(gemm)
    ours, theirs = jax_calls(*arrays, dtype), torch_calls(*arrays, dtype)
    rows = []
    for role in ROLES:
        error = check_agree(gemm.name, role, dtype, ours[role](), theirs[role]())
        jax_s, torch_s = bench(ours[role], reps=reps)[0], bench(theirs[role], reps=reps)[0]
        rows.append({"gemm": gemm.name, "role": role, "dtype": dtype, "rows": list(gemm.rows), "k": gemm.k,
                     "n": gemm.n, "count_per_epoch": gemm.count, "relative_difference": error,
                     "jax_ms": jax_s * 1e3, "torch_ms": torch_s * 1e3,
                     "jax_gflops": gemm.flops / jax_s / 1e9, "torch_gflops": gemm.flops / torch_s / 1e9})
    return rows


def update_floor(rows: list[dict], epochs: int) -> dict:
    """dtype -> each library's seconds for all the update's GEMMs (every role, count and epoch)."""
    floor: dict[str, dict[str, float]] = {}
    for r in rows:
        side = floor.setdefault(r["dtype"], {"jax_s": 0.0, "torch_s": 0.0})
        for lib in ("jax", "torch"):
            side[f"{lib}_s"] += r[f"{lib}_ms"] / 1e3 * r["count_per_epoch"] * epochs
    return floor


def report(rows: list[dict], floor: dict, epochs: int) -> None:
    print(f"{'gemm':14s} {'role':16s} {'dtype':9s} {'[M,K]x[K,N]':>22s} {'XLA ms':>8s} {'torch ms':>9s} "
          f"{'XLA GF/s':>9s} {'torch GF/s':>10s} {'torch lead':>10s}")
    for r in rows:
        shape = f"[{r['rows'][0] * r['rows'][1]},{r['k']}]x[{r['k']},{r['n']}]"
        print(f"{r['gemm']:14s} {r['role']:16s} {r['dtype']:9s} {shape:>22s} {r['jax_ms']:8.2f} "
              f"{r['torch_ms']:9.2f} {r['jax_gflops']:9.0f} {r['torch_gflops']:10.0f} "
              f"{r['jax_ms'] / r['torch_ms']:9.2f}x")
    for dtype, side in floor.items():
        print(f"{dtype}: the update's GEMMs ({epochs} epochs) take {side['jax_s']:.2f} s in XLA:CPU, "
              f"{side['torch_s']:.2f} s in PyTorch ({side['jax_s'] / side['torch_s']:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(p)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--reps", type=int, default=30, help="timed calls per GEMM, role, dtype and library")
    p.add_argument("--omp-wait-policy", default="PASSIVE", help="as in bench_ppo.py ('' leaves libgomp's)")
    p.add_argument("--json", help="write the rows, the floor and the versions here")
    args = p.parse_args()
    dtypes = args.dtypes.split(",")
    unknown = sorted(set(dtypes) - set(TOLERANCE))
    if unknown:
        p.error(f"--dtypes takes {', '.join(TOLERANCE)} (got {unknown})")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.arch != "gpt2":
        p.error(f"--arch {args.arch}: only the GPT-2 update's GEMMs are listed here")
    set_omp_wait_policy(args.omp_wait_policy)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    shapes = Shapes.from_args(args)
    rows = [row for dtype in dtypes for gemm in update_gemms(shapes) for row in measure(gemm, dtype, args.reps)]
    floor = update_floor(rows, shapes.epochs)
    report(rows, floor, shapes.epochs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shapes": dataclasses.asdict(shapes), "rows": rows, "update_floor": floor,
                       "versions": versions(), "xla_flags": os.environ.get("XLA_FLAGS", "")}, f, indent=1)


if __name__ == "__main__":
    main()
