"""The one error of the Hugging Face bridge: a model directory (or config) ppo_jax cannot read or write.
Named apart from `ppo_jax.checkpoint.CheckpointError`, which is about a run's own checkpoints."""


class HFModelError(ValueError):
    """A Hugging Face checkpoint directory that ppo_jax cannot read (or a config it cannot write)."""
