"""The optional distillation stages of the demo (run_distill), after PPO:

6. `train_teacher`: a wider GPT-2 SFT'd on the world's gold-best answers (`World.best_response`);
   exports <workdir>/teacher/hf. `teacher_gold` judges it on PPO's held-out prompts.
7. `train_distill`: on-policy distillation of the SFT policy toward that teacher (the reverse KL as the
   only reward, no reward model, no critic) with PPO's budget and KL leash, judged as PPO is;
   exports <workdir>/distill/hf.

docs/ablations.md ("Distillation against PPO") has the seeded comparison these stages make.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.demo.responses import ResponseSampler
from ppo_jax.demo.settings import DemoSettings
from ppo_jax.demo.stages import PPOResult, StageResult, eval_prompts, train_policy
from ppo_jax.supervised.sft import SFTTrainer


@dataclasses.dataclass
class TeacherResult:
    stage: StageResult  # the teacher's SFT (history, seconds, export)
    gold: float  # mean gold reward of the teacher's answers on PPO's held-out prompts


def teacher_corpus(settings: DemoSettings, n: int, seed: int) -> list[dict[str, str]]:
    """`n` {"prompt", "response"} records: train prompts with the answer that attains the best gold reward."""
    world = settings.world
    return [{"prompt": p, "response": world.best_response(p)} for p in world.prompts(n, "train", seed=seed)]


def train_teacher(settings: DemoSettings, workdir: str, mesh=None) -> TeacherResult:
    """Stage 6: the teacher, SFT'd from scratch on gold-best answers; judged on the held-out prompts."""
    t0 = time.perf_counter()
    seed = settings.seed
    train = teacher_corpus(settings, settings.distill.num_teacher_examples, seed + 41)
    held_out = teacher_corpus(settings, settings.corpus.num_eval, seed + 43)
    out = os.path.join(workdir, "teacher")
    trainer = SFTTrainer(dataclasses.replace(settings.teacher_stage(), wandb=settings.stage_wandb("teacher", workdir)),
                         out, tokenizer=settings.world.tokenizer, train_records=train, eval_records=held_out,
                         mesh=mesh)
    history = trainer.train()
    hf_dir = os.path.join(out, "hf")
    gold = teacher_gold(settings, hf_dir, mesh)
    return TeacherResult(StageResult("teacher", time.perf_counter() - t0, history, hf_dir), gold)


def teacher_gold(settings: DemoSettings, teacher_dir: str, mesh=None) -> float:
    """Mean gold reward of the teacher's answers (temperature 1, as the rollouts sample) on the held-out
    prompts PPO's evaluation uses, `ppo.rollout.num_samples` answers each."""
    world, rollout = settings.world, settings.ppo.rollout
    mesh = mesh or sharding.make_mesh(tuple(settings.teacher.mesh.shape))
    sampler = ResponseSampler(world, teacher_dir, num_samples=rollout.num_samples, temperature=1.0,
                              batch_size=rollout.batch_size, prompt_length=settings.prompt_length, mesh=mesh)
    prompts = eval_prompts(settings)
    answers = sampler(prompts, jax.random.key(settings.seed + 47))
    return float(np.mean([world.gold(p, text, stopped) for p, rows in zip(prompts, answers) for text, stopped in rows]))


def train_distill(settings: DemoSettings, sft_dir: str, teacher_dir: str, workdir: str, mesh=None) -> PPOResult:
    """Stage 7: the SFT policy distilled on-policy toward the teacher (`DemoSettings.distill_stage`), in
    <workdir>/distill; the gold evaluation uses PPO's held-out prompts and sampling keys."""
    return train_policy(settings, settings.distill_stage(sft_dir, teacher_dir), "distill", workdir, mesh)
