"""Memory plan of PPO on a Qwen3-8B (8.19B parameters, q/k norms), bf16, on one 8-GPU host
(`ppo_jax.cli.plan`).

    python -m ppo_jax.cli.plan --config=configs/plan_qwen3_8b.py --device_memory_gb=141      # 8 x H200
    python -m ppo_jax.cli.plan --config=configs/plan_qwen3_8b.py --device_memory_gb=80       # 8 x H100

The reward model has the policy's architecture (a separate ScalarModel); the value model grows from the
policy. Only shapes are used: no weights exist or are read.
"""

from ppo_jax.plan import model_shape
from ppo_jax.rl.settings import ppo_config


def get_config():
    config = ppo_config()  # every field and its meaning: ppo_jax/rl/settings.py
    config.mesh.shape = (1, 8, 1)  # one host, fsdp over its 8 GPUs
    # remat: each layer is recomputed in the backward pass instead of keeping its activations.
    config.policy.model = model_shape("qwen3-8b", param_dtype="bfloat16", dtype="bfloat16", remat=True)
    config.reward.functions = "toy_target_count"  # any reward source; the planner adds a reward model
    config.data.prompt_length = 512  # tokens, left-padded
    config.rollout.batch_size = 128  # prompts per iteration
    config.rollout.response_length = 512  # new tokens per response
    config.rollout.forward_microbatch = 32  # rows per experience forward
    config.ppo.epochs = 2  # PPO epochs per rollout batch
    config.ppo.num_minibatches = 4  # 32 rows per optimizer step
    config.ppo.num_microbatches = 4  # 8 rows per gradient-accumulation slice (1 per GPU)
    return config
