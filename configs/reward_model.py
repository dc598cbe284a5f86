"""Reward model on your own preferences: a JSONL file of {"prompt", "chosen", "rejected"} records,
starting from your SFT model (its transformer, a fresh scalar head).

    python -m ppo_jax.cli.reward_model --config=configs/reward_model.py --workdir=runs/rm \
        --config.model.path=runs/sft/hf --config.data.train=prefs.jsonl --config.data.eval=prefs_val.jsonl

LoRA (adapters on the transformer + the new score head train, the SFT base stays frozen; the export is
merged): --config.model.lora.rank=8 --config.model.lora.targets=q,k,v,o --config.optim.lr=1e-4
Every field and its meaning: `ppo_jax.supervised.settings.RewardModelSettings`.
"""

from ppo_jax.supervised.settings import reward_model_config


def get_config():
    config = reward_model_config()
    config.data.max_prompt_length = 256  # use the PPO data.prompt_length
    config.data.max_response_length = 256  # use the PPO rollout.response_length
    config.normalize.source = "policy"  # the SFT policy's own samples score mean 0, std 1
    config.normalize.num_prompts = 512  # prompts sampled for normalisation
    config.train.batch_size = 32  # preference pairs per optimizer step
    config.train.steps = 1000  # optimizer steps (about one epoch of 32k pairs)
    config.train.eval_every = 200  # validation accuracy every N steps
    config.train.checkpoint_every = 500  # Orbax checkpoint every N steps (resumed automatically)
    config.optim.lr = 1e-5  # fine-tuning a pretrained model: a small learning rate
    config.optim.warmup_steps = 50  # linear warmup
    return config
