"""`python -m ppo_jax.verifiable`: RL with a verifiable reward, end to end on CPU in a few minutes.

1. SFT: a tiny GPT-2 from scratch on demonstrations of sorting number words, a share of them wrong.
2. RL from the SFT policy on the checker's 1/0 reward (GRPO by default; `rl.ppo.advantage_estimator`
   picks PPO, RLOO or REINFORCE++), with exact-match accuracy on held-out prompts before, during and
   after.

A rerun on the same workdir starts over (like the demo, it clears its own outputs and refuses a
non-empty directory it did not make). Outputs in the workdir: sft/ and rl/ (each trainer's metrics, checkpoints and export; rl/metrics.jsonl
holds `eval/accuracy` at every evaluation), summary.json (accuracy before and after, final KL, wall
times) and samples_before_after.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ppo_jax.cli.common import config_command
from ppo_jax.demo.pipeline import prepare_workdir
from ppo_jax.rl.errors import RunStopped
from ppo_jax.rl.held_out import HeldOutSampler
from ppo_jax.rl.trainer import PPOTrainer
from ppo_jax.supervised.sft import SFTTrainer
from ppo_jax.verifiable import default_config
from ppo_jax.verifiable.settings import VerifiableSettings
from ppo_jax.verifiable.task import is_correct, tokenizer

DEFAULT_WORKDIR = os.path.join("runs", "verifiable")
MARKER = ".ppo_jax_verifiable"  # marks a directory this pipeline may clear and rewrite
OUTPUTS = ("sft", "rl", "summary.json", "samples_before_after.jsonl")


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The policy on the held-out prompts at one RL iteration: every sample checked."""

    step: int
    accuracy: float  # share of exactly sorted answers (all samples of all held-out prompts)
    prompt_accuracy: float  # share of prompts whose every sample is exactly sorted
    kl: float  # mean KL(policy || SFT) per response, nats
    length: float  # mean response length in tokens (EOS included)


class Evaluator:
    """The trainer's current policy on fixed held-out prompts (`HeldOutSampler`: fixed keys, so
    successive evaluations differ only because the policy did), every sample checked exactly."""

    def __init__(self, trainer: PPOTrainer, prompts: Sequence[str], seed: int):
        self.trainer = trainer
        self.sampler = HeldOutSampler(trainer, prompts, seed)

    def __call__(self, step: int) -> tuple[Evaluation, list[dict[str, Any]]]:
        t = self.trainer
        rows: list[dict[str, Any]] = []
        for sample in self.sampler():
            ids = sample.tokens[:sample.length]
            text = t.tokenizer.decode([x for x in ids if x not in t.stop_ids], skip_special_tokens=True)
            rows.append({"prompt": sample.prompt, "response": text, "correct": is_correct(sample.prompt, text),
                         "kl": sample.kl, "length": sample.length})
        correct = np.asarray([r["correct"] for r in rows]).reshape(-1, t.settings.rollout.num_samples)
        return Evaluation(step=step, accuracy=float(correct.mean()), prompt_accuracy=float(correct.all(-1).mean()),
                          kl=float(np.mean([r["kl"] for r in rows])),
                          length=float(np.mean([r["length"] for r in rows]))), rows


def train_sft(s: VerifiableSettings, workdir: str, mesh=None) -> tuple[str, float]:
    """Stage 1; returns (its export, seconds)."""
    t0 = time.perf_counter()
    out = os.path.join(workdir, "sft")
    trainer = SFTTrainer(s.sft_stage(), out, tokenizer=tokenizer(), mesh=mesh,
                         train_records=s.task.sft_corpus(s.corpus.num_train, seed=s.seed),
                         eval_records=s.task.sft_corpus(s.corpus.num_eval, seed=s.seed + 1))
    trainer.train()
    return os.path.join(out, "hf"), time.perf_counter() - t0


