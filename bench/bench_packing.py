"""Packed (padding-free) against padded experience and update steps, same rollouts, one run.

Builds the trainers of `bench_ppo.py` (a random GPT-2 policy, a GPT-2 reward model, the value model
grown from it; every step fp32 on this host's CPU) once with `ppo.packing="off"` and once per packed
token budget (`ppo.packing="on"`, `ppo.max_tokens_per_microbatch`), then times their compiled
experience step and update step (all epochs) on the same synthetic rollouts. Nothing else differs:
the same weights, the same tokens, the same lengths.

Length distributions (the rollouts' real tokens; prompts are left-padded to --prompt, responses
right-padded to --response, as the sampler returns them):
  * full:     every prompt and response at its maximum (no padding: what packing costs when it
              cannot save anything);
  * uniform:  prompt lengths uniform in [8, --prompt] and response lengths uniform in [8, --response]
              (the issue's long tail: chat prompts of varied length, responses stopped anywhere);
  * stopped:  prompt lengths uniform in [8, --prompt]; responses EOS-stopped early: geometric lengths
              with mean --response / 4, at least 1, capped at --response (a policy that mostly
              answers briefly, like the demo's).

Reported per distribution and side: token efficiency (real tokens / the tokens the forwards compute,
the step's own `perf/token_efficiency` metrics), and the median wall time of the experience step and
of the update step over --iterations calls per round, sides alternating within each round so machine
load hits them alike. Speed-up = padded median / packed median.

Run (from the repository root, with the `[bench]` extra installed):
    python bench/bench_packing.py                       # the bench_ppo shapes, 3 rounds x 3 calls
    python bench/bench_packing.py --layers 1 --hidden 64 --vocab 512 --rounds 1 --iterations 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ppo import Hyper, Shapes, add_shape_arguments, build_assets, versions  # noqa: E402

DISTRIBUTIONS = ("full", "uniform", "stopped")


def lengths(kind: str, rows: int, longest: int, rng: np.random.Generator, *, prompt: bool) -> np.ndarray:
    """[rows] real-token counts under distribution `kind` (see the module docstring)."""
    if kind == "full":
        return np.full(rows, longest)
    if prompt or kind == "uniform":
        return rng.integers(min(8, longest), longest + 1, size=rows)
    return np.minimum(rng.geometric(4.0 / longest, size=rows), longest)


def synthetic_rollout(kind: str, shapes: Shapes, vocab: int, seed: int):
    """A `Rollout` of batch x (prompt + response) tokens with the lengths of `kind`."""
    import jax.numpy as jnp

    from ppo_jax.rl.state import Rollout

    rng = np.random.default_rng(seed)
    b, lq, lr = shapes.batch, shapes.prompt, shapes.response
    q = lengths(kind, b, lq, rng, prompt=True)
    r = lengths(kind, b, lr, rng, prompt=False)
    prompt_mask = (np.arange(lq)[None, :] >= lq - q[:, None]).astype(np.int32)  # left-padded
    mask = (np.arange(lr)[None, :] < r[:, None]).astype(np.int32)  # right-padded
    prompt_tokens = rng.integers(4, vocab, size=(b, lq)) * prompt_mask
    tokens = rng.integers(4, vocab, size=(b, lr)) * mask
    return Rollout(prompt_tokens=jnp.asarray(prompt_tokens, jnp.int32), prompt_mask=jnp.asarray(prompt_mask),
                   tokens=jnp.asarray(tokens, jnp.int32), mask=jnp.asarray(mask),
                   sampler_logprobs=jnp.zeros((b, lr), jnp.float32), behaviour_logprobs=jnp.zeros((b, lr), jnp.float32),
                   stopped=jnp.asarray(r < lr),
                   host_scores=jnp.zeros((b,), jnp.float32))


class Side:
    """One trainer's compiled experience and update steps, timed on given rollouts."""

    def __init__(self, name: str, shapes: Shapes, hp: Hyper, assets: dict, workdir: str, packing: str,
                 budget: int):
        import jax

        from ppo_jax import sharding
        from ppo_jax.rl.settings import ppo_config
        from ppo_jax.rl.trainer import PPOTrainer

        c = ppo_config()
        c.seed = hp.seed
        c.policy.path = assets["paths"]["policy"]
        c.reward.path = assets["paths"]["reward"]
        c.value.init = "reward"
        c.data.prompt_length = shapes.prompt
        c.rollout.batch_size = shapes.batch
        c.rollout.response_length = shapes.response
        c.rollout.temperature = hp.temperature
        c.ppo.epochs = shapes.epochs
        c.ppo.num_minibatches = shapes.minibatches
        c.ppo.num_microbatches = 1
        c.ppo.packing = packing
        c.ppo.max_tokens_per_microbatch = budget
        c.optim.policy_lr = hp.learning_rate
        c.optim.value_lr = hp.learning_rate
        c.train.progress = False
        mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
        self.name = name
        self.trainer = PPOTrainer(c, os.path.join(workdir, name), tokenizer=assets["tokenizer"],
                                  prompts=assets["prompts"], mesh=mesh)
        self.times: dict[str, dict[str, list[float]]] = {}
        self.efficiency: dict[str, dict[str, float]] = {}

    def call(self, rollout) -> tuple[float, float, dict]:
        """(experience seconds, update seconds, metrics) of one experience + update on `rollout`."""
        import jax

        trainer, steps = self.trainer, self.trainer.steps
        t0 = time.perf_counter()
        exp, exp_metrics = steps.experience_jit(trainer.state, trainer.frozen, rollout)
        jax.block_until_ready(exp)
        t1 = time.perf_counter()
        trainer.state, metrics = steps.update_jit(trainer.state, trainer.frozen, exp)
        jax.block_until_ready(trainer.state)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, {**jax.device_get(exp_metrics), **jax.device_get(metrics)}

    def run(self, kind: str, rollout, iterations: int) -> None:
        if kind not in self.times:  # the first call compiles (once per side: same shapes for every kind)
            _, _, m = self.call(rollout)
            self.times[kind] = {"experience": [], "update": []}
            self.efficiency[kind] = {"experience": float(m["perf/experience_token_efficiency"]),
                                     "update": float(m["perf/token_efficiency"])}
        for _ in range(iterations):
            e, u, _ = self.call(rollout)
            self.times[kind]["experience"].append(e)
            self.times[kind]["update"].append(u)

    def medians(self, kind: str) -> dict[str, float]:
        return {phase: statistics.median(v) for phase, v in self.times[kind].items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(p)
    p.add_argument("--budgets", default="0",
                   help="comma-separated ppo.max_tokens_per_microbatch values to time packed (0 = the default)")
    p.add_argument("--distributions", default=",".join(DISTRIBUTIONS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=3, help="timed calls per side, distribution and round")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    shapes = Shapes.from_args(args)
    kinds = [k for k in args.distributions.split(",") if k]
    for k in kinds:
        if k not in DISTRIBUTIONS:
            p.error(f"--distributions: {k!r} is not one of {', '.join(DISTRIBUTIONS)}")
    budgets = [int(b) for b in args.budgets.split(",") if b]
    hp = Hyper()
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        assets = build_assets(shapes, tmp)
        sides = [Side("padded", shapes, hp, assets, tmp, "off", 0)]
        sides += [Side(f"packed:{b}", shapes, hp, assets, tmp, "on", b) for b in budgets]
        rollouts = {k: synthetic_rollout(k, shapes, args.vocab, seed=i) for i, k in enumerate(kinds)}
        for r in range(args.rounds):
            for kind in kinds:
                for side in sides:
                    side.run(kind, rollouts[kind], args.iterations)
            print(f"round {r} done, load {os.getloadavg()[0]:.2f}", flush=True)

    results = {"shapes": vars(args), "versions": versions(), "cpus": os.cpu_count(),
               "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "rows": []}
    base = sides[0]
    print(f"\n{'lengths':<9} {'side':<12} {'M':>3} {'eff exp':>8} {'eff upd':>8} {'experience s':>13} "
          f"{'update s':>9} {'exp x':>6} {'upd x':>6} {'both x':>7}")
    for kind in kinds:
        b = base.medians(kind)
        for side in sides:
            m = side.medians(kind)
            rows = side.trainer.hp.packed_rows
            row = {"lengths": kind, "side": side.name, "packed_rows_per_microbatch": rows,
                   "token_efficiency": side.efficiency[kind], "median_s": m,
                   "speedup": {"experience": b["experience"] / m["experience"], "update": b["update"] / m["update"],
                               "both": (b["experience"] + b["update"]) / (m["experience"] + m["update"])}}
            results["rows"].append(row)
            print(f"{kind:<9} {side.name:<12} {rows:>3} {row['token_efficiency']['experience']:>8.3f} "
                  f"{row['token_efficiency']['update']:>8.3f} {m['experience']:>13.4f} {m['update']:>9.4f} "
                  f"{row['speedup']['experience']:>6.2f} {row['speedup']['update']:>6.2f} "
                  f"{row['speedup']['both']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
