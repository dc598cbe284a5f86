"""The built-in demo config as a config file: what `python -m ppo_jax.demo` and
`python -m ppo_jax.demo.kl_sweep` load without --config. `ml_collections` loads a config file by path
(a fresh module), so this file only forwards to the library's defaults in `ppo_jax.demo.settings`."""

from ppo_jax.demo.settings import get_config

__all__ = ["get_config"]
