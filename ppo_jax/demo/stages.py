"""The demo's four stages and their results, each from typed `DemoSettings` (`ppo_jax.demo.settings`):

1. `train_sft`: SFT on the world's corpus; exports <workdir>/sft/hf.
2. `sample_preferences`: pairs of SFT answers labelled by the gold reward; <workdir>/preferences/.
3. `train_reward_model`: Bradley-Terry from the SFT transformer; exports <workdir>/reward_model/hf.
4. `train_ppo`: PPO against the reward model, judged by the gold reward; exports <workdir>/ppo/hf.
5. `train_dpo` (optional): DPO from the SFT policy on the stage-3 pairs, judged like PPO; exports
   <workdir>/dpo/hf.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.demo.evaluator import EvalPoint, PolicyEvaluator
from ppo_jax.demo.responses import ResponseSampler
from ppo_jax.demo.settings import DemoSettings
from ppo_jax.models import hf
from ppo_jax.rl.state import policy_variables
from ppo_jax.rl.errors import RunStopped
from ppo_jax.rl.trainer import PPOTrainer
from ppo_jax.supervised.dpo import DPOTrainer
from ppo_jax.supervised.reward_model import RewardModelTrainer
from ppo_jax.supervised.sft import SFTTrainer


@dataclasses.dataclass
class StageResult:
    name: str
    seconds: float  # wall time of the stage, compilation included
    history: list[dict[str, float]]  # the trainer's logged rows
    hf_dir: str | None = None  # the stage's Hugging Face export


@dataclasses.dataclass
class DPOResult:
    seconds: float  # training and the gold evaluation
    history: list[dict[str, float]]  # the DPO trainer's logged rows
    final: EvalPoint  # the final DPO policy on PPO's held-out prompts and sampling keys
    after: list[dict[str, Any]]  # its evaluation answers
    hf_dir: str


@dataclasses.dataclass
class PPOResult:
    seconds: float
    history: list[dict[str, float]]
    evals: list[EvalPoint]
    before: list[dict[str, Any]]  # evaluation answers of the SFT policy
    after: list[dict[str, Any]]  # evaluation answers of the final policy
    hf_dir: str


def eval_prompts(settings: DemoSettings) -> list[str]:
    """The held-out prompts every policy of the demo is judged on (PPO, DPO, distillation, the teacher)."""
    return settings.world.prompts(settings.eval.num_prompts, "eval", seed=settings.seed + 29)


def train_sft(settings: DemoSettings, workdir: str, mesh=None) -> StageResult:
    """Stage 1: SFT on the world's corpus; exports <workdir>/sft/hf."""
    t0 = time.perf_counter()
    world, seed = settings.world, settings.seed
    train = world.sft_corpus(settings.corpus.num_train, seed=seed)
    held_out = world.sft_corpus(settings.corpus.num_eval, seed=seed + 1)
    out = os.path.join(workdir, "sft")
    trainer = SFTTrainer(dataclasses.replace(settings.sft_stage(), wandb=settings.stage_wandb("sft", workdir)), out, tokenizer=world.tokenizer, train_records=train,
                         eval_records=held_out, mesh=mesh)
    history = trainer.train()
    return StageResult("sft", time.perf_counter() - t0, history, os.path.join(out, "hf"))


