"""The whole RLHF pipeline, offline, on a laptop CPU: SFT -> reward model -> PPO in a synthetic world.

    python -m ppo_jax.demo [--workdir=./runs/demo] [--config=configs/demo.py] [--config.ppo.ppo.kl_coef=0.02 ...]

1. SFT: a tiny GPT-2 learns the world's language from a corpus of prompt/response pairs of mixed quality.
2. Preferences: the SFT policy answers each training prompt twice; the hidden gold reward
   (`ppo_jax.world`) labels the pair with Bradley-Terry noise. Validation pairs (held-out prompts) are
   labelled by the gold reward itself, so validation accuracy is accuracy against gold.
3. Reward model: Bradley-Terry on those pairs, from the SFT transformer, normalised so the SFT
   policy's samples score mean 0, std 1.
4. PPO against the reward model with a KL leash to the SFT policy. Every few iterations the policy
   answers held-out prompts and the gold reward - which PPO never sees - judges the answers.

Everything lands in the workdir: per-stage metrics (JSONL + TensorBoard), Orbax checkpoints, Hugging
Face exports, the preference data, PPO samples, before/after samples, PNG plots and summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ppo_jax import config as config_lib
from ppo_jax import data as data_lib
from ppo_jax import sharding
from ppo_jax.demo import world as world_lib
from ppo_jax.rl.settings import ppo_config
from ppo_jax.supervised.settings import reward_model_config
from ppo_jax.supervised.settings import sft_config

DEFAULT_WORKDIR = os.path.join("runs", "demo")
MARKER = ".ppo_jax_demo"  # marks a directory the demo may clear and rewrite
STAGE_DIRS = ("sft", "preferences", "reward_model", "ppo", "plots")
STAGE_FILES = ("samples_before_after.jsonl", "summary.json")


# ----------------------------------------------------------------------------------------------
# Config.


def get_config() -> ml_collections.ConfigDict:
    """The full demo config (every field commented); configs/demo.py and demo_small.py start here.

    Lengths that must agree across stages are linked (FieldReference): the response budget is
    world.max_response_tokens, the prompt length is prompt_length.
    """
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds everything: the corpus, every stage's init and data order, sampling, labels, evaluation
    seed = c.get_ref("seed")
    c.prompt_length = 10  # prompt tokens (the longest world prompt has 10 words); shared by every stage
    c.world = ml_collections.ConfigDict(dataclasses.asdict(world_lib.World()))  # ppo_jax.world.World fields
    response_tokens = c.world.get_ref("max_response_tokens")
    prompt_length = c.get_ref("prompt_length")

    c.corpus = ml_collections.ConfigDict()
    c.corpus.num_train = 32000  # SFT corpus size (prompt/response pairs from the world's train prompts)
    c.corpus.num_eval = 512  # held-out SFT pairs for the eval loss

    c.sft = sft_config()  # ppo_jax/sft.py: every field and its meaning
    c.sft.seed = seed  # linked to the top-level seed
    c.sft.model.config.vocab_size = world_lib.World().vocab_size  # the world's tokenizer, exactly
    c.sft.model.config.hidden_size = 64  # a tiny GPT-2: 2 layers, 4 heads, d = 64
    c.sft.model.config.num_layers = 2  # transformer blocks
    c.sft.model.config.num_heads = 4  # attention heads
    c.sft.model.config.max_position_embeddings = 64  # learned positions (>= prompt + SFT response)
    c.sft.data.max_prompt_length = prompt_length  # linked to prompt_length
    c.sft.data.max_response_length = 24  # the corpus's rambling answers run past the 16-token budget
    c.sft.train.batch_size = 64  # examples per step
    c.sft.train.steps = 800  # about 1.6 epochs of the corpus
    c.sft.train.log_every = 25  # metrics every N steps
    c.sft.train.eval_every = 100  # held-out loss every N steps
    c.sft.optim.lr = 3e-3  # a tiny model from scratch: a large learning rate
    c.sft.optim.warmup_steps = 30  # linear warmup, then cosine decay

    c.preferences = ml_collections.ConfigDict()
    c.preferences.num_train = 6144  # training pairs (two SFT samples of one train prompt, noisy gold label)
    c.preferences.num_val = 512  # validation pairs on held-out prompts, labelled by the gold reward itself
    c.preferences.label_temperature = 0.5  # Bradley-Terry label noise: P(a > b) = sigmoid((gold_a - gold_b) / T)
    c.preferences.sample_temperature = 1.0  # SFT sampling temperature for the pairs
    c.preferences.batch_size = 256  # prompts per sampling call

    c.reward_model = reward_model_config()  # ppo_jax/reward_model.py: every field and its meaning
    c.reward_model.seed = seed  # linked to the top-level seed
    c.reward_model.data.max_prompt_length = prompt_length  # linked to prompt_length
    c.reward_model.data.max_response_length = response_tokens  # an unfinished answer is stored without EOS
    c.reward_model.normalize.source = "preferences"  # the pairs ARE samples of the SFT policy
    c.reward_model.normalize.num_prompts = 6144  # every training pair, both answers
    c.reward_model.train.batch_size = 64  # pairs per step
    c.reward_model.train.steps = 500  # about 5 epochs of the pairs
    c.reward_model.train.log_every = 25  # metrics every N steps
    c.reward_model.train.eval_every = 100  # validation accuracy every N steps
    c.reward_model.optim.lr = 3e-4  # fine-tuning the SFT transformer
    c.reward_model.optim.warmup_steps = 30  # linear warmup, then cosine decay

    c.ppo = ppo_config()  # ppo_jax/config.py: every field and its meaning (policy/reward paths are set by the demo)
    c.ppo.seed = seed  # linked to the top-level seed
    c.ppo.data.prompt_length = prompt_length  # linked to prompt_length
    c.ppo.rollout.response_length = response_tokens  # linked to world.max_response_tokens
    c.ppo.rollout.batch_size = 64  # prompts per iteration
    c.ppo.ppo.epochs = 4  # PPO epochs per rollout batch
    c.ppo.ppo.num_minibatches = 2  # optimizer steps per epoch
    c.ppo.ppo.kl_coef = 0.1  # the KL leash (docs/overoptimization.md: what smaller values do)
    c.ppo.value.init = "reward"  # value model starts from the reward model (N+ style)
    c.ppo.optim.policy_lr = 3e-4  # policy learning rate
    c.ppo.optim.value_lr = 3e-4  # value model learning rate
    c.ppo.optim.warmup_steps = 40  # 5 iterations of warmup: no early KL overshoot
    c.ppo.train.iterations = 60  # PPO iterations (rollout + update)
    c.ppo.train.sample_every = 10  # write samples every N iterations

    c.eval = ml_collections.ConfigDict()
    c.eval.num_prompts = 256  # held-out prompts the gold reward judges (a multiple of ppo.rollout.batch_size)
    c.eval.every = 5  # evaluate every N PPO iterations (and before the first, and after the last)

    c.targets = ml_collections.ConfigDict()
    c.targets.kl_bound = 5.0  # the final policy's KL to the SFT reference (nats per response) must stay below
    c.targets.rm_accuracy = 0.75  # reward-model validation accuracy against gold labels must reach
    c.targets.gap_closed = 0.5  # share of the (best gold - SFT gold) gap PPO must close

    c.progress = True  # tqdm bars per stage
    c.plots = True  # write PNG plots (matplotlib, Agg backend)
    return c


def small_config() -> ml_collections.ConfigDict:
    """The reduced demo (test suite, notebook): the same pipeline, a smaller corpus and fewer steps.
    It shows the direction (RM above chance, gold reward up, KL bounded), not the full numbers."""
    c = get_config()
    c.corpus.num_train = 8000  # SFT pairs
    c.corpus.num_eval = 128  # held-out SFT pairs
    c.sft.train.steps = 200  # SFT optimizer steps
    c.sft.train.eval_every = 0  # evaluate once, at the end
    c.preferences.num_train = 1024  # reward-model training pairs
    c.preferences.num_val = 256  # validation pairs (gold labels)
    c.reward_model.normalize.num_prompts = 1024  # normalise on every training pair
    c.reward_model.train.steps = 100  # reward-model optimizer steps
    c.reward_model.train.eval_every = 0  # evaluate once, at the end
    c.ppo.rollout.batch_size = 32  # prompts per PPO iteration
    c.ppo.train.iterations = 20  # PPO iterations
    c.eval.num_prompts = 64  # held-out prompts judged by the gold reward
    c.eval.every = 10  # evaluate every N PPO iterations
    c.ppo.train.sample_every = 10  # samples written every N iterations
    return c


def validate(config) -> world_lib.World:
    world = world_lib.world_from_config(config.world)
    if config.eval.num_prompts < 1 or config.eval.num_prompts % config.ppo.rollout.batch_size:
        raise config_lib.ConfigError(
            f"demo: eval.num_prompts={config.eval.num_prompts} must be a positive multiple of "
            f"ppo.rollout.batch_size={config.ppo.rollout.batch_size} (evaluation reuses the rollout sampler)")
    if config.eval.every < 1:
        raise config_lib.ConfigError(f"demo: eval.every must be >= 1, got {config.eval.every}")
    if config.preferences.num_train < 1 or config.preferences.num_val < 1:
        raise config_lib.ConfigError("demo: preferences.num_train and preferences.num_val must be >= 1")
    if not config.preferences.label_temperature > 0:
        raise config_lib.ConfigError("demo: preferences.label_temperature must be > 0")
    if config.sft.model.config.vocab_size < world.vocab_size:
        raise config_lib.ConfigError(f"demo: sft.model.config.vocab_size={config.sft.model.config.vocab_size} "
                                     f"is smaller than the world's vocabulary ({world.vocab_size})")
    return world


# ----------------------------------------------------------------------------------------------
# Stage results.


@dataclasses.dataclass
class StageResult:
    name: str
    seconds: float  # wall time of the stage, compilation included
    history: list[dict[str, float]]  # the trainer's logged rows
    hf_dir: str | None = None  # the stage's Hugging Face export


@dataclasses.dataclass
class EvalPoint:
    """The policy on the held-out prompts at one PPO iteration."""

    step: int
    gold: float  # mean gold reward
    rm_score: float  # mean reward-model score (normalised: the SFT policy's samples average 0)
    kl: float  # mean KL(policy || SFT reference) per response, nats (k1, as PPO logs it)
    eos_rate: float  # share of responses that stopped within the budget
    length: float  # mean response length in tokens (EOS included)


@dataclasses.dataclass
class DemoResult:
    """The summary table's numbers (also written to summary.json)."""

    rm_val_accuracy: float  # reward-model accuracy on validation pairs labelled by the gold reward
    sft_gold: float  # mean gold reward of the SFT policy on the held-out prompts
    ppo_gold: float  # ... of the final PPO policy
    best_gold: float  # the best achievable gold reward
    gap_closed: float  # (ppo_gold - sft_gold) / (best_gold - sft_gold)
    final_kl: float  # KL(final policy || SFT), nats per response, held-out prompts
    kl_bound: float  # targets.kl_bound
    sft_rm_score: float  # mean reward-model score of the SFT policy's answers (normalised: about 0)
    ppo_rm_score: float  # ... of the final policy's answers
    seconds: dict[str, float]  # wall time per stage and in total
    evals: list[EvalPoint]  # every gold evaluation during PPO
    workdir: str
    targets_met: dict[str, bool]  # rm_accuracy, gap_closed, kl

    def table(self) -> str:
        rows = [
            ("reward model val accuracy (vs gold)", f"{self.rm_val_accuracy:.1%}",
             self.targets_met["rm_accuracy"]),
            ("gold reward, SFT policy", f"{self.sft_gold:+.3f}", None),
            ("gold reward, PPO policy", f"{self.ppo_gold:+.3f}", None),
            ("gold reward, best achievable", f"{self.best_gold:+.3f}", None),
            ("share of the gap closed by PPO", f"{self.gap_closed:.1%}", self.targets_met["gap_closed"]),
            ("RM score, SFT -> PPO", f"{self.sft_rm_score:+.2f} -> {self.ppo_rm_score:+.2f}", None),
            (f"final KL to SFT (bound {self.kl_bound:g})", f"{self.final_kl:.2f} nats", self.targets_met["kl"]),
            ("wall time", " + ".join(f"{k} {v:.0f}s" for k, v in self.seconds.items() if k != "total")
             + f" = {self.seconds['total']:.0f}s", None),
        ]
        width = max(len(r[0]) for r in rows)
        lines = []
        for name, value, ok in rows:
            mark = "" if ok is None else ("  ok" if ok else "  MISSED")
            lines.append(f"  {name:<{width}}  {value}{mark}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Stages.


def train_sft(config, world: world_lib.World, workdir: str, mesh=None) -> StageResult:
    """Stage 1: SFT on the world's corpus; exports <workdir>/sft/hf."""
    from ppo_jax.supervised.sft import SFTTrainer

    t0 = time.perf_counter()
    cfg = config.sft.copy_and_resolve_references()
    cfg.train.progress = bool(config.progress)
    train = world.sft_corpus(int(config.corpus.num_train), seed=int(config.seed))
    held_out = world.sft_corpus(int(config.corpus.num_eval), seed=int(config.seed) + 1)
    out = os.path.join(workdir, "sft")
    trainer = SFTTrainer(cfg, out, tokenizer=world.tokenizer, train_records=train, eval_records=held_out,
                         mesh=mesh)
    history = trainer.train()
    return StageResult("sft", time.perf_counter() - t0, history, os.path.join(out, "hf"))


def _load_policy(path: str, mesh):
    from ppo_jax.models import CausalLM, hf

    loaded = hf.load_model(path, mesh, kind="causal_lm")
    return CausalLM(loaded.config), loaded.params


class ResponseSampler:
    """`num_samples` answers per prompt from a Hugging Face policy directory, as (text, stopped) pairs
    decoded exactly (`World.decode_response`). Compiled once for `batch_size` prompts per call."""

    def __init__(self, world: world_lib.World, policy_dir: str, *, num_samples: int, temperature: float,
                 batch_size: int, prompt_length: int, mesh):
        from ppo_jax import sampling

        self.world, self.mesh = world, mesh
        self.module, self.params = _load_policy(policy_dir, mesh)
        tok = world.tokenizer
        self.eos = tok.eos_token_id
        self.num_samples, self.batch_size, self.prompt_length = num_samples, batch_size, prompt_length
        self.sampler = sampling.make_sampler(self.module, sampling.SamplingConfig(
            max_new_tokens=world.max_response_tokens, pad_token_id=tok.pad_token_id,
            stop_token_ids=(tok.eos_token_id,), temperature=temperature, num_samples=num_samples),
            mesh, jax.tree.map(lambda x: x.sharding, self.params))
        self.encoder = data_lib.PromptTokenizer(tok, max_prompt_length=prompt_length)

    def __call__(self, prompts: Sequence[str], key) -> list[list[tuple[str, bool]]]:
        answers: list[list[tuple[str, bool]]] = []
        n, b = self.num_samples, self.batch_size
        for start in range(0, len(prompts), b):
            chunk = list(prompts[start:start + b])
            real = len(chunk)
            chunk += [chunk[-1]] * (b - real)  # one compiled shape; filler rows dropped below
            batch = self.encoder.prompts(chunk, length=self.prompt_length)
            toks, mask = sharding.put_batch((batch.tokens, batch.mask), self.mesh)
            out = sharding.to_host(self.sampler(self.params, toks, mask, jax.random.fold_in(key, start)))
            rows = [self.world.decode_response(r, (self.eos,)) for r in np.asarray(out.tokens)]
            answers += [rows[i * n:(i + 1) * n] for i in range(real)]
        return answers


def sample_preferences(config, world: world_lib.World, sft_dir: str, workdir: str, mesh=None
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Stage 2: pairs of SFT answers, labelled by the gold reward (noisy for training, exact for
    validation); written to <workdir>/preferences/{train,val}.jsonl."""
    mesh = mesh or sharding.make_mesh(tuple(config.sft.mesh.shape))
    p = config.preferences
    seed = int(config.seed)
    key = jax.random.key(seed + 7)

    sampler = ResponseSampler(world, sft_dir, num_samples=2, temperature=float(p.sample_temperature),
                              batch_size=int(p.batch_size), prompt_length=int(config.prompt_length), mesh=mesh)

    def pairs(split: str, n: int, salt: int):
        prompts = world.prompts(n, split, seed=seed + salt)
        answers = sampler(prompts, jax.random.fold_in(key, salt))
        (a, sa), (b, sb) = zip(*[x[0] for x in answers]), zip(*[x[1] for x in answers])
        return prompts, a, b, sa, sb

    prompts, a, b, sa, sb = pairs("train", int(p.num_train), 11)
    train = world.label_pairs(prompts, a, b, sa, sb, rng=np.random.default_rng((seed, 17)),
                              temperature=float(p.label_temperature))
    prompts, a, b, sa, sb = pairs("eval", int(p.num_val), 13)
    val = world.label_pairs(prompts, a, b, sa, sb, rng=None, temperature=float(p.label_temperature))
    out = os.path.join(workdir, "preferences")
    os.makedirs(out, exist_ok=True)
    for name, records in (("train", train), ("val", val)):
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return train, val


def train_reward_model(config, world: world_lib.World, sft_dir: str, train_pairs, val_pairs, workdir: str,
                       mesh=None) -> StageResult:
    """Stage 3: Bradley-Terry reward model from the SFT transformer; exports <workdir>/reward_model/hf."""
    from ppo_jax.supervised.reward_model import RewardModelTrainer

    t0 = time.perf_counter()
    cfg = config.reward_model.copy_and_resolve_references()
    cfg.model.path = sft_dir
    cfg.train.progress = bool(config.progress)
    out = os.path.join(workdir, "reward_model")
    trainer = RewardModelTrainer(cfg, out, tokenizer=world.tokenizer, train_records=train_pairs,
                                 eval_records=val_pairs, mesh=mesh)
    history = trainer.train()
    return StageResult("reward_model", time.perf_counter() - t0, history, os.path.join(out, "hf"))


class PolicyEvaluator:
    """Samples the current policy on fixed held-out prompts (fixed keys, so successive evaluations
    differ only because the policy did) and measures gold reward, RM score and KL to the reference."""

    def __init__(self, trainer, world: world_lib.World, prompts: Sequence[str], seed: int):
        self.trainer, self.world = trainer, world
        self.prompts = list(prompts)
        b = trainer.settings.rollout.batch_size
        length = trainer.settings.data.prompt_length
        encoder = data_lib.PromptTokenizer(trainer.tokenizer, max_prompt_length=length)
        self.batches = []
        for start in range(0, len(self.prompts), b):
            batch = encoder.prompts(self.prompts[start:start + b], length=length)
            self.batches.append(sharding.put_batch((batch.tokens, batch.mask), trainer.mesh))
        self.keys = [jax.random.fold_in(jax.random.key(seed), 1000 + i) for i in range(len(self.batches))]
    def __call__(self, step: int) -> tuple[EvalPoint, list[dict[str, Any]]]:
        t = self.trainer
        rows: list[dict[str, Any]] = []
        stop_ids = tuple(t.stop_ids)
        for batch, key in zip(self.batches, self.keys):
            out = t.sampler(t.state.policy, batch[0], batch[1], key)
            ref_logprobs, rm_scores = t.score_responses(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
            host = sharding.to_host({"tokens": out.tokens, "mask": out.mask, "logprobs": out.logprobs,
                                     "ref": ref_logprobs, "rm": rm_scores})
            host["kl"] = ((host["logprobs"] - host["ref"]) * host["mask"]).sum(-1)
            for i in range(host["tokens"].shape[0]):
                prompt = self.prompts[len(rows)]
                text, stopped = self.world.decode_response(host["tokens"][i], stop_ids)
                rows.append({"prompt": prompt, "response": text, "stopped": bool(stopped),
                             "gold": self.world.gold(prompt, text, stopped), "rm_score": float(host["rm"][i]),
                             "kl": float(host["kl"][i]), "length": int(host["mask"][i].sum())})
        point = EvalPoint(step=step, gold=float(np.mean([r["gold"] for r in rows])),
                          rm_score=float(np.mean([r["rm_score"] for r in rows])),
                          kl=float(np.mean([r["kl"] for r in rows])),
                          eos_rate=float(np.mean([r["stopped"] for r in rows])),
                          length=float(np.mean([r["length"] for r in rows])))
        return point, rows


@dataclasses.dataclass
class PPOResult:
    seconds: float
    history: list[dict[str, float]]
    evals: list[EvalPoint]
    before: list[dict[str, Any]]  # evaluation answers of the SFT policy
    after: list[dict[str, Any]]  # evaluation answers of the final policy
    hf_dir: str


def train_ppo(config, world: world_lib.World, sft_dir: str, rm_dir: str, workdir: str, mesh=None) -> PPOResult:
    """Stage 4: PPO from the SFT policy against the reward model, evaluated by the gold reward.

    The loop is PPOTrainer.train (metrics, samples, checkpoints, progress, SIGTERM) with a gold
    evaluation every eval.every iterations as its on_iteration hook. Checkpoints go to
    <workdir>/ppo/checkpoints; the final policy is exported to <workdir>/ppo/hf.
    """
    from ppo_jax.models import hf
    from ppo_jax.rl.trainer import PPOTrainer

    t0 = time.perf_counter()
    cfg = config.ppo.copy_and_resolve_references()
    cfg.policy.path = sft_dir
    cfg.reward.path = rm_dir
    cfg.train.progress = bool(config.progress)
    cfg.train.max_consecutive_nonfinite = 1  # the demo stops at the first non-finite iteration
    out = os.path.join(workdir, "ppo")
    trainer = PPOTrainer(cfg, out, prompts=world.all_prompts("train"), mesh=mesh)
    eval_prompts = world.prompts(int(config.eval.num_prompts), "eval", seed=int(config.seed) + 29)
    evaluator = PolicyEvaluator(trainer, world, eval_prompts, seed=int(config.seed))
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

    iterations = int(cfg.train.iterations)
    before = evaluate(0)
    after = before

    def on_iteration(step, scalars):
        nonlocal after
        if step % int(config.eval.every) == 0 or step == iterations:
            after = evaluate(step)
        return None

    try:
        trainer.train(on_iteration=on_iteration)
    finally:
        trainer.close()
    history = trainer.history
    hf_dir = os.path.join(out, "hf")
    hf.export_model(hf_dir, trainer.policy_config, trainer.state.policy, kind="causal_lm",
                    tokenizer=trainer.tokenizer)
    return PPOResult(time.perf_counter() - t0, history, evals, before, after, hf_dir)


# ----------------------------------------------------------------------------------------------
# Plots.


def _figure(ncols: int, size):
    """A matplotlib Figure without pyplot: no global backend is touched (Agg renders the PNG; a
    notebook displays the returned Figure inline)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    return fig, fig.subplots(1, ncols)


def _save(fig, path: str | None) -> None:
    if path is not None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fig.savefig(path, dpi=110)


def plot_ppo(history: Sequence[dict[str, float]], evals: Sequence[EvalPoint], *, best_gold: float,
             kl_bound: float | None, path: str | None = None, title: str = "PPO against a learned reward model"):
    """Three panels against PPO iteration: RM score, gold reward, KL to the SFT reference.
    Saved to `path` (PNG) when given; returns the Figure."""
    steps = np.arange(1, len(history) + 1)
    es = [e.step for e in evals]
    fig, axes = _figure(3, (14, 3.8))
    ax = axes[0]
    ax.plot(steps, [h["objective/model_scores"] for h in history], color="tab:blue", alpha=0.5,
            label="training rollouts")
    ax.plot(es, [e.rm_score for e in evals], "o-", color="tab:blue", label="held-out prompts")
    ax.set_title("reward-model score (proxy)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.plot(es, [e.gold for e in evals], "o-", color="tab:green", label="PPO policy")
    ax.axhline(evals[0].gold, color="gray", ls=":", label="SFT policy")
    ax.axhline(best_gold, color="black", ls="--", label="best achievable")
    ax.set_title("gold reward (hidden, held-out prompts)")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.plot(steps, [h["objective/kl"] for h in history], color="tab:red", alpha=0.5, label="training rollouts")
    ax.plot(es, [e.kl for e in evals], "o-", color="tab:red", label="held-out prompts")
    if kl_bound is not None:
        ax.axhline(kl_bound, color="black", ls="--", label="bound")
    ax.set_title("KL(policy || SFT), nats per response")
    ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("PPO iteration")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    _save(fig, path)
    return fig


def plot_supervised(sft_history, rm_history, path: str | None = None):
    """SFT loss and reward-model accuracy against step; saved to `path` when given; returns the Figure."""
    fig, axes = _figure(2, (10, 3.6))
    ax = axes[0]
    rows = [r for r in sft_history if "train/loss" in r]
    ax.plot([r["step"] for r in rows], [r["train/loss"] for r in rows], label="train")
    ev = [r for r in sft_history if "eval/loss" in r]
    ax.plot([r["step"] for r in ev], [r["eval/loss"] for r in ev], "o-", label="held out")
    ax.set_title("SFT: response-token NLL")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    ax = axes[1]
    rows = [r for r in rm_history if "train/accuracy" in r]
    ax.plot([r["step"] for r in rows], [r["train/accuracy"] for r in rows], label="train (noisy labels)")
    ev = [r for r in rm_history if "eval/accuracy" in r]
    ax.plot([r["step"] for r in ev], [r["eval/accuracy"] for r in ev], "o-", label="validation (gold labels)")
    ax.axhline(0.5, color="gray", ls=":")
    ax.set_title("reward model: pairwise accuracy")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    return fig


# ----------------------------------------------------------------------------------------------
# The pipeline.


def prepare_workdir(workdir: str) -> None:
    """Creates the workdir, or clears the previous demo's outputs in it. A non-empty directory the demo
    did not create is refused (nothing of the user's is ever deleted)."""
    if os.path.isdir(workdir) and os.listdir(workdir):
        if not os.path.exists(os.path.join(workdir, MARKER)):
            raise FileExistsError(f"workdir {workdir!r} is not empty and was not made by the demo; choose "
                                  f"another --workdir (or an empty directory)")
        for name in STAGE_DIRS:
            shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
        for name in STAGE_FILES:
            if os.path.exists(os.path.join(workdir, name)):
                os.remove(os.path.join(workdir, name))
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, MARKER), "w") as f:
        f.write("written by python -m ppo_jax.demo; the demo may clear this directory's stage outputs\n")


def run(config, workdir: str = DEFAULT_WORKDIR, *, mesh=None, verbose: bool = True) -> DemoResult:
    """SFT -> preferences -> reward model -> PPO -> plots and summary. Returns the summary numbers."""
    world = validate(config)
    t_start = time.perf_counter()
    if jax.process_index() == 0:
        prepare_workdir(workdir)
    log = print if verbose and jax.process_index() == 0 else (lambda *a, **k: None)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    log(f"ppo_jax demo -> {workdir}  ({jax.device_count()} {jax.default_backend()} device(s)"
        + (f", load average {load[0]:.1f}" if load else "") + ")")
    seconds: dict[str, float] = {}

    log("[1/4] SFT: a tiny GPT-2 learns the world's language")
    sft = train_sft(config, world, workdir, mesh)
    seconds["sft"] = sft.seconds

    log("[2/4] preferences: SFT answers, labelled by the hidden gold reward")
    t0 = time.perf_counter()
    train_pairs, val_pairs = sample_preferences(config, world, sft.hf_dir, workdir, mesh)
    seconds["preferences"] = time.perf_counter() - t0

    log(f"[3/4] reward model: Bradley-Terry on {len(train_pairs)} pairs")
    rm = train_reward_model(config, world, sft.hf_dir, train_pairs, val_pairs, workdir, mesh)
    seconds["reward_model"] = rm.seconds
    rm_eval = [r for r in rm.history if "eval/accuracy" in r]
    rm_accuracy = float(rm_eval[-1]["eval/accuracy"])

    log("[4/4] PPO against the reward model (the gold reward only watches)")
    ppo = train_ppo(config, world, sft.hf_dir, rm.hf_dir, workdir, mesh)
    seconds["ppo"] = ppo.seconds

    if jax.process_index() == 0:
        with open(os.path.join(workdir, "samples_before_after.jsonl"), "w") as f:
            for b, a in zip(ppo.before, ppo.after):
                f.write(json.dumps({"prompt": b["prompt"], "sft_response": b["response"], "sft_gold": b["gold"],
                                    "sft_rm_score": b["rm_score"], "ppo_response": a["response"],
                                    "ppo_gold": a["gold"], "ppo_rm_score": a["rm_score"]}) + "\n")
        if config.plots:
            t0 = time.perf_counter()
            plot_ppo(ppo.history, ppo.evals, best_gold=world.best_gold, kl_bound=float(config.targets.kl_bound),
                     path=os.path.join(workdir, "plots", "ppo_curves.png"))
            plot_supervised(sft.history, rm.history, os.path.join(workdir, "plots", "sft_reward_model.png"))
            seconds["plots"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_start

    first, last = ppo.evals[0], ppo.evals[-1]
    best = world.best_gold
    gap_closed = (last.gold - first.gold) / (best - first.gold)
    t = config.targets
    result = DemoResult(
        rm_val_accuracy=rm_accuracy, sft_gold=first.gold, ppo_gold=last.gold, best_gold=best,
        gap_closed=gap_closed, final_kl=last.kl, kl_bound=float(t.kl_bound), sft_rm_score=first.rm_score,
        ppo_rm_score=last.rm_score, seconds=seconds, evals=ppo.evals, workdir=workdir,
        targets_met={"rm_accuracy": rm_accuracy >= t.rm_accuracy, "gap_closed": gap_closed >= t.gap_closed,
                     "kl": last.kl < t.kl_bound})
    if jax.process_index() == 0:
        summary = {k: v for k, v in dataclasses.asdict(result).items() if k != "evals"}
        summary["load_average_at_start"] = list(load) if load else None
        summary["load_average_at_end"] = list(os.getloadavg()) if load else None
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    log("\nsummary\n" + result.table())
    log(f"\noutputs: {workdir}/plots/ppo_curves.png, {workdir}/samples_before_after.jsonl, "
        f"{workdir}/summary.json")
    return result


# ----------------------------------------------------------------------------------------------
# Command line.


def main(argv=None) -> None:
    from absl import app, flags
    from ml_collections import config_flags

    config_flag = config_flags.DEFINE_config_file(
        "config", os.path.abspath(__file__), "demo config file (get_config()); default: the built-in one",
        lock_config=True)
    workdir_flag = flags.DEFINE_string("workdir", DEFAULT_WORKDIR, "directory for every output of the demo")

    def _main(args):
        if len(args) > 1:
            raise app.UsageError(f"unexpected arguments {args[1:]}")
        if not flags.FLAGS["verbosity"].present:  # JAX's INFO lines would bury the demo's own output
            from absl import logging

            logging.set_verbosity(logging.WARNING)
        try:
            run(config_flag.value, workdir_flag.value)
        except (config_lib.ConfigError, FileExistsError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    app.run(_main, argv=argv)


if __name__ == "__main__":
    main()
