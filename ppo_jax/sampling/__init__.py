"""Rollout sampling: token choice, the KV-cache decode loop, and the jitted, sharded sampler."""

from ppo_jax.sampling.sampler import (
    SampleOutput,
    Sampler,
    SamplingConfig,
    make_sampler,
    sample,
    truncation_metrics,
)

__all__ = ["SampleOutput", "Sampler", "SamplingConfig", "make_sampler", "sample", "truncation_metrics"]
