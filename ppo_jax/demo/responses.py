"""Sampling answers from an exported policy (stage 2's preference pairs): `num_samples` answers per
prompt, decoded exactly by the world (`World.decode_response`), compiled once for one batch shape."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from tqdm.auto import tqdm

from ppo_jax import sampling
from ppo_jax.data import PromptTokenizer
from ppo_jax.demo.world import World
from ppo_jax.models import CausalLM, hf


def load_policy(path: str, mesh) -> tuple[CausalLM, object]:
    """A Hugging Face causal-LM directory as (module, params) placed on `mesh`."""
    loaded = hf.load_model(path, mesh, kind="causal_lm")
    return CausalLM(loaded.config), loaded.params


class ResponseSampler:
    """`num_samples` answers per prompt from a Hugging Face policy directory, as (text, stopped) pairs
    decoded exactly (`World.decode_response`). Compiled once for `batch_size` prompts per call."""

    def __init__(self, world: World, policy_dir: str, *, num_samples: int, temperature: float,
                 batch_size: int, prompt_length: int, mesh):
        self.world, self.mesh = world, mesh
        self.module, self.params = load_policy(policy_dir, mesh)
        tok = world.tokenizer
        self.eos = tok.eos_token_id
        self.num_samples, self.batch_size, self.prompt_length = num_samples, batch_size, prompt_length
        self.sampler = sampling.make_sampler(self.module, sampling.SamplingConfig(
            max_new_tokens=world.max_response_tokens, pad_token_id=tok.pad_token_id,
            stop_token_ids=(tok.eos_token_id,), temperature=temperature, num_samples=num_samples),
            mesh, jax.tree.map(lambda x: x.sharding, self.params))
        self.encoder = PromptTokenizer(tok, max_prompt_length=prompt_length)

    def __call__(self, prompts: Sequence[str], key, *, desc: str | None = None
                 ) -> list[list[tuple[str, bool]]]:
        """desc: a tqdm bar by that name counts the prompts answered (None: no bar)."""
        # sampling.sample_prompts pads each call of batch_size prompts with copies of the last one (one
        # compiled shape), folds `start` into the key per call and drops the filler rows again.
        with tqdm(total=len(prompts), desc=desc, unit="prompt", disable=desc is None) as bar:
            out = sampling.sample_prompts(self.sampler, self.params, self.encoder, prompts, key,
                                          prompt_length=self.prompt_length, mesh=self.mesh,
                                          batch_size=self.batch_size, on_fetched=bar.update)
        rows = [self.world.decode_response(r, (self.eos,)) for r in out.tokens]
        n = self.num_samples
        return [rows[i * n:(i + 1) * n] for i in range(len(prompts))]
