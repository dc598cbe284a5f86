"""The sampler's settings derived from a run's (`rollout.*`, `moe.router_replay`): the `SamplingConfig`
the sampler is built from, with what `rollout.steps_per_sync = 0` means by platform."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from ppo_jax.rl.settings import DECODE_LOOPS, Settings
from ppo_jax.sampling import SamplingConfig

# rollout.steps_per_sync = 0 by platform: a GPU evaluates a data-dependent loop condition on the host.
AUTO_STEPS_PER_SYNC = {"gpu": 8}


def sampling_config(s: Settings, stop_ids: Sequence[int], pad_id: int,
                    unroll_layers: bool | None = None, slots: int = 0, platform: str | None = None) -> SamplingConfig:
    """The sampler settings of a run (rollout.*); unroll_layers, if given, overrides rollout.decode;
    slots: the continuous engine's (`DerivedSizes.decode_slots`); platform: the sampler's devices'
    (what rollout.steps_per_sync = 0 resolves for; None: this process's backend)."""
    r = s.rollout
    if unroll_layers is None:
        unroll_layers = DECODE_LOOPS[r.decode]
    steps_per_sync = r.steps_per_sync or AUTO_STEPS_PER_SYNC.get(platform or jax.default_backend(), 1)
    return SamplingConfig(
        max_new_tokens=r.response_length, min_new_tokens=r.min_new_tokens, temperature=r.temperature,
        top_k=r.top_k, top_p=r.top_p, stop_token_ids=tuple(stop_ids), pad_token_id=int(pad_id),
        num_samples=r.num_samples, cache_dtype=r.cache_dtype or None, engine=r.engine, slots=slots,
        prefill_prompts=r.prefill_prompts, tail_halvings=None if r.tail_halvings < 0 else r.tail_halvings,
        steps_per_sync=steps_per_sync, unroll_layers=unroll_layers, record_experts=s.moe.router_replay,
        gemm=r.gemm)
