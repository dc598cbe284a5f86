"""A tiny Llama-shaped PPO run for `ppo_jax.cli.plan` (seconds on a laptop; used by tests/test_plan.py).

    python -m ppo_jax.cli.plan --config=configs/plan_tiny.py --config.mesh.shape=1,8,1 --device_memory_gb=0.01
"""

from ppo_jax.config import model_config_dict
from ppo_jax.rl.settings import ppo_config


def get_config():
    config = ppo_config()  # every field and its meaning: ppo_jax/rl/settings.py
    config.mesh.shape = (1, 1, 1)  # (data, fsdp, tensor)
    config.policy.model = model_config_dict(arch="llama", vocab_size=128, hidden_size=64, num_layers=2,
                                            num_heads=4, num_kv_heads=2, intermediate_size=128,
                                            max_position_embeddings=64, tie_word_embeddings=False)
    config.reward.functions = "toy_target_count"  # any reward source; the planner adds a reward model
    config.data.prompt_length = 8  # tokens, left-padded
    config.rollout.batch_size = 16  # prompts per iteration
    config.rollout.response_length = 8  # new tokens per response
    config.ppo.epochs = 1  # one epoch keeps the update program small
    config.ppo.num_minibatches = 1  # 16 rows per optimizer step
    return config
