"""Real multi-process runs on CPU: 2 processes x 4 devices over gloo give the metrics of 1 process x
8 devices, and their checkpoint restores in a single process."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
from conftest import make_test_mesh
from tiny_configs import tiny_config

from ppo_jax.rl.trainer import PPOTrainer

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process_and_checkpoint_restores(tmp_path):
    workdir, out = tmp_path / "multi", tmp_path / "multi.json"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py"), str(i), "2",
                               str(port), str(workdir), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(2)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    multi = json.loads(out.read_text())

    # The same run in this one process over 8 devices.
    single = PPOTrainer(tiny_config(**{"train.iterations": 2}), str(tmp_path / "single"),
                        mesh=make_test_mesh((2, 2, 2)))
    history = single.train()
    single.close()
    for want, got in zip(history, multi["history"]):
        for key, value in want.items():
            if not key.startswith(("time/", "perf/")):
                np.testing.assert_allclose(got[key], value, rtol=2e-3, atol=2e-4, err_msg=key)

    # The 2-process checkpoint restores in one process (onto a different device layout).
    resumed = PPOTrainer(tiny_config(**{"train.iterations": 2}), str(workdir), mesh=make_test_mesh((1, 8, 1)))
    assert resumed.resumed_from == 2
    restored = {jax.tree_util.keystr(k): np.asarray(v)
                for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(resumed.state.policy))}
    assert restored.keys() == multi["policy"].keys()
    for name, value in restored.items():
        np.testing.assert_array_equal(value, np.asarray(multi["policy"][name], value.dtype), err_msg=name)
    resumed.close()
