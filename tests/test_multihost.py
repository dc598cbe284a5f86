"""Real multi-process runs on CPU: 2 processes x 4 devices over gloo give the metrics of 1 process x
8 devices, and their checkpoint restores in a single process."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
from conftest import TEST_XLA_FLAGS, make_test_mesh
from tiny_configs import tiny_config

from ppo_jax.rl.trainer import PPOTrainer

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(workdir, out, overrides=None) -> dict:
    """Runs multihost_worker.py as 2 processes x 4 devices; its JSON output."""
    port = _free_port()
    # conftest's compile flags (the workers had compiled with XLA's slower defaults), 4 devices each.
    env = {**os.environ, "XLA_FLAGS": f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count=4"}
    extra = [json.dumps(overrides)] if overrides else []
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py"), str(i), "2",
                               str(port), str(workdir), str(out), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(2)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return json.loads(out.read_text())


def assert_same_metrics(expected: list[dict], got: list[dict]) -> None:
    """Every logged metric but timings within fp32 round-off of the reduction order."""
    assert len(expected) == len(got)
    for want, row in zip(expected, got):
        for key, value in want.items():
            if not key.startswith(("time/", "perf/")):
                np.testing.assert_allclose(row[key], value, rtol=2e-3, atol=2e-4, err_msg=key)


def test_two_processes_match_one_process_and_checkpoint_restores(tmp_path):
    workdir, out = tmp_path / "multi", tmp_path / "multi.json"
    multi = run_two_processes(workdir, out)

    # The same run in this one process over 8 devices.
    single = PPOTrainer(tiny_config(**{"train.iterations": 2}), str(tmp_path / "single"),
                        mesh=make_test_mesh((2, 2, 2)))
    assert_same_metrics(single.train(), multi["history"])
    single.close()

    # The 2-process checkpoint restores in one process (onto a different device layout).
    resumed = PPOTrainer(tiny_config(**{"train.iterations": 2}), str(workdir), mesh=make_test_mesh((1, 8, 1)))
    assert resumed.resumed_from == 2
    restored = {jax.tree_util.keystr(k): np.asarray(v)
                for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(resumed.state.policy))}
    assert restored.keys() == multi["policy"].keys()
    for name, value in restored.items():
        np.testing.assert_array_equal(value, np.asarray(multi["policy"][name], value.dtype), err_msg=name)
    resumed.close()


def test_disaggregated_roles_across_two_processes_with_off_policy_rollouts(tmp_path):
    """Each process gives 2 of its 4 devices to the sampler: the weight sync and the rollouts cross
    between the processes' device sets (sharding.reshard's program over both), pipelined one step
    off-policy; the metrics are those of the same run in one process."""
    overrides = {"mesh.shape": [2, 2, 1], "roles.sampler_devices": 4, "roles.sampler_mesh": [1, 2, 2],
                 "rollout.off_policy_steps": 1, "ppo.off_policy_ratio": "truncated_is"}
    multi = run_two_processes(tmp_path / "multi", tmp_path / "multi.json", overrides)
    config = tiny_config(**{"train.iterations": 2, **{k: tuple(v) if isinstance(v, list) else v
                                                      for k, v in overrides.items()}})
    single = PPOTrainer(config, str(tmp_path / "single"))
    history = single.train()
    single.close()
    assert_same_metrics(history, multi["history"])
    assert [row["perf/weight_sync_bytes"] for row in history] == [row["perf/weight_sync_bytes"]
                                                                  for row in multi["history"]]
    # The first iteration synced the initial weights (its sample and the next one's share them); the
    # last one starts no sample, so syncs nothing.
    assert multi["history"][0]["perf/weight_sync_bytes"] > 0 == multi["history"][1]["perf/weight_sync_bytes"]


def test_multi_turn_episodes_across_two_processes(tmp_path):
    """Multi-turn rows on 2 processes (agentic/bookkeeping.py): each resets and steps the
    environments of its own 8 prompt rows, the answers are gathered, and the continuous schedule's
    decisions (append, decode again, stop) are taken alike everywhere; the metrics are those of
    the same run in one process over 8 devices."""
    overrides = {"environment.name": "scripted_envs:Scripted", "environment.max_turns": 3,
                 "environment.max_observation_tokens": 3, "rollout.batch_size": 16, "rollout.response_length": 20,
                 "policy.model.max_position_embeddings": 64, "rollout.engine": "continuous",
                 "environment.segment_steps": 2}
    multi = run_two_processes(tmp_path / "multi", tmp_path / "multi.json", overrides)
    single = PPOTrainer(tiny_config(**{"train.iterations": 2, **overrides}), str(tmp_path / "single"),
                        mesh=make_test_mesh((2, 2, 2)))
    history = single.train()
    single.close()
    assert all(row["rollout/turns"] > 1 for row in history)
    assert_same_metrics(history, multi["history"])