def train_rl(s: VerifiableSettings, sft_dir: str, workdir: str, mesh=None):
    """Stage 2; returns (evaluations, first and last evaluation's answers, final history row, seconds)."""
    t0 = time.perf_counter()
    out = os.path.join(workdir, "rl")
    settings = s.rl_stage(sft_dir)
    trainer = PPOTrainer(settings, out, prompts=s.task.prompts(4096, "train", seed=s.seed), mesh=mesh)
    evaluator = Evaluator(trainer, s.task.prompts(s.eval.num_prompts, "eval", seed=s.seed + 29), seed=s.seed)
    evals: list[Evaluation] = []

    def evaluate(step: int):
        point, rows = evaluator(step)
        evals.append(point)
        trainer.writer.write(step, {f"eval/{k}": v for k, v in dataclasses.asdict(point).items() if k != "step"})
        return rows

    before = after = evaluate(0)

    def on_iteration(step, scalars):
        nonlocal after
        if step % s.eval.every == 0 or step == settings.train.iterations:
            after = evaluate(step)

    try:
        trainer.train(on_iteration=on_iteration)
    finally:
        trainer.close()
    if trainer.stopped_by:
        raise RunStopped(trainer.stopped_by)
    return evals, before, after, time.perf_counter() - t0


def run(config, workdir: str = DEFAULT_WORKDIR, *, mesh=None, verbose: bool = True) -> dict[str, Any]:
    """SFT -> RL -> summary.json. Returns the summary."""
    s = VerifiableSettings.from_config(config)
    log = print if verbose and jax.process_index() == 0 else (lambda *a, **k: None)
    start = time.perf_counter()
    if jax.process_index() == 0:  # a rerun starts over: a finished stage would not be this run's "before"
        prepare_workdir(workdir, marker=MARKER, outputs=OUTPUTS, made_by="the verifiable-reward pipeline")
    log(f"[1/2] SFT on {s.corpus.num_train} demonstrations ({s.task.demo_error_rate:.0%} of them wrong)")
    sft_dir, sft_seconds = train_sft(s, workdir, mesh)
    log(f"[2/2] {s.rl.ppo.advantage_estimator} on the exact-match reward, {s.rl.rollout.num_samples} samples per prompt")
    evals, before, after, rl_seconds = train_rl(s, sft_dir, workdir, mesh)
    first, last = evals[0], evals[-1]
    summary = {"accuracy_before": first.accuracy, "accuracy_after": last.accuracy,
               "prompt_accuracy_before": first.prompt_accuracy, "prompt_accuracy_after": last.prompt_accuracy,
               "final_kl": last.kl, "estimator": s.rl.ppo.advantage_estimator,
               "samples_per_prompt": s.rl.rollout.num_samples, "iterations": s.rl.train.iterations,
               "seconds": {"sft": sft_seconds, "rl": rl_seconds, "total": time.perf_counter() - start}}
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        with open(os.path.join(workdir, "samples_before_after.jsonl"), "w") as f:
            for b, a in zip(before, after):
                f.write(json.dumps({"prompt": b["prompt"], "before": b["response"], "before_correct": b["correct"],
                                    "after": a["response"], "after_correct": a["correct"]}) + "\n")
    log(f"exact-match accuracy on {len(before)} held-out samples: {first.accuracy:.1%} (SFT) -> "
        f"{last.accuracy:.1%} ({s.rl.ppo.advantage_estimator}), KL {last.kl:.2f} nats; "
        f"{summary['seconds']['total']:.0f} s; {workdir}/summary.json")
    return summary


def _command(config, workdir: str) -> None:
    run(config, workdir)


def main(argv=None) -> None:
    """`python -m ppo_jax.verifiable` (without --config: the built-in task)."""
    config_command(_command, schema=VerifiableSettings, what="verifiable-reward", default_config=default_config.__file__,
                   workdir=DEFAULT_WORKDIR, argv=argv)
