"""Bit identity of a refactor: runs the tests' tiny PPO configs across the modes (padded, packed, k = 1
whole, k = 2 partial with evaluation, routing replay, 8 devices, LoRA, the sampler's own scoring mesh,
multi-turn whole / off-policy / partial / slots) and writes each run's metrics (time/ and perf/ left
out) and a digest of its final policy to a JSON, so that two trees can be compared run for run.

    # in the tree before and the tree after (each its own checkout; PYTHONPATH picks the package):
    PYTHONPATH=$OLD python bench/bit_identity.py $OLD/tests old.json run
    PYTHONPATH=$NEW python bench/bit_identity.py $NEW/tests new.json run
    # checkpoints written by the old tree (stopped by a SIGTERM mid-run), resumed by the new one:
    PYTHONPATH=$OLD python bench/bit_identity.py $OLD/tests old_stop.json stop /tmp/ckpt
    PYTHONPATH=$NEW python bench/bit_identity.py $NEW/tests new_resume.json resume /tmp/ckpt
    python bench/bit_identity.py compare old.json new.json

Measured for issue 60 (the rollout side as composed parts, d0f041e -> d5589b2): docs/architecture.md.
"""
import hashlib
import json
import os
import sys
import tempfile

if sys.argv[1] == "compare":
    old, new = (json.load(open(p)) for p in sys.argv[2:4])
    for name in old:
        same = name in new and old[name] == new[name]
        print(f"{name:24s} {'identical' if same else 'DIFFERS'}")
        if not same and name in new:
            for i, (a, b) in enumerate(zip(old[name]["history"], new[name]["history"])):
                print("   ", i, sorted(k for k in a if a.get(k) != b.get(k)))
    sys.exit(0)

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, sys.argv[1])  # the tests' helpers: tiny configs, meshes, scripted environments
import jax  # noqa: E402
import numpy as np  # noqa: E402
jax.config.update("jax_default_matmul_precision", "highest")
import scripted_envs  # noqa: E402,F401 (registers the test environments)
from conftest import make_test_mesh  # noqa: E402
from tiny_configs import tiny_config  # noqa: E402

from ppo_jax.rl.trainer import PPOTrainer  # noqa: E402

PARTIAL = {"rollout.off_policy_steps": 2, "rollout.engine": "continuous", "rollout.partial_rollouts": True,
           "train.iterations": 3}
MOE = {"policy.model.arch": "qwen3_moe", "policy.model.qk_norm": True, "policy.model.num_heads": 4,
       "policy.model.num_experts": 4, "policy.model.experts_per_token": 2,
       "policy.model.moe_intermediate_size": 16, "moe.router_replay": True}
MT = {"environment.name": "scripted_test_env", "environment.max_turns": 3, "environment.max_observation_tokens": 3,
      "rollout.batch_size": 16, "rollout.response_length": 20, "policy.model.max_position_embeddings": 64,
      "train.iterations": 2}
LORA = {"policy.lora.rank": 4, "policy.lora.alpha": 8.0, "policy.lora.targets": "o,fc,proj"}
CASES = {
    "padded": ({"ppo.packing": "off", "train.iterations": 2}, (1, 1, 1)),
    "packed": ({"ppo.packing": "on", "train.iterations": 2, "train.eval_every": 1}, (1, 1, 1)),
    "k1_whole": ({"rollout.off_policy_steps": 1, "train.iterations": 3, "train.eval_every": 2}, (1, 1, 1)),
    "k2_partial_eval": ({**PARTIAL, "train.eval_every": 2}, (1, 1, 1)),
    "k2_partial_moe": ({**PARTIAL, **MOE}, (1, 1, 1)),
    "k2_partial_8dev": (PARTIAL, (2, 2, 2)),
    "lora_k1": ({**LORA, "rollout.off_policy_steps": 1, "train.iterations": 3}, (1, 1, 1)),
    "scoring_sampler": ({"roles.sampler_devices": 4, "roles.sampler_mesh": (1, 2, 2), "roles.scoring": "sampler",
                         "rollout.off_policy_steps": 1, "train.iterations": 3}, (4, 1, 1)),
    "multi_turn": ({**MT, "train.eval_every": 1}, (1, 1, 1)),
    "multi_turn_k1": ({**MT, "rollout.off_policy_steps": 1, "train.iterations": 3}, (1, 1, 1)),
    "multi_turn_k2_partial": ({**MT, **PARTIAL, "environment.name": "stateful_scripted_test_env",
                               "train.eval_every": 3}, (1, 1, 1)),
    "multi_turn_slots": ({**MT, "rollout.engine": "continuous", "environment.segment_steps": 2, "rollout.slots": 8,
                          "rollout.prefill_prompts": 4}, (1, 1, 1)),
}

def digest(tree):
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()

def clean(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

def sigterm_at(call):
    import signal
    from ppo_jax import reward_functions as reward_fns
    calls = {"n": 0}
    def reward(prompts, responses):
        calls["n"] += 1
        if calls["n"] == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return reward_fns.toy_target_count(prompts, responses)
    return reward

mode, rest = sys.argv[3], sys.argv[4:]
root = rest.pop(0) if mode in ("stop", "resume") else None
out = {}
for name in rest or list(CASES):
    overrides, shape = CASES[name]
    config = tiny_config(**overrides)
    mesh = None if "roles.sampler_devices" in overrides else make_test_mesh(shape)
    if mode == "run":
        with tempfile.TemporaryDirectory() as d:
            t = PPOTrainer(config, d, mesh=mesh)
            hist = t.train(); pol = digest(t.state.policy); t.close()
    elif mode == "stop":
        t = PPOTrainer(config, os.path.join(root, name), mesh=mesh,
                       reward_functions=[(sigterm_at(2), 1.0)])
        hist = t.train(); pol = digest(t.state.policy); t.close()
    else:
        import shutil
        with tempfile.TemporaryDirectory() as d:
            shutil.copytree(os.path.join(root, name), os.path.join(d, "w"))
            t = PPOTrainer(config, os.path.join(d, "w"), mesh=mesh)
            start = t.resumed_from
            hist = t.train(); pol = digest(t.state.policy); t.close()
        hist = [{"resumed_from": start}] + hist
    out[name] = {"history": clean(hist), "policy": pol}
    print(name, mode, "ok", len(hist), flush=True)
    json.dump(out, open(sys.argv[2], "w"), indent=0, sort_keys=True, default=float)
