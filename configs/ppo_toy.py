"""PPO on the built-in toy task: a tiny GPT-2-shaped policy learns to say the target word "w7"."""

from ppo_jax.rl.settings import ppo_config


def get_config():
    config = ppo_config()  # every field and its meaning: ppo_jax/rl/settings.py
    config.reward.functions = "toy_target_count"  # reward = fraction of response words equal to "w7"
    config.rollout.batch_size = 32  # prompts per iteration
    config.rollout.response_length = 12  # tokens per response
    config.ppo.kl_coef = 0.02  # a loose leash: the toy reward is the point
    config.optim.policy_lr = 3e-4  # small model, large steps
    config.optim.value_lr = 3e-4  # value model learns as fast
    config.train.iterations = 30  # about a minute on a laptop CPU
    return config
