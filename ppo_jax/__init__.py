"""ppo_jax: RLHF with PPO for language models in JAX/Flax."""

import os

# transformers serves us tokenizers, configs and (in tests) reference models. Its import-time advice
# "PyTorch was not found. Models won't be available ..." is noise on a core install, and any module
# may import it first (the demo's settings build the world's tokenizer at import), so it is silenced
# here, before any of them. Only advisory messages; set the variable to 0 to see them again.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"

# On a CPU-only machine, freed host memory is kept for reuse instead of being unmapped after every XLA
# execution (the kernel zero-filled a quarter of an SFT step's time): `ppo_jax.host_memory`. Here, so
# that it comes before JAX starts its CPU backend. PPO_JAX_HOST_MALLOC=system leaves malloc alone.
from ppo_jax import host_memory as _host_memory  # noqa: E402

_host_memory.reuse_freed_host_memory()
