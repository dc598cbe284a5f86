"""Memory plan of PPO on a Llama-3-8B-shaped policy (bf16 params and compute) on a v5p-8 slice (4 chips,
95 GiB each), for `ppo_jax.cli.plan`; the TPU fused-attention rows of docs/benchmarks.md.

    python -m ppo_jax.cli.plan --config=configs/plan_llama3_8b.py --platform=tpu --tpu_topology=v5p:2x2x1 \
        --phases=experience,update --device_memory_gib=95                           # auto: splash attention
    ... --config.compute.attention=einsum                                           # the einsum reference

The reward model has the policy's architecture (a separate ScalarModel); the value model grows from the
policy. Only shapes are used: no weights exist or are read.
"""

from ppo_jax.plan import model_shape
from ppo_jax.rl.settings import ppo_config


def get_config():
    config = ppo_config()  # every field and its meaning: ppo_jax/rl/settings.py
    config.mesh.shape = (1, 4, 1)  # v5p-8: 4 chips, fsdp over all of them
    # remat: each layer is recomputed in the backward pass instead of keeping its activations.
    config.policy.model = model_shape("llama3-8b", param_dtype="bfloat16", dtype="bfloat16", remat=True)
    config.reward.functions = "toy_target_count"  # any reward source; the planner adds a reward model
    config.data.prompt_length = 512  # tokens, left-padded
    config.rollout.batch_size = 64  # prompts per iteration
    config.rollout.response_length = 512  # new tokens per response
    config.rollout.forward_microbatch = 32  # rows per experience forward (8 per chip)
    config.ppo.epochs = 2  # PPO epochs per rollout batch
    config.ppo.num_minibatches = 2  # 32 rows per optimizer step
    config.ppo.num_microbatches = 4  # 8 rows per gradient-accumulation slice (2 per chip)
    return config
