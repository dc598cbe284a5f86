"""The offline RLHF demo: a synthetic world with a hidden gold reward, and the SFT -> reward model -> PPO
pipeline run in it (`python -m ppo_jax.demo`; the KL sweep: `python -m ppo_jax.demo.kl_sweep`).

Modules, by job (each imports only downwards: rl/, supervised/, sampling/, data/, models/):

  world       the synthetic world: tokenizer, prompts, corpus, the gold reward, preference labels
  settings    `DemoSettings` (typed, frozen; the trainers' own settings as sections), `get_config()`,
              `small_config()`, validation
  responses   `ResponseSampler`: answers of an exported policy (the preference pairs)
  evaluator   `PolicyEvaluator`, `EvalPoint`: the gold evaluation during PPO
  stages      the four stages and their results (`train_sft`, `sample_preferences`,
              `train_reward_model`, `train_ppo`)
  plots       the figures
  pipeline    `run(config, workdir)`: workdir, stages in order, summary; the command line
  kl_sweep    PPO at several KL coefficients from one SFT policy and reward model
"""
