"""bench/bench_accel.py runs end to end at its tiny size on CPU (no timing asserted), and its FLOP
count's parameter term equals the matmul parameters of the same models in `transformers`."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_accel  # noqa: E402


def test_matmul_parameter_count_matches_the_transformers_models():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = bench_accel.TINY.model_config("float32", "float32", 32)
    hf = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
              intermediate_size=cfg.mlp_dim, tie_word_embeddings=False, num_labels=1, pad_token_id=0)
    for cls, lm_head in ((transformers.LlamaForCausalLM, True), (transformers.LlamaForSequenceClassification, False)):
        model = cls(transformers.LlamaConfig(**hf))
        linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
        assert bench_accel.matmul_params(cfg, lm_head) == linear, cls.__name__
    tied = cfg.replace(tie_word_embeddings=True)
    assert bench_accel.matmul_params(tied, True) == bench_accel.matmul_params(cfg, True)  # the head is a matmul either way


def test_tiny_run_reports_every_phase_and_the_peers(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "accel.json"
    result = bench_accel.main(["--tiny", "--iterations", "1", "--json", str(out), "--profile", str(tmp_path / "trace")])
    saved = json.loads(out.read_text())
    assert saved["figures"]["flops"] == result["figures"]["flops"]
    ours = result["figures"]["ppo_jax"]
    for phase in ("generate", "experience", "update"):
        assert ours[phase]["seconds"] > 0
    assert ours["generate"]["tokens_per_s"] > 0 and ours["compile_s"]["wall"] > 0
    assert result["ppo_jax_raw"]["trace_counts"] == {"experience": 1, "update": 1}  # no recompiles
    assert result["figures"]["hf_generate"]["seconds"] > 0
    # Every result file says where and when: the device, the software, the flags, the date, the commit.
    env = saved["environment"]
    assert env["device_kind"] and env["backend"] == "cpu" and env["jax"] and env["date"].startswith("20")
    assert len(env["commit"]) == 40 or env["commit"] == "unknown"
    assert result["figures"]["torch_update"]["seconds"] > 0
    # The traced iteration's device time, by program: the experience and update steps' XLA modules,
    # their busy time split into kernel kinds that add up to it (on CPU: XLA:CPU's thunks).
    profile = result["ppo_jax_raw"]["profile"]
    for program in ("jit_experience", "jit_update"):
        times = profile[program]
        assert times["seconds"] > 0 and times["events"] > 0, program
        assert sum(times["by_kind"].values()) == pytest.approx(times["seconds"])
    assert profile["jit_update"]["by_kind"].get("gemm", 0) > 0  # the update's matmuls are found as such
