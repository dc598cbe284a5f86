"""bench/bench_cpu_gemm.py: the GEMM list covers the update's matmul FLOPs (the 6·N·D rule for a
GPT-2 policy and value model), the two libraries' products agree on real operands and a wrong product
is refused, and a smoke run reports every GEMM, role and dtype."""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
import bench_cpu_gemm as bg  # noqa: E402
from bench_ppo import Shapes, add_shape_arguments  # noqa: E402

SMOKE = ["--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "64", "--batch", "2", "--prompt", "4",
         "--response", "3", "--epochs", "2"]


def test_the_gemms_hold_the_updates_matmul_flops():
    s = Shapes(layers=4, hidden=256, heads=4, vocab=4096, batch=32, prompt=32, response=64, epochs=4,
               minibatches=1)
    tokens = s.batch * (s.prompt + s.response)
    # forward + backward of a matmul with N weights over D tokens: 6·N·D. Per layer 12·d² weights
    # (q/k/v 3d², output d², MLP 8d²), two models; the tied LM head's d·V over the response tokens.
    expected = 6 * 12 * s.hidden**2 * s.layers * 2 * tokens + 6 * s.hidden * s.vocab * s.batch * s.response
    listed = sum(len(bg.ROLES) * g.flops * g.count for g in bg.update_gemms(s))
    assert listed == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_libraries_products_agree_and_a_wrong_one_is_refused(dtype):
    gemm = bg.Gemm("mlp_up", (2, 5), 16, 24, 1)
    arrays = bg.operands(gemm)
    ours, theirs = bg.jax_calls(*arrays, dtype), bg.torch_calls(*arrays, dtype)
    x, w, g = (a.astype(np.float64) for a in arrays)
    truth = {"forward": x @ w, "input_gradient": g @ w.T, "weight_gradient": np.einsum("btk,btn->kn", x, g)}
    for role in bg.ROLES:
        bg.check_agree(gemm.name, role, dtype, ours[role](), theirs[role]())
        product = np.asarray(ours[role](), np.float64)
        assert product.shape == truth[role].shape
        np.testing.assert_allclose(product, truth[role], atol=bg.TOLERANCE[dtype] * np.abs(truth[role]).max())
    wrong = np.asarray(ours["weight_gradient"](), np.float32) * 1.1
    with pytest.raises(AssertionError, match="XLA and PyTorch differ"):
        bg.check_agree(gemm.name, "weight_gradient", dtype, wrong, theirs["weight_gradient"]())


def test_a_smoke_run_reports_every_gemm_role_and_dtype(tmp_path):
    out = tmp_path / "gemm.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_cpu_gemm.py"), *SMOKE, "--reps", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    parser = argparse.ArgumentParser()
    add_shape_arguments(parser)
    names = [g.name for g in bg.update_gemms(Shapes.from_args(parser.parse_args(SMOKE)))]
    assert [(r["dtype"], r["gemm"], r["role"]) for r in result["rows"]] == [
        (d, n, role) for d in ("float32", "bfloat16") for n in names for role in bg.ROLES]
    assert all(r["jax_ms"] > 0 and r["torch_ms"] > 0 for r in result["rows"])
    for dtype, floor in result["update_floor"].items():
        rows = [r for r in result["rows"] if r["dtype"] == dtype]
        assert floor["jax_s"] == pytest.approx(sum(r["jax_ms"] * r["count_per_epoch"] for r in rows) * 2 / 1e3)
    assert "the update's GEMMs (2 epochs)" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--dtypes", "float16"], "--dtypes takes float32, bfloat16"),
    (["--arch", "qwen3_moe"], "--arch qwen3_moe: only the GPT-2 update's GEMMs are listed here"),
])
def test_bad_flags_are_one_error_line(flags, message):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_cpu_gemm.py"), *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("bench_cpu_gemm.py: error: ") and message in last
