"""Memory plan of PPO on GPT-OSS-20B (a mixture of experts: 20.9B parameters, 32 experts of which 4 run
per token, 3.6B active; the MXFP4 release dequantised to bf16), bf16, on one 8-GPU host
(`ppo_jax.cli.plan`).

    python -m ppo_jax.cli.plan --config=configs/plan_gpt_oss_20b.py --device_memory_gb=141   # 8 x H200
    python -m ppo_jax.cli.plan --config=configs/plan_gpt_oss_20b.py --device_memory_gb=80    # 8 x H100

As written, every GPU's program holds every expert, sharded like a dense weight (its embed axis over
fsdp). With expert parallelism each GPU holds 1/8 of the experts and runs them for all 8 GPUs' tokens:

    python -m ppo_jax.cli.plan --config=configs/plan_gpt_oss_20b.py --config.mesh.shape=1,1,1,8 \
        --platform=gpu --gpu=h100 --device_memory_gb=80

Only shapes are used: no weights exist or are read.
"""

from ppo_jax.plan import model_shape
from ppo_jax.rl.settings import ppo_config


def get_config():
    config = ppo_config()  # every field and its meaning: ppo_jax/rl/settings.py
    config.mesh.shape = (1, 8, 1)  # one host, fsdp over its 8 GPUs
    config.policy.model = model_shape("gpt-oss-20b", param_dtype="bfloat16", dtype="bfloat16", remat=True)
    config.reward.functions = "toy_target_count"  # any reward source; the planner adds a reward model
    config.data.prompt_length = 512  # tokens, left-padded
    config.rollout.batch_size = 64  # prompts per iteration
    config.rollout.response_length = 512  # new tokens per response
    config.rollout.forward_microbatch = 16  # rows per experience forward
    config.ppo.epochs = 1  # PPO epochs per rollout batch
    config.ppo.num_minibatches = 4  # 16 rows per optimizer step
    config.ppo.num_microbatches = 2  # 8 rows per gradient-accumulation slice (1 per GPU)
    return config
