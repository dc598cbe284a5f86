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

Run (from the repository root):
    python bench/timeline.py --measure                        # ~2 min on this 2-core machine
    python bench/timeline.py --phases G=0.40,H=0.05,E=0.66,U=1.09,S=0.02   # predict from figures
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time


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
    """The toy reward after `seconds` of sleep: a verifier's host time that overlaps device work;
    `last` is how long its latest call took."""

    def __init__(self, seconds: float):
        self.seconds, self.last = seconds, 0.0

    def __call__(self, prompts, responses):
        from ppo_jax import reward_functions

        start = time.perf_counter()
        time.sleep(self.seconds)
        out = reward_functions.toy_target_count(prompts, responses)
        self.last = time.perf_counter() - start
        return out


def measured_run(overrides: dict, iterations: int, reward_seconds: float) -> tuple[Phases, float]:
    """(median phases, median wall seconds between iterations) of a tiny PPO run, the first
    iteration (compiles) left out."""
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
    stamps: list[float] = []
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", help="G=..,H=..,E=..,U=..[,S=..] seconds: print the model's predictions")
    parser.add_argument("--measure", action="store_true", help="check the model against tiny CPU runs")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--reward-seconds", type=float, default=0.2, help="the slow verifier's sleep per batch")
    args = parser.parse_args(argv)
    if args.phases:
        print(prediction_table(parse_phases(args.phases)))
    if args.measure:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        print(measure(args.iterations, args.reward_seconds))
    if not (args.phases or args.measure):
        parser.error("give --phases and/or --measure")


if __name__ == "__main__":
    main()
