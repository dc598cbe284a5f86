"""Multi-turn rollouts: the rounds schedule against the continuous one, and the continuous one on
fewer decode slots than episodes (issue 45), side by side.

    python bench/bench_multi_turn.py [--rows 16] [--slots 8,4] [--repeats 3] [--out results.json]

One random GPT-2-shaped policy over a word tokenizer (turns end at one of a few words, ~1 draw in
8), the same prompts and key for both schedules, `--max-turns` turns of up to `--response-length`
tokens in all. Three kinds of environment answer each turn with a few words:

- instant:  no latency (what the schedules cost on their own: host round trips, segment launches);
- latency:  a sleep drawn per step from a lognormal (median `--latency-ms`, sigma 1: long-tailed,
            a remote verifier or a tool server), seeded by row and turn, so both schedules wait
            the same;
- sandbox:  a real `sandbox.run_python` call per step (a process with its limits: the built-in
            Python tool's cost).

Schedules: rounds, continuous (a cache row per episode), and for each S of `--slots` "slots S"
(agentic/slot_rollout.py: S decode slots, a waiting episode's slot given to another and the episode
re-prefilled when it is answered; `--insert-rows` a re-prefill call, 0: S / 4).

For each, the rollout's wall time (compiled first, then `--repeats` runs of each schedule, taken
in turn), the decode steps each ran and the share of their row-slots that decoded an active row
(`row_occupancy`), the turns resumed by a re-prefill, and the rows whose tokens are not the rounds
schedule's (0 for continuous, whose decode batch is the rounds'; a few for slots, whose decode batch
and re-prefills round differently: a draw within ~1e-6 of a token's CDF boundary picks its neighbour). Prints a markdown table; `--out` writes the figures as JSON.

    python bench/bench_multi_turn.py --trainer

instead times PPO iterations of the tests' tiny multi-turn run (tests/scripted_envs.py, 0.2 s an
environment step) on-policy, at rollout.off_policy_steps = 1, where the next batch's episodes run
on their thread beside the update, and at k = 2 on the continuous schedule with whole and partial
rollouts (a segment of turns per iteration): the medians of iterations 2-5. `--trainer-hidden`,
`--trainer-layers`, `--trainer-heads` size the policy; `--trainer-settings k2` runs the k = 2 pair only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.agentic import continuous_rollout, rollout as rounds_rollout, sandbox, slot_rollout
from ppo_jax.agentic.environment import StepResult
from ppo_jax.data import PromptTokenizer, build_word_tokenizer
from ppo_jax.models import CausalLM, ModelConfig, init_params
from ppo_jax.sampling import SamplingConfig
from ppo_jax.sampling.turn_slots import SlotDecoder
from ppo_jax.sampling.turns import TurnConfig, TurnDecoder

WORDS = [f"w{i}" for i in range(60)] + ["obs"]
STOPS = ["w1", "w2", "w3", "w4", "w5", "w6", "w7"]


class Answering:
    """Answers each turn with 3 "obs" words after `latency(row, turn)` seconds (or a sandbox run)."""

    stop_strings = tuple(STOPS)

    def __init__(self, row: int, kind: str, median_ms: float):
        self.row, self.kind, self.median_ms, self.turn = row, kind, median_ms, 0

    def step(self, turn_text, turn_token_ids):
        if self.kind == "latency":
            draw = np.random.default_rng([self.row, self.turn]).lognormal(np.log(self.median_ms / 1e3), 1.0)
            time.sleep(draw)
        elif self.kind == "sandbox":
            sandbox.run_python(f"print({self.row} * {self.turn})")
        self.turn += 1
        return StepResult(observation="obs obs obs", reward=0.0, done=False)


def build(args):
    tokenizer = build_word_tokenizer(WORDS)
    model = CausalLM(ModelConfig(arch="gpt2", vocab_size=len(tokenizer), hidden_size=args.hidden, num_layers=4,
                                 num_heads=4, max_position_embeddings=256))
    params, _ = init_params(model, jax.random.key(0), sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    params["transformer"]["embed"]["embedding"] = params["transformer"]["embed"]["embedding"] * 3.0
    sampling = SamplingConfig(max_new_tokens=args.response_length, pad_token_id=tokenizer.pad_token_id,
                              stop_token_ids=(tokenizer.eos_token_id,))
    config = TurnConfig(sampling=sampling, turn_stops=tuple((tokenizer.convert_tokens_to_ids(w),) for w in STOPS),
                        max_observation_tokens=4)
    texts = [" ".join(f"w{(7 * i + j) % 60}" for j in range(1 + i % 8)) for i in range(args.rows)]
    batch = PromptTokenizer(tokenizer, max_prompt_length=8).prompts(texts, length=8)
    return tokenizer, (model, config), params, np.asarray(batch.tokens), np.asarray(batch.mask)


def schedules(args, model, config) -> dict[str, tuple]:
    """name -> (rollout function, its decoder, its keyword arguments)."""
    segments = {"segment_steps": args.segment_steps}
    out = {"rounds": (rounds_rollout.rollout, TurnDecoder(model, config), {}),
           "continuous": (continuous_rollout.rollout, TurnDecoder(model, config), segments)}
    for slots in [int(s) for s in args.slots.split(",") if s]:
        decoder = SlotDecoder(model, config, slots, args.insert_rows or max(1, slots // 4))
        out[f"slots {slots}"] = (slot_rollout.rollout, decoder, segments)
    return out


def one_rollout(schedule, args, kind, built):
    tokenizer, _, params, tokens, mask = built
    schedule, decoder, extra = schedule
    envs = [Answering(row, kind, args.latency_ms) for row in range(args.rows)]
    start = time.perf_counter()
    out = schedule(decoder, params, tokens, mask, envs, jax.random.key(1), tokenizer=tokenizer,
                   max_turns=args.max_turns, environment_workers=args.rows, **extra)
    return time.perf_counter() - start, out


def trainer_overlap(hidden: int = 32, layers: int = 2, heads: int = 2, settings: str = "all") -> None:
    import os
    import sys
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import scripted_envs  # noqa: F401 (registers slow_scripted_test_env)
    from tiny_configs import tiny_config

    from ppo_jax.rl.trainer import PPOTrainer

    print("| rollout.off_policy_steps | engine | partial_rollouts | time/iteration (median, s) | environment wait "
          "(median, s) | turns/episode | policy_lag_mean | mismatch_kl (median) |")
    print("|---|---|---|---|---|---|---|---|")
    runs = ((0, "static", False), (1, "static", False), (2, "continuous", False), (2, "continuous", True))
    for steps_ahead, engine, partial in runs if settings == "all" else runs[2:]:
        config = tiny_config(**{"policy.model.hidden_size": hidden, "policy.model.num_layers": layers,
                                "policy.model.num_heads": heads, "environment.name": "slow_scripted_test_env",
                                "environment.max_turns": 3, "environment.max_observation_tokens": 3, "rollout.batch_size": 16,
                                "rollout.response_length": 20, "policy.model.max_position_embeddings": 64,
                                "train.iterations": 6, "rollout.off_policy_steps": steps_ahead,
                                "rollout.engine": engine, "rollout.partial_rollouts": partial})
        trainer = PPOTrainer(config, tempfile.mkdtemp(), mesh=sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
        history = trainer.train()[2:]
        trainer.close()
        wait = [row.get("time/environment", row.get("perf/environment_seconds_overlapped")) for row in history]
        median = lambda key: statistics.median(row.get(key, 0.0) for row in history)  # noqa: E731
        print(f"| {steps_ahead} | {engine} | {partial} | {median('time/iteration'):.3f} | {statistics.median(wait):.3f} | "
              f"{history[-1]['rollout/turns']:.2f} | {median('rollout/policy_lag_mean'):.2f} | "
              f"{median('rollout/mismatch_kl'):.4f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=192)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--segment-steps", type=int, default=8)
    parser.add_argument("--slots", default="8,4", help="comma-separated slot counts for the slot schedule")
    parser.add_argument("--insert-rows", type=int, default=0, help="episodes a re-prefill call (0: a quarter of the slots)")
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default="instant,latency,sandbox")
    parser.add_argument("--out", default="")
    parser.add_argument("--trainer", action="store_true", help="time PPO iterations on- and off-policy instead")
    parser.add_argument("--trainer-hidden", type=int, default=32, help="--trainer: the policy's hidden size")
    parser.add_argument("--trainer-layers", type=int, default=2, help="--trainer: the policy's layers")
    parser.add_argument("--trainer-heads", type=int, default=2, help="--trainer: the policy's attention heads")
    parser.add_argument("--trainer-settings", default="all", choices=("all", "k2"),
                        help="--trainer: every setting, or k = 2 whole and partial only")
    args = parser.parse_args()
    if args.trainer:
        return trainer_overlap(args.trainer_hidden, args.trainer_layers, args.trainer_heads, args.trainer_settings)
    built = build(args)
    runs = schedules(args, *built[1])
    for schedule in runs.values():  # compile every program once
        one_rollout(schedule, args, "instant", built)
    rows = []
    for kind in args.kinds.split(","):
        times, outs = {name: [] for name in runs}, {}
        for _ in range(args.repeats):
            for name, schedule in runs.items():
                seconds, outs[name] = one_rollout(schedule, args, kind, built)
                times[name].append(seconds)
        for name, out in outs.items():
            median = statistics.median(times[name])
            rows.append({"environment": kind, "schedule": name, "seconds": times[name], "median_seconds": median,
                         "speedup": statistics.median(times["rounds"]) / median,
                         "rows_differing": int((out.tokens != outs["rounds"].tokens).any(axis=1).sum()),
                         "turns_mean": float(out.turns.mean()),
                         "blocked_seconds": float(out.environment_wall_seconds.sum()),
                         "environment_seconds": float(out.environment_seconds.sum()),
                         "decode_steps": int(out.decode_steps), "row_occupancy": rounds_rollout.row_occupancy(out),
                         "reprefilled_turns": None if out.reprefilled_turns is None else int(out.reprefilled_turns)})
    print(f"rows {args.rows}, response {args.response_length} tokens, up to {args.max_turns} turns, segments of "
          f"{args.segment_steps} steps, {jax.devices()[0].platform}\n")
    print("| environment | schedule | median (s) | speed-up over rounds | blocked (s) | decode steps | row occupancy "
          "| re-prefilled turns | rows unlike rounds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['environment']} | {r['schedule']} | {r['median_seconds']:.3f} | {r['speedup']:.2f}x | "
              f"{r['blocked_seconds']:.3f} | {r['decode_steps']} | {r['row_occupancy']:.2f} | "
              f"{'-' if r['reprefilled_turns'] is None else r['reprefilled_turns']} | {r['rows_differing']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
