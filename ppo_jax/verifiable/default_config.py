"""The verifiable-reward task's config as a config file: what `python -m ppo_jax.verifiable` loads without
--config (it only forwards to `ppo_jax.verifiable.settings.get_config`)."""

from ppo_jax.verifiable.settings import get_config

__all__ = ["get_config"]
