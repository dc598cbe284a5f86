"""Memory plan of long-context PPO on a Llama-3-8B-shaped policy (bf16 params and compute): 16 rows of
2,048 prompt + 30,720 response tokens, for `ppo_jax.cli.plan` and the context axis (issue 46,
docs/long_context.md). The mesh is (1, devices / context, 1, 1, context): set the context size with
`--config.mesh.shape`, and keep the microbatch at one row per fsdp device with
`--config.ppo.num_microbatches=<context>` and `--config.rollout.forward_microbatch=<devices / context>`:

    python -m ppo_jax.cli.plan --config=configs/plan_llama3_8b_long.py --platform=gpu --gpu=h200 \
        --device_memory_gb=141 --config.mesh.shape=1,4,1,1,2 --config.ppo.num_microbatches=2 \
        --config.rollout.forward_microbatch=4                                      # 8x H200, context 2
    python -m ppo_jax.cli.plan --config=configs/plan_llama3_8b_long.py --platform=tpu \
        --tpu_topology=v5p:2x4x4 --device_memory_gib=95 --config.mesh.shape=1,16,1,1,2 \
        --config.ppo.num_microbatches=1 --config.rollout.forward_microbatch=16      # v5p-64, context 2

Each optimizer step takes 8 or 16 rows (two or one minibatches); with context c every device holds
32,768 / c tokens of one row per microbatch. Only shapes are used: no weights exist or are read.
"""

from ppo_jax.plan import model_shape
from ppo_jax.rl.settings import ppo_config


def get_config():
    config = ppo_config()  # every field and its meaning: ppo_jax/rl/settings.py
    config.mesh.shape = (1, 8, 1, 1, 1)  # 8x H200, fsdp only: a 32k-token row on one device
    config.policy.model = model_shape("llama3-8b", param_dtype="bfloat16", dtype="bfloat16", remat=True,
                                      max_position_embeddings=32768)  # Llama 3.1's rope scaling aside
    config.reward.functions = "toy_target_count"  # any reward source; the planner adds a reward model
    config.data.prompt_length = 2048  # tokens, left-padded
    config.rollout.batch_size = 16  # prompts per iteration
    config.rollout.response_length = 30720  # new tokens per response
    config.rollout.forward_microbatch = 8  # rows per experience forward: one per fsdp device
    config.ppo.epochs = 1
    config.ppo.num_minibatches = 2  # 8 rows per optimizer step
    config.ppo.num_microbatches = 1  # rows per gradient-accumulation slice: 8 / num_microbatches
    return config
