"""The one error of the Hugging Face bridge: a checkpoint (or config) ppo_jax cannot read or write."""


class CheckpointError(ValueError):
    """A Hugging Face checkpoint directory that ppo_jax cannot read (or a config it cannot write)."""
