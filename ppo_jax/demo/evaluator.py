"""The gold evaluation during PPO: the current policy answers fixed held-out prompts and the hidden
gold reward (which PPO never sees) judges the answers, beside the reward model's score and the KL to
the SFT reference.

Only the trainer's public API is used: `settings`, `tokenizer`, `mesh`, `sample`, `stop_ids`
and `score_responses` (the reference log-probs and reward-model scores of sampled responses).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.data import PromptTokenizer
from ppo_jax.demo.world import World
from ppo_jax.rl.trainer import PPOTrainer


@dataclasses.dataclass
class EvalPoint:
    """The policy on the held-out prompts at one PPO iteration."""

    step: int
    gold: float  # mean gold reward
    rm_score: float  # mean reward-model score (normalised: the SFT policy's samples average 0)
    kl: float  # mean KL(policy || SFT reference) per response, nats (k1, as PPO logs it)
    eos_rate: float  # share of responses that stopped within the budget
    length: float  # mean response length in tokens (EOS included)


class PolicyEvaluator:
    """Samples the current policy on fixed held-out prompts (fixed keys, so successive evaluations
    differ only because the policy did) and measures gold reward, RM score and KL to the reference:
    means over every sample (rollout.num_samples per prompt)."""

    def __init__(self, trainer: PPOTrainer, world: World, prompts: Sequence[str], seed: int):
        self.trainer, self.world = trainer, world
        self.prompts = list(prompts)
        b = trainer.settings.rollout.batch_size
        length = trainer.settings.data.prompt_length
        encoder = PromptTokenizer(trainer.tokenizer, max_prompt_length=length)
        self.batches = []
        for start in range(0, len(self.prompts), b):
            batch = encoder.prompts(self.prompts[start:start + b], length=length)
            self.batches.append(sharding.put_batch((batch.tokens, batch.mask), trainer.mesh))
        self.keys = [jax.random.fold_in(jax.random.key(seed), 1000 + i) for i in range(len(self.batches))]

    def __call__(self, step: int) -> tuple[EvalPoint, list[dict[str, Any]]]:
        t = self.trainer
        rows: list[dict[str, Any]] = []
        stop_ids = tuple(t.stop_ids)
        n = t.settings.rollout.num_samples  # the sampler's rows of prompt i: [i * n, (i + 1) * n)
        for batch, key in zip(self.batches, self.keys):
            out = t.sample(batch[0], batch[1], key)
            ref_logprobs, rm_scores = t.score_responses(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
            host = sharding.to_host({"tokens": out.tokens, "mask": out.mask, "logprobs": out.logprobs,
                                     "ref": ref_logprobs, "rm": rm_scores})
            host["kl"] = ((host["logprobs"] - host["ref"]) * host["mask"]).sum(-1)
            for i in range(host["tokens"].shape[0]):
                prompt = self.prompts[len(rows) // n]
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