def sample_preferences(settings: DemoSettings, sft_dir: str, workdir: str, mesh=None
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Stage 2: pairs of SFT answers, labelled by the gold reward (noisy for training, exact for
    validation); written to <workdir>/preferences/{train,val}.jsonl."""
    mesh = mesh or sharding.make_mesh(tuple(settings.sft.mesh.shape))
    world, p, seed = settings.world, settings.preferences, settings.seed
    key = jax.random.key(seed + 7)

    sampler = ResponseSampler(world, sft_dir, num_samples=2, temperature=p.sample_temperature,
                              batch_size=p.batch_size, prompt_length=settings.prompt_length, mesh=mesh)

    def pairs(split: str, n: int, salt: int):
        prompts = world.prompts(n, split, seed=seed + salt)
        desc = f"preferences ({split})" if settings.progress and jax.process_index() == 0 else None
        answers = sampler(prompts, jax.random.fold_in(key, salt), desc=desc)
        (a, sa), (b, sb) = zip(*[x[0] for x in answers]), zip(*[x[1] for x in answers])
        return prompts, a, b, sa, sb

    prompts, a, b, sa, sb = pairs("train", p.num_train, 11)
    train = world.label_pairs(prompts, a, b, sa, sb, rng=np.random.default_rng((seed, 17)),
                              temperature=p.label_temperature)
    prompts, a, b, sa, sb = pairs("eval", p.num_val, 13)
    val = world.label_pairs(prompts, a, b, sa, sb, rng=None, temperature=p.label_temperature)
    out = os.path.join(workdir, "preferences")
    os.makedirs(out, exist_ok=True)
    for name, records in (("train", train), ("val", val)):
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return train, val


def train_reward_model(settings: DemoSettings, sft_dir: str, train_pairs, val_pairs, workdir: str,
                       mesh=None) -> StageResult:
    """Stage 3: Bradley-Terry reward model from the SFT transformer; exports <workdir>/reward_model/hf."""
    t0 = time.perf_counter()
    out = os.path.join(workdir, "reward_model")
    rm_settings = dataclasses.replace(settings.reward_model_stage(sft_dir),
                                      wandb=settings.stage_wandb("reward_model", workdir))
    trainer = RewardModelTrainer(rm_settings, out, tokenizer=settings.world.tokenizer,
                                 train_records=train_pairs, eval_records=val_pairs, mesh=mesh)
    history = trainer.train()
    return StageResult("reward_model", time.perf_counter() - t0, history, os.path.join(out, "hf"))


def train_ppo(settings: DemoSettings, sft_dir: str, rm_dir: str, workdir: str, mesh=None) -> PPOResult:
    """Stage 4: PPO from the SFT policy against the reward model, evaluated by the gold reward.
    Checkpoints go to <workdir>/ppo/checkpoints; the final policy is exported to <workdir>/ppo/hf."""
    return train_policy(settings, settings.ppo_stage(sft_dir, rm_dir), "ppo", workdir, mesh)


def train_policy(settings: DemoSettings, stage_settings, stage: str, workdir: str, mesh=None) -> PPOResult:
    """A PPO-trainer stage (`stage_settings`: PPO's, or the distillation stage's) in <workdir>/<stage>,
    judged by the gold reward on the held-out prompts every eval.every iterations.

    The loop is PPOTrainer.train (metrics, samples, checkpoints, progress, SIGTERM) with the gold
    evaluation as its on_iteration hook; the final policy is exported to <workdir>/<stage>/hf.
    """
    t0 = time.perf_counter()
    world = settings.world
    stage_settings = stage_settings.replace(wandb=settings.stage_wandb(stage, workdir))
    out = os.path.join(workdir, stage)
    trainer = PPOTrainer(stage_settings, out, prompts=world.all_prompts("train"), mesh=mesh)
    evaluator = PolicyEvaluator(trainer, world, eval_prompts(settings), seed=settings.seed)
    evals: list[EvalPoint] = []
    eval_log = os.path.join(out, "eval.jsonl")

    def evaluate(step):
        point, rows = evaluator(step)
        evals.append(point)
        if jax.process_index() == 0:
            with open(eval_log, "a") as f:
                f.write(json.dumps(dataclasses.asdict(point)) + "\n")
        trainer.writer.write(step, {f"gold/{k}": v for k, v in dataclasses.asdict(point).items() if k != "step"})
        return rows

    iterations = stage_settings.train.iterations
    before = evaluate(0)
    after = before

    def on_iteration(step, scalars):
        nonlocal after
        if step % settings.eval.every == 0 or step == iterations:
            after = evaluate(step)
        return None

    try:
        trainer.train(on_iteration=on_iteration)
    finally:
        trainer.close()
    if trainer.stopped_by:  # saved; the same command resumes it (no export, no figures of a partial run)
        raise RunStopped(trainer.stopped_by)
    history = trainer.history
    hf_dir = os.path.join(out, "hf")
    params, adapters = policy_variables(trainer.state.policy, trainer.frozen.policy)  # LoRA: merged on export
    hf.export_model(hf_dir, trainer.policy_config, params, kind="causal_lm", tokenizer=trainer.tokenizer,
                    adapters=adapters)
    return PPOResult(time.perf_counter() - t0, history, evals, before, after, hf_dir)


def train_dpo(settings: DemoSettings, sft_dir: str, rm_dir: str, train_pairs, val_pairs, workdir: str,
              mesh=None) -> DPOResult:
    """Stage 5 (with run_dpo): DPO from the SFT policy on the pairs the reward model learned from,
    validated on the gold-labelled pairs; exports <workdir>/dpo/hf. The final policy is judged exactly
    as PPO's: `PolicyEvaluator` on the same held-out prompts and sampling keys, its KL measured against
    the SFT policy (the PPO trainer's reference) and its answers scored by the reward model too.
    """
    t0 = time.perf_counter()
    world = settings.world
    out = os.path.join(workdir, "dpo")
    dpo_settings = dataclasses.replace(settings.dpo_stage(sft_dir), wandb=settings.stage_wandb("dpo", workdir))
    trainer = DPOTrainer(dpo_settings, out, tokenizer=world.tokenizer, train_records=train_pairs,
                         eval_records=val_pairs, mesh=mesh)
    history = trainer.train()
    # A PPO trainer built as stage 4's (SFT reference, the reward model) but never trained: its sampler,
    # reference and reward model are the evaluator's instruments; the DPO policy takes its place (no W&B run).
    judge = PPOTrainer(settings.ppo_stage(sft_dir, rm_dir), os.path.join(out, "gold_eval"),
                       prompts=world.all_prompts("train"), mesh=mesh)
    judge.state = judge.state.replace(policy=jax.device_put(trainer.params, judge.state_shardings.policy))
    try:
        final, after = PolicyEvaluator(judge, world, eval_prompts(settings), seed=settings.seed)(trainer.step)
    finally:
        judge.close()
    if jax.process_index() == 0:
        with open(os.path.join(out, "eval.jsonl"), "w") as f:
            f.write(json.dumps(dataclasses.asdict(final)) + "\n")
    return DPOResult(time.perf_counter() - t0, history, final, after, os.path.join(out, "hf"))
