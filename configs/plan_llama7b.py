"""Memory plan of PPO on a Llama-2-7B-shaped policy (bf16 params and compute), for `ppo_jax.cli.plan`.

    python -m ppo_jax.cli.plan --config=configs/plan_llama7b.py --device_memory_gib=95 \
        --platform=tpu --tpu_topology=v5p:2x4x4                                   # v5p-64
    python -m ppo_jax.cli.plan --config=configs/plan_llama7b.py --config.mesh.shape=1,8,1 --device_memory_gb=141

The reward and value models have the policy's architecture (reward: a separate 7B ScalarModel; value:
grown from the policy). Adam moments follow the parameter dtype (optax), so they are bf16 here; for
fp32 master weights and fp32 Adam states add --config.policy.param_dtype=float32.
Only shapes are used: no weights exist or are read.
"""

from ppo_jax.rl.settings import ppo_config
from ppo_jax.plan import model_shape


def get_config():
    config = ppo_config()  # every field and its meaning: ppo_jax/rl/settings.py
    config.mesh.shape = (1, 32, 1)  # v5p-64: 32 chips (64 TensorCores), fsdp over all of them
    # remat: each layer is recomputed in the backward pass instead of keeping its activations.
    config.policy.model = model_shape("llama2-7b", param_dtype="bfloat16", dtype="bfloat16", remat=True)
    config.reward.functions = "toy_target_count"  # any reward source; the planner adds a reward model
    config.data.prompt_length = 512  # tokens, left-padded
    config.rollout.batch_size = 256  # prompts per iteration
    config.rollout.response_length = 512  # new tokens per response
    config.rollout.forward_microbatch = 64  # rows per experience forward
    config.ppo.epochs = 2  # PPO epochs per rollout batch
    config.ppo.num_minibatches = 4  # 64 rows per optimizer step
    config.ppo.num_microbatches = 2  # 32 rows per gradient-accumulation slice (1 per chip on 32 chips)
    return config
