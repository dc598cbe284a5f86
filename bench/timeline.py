"""A timeline model of one PPO iteration per role layout (issue 31), from measured phase times, and
its check against real runs on this machine.

The model. Phases of one iteration, in seconds: G generate (on the sampler's devices), H host
rewards (Python, on the host), E experience forwards and U update (on the trainer's devices), S the
weight sync. One step off-policy starts sample k+1 right after the sync and before the trainer
waits for sample k, so in steady state

    on-policy (any layout):           T = S + G + H + E + U
    off-policy, disaggregated roles:  T = S + max(G, H + E + U)
    off-policy, shared devices:       T = S + max(G, H) + E + U  (one device runs one program at a
                                                                  time; only the host overlaps)

With k steps of staleness (`rollout.off_policy_steps = k`) and phases that vary from iteration to
iteration (long-tailed responses, a verifier that sometimes takes long), `simulate` runs the same
model iteration by iteration: the sampler may run up to k batches ahead, so a slow batch on one side
is absorbed by the other side's slack. With constant phases every k >= 1 gives the closed forms
above; what more staleness buys is only that absorption.

Assumptions, stated: (1) the sampler's and the trainer's devices are independent hardware (true on
GPUs and TPU chips; not for this machine's fake CPU devices, which share its 2 cores); (2) the sync
blocks both sides; (3) a phase's time on a layout is measured on that layout (the model does not
guess how G scales with the sampler's device count: decode streams weights, so fewer sampler
devices is not proportionally slower); (4) dispatch and host-to-device transfers of the prompts are
negligible.

The check (`--measure`): tiny PPO runs on 8 fake CPU devices, disaggregated 4 + 4, on-policy and
off-policy, with a reward function that sleeps (a slow verifier: host time that really overlaps
device work even on 2 cores). Each layout's phases come from its own on-policy run; the measured
wall time per iteration (between iterations, excluding the first) is set against the model's
prediction.

`--measure --staleness 0,1,2,4` checks `simulate` the same way: k = 0..4 on the 4 + 4 layout, the
verifier's sleeps long-tailed (seeded, the same sequence in every run).

Run (from the repository root):
    python bench/timeline.py --measure                        # ~2 min on this 2-core machine
    python bench/timeline.py --measure --staleness 0,1,2,3,4 --host-cv 1.0 --iterations 14
    python bench/timeline.py --phases G=0.40,H=0.05,E=0.66,U=1.09,S=0.02   # predict from figures
    python bench/timeline.py --phases G=0.26,H=0,E=0.07,U=0.11,S=0.005 --staleness 0,1,2,4 --generate-cv 0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Phases:
    """Seconds per phase of one iteration (see the module docstring)."""

    G: float  # generate, on the sampler's devices
    H: float  # host rewards
    E: float  # experience forwards
    U: float  # update
    S: float = 0.0  # weight sync


def predict(p: Phases, *, off_policy: bool, disaggregated: bool) -> float:
    """Steady-state seconds per iteration."""
    if not off_policy:
        return p.S + p.G + p.H + p.E + p.U
    if disaggregated:
        return p.S + max(p.G, p.H + p.E + p.U)
    return p.S + max(p.G, p.H) + p.E + p.U


def simulate(generate: Sequence[float], host: Sequence[float], p: Phases, *, k: int,
             disaggregated: bool) -> list[float]:
    """When each iteration's update (and its sync) ends, from the start, with per-iteration generate
    times `generate` [n] and host reward times `host` [n], the fixed E, U and S of `p`, and up to `k`
    batches sampled ahead of the trainer (`rollout.off_policy_steps`; 0 = on-policy).

    Disaggregated: batch i may be sampled by a policy at most k updates old, so the sampler starts
    it once it has finished batch i - 1 and the weights of update i - k - 1 have arrived; a sync
    lands while a pipelined batch decodes and pauses it (S). The trainer takes batch i once it has
    finished update i - 1 and the batch is sampled. Shared devices: one device runs one program at a
    time, so any k >= 1 overlaps only the host's rewards with the next batch's decode (the k = 1
    closed form, iteration by iteration); more staleness cannot overlap more.
    """
    trainer = p.E + p.U + p.S
    done: list[float] = []
    if not disaggregated:
        clock = generate[0] if k else 0.0
        for i in range(len(generate)):
            if k:  # batch i + 1 decodes while the host scores batch i
                clock += max(generate[i + 1] if i + 1 < len(generate) else generate[i], host[i]) + trainer
            else:
                clock += generate[i] + host[i] + trainer
            done.append(clock)
        return done
    sampled = 0.0
    for i in range(len(generate)):
        weights_ready = done[i - k - 1] if i - k - 1 >= 0 else 0.0
        sampled = max(sampled, weights_ready) + generate[i] + (p.S if k else 0.0)
        done.append(max(done[-1] if done else 0.0, sampled) + host[i] + trainer)
    return done


def steady_seconds(done: Sequence[float], warmup: int) -> float:
    """Mean seconds per iteration after the first `warmup` iterations."""
    return (done[-1] - done[warmup - 1]) / (len(done) - warmup) if warmup else done[-1] / len(done)


def long_tailed(mean: float, cv: float, n: int, seed: int = 0) -> list[float]:
    """n seeded draws of a log-normal with this mean and coefficient of variation (cv = 0: all `mean`)."""
    if cv == 0:
        return [mean] * n
    rng = random.Random(seed)
    sigma = math.sqrt(math.log1p(cv * cv))
    return [rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma) for _ in range(n)]


def staleness_table(p: Phases, ks: Sequence[int], generate_cv: float, host_cv: float, n: int = 400) -> str:
    """Predicted seconds per iteration for each k and layout, with G and H long-tailed around the
    phases' means (seeded draws, the first quarter left out)."""
    generate, host = long_tailed(p.G, generate_cv, n, 1), long_tailed(p.H, host_cv, n, 2)
    rows = ["| layout | " + " | ".join(f"k = {k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
    for disaggregated in (False, True):
        cells = [steady_seconds(simulate(generate, host, p, k=k, disaggregated=disaggregated), n // 4) for k in ks]
        rows.append(f"| {'disaggregated' if disaggregated else 'shared devices'} | "
                    + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return "\n".join(rows)


def parse_phases(text: str) -> Phases:
    values = dict(item.split("=") for item in text.split(","))
    return Phases(**{k: float(v) for k, v in values.items()})


def prediction_table(p: Phases) -> str:
    rows = ["| layout | rollouts | predicted s/iteration |", "|---|---|---|"]
    for disaggregated in (False, True):
        for off in (False, True):
            rows.append(f"| {'disaggregated' if disaggregated else 'shared devices'} | "
                        f"{'one step off-policy' if off else 'on-policy'} | "
                        f"{predict(p, off_policy=off, disaggregated=disaggregated):.3f} |")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------ the CPU check

class SlowReward:
    """The toy reward after a sleep: a verifier's host time that overlaps device work. `seconds`: each
    call's sleep, a number or a list (a long-tailed verifier, call by call); `last` is how long the
    latest call took, `calls` every call's."""

    def __init__(self, seconds: float | Sequence[float]):
        self.seconds, self.last, self.calls = seconds, 0.0, []

    def __call__(self, prompts, responses):
        from ppo_jax import reward_functions

        start = time.perf_counter()
        sleep = self.seconds if isinstance(self.seconds, (int, float)) else self.seconds[len(self.calls)]
        time.sleep(sleep)
        out = reward_functions.toy_target_count(prompts, responses)
        self.last = time.perf_counter() - start
        self.calls.append(self.last)
        return out


def measured_run(overrides: dict, iterations: int, reward_seconds: float | Sequence[float],
                 stamps: list[float] | None = None) -> tuple[Phases, float]:
    """(median phases, median wall seconds between iterations) of a tiny PPO run, the first
    iteration (compiles) left out. `stamps`, if given, receives each iteration's end time."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from tiny_configs import tiny_config

    from ppo_jax.rl.trainer import PPOTrainer

    # Generation about as long as the rest (G ~ H + E + U): where pipelining has the most to win.
    config = tiny_config(**{"train.iterations": iterations, "rollout.response_length": 56,
                            "data.prompt_length": 8, "ppo.epochs": 1, "ppo.num_minibatches": 1,
                            "ppo.num_microbatches": 1, "rollout.forward_microbatch": 0, **overrides})
    config.policy.model.max_position_embeddings = 64
    config.policy.model.hidden_size = 128
    config.policy.model.num_layers = 4
    reward = SlowReward(reward_seconds)
    stamps = [] if stamps is None else stamps
    rows = []

    def on_iteration(step, scalars):
        stamps.append(time.perf_counter())
        rows.append({**scalars, "host": reward.last})

    trainer = PPOTrainer(config, tempfile.mkdtemp(), reward_functions=[(reward, 1.0)])
    trainer.train(on_iteration)
    trainer.close()
    steady = rows[1:]
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    phases = Phases(G=med("time/generate") - med("host"), H=med("host"), E=med("time/experience"),
                    U=med("time/update"), S=med("time/weight_sync"))
    return phases, statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:]))


def measure(iterations: int, reward_seconds: float) -> str:
    layout = {"mesh.shape": (4, 1, 1), "roles.sampler_devices": 4}
    lines = ["| layout | rollouts | G | H | E | U | S | predicted s/it | measured s/it |", "|---|---|---|---|---|---|---|---|---|"]
    for name, placement in (("one mesh, 8 devices", {"mesh.shape": (8, 1, 1)}), ("disaggregated 4 + 4", layout)):
        phases, on_wall = measured_run(placement, iterations, reward_seconds)
        _, off_wall = measured_run({**placement, "rollout.off_policy_steps": 1}, iterations, reward_seconds)
        disaggregated = "roles.sampler_devices" in placement
        f = lambda x: f"{x:.3f}"  # noqa: E731
        for off, wall in ((False, on_wall), (True, off_wall)):
            lines.append(f"| {name} | {'one step off-policy' if off else 'on-policy'} | {f(phases.G)} | {f(phases.H)} | "
                         f"{f(phases.E)} | {f(phases.U)} | {f(phases.S)} | "
                         f"{f(predict(phases, off_policy=off, disaggregated=disaggregated))} | {f(wall)} |")
    return "\n".join(lines)


def measure_staleness(iterations: int, reward_seconds: float, cv: float, ks: Sequence[int]) -> str:
    """k = each of `ks` on the disaggregated 4 + 4 layout with a long-tailed verifier (seeded sleeps
    of mean `reward_seconds` and coefficient of variation `cv`, the same sequence in every run),
    against `simulate` fed the on-policy run's phases and the verifier's sleeps call by call."""
    layout = {"mesh.shape": (4, 1, 1), "roles.sampler_devices": 4}
    sleeps = long_tailed(reward_seconds, cv, iterations + max(ks) + 1, seed=3)
    warmup = 2  # the first iteration compiles; the second still fills the pipeline
    phases, _ = measured_run(layout, iterations, sleeps)
    lines = [f"phases (on-policy run): G {phases.G:.3f}, E {phases.E:.3f}, U {phases.U:.3f}, S {phases.S:.3f}; "
             f"verifier sleeps: mean {statistics.mean(sleeps[:iterations]):.3f} s, max {max(sleeps[:iterations]):.3f} s",
             "| k | predicted s/it | measured s/it |", "|---|---|---|"]
    for k in ks:
        stamps: list[float] = []
        measured_run({**layout, "rollout.off_policy_steps": k}, iterations, sleeps, stamps)
        done = simulate([phases.G] * iterations, sleeps[:iterations], phases, k=k, disaggregated=True)
        measured = (stamps[-1] - stamps[warmup - 1]) / (len(stamps) - warmup)
        lines.append(f"| {k} | {steady_seconds(done, warmup):.3f} | {measured:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", help="G=..,H=..,E=..,U=..[,S=..] seconds: print the model's predictions")
    parser.add_argument("--measure", action="store_true", help="check the model against tiny CPU runs")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--reward-seconds", type=float, default=0.2, help="the slow verifier's sleep per batch")
    parser.add_argument("--staleness", default="", help="k values, e.g. 0,1,2,4: the k-step table "
                        "(with --phases: predicted; with --measure: against runs with a long-tailed verifier)")
    parser.add_argument("--generate-cv", type=float, default=0.0, help="with --phases --staleness: G's variation")
    parser.add_argument("--host-cv", type=float, default=1.0, help="the long-tailed verifier's (and H's) variation")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.staleness.split(",")] if args.staleness else []
    if args.phases:
        print(prediction_table(parse_phases(args.phases)))
        if ks:
            print(staleness_table(parse_phases(args.phases), ks, args.generate_cv, args.host_cv))
    if args.measure:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        print(measure_staleness(args.iterations, args.reward_seconds, args.host_cv, ks) if ks
              else measure(args.iterations, args.reward_seconds))
    if not (args.phases or args.measure):
        parser.error("give --phases and/or --measure")


if __name__ == "__main__":
    main()
