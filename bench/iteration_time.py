"""Median wall seconds per PPO iteration of a tiny run on one mesh (the default layout), the first
two iterations left out: a before/after check that a change to the loop did not slow the default
path. Run from a checkout's root, e.g. alternating two checkouts:
    (cd OLD && PYTHONPATH=$PWD python /path/to/bench/iteration_time.py); python bench/iteration_time.py
"""
import os, sys, statistics, tempfile, time
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
os.environ["JAX_PLATFORMS"] = "cpu"
from tiny_configs import tiny_config
from ppo_jax.rl.trainer import PPOTrainer
c = tiny_config(**{"train.iterations": 12, "rollout.response_length": 32})
c.policy.model.hidden_size = 128; c.policy.model.num_layers = 4; c.policy.model.max_position_embeddings = 64
stamps = []
t = PPOTrainer(c, tempfile.mkdtemp())
t.train(lambda step, s: stamps.append(time.perf_counter()))
print("median s/iteration", round(statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:])), 4))
