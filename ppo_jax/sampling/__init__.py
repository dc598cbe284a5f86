"""Rollout sampling: token choice, the KV-cache decode loop, the jitted, sharded sampler, and a
text-in/text-out helper.

Modules, each importing only those below it:
    texts         generate_texts / sample_prompts / decode_responses: strings in, strings out
    segments      SegmentedSampler: the continuous engine in segments, weights swapped between them
    sampler       Sampler / make_sampler: `sample` jitted over a mesh, batch checks
    continuous    sample_continuous: the same on a fixed number of decode slots fed from a queue
    turns         TurnDecoder: multi-turn decoding (turn segments, observations appended to the cache)
    loop          sample: prefill + `lax.while_loop` decode over a preallocated KV cache
    token_choice  choose_tokens: one step's logits [R, V] -> tokens and log-probs [R]
    config        SamplingConfig, validate_inputs, SampleOutput, truncation_metrics
"""

from ppo_jax.sampling.config import SampleOutput, SamplingConfig, slot_occupancy, truncation_metrics
from ppo_jax.sampling.continuous import sample_continuous
from ppo_jax.sampling.loop import sample
from ppo_jax.sampling.sampler import Sampler, make_sampler
from ppo_jax.sampling.texts import decode_responses, generate_texts, sample_prompts

__all__ = [
    "SampleOutput", "Sampler", "SamplingConfig", "make_sampler", "sample", "sample_continuous", "slot_occupancy",
    "truncation_metrics",
    "generate_texts", "sample_prompts", "decode_responses",
]
