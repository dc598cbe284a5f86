"""Memory plan of PPO on a Llama-3-70B-shaped policy with a Llama-3-8B-shaped reward model and a value
model grown from it (value.init="reward"); bf16 params and compute. For `ppo_jax.plan`:

    python -m ppo_jax.cli.plan --config=configs/plan_llama70b_rm8b.py --config.mesh.shape=1,8,1 --device_memory_gb=141

Batch settings as configs/plan_llama70b.py. Adam moments follow the parameter dtype (bf16 here).
"""

import ml_collections

from ppo_jax.rl.settings import ppo_config
from ppo_jax.plan import model_shape


def get_config():
    config = ppo_config()  # every field and its meaning: ppo_jax/rl/settings.py
    config.mesh.shape = (1, 8, 1)  # one 8-GPU host, fsdp over all of them
    config.policy.model = model_shape("llama3-70b", param_dtype="bfloat16", dtype="bfloat16", remat=True)
    config.plan = ml_collections.ConfigDict()
    config.plan.reward_model = model_shape("llama3-8b", param_dtype="bfloat16", dtype="bfloat16", remat=True)
    config.value.init = "reward"  # the value model starts from the 8B reward model
    config.reward.functions = "toy_target_count"  # any reward source; the planner adds the reward model
    config.data.prompt_length = 512  # tokens, left-padded
    config.rollout.batch_size = 128  # prompts per iteration
    config.rollout.response_length = 512  # new tokens per response
    config.rollout.forward_microbatch = 32  # rows per experience forward
    config.ppo.epochs = 2  # PPO epochs per rollout batch
    config.ppo.num_minibatches = 4  # 32 rows per optimizer step
    config.ppo.num_microbatches = 1  # 32 rows per gradient slice
    return config
