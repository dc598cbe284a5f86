"""A PPO trainer's current policy on fixed held-out prompts, for evaluations outside the training loop
(the demo's gold evaluation, the verifiable task's exact-match accuracy): each judges the samples its
own way.

The prompts are tokenised and placed once; each batch has its own fixed key, so successive
evaluations differ only because the policy did. Only the trainer's public API is used: `settings`,
`tokenizer`, `meshes` (the prompts live on the sampler's), `sample` and `score_responses`
(reference log-probs and reward-model scores).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from ppo_jax import sharding
from ppo_jax.data import PromptTokenizer


@dataclasses.dataclass(frozen=True)
class HeldOutSample:
    """One sampled response to a held-out prompt."""

    prompt: str
    tokens: np.ndarray  # [Lr] int32 as sampled: the stop token and padding included
    length: int  # response tokens, the stop token included
    kl: float  # KL(policy || reference) of the response, nats (k1, summed over its tokens, as PPO logs it)
    rm_score: float  # the run's reward-model score (gain and bias applied; 0 without a reward model)


class HeldOutSampler:
    """`rollout.num_samples` responses of the trainer's current policy to each of `prompts` (a multiple
    of rollout.batch_size, sampled a batch at a time)."""

    def __init__(self, trainer, prompts: Sequence[str], seed: int):
        self.trainer, self.prompts = trainer, list(prompts)
        b, length = trainer.settings.rollout.batch_size, trainer.settings.data.prompt_length
        encoder = PromptTokenizer(trainer.tokenizer, max_prompt_length=length)
        mesh = trainer.meshes.sampler
        self.batches = []
        for start in range(0, len(self.prompts), b):
            batch = encoder.prompts(self.prompts[start:start + b], length=length)
            self.batches.append(sharding.put_batch((batch.tokens, batch.mask), mesh))
        self.keys = [sharding.replicate(jax.random.fold_in(jax.random.key(seed), 1000 + i), mesh)
                     for i in range(len(self.batches))]

    def __call__(self) -> list[HeldOutSample]:
        """Every sample, prompt-major: prompt i's n samples at [i * n, (i + 1) * n)."""
        t, n = self.trainer, self.trainer.settings.rollout.num_samples
        samples: list[HeldOutSample] = []
        for (tokens, mask), key in zip(self.batches, self.keys):
            out = t.sample(tokens, mask, key)
            ref_logprobs, rm_scores = t.score_responses(out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
            host = sharding.to_host({"tokens": out.tokens, "mask": out.mask, "logprobs": out.logprobs,
                                     "ref": ref_logprobs, "rm": rm_scores})
            kl = ((host["logprobs"] - host["ref"]) * host["mask"]).sum(-1)
            for i in range(host["tokens"].shape[0]):
                samples.append(HeldOutSample(prompt=self.prompts[len(samples) // n], tokens=host["tokens"][i],
                                             length=int(host["mask"][i].sum()), kl=float(kl[i]),
                                             rm_score=float(host["rm"][i])))
        return samples
