"""The arithmetic task end to end (issue 45 item 6): SFT a tiny policy on calculator demonstrations
(a share of them wrong), then PPO with the calculator as a tool, accuracy on held-out prompts before
and after RL. `python -m ppo_jax.arithmetic` runs it and writes <workdir>/summary.json.

    tokenizer     characters, plus the tool format's fixed pieces as single tokens (short rows)
    sft           prompt "what is A * B" -> tool call, its result, "the answer is N" (SFTTrainer)
    ppo           the SFT policy in `BareArithmetic` episodes: a turn ends at </tool_call>, the real
                  calculator answers, the episode pays arithmetic_exact at the end
    evaluate      the same episodes on eval prompts, one fixed key: accuracy (the environment's
                  reward) and the share of episodes that call the tool, with a 95% interval

The prompt is the bare question (no tool instructions: the tiny policy learns the format from the
demonstrations, and a 500-character system text would dwarf the rows).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import string
import time
from typing import Any

import jax
import numpy as np

from ppo_jax.agentic import environment, tool_format, tools
from ppo_jax.arithmetic import task as arithmetic_task
from ppo_jax.rl.settings import ppo_config as ppo_defaults
from ppo_jax.rl.trainer import PPOTrainer
from ppo_jax.supervised.sft import SFTTrainer, sft_config

# The tool format's fixed pieces, one token each (every other character is its own token).
PIECES = (tool_format.CALL_OPEN, tool_format.CALL_CLOSE, tool_format.RESULT_OPEN, tool_format.RESULT_CLOSE,
          '{"name": "calculator", "arguments": {"expression": "', '"}}', "the answer is ", "what is ")


def char_tokenizer():
    """A character tokenizer (pad, bos, eos, unk, the PIECES, printable ASCII) that round-trips text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(specials + list(PIECES) + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters join without spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")
    tok.add_tokens(list(PIECES))  # matched before the split; not special, so decoding keeps them
    return tok


class BareArithmetic(environment.ToolEnvironment):
    """The registered "arithmetic" environment with the bare question as its prompt."""

    def reset(self, record):
        super().reset(record)
        return str(record["prompt"])


@environment.register("arithmetic_bare")
def bare_arithmetic(max_turns: int = 2) -> BareArithmetic:
    return BareArithmetic([tools.calculator()], max_turns=max_turns, reward=arithmetic_task.record_reward)


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """Sizes of the run (the defaults: a few minutes on 2 CPU cores)."""

    seed: int = 0
    digits: int = 4  # each factor's digits (products of up to 8: past a tiny policy's head)
    wrong_rate: float = 0.25  # demonstrations with a mistake (a mistyped call or a misread result)
    demonstrations: int = 2048
    sft_steps: int = 600
    ppo_iterations: int = 200
    policy_lr: float = 1e-4
    batch_size: int = 32  # episodes per PPO iteration, and evaluation rows per batch
    estimator: str = "gae"  # ppo.advantage_estimator: "gae" (a value model), or "grpo" / "rloo" (groups)
    samples_per_prompt: int = 1  # rollout.num_samples: episodes per prompt, a group (grpo / rloo: > 1)
    eval_batches: int = 8  # held-out prompts: eval_batches * batch_size
    prompt_length: int = 16
    response_length: int = 40
    hidden_size: int = 64
    num_layers: int = 2


def _model(p: PipelineSettings, vocab_size: int) -> dict[str, Any]:
    return dict(arch="gpt2", vocab_size=vocab_size, hidden_size=p.hidden_size, num_layers=p.num_layers,
                num_heads=4, max_position_embeddings=p.prompt_length + p.response_length + 16)


def sft_records(task: arithmetic_task.ArithmeticTask, n: int) -> list[dict[str, str]]:
    """Demonstrations as {prompt, response}: the whole transcript after the prompt (the tool's result
    included: the SFT loss reads it, the RL loss never does)."""
    return [{"prompt": prompt, "response": "".join(t.content for t in turns)}
            for prompt, turns in task.demonstrations(n)]


def train_sft(p: PipelineSettings, task, tokenizer, workdir: str) -> str:
    """SFT on the demonstrations; returns the exported Hugging Face directory."""

    c = sft_config()
    c.seed = p.seed
    c.model.config.update(_model(p, len(tokenizer)))
    c.data.max_prompt_length, c.data.max_response_length = p.prompt_length, p.response_length
    c.train.steps, c.train.batch_size, c.train.log_every, c.train.progress = p.sft_steps, 32, 50, False
    out = os.path.join(workdir, "sft")
    trainer = SFTTrainer(c, out, tokenizer=tokenizer, train_records=sft_records(task, p.demonstrations))
    trainer.train()
    return os.path.join(out, "hf")


def ppo_config(p: PipelineSettings, sft_dir: str):
    c = ppo_defaults()
    c.seed = p.seed
    c.policy.path = sft_dir
    c.environment.name, c.environment.max_turns, c.environment.max_observation_tokens = "arithmetic_bare", 2, 12
    c.data.prompt_length, c.rollout.response_length = p.prompt_length, p.response_length
    if p.batch_size % p.samples_per_prompt:
        raise ValueError(f"batch_size={p.batch_size} is not a multiple of samples_per_prompt={p.samples_per_prompt}")
    c.rollout.batch_size, c.rollout.num_samples = p.batch_size // p.samples_per_prompt, p.samples_per_prompt
    c.ppo.advantage_estimator = p.estimator
    c.ppo.epochs, c.ppo.num_minibatches, c.ppo.kl_coef = 2, 2, 0.02
    c.optim.policy_lr, c.optim.value_lr = p.policy_lr, 1e-4
    c.train.iterations, c.train.progress, c.train.sample_every = p.ppo_iterations, False, 0
    return c


def interval(successes: float, n: int) -> list[float]:
    """A 95% Wilson interval of a share."""
    z, share = 1.96, successes / max(n, 1)
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [centre - half, centre + half]


def without_tool() -> BareArithmetic:
    """The same episodes with no tool declared: a call is answered with an error naming none."""
    return BareArithmetic([], max_turns=2, reward=arithmetic_task.record_reward)


def evaluate(trainer, prompts: list[str], seed: int, factory=None) -> dict[str, Any]:
    """The current policy's episodes on `prompts` with fixed keys, one per prompt (the first of each
    group when the run samples several): accuracy (the environment's end-of-episode reward, 1 for the
    exact product) and the share of episodes that call the tool. factory: another environment for
    these episodes (e.g. `without_tool`)."""
    batch_size, group = trainer.settings.rollout.batch_size, trainer.settings.rollout.num_samples
    runner = trainer.rollouts.evaluation.runner  # the episodes' environments, decoder and schedule
    own, runner.factory = runner.factory, factory or runner.factory
    try:
        batches = [_episodes(trainer, prompts[i:i + batch_size], jax.random.key(seed * 1000 + i))
                   for i in range(0, len(prompts), batch_size)]
    finally:
        runner.factory = own
    rewards = np.concatenate([np.asarray(e.rewards)[::group] for e in batches])
    tool_calls = np.concatenate([np.asarray(e.tool_calls)[::group] for e in batches])
    correct, n = float(rewards.sum()), len(rewards)
    return {"accuracy": correct / n, "accuracy_interval": interval(correct, n),
            "tool_call_share": float((tool_calls > 0).sum()) / n, "episodes": n}


def _episodes(trainer, prompts: list[str], key):
    """One batch of episodes (`MultiTurnOutput`) of the trainer's current policy."""
    batch = trainer.prompts.tokenizer.prompts(prompts, length=trainer.settings.data.prompt_length)
    return trainer.rollouts.whole(trainer.state, np.asarray(batch.tokens), np.asarray(batch.mask), key).episodes


def run(workdir: str, p: PipelineSettings = PipelineSettings()) -> dict[str, Any]:
    """SFT, evaluation, PPO, evaluation; writes and returns <workdir>/summary.json."""

    os.makedirs(workdir, exist_ok=True)
    t0 = time.perf_counter()
    task = arithmetic_task.ArithmeticTask(seed=p.seed, digits=p.digits, wrong_rate=p.wrong_rate)
    sft_dir = train_sft(p, task, char_tokenizer(), workdir)
    sft_seconds = time.perf_counter() - t0
    eval_prompts = task.prompts(p.eval_batches * p.batch_size, "eval")
    trainer = PPOTrainer(ppo_config(p, sft_dir), os.path.join(workdir, "ppo"),
                         prompts=task.prompts(4 * p.batch_size * p.ppo_iterations, "train"))
    before = evaluate(trainer, eval_prompts, p.seed)
    before_bare = evaluate(trainer, eval_prompts, p.seed, without_tool)
    history = trainer.train()
    after = evaluate(trainer, eval_prompts, p.seed)
    after_bare = evaluate(trainer, eval_prompts, p.seed, without_tool)
    summary = {
        "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
        "accuracy_before_interval": before["accuracy_interval"], "accuracy_after_interval": after["accuracy_interval"],
        "tool_call_share_before": before["tool_call_share"], "tool_call_share_after": after["tool_call_share"],
        "accuracy_without_tool_before": before_bare["accuracy"], "accuracy_without_tool_after": after_bare["accuracy"],
        "eval_episodes": after["episodes"], "settings": dataclasses.asdict(p),
        "train_environment_reward_first": history[0].get("objective/environment_rewards"),
        "train_environment_reward_last": history[-1].get("objective/environment_rewards"),
        "seconds_sft": sft_seconds, "seconds_total": time.perf_counter() - t0,
    }
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
