"""The metric writer's TensorBoard events, written without loading torch (tensorboardX imports it
at import time when it is installed: 2.5 s and 195 MB per run, see ppo_jax/metrics.py)."""

import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest

from tensorboardX.proto import event_pb2


def read_scalars(events_dir) -> dict[str, list[tuple[int, float]]]:
    """The scalars of TFRecord event files: [8-byte length][4-byte crc][event][4-byte crc] records."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(events_dir.iterdir()):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


WRITE = """
import json, sys
from ppo_jax.metrics import MetricWriter
writer = MetricWriter(sys.argv[1])
writer.write(1, {"loss/policy_avg": 0.5})
writer.write(2, {"loss/policy_avg": 0.25})
writer.close()
torch_loaded = "torch" in sys.modules
import torch  # the user's own code may still import it afterwards
print(json.dumps({"torch_loaded": torch_loaded, "torch_works": float(torch.ones(2).sum())}))
"""


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch installed to show it stays unloaded")
def test_tensorboard_events_are_written_without_importing_torch_and_torch_still_imports(tmp_path):
    out = subprocess.run([sys.executable, "-c", WRITE, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    said = json.loads(out.stdout.strip().splitlines()[-1])
    assert said == {"torch_loaded": False, "torch_works": 2.0}
    assert read_scalars(tmp_path / "tensorboard") == {"loss/policy_avg": [(1, 0.5), (2, 0.25)]}


def test_with_torch_already_loaded_the_writer_leaves_it_alone(tmp_path):
    torch = pytest.importorskip("torch")
    from ppo_jax.metrics import MetricWriter

    writer = MetricWriter(str(tmp_path))
    writer.write(3, {"reward/mean": 1.5})
    writer.close()
    assert sys.modules["torch"] is torch
    assert read_scalars(tmp_path / "tensorboard") == {"reward/mean": [(3, 1.5)]}
