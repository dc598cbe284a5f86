"""Prompt batches for the PPO trainer (interim: replaced by ppo_jax.data loader integration)."""

from __future__ import annotations

import numpy as np


class PromptStream:
    def __init__(self, config, tokenizer, prompts=None):
        from ppo_jax import toy

        self.config = config
        self.tokenizer = tokenizer
        if prompts is None:
            prompts = toy.prompts(1024, len(tokenizer), config.seed)
        self.texts = list(prompts)
        self.length = config.data.prompt_length
        self.batch = config.rollout.batch_size
        self.pos = 0
        self.epoch = 0
        self.truncated = 0
        self.order = np.random.default_rng((config.seed, 0)).permutation(len(self.texts))

    def next_batch(self):
        rows = []
        for _ in range(self.batch):
            if self.pos == len(self.texts):
                self.epoch += 1
                self.pos = 0
                self.order = np.random.default_rng((self.config.seed, self.epoch)).permutation(len(self.texts))
            rows.append(self.texts[self.order[self.pos]])
            self.pos += 1
        ids = [self.tokenizer(t, add_special_tokens=True)["input_ids"][-self.length:] for t in rows]
        tokens = np.full((self.batch, self.length), self.tokenizer.pad_token_id, np.int32)
        mask = np.zeros((self.batch, self.length), np.int32)
        for i, r in enumerate(ids):
            tokens[i, self.length - len(r):] = r
            mask[i, self.length - len(r):] = 1
        return tokens, mask
