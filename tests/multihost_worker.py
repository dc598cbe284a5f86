"""One process of a real multi-process PPO run on CPU (started by test_multihost.py).

argv: process_id num_processes port workdir out_json [overrides_json]
Each process has 4 CPU devices; together they form one (2, 2, 2) mesh over gloo collectives (unless
the overrides, {"section.field": value}, say otherwise, e.g. disaggregated roles).
"""

import json
import os
import sys

# The test passes conftest's compile flags with the device count; run by hand, 4 devices and XLA's own.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def main():
    process_id, num_processes, port, workdir, out = sys.argv[1:6]
    overrides = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    from tiny_configs import tiny_config

    from ppo_jax import distributed, sharding
    from ppo_jax.rl.settings import Settings
    from ppo_jax.rl.trainer import PPOTrainer

    config = tiny_config(**{"train.iterations": 2, "mesh.shape": (2, 2, 2), **overrides})
    config.distributed.coordinator_address = f"127.0.0.1:{port}"
    config.distributed.num_processes = int(num_processes)
    config.distributed.process_id = int(process_id)
    assert distributed.initialize(Settings.from_config(config).distributed)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    trainer = PPOTrainer(config, workdir)
    history = trainer.train()
    policy = sharding.to_host(trainer.state.policy)
    trainer.close()
    if jax.process_index() == 0:
        flat = {jax.tree_util.keystr(k): np.asarray(v).tolist()
                for k, v in jax.tree_util.tree_leaves_with_path(policy)}
        with open(out, "w") as f:
            json.dump({"history": history, "policy": flat}, f)


if __name__ == "__main__":
    main()
