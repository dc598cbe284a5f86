"""PPO on the toy task with the roles apart (issue 31, docs/architecture.md "Roles"): half the devices
decode, the other half train, one step off-policy so both halves work at once, and the reference and
reward scoring on the sampler's half. Needs 8 devices (on a CPU:
XLA_FLAGS=--xla_force_host_platform_device_count=8); on a pod slice scale the numbers with it."""

from ppo_jax.rl.settings import ppo_config


def get_config():
    config = ppo_config()  # every field and its meaning: ppo_jax/rl/settings.py, ppo_jax/rl/roles.py
    config.reward.functions = "toy_target_count"  # the toy task of configs/ppo_toy.py
    config.rollout.batch_size = 32
    config.rollout.response_length = 12
    config.ppo.kl_coef = 0.02
    config.optim.policy_lr = 3e-4
    config.optim.value_lr = 3e-4
    config.train.iterations = 30
    config.mesh.shape = (1, -1, 1)  # the trainer: FSDP over its devices
    config.roles.sampler_devices = 4  # the sampler: 4 devices of its own (each process gives the same share)
    config.roles.sampler_mesh = (2, 1, 2)  # decode layout: 2 replicas x 2-way tensor parallel (no FSDP gathers per step)
    config.roles.scoring = "sampler"  # the frozen reference scores there too: the trainer holds no frozen tree
    config.rollout.off_policy_steps = 1  # batch k+1 samples the weights before update k while update k runs
    config.ppo.off_policy_ratio = "truncated_is"  # ratio 1 on the first minibatch, staleness in capped weights
    return config
