"""ppo_jax: RLHF with PPO for language models in JAX/Flax."""

import os

# transformers serves us tokenizers, configs and (in tests) reference models. Its import-time advice
# "PyTorch was not found. Models won't be available ..." is noise on a core install, and any module
# may import it first (the demo's settings build the world's tokenizer at import), so it is silenced
# here, before any of them. Only advisory messages; set the variable to 0 to see them again.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"
