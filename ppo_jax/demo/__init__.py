"""The offline RLHF demo: a synthetic world with a hidden gold reward, and the SFT -> reward model -> PPO
pipeline run in it (`python -m ppo_jax.demo`)."""
