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
    # The decode loop apart from the prefill (the sampler alone at N and 1 new tokens); the
    # torch.compile peers need CUDA unless asked for, and say so instead of figures.
    generate = ours["generate"]
    assert generate["decode_ms_per_step"] == ours["sampler_gemm"]["auto"]["decode_ms_per_step"]
    assert generate["prefill_ms"] > 0 and result["ppo_jax_raw"]["decode"]["auto"]["decode_steps"] == 7
    for peer in bench_accel.TORCH_COMPILE_PEERS:
        assert result["figures"][peer]["error"].startswith("skipped: no CUDA device"), peer
    # The traced iteration's device time, by program: the experience and update steps' XLA modules,
    # their busy time split into kernel kinds that add up to it (on CPU: XLA:CPU's thunks).
    profile = result["ppo_jax_raw"]["profile"]
    for program in ("jit_experience", "jit_update"):
        times = profile[program]
        assert times["seconds"] > 0 and times["events"] > 0, program
        assert sum(times["by_kind"].values()) == pytest.approx(times["seconds"])
    assert profile["jit_update"]["by_kind"].get("gemm", 0) > 0  # the update's matmuls are found as such


def test_a_torch_compile_peer_out_of_time_is_recorded_not_fatal(tmp_path):
    """The torch.compile peers run in a child process killed at --torch-compile-timeout: what they
    did not finish gets the reason in the JSON, and the benchmark goes on."""
    pytest.importorskip("torch")
    args = bench_accel.parse_args(["--tiny", "--torch-compile", "on", "--torch-compile-timeout", "0.5"])
    assets = bench_accel.build_assets(bench_accel.TINY, args, str(tmp_path))
    peers = bench_accel.run_torch_compile_peers(args, assets, str(tmp_path))
    assert set(peers) == set(bench_accel.TORCH_COMPILE_PEERS)
    for peer in peers.values():
        assert "--torch-compile-timeout=0.5" in peer["error"]


def test_the_trainer_runs_in_the_dtypes_the_benchmark_names(tmp_path):
    """The benchmark's checkpoints are bf16; the trainer must hold and run all four trees in bf16 as the
    table says, not upcast them to fp32 (the loader's default). The 2026-11-26/27 H200 runs did: every
    GEMM was an fp32 (TF32) kernel while the table printed "bfloat16 params / bfloat16 compute"."""
    import jax
    import jax.numpy as jnp

    from ppo_jax import sharding
    from ppo_jax.rl.trainer import PPOTrainer

    args = bench_accel.parse_args(["--tiny"])
    args.param_dtype = args.dtype = "bfloat16"  # --tiny computes in fp32 for the CPU; the GPU default is bf16
    assets = bench_accel.build_assets(bench_accel.TINY, args, str(tmp_path))
    trainer = PPOTrainer(bench_accel.ppo_jax_settings(args, assets), str(tmp_path / "run"),
                         tokenizer=assets["tokenizer"], prompts=assets["prompts"],
                         mesh=sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    for name, params, module in (("policy", trainer.state.policy, trainer.modules.policy),
                                 ("value", trainer.state.value, trainer.modules.value),
                                 ("reward", trainer.frozen.reward, trainer.modules.reward),
                                 ("reference", trainer.frozen.reference, trainer.modules.policy)):
        floats = {jnp.dtype(x.dtype).name for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)}
        assert floats == {"bfloat16"} and module.config.dtype == "bfloat16", name
    trainer.close()


def test_the_trace_summary_counts_overlapping_kernels_and_a_loop_once():
    """bench/profile_summary.py on a hand-made GPU stream: a while loop holding two kernels, then two
    kernels whose timestamps overlap by a few ns (CUPTI's, inside a CUDA graph), named by the kernel
    since their op is the graph. The loop's own event is not counted; both overlapping kernels are
    (the first version dropped the earlier of such a pair: 40% of the H200 update's kernels)."""
    import types

    import profile_summary

    def event(name, start, duration, op):
        return types.SimpleNamespace(name=name, start_ns=start, duration_ns=duration,
                                     stats=[("hlo_module", "jit_update"), ("hlo_op", op)])

    stream = types.SimpleNamespace(name="Stream #14(Compute)", events=[
        event("while.3", 0, 1000, "while.3"),
        event("loop_add_fusion", 10, 400, "loop_add_fusion"),
        event("gemm_fusion_dot", 500, 400, "gemm_fusion_dot"),
        event("sm90_xmma_gemm_bf16bf16_bf16f32", 2000, 1000, "command_buffer_7"),
        event("loop_transpose_fusion", 2990, 500, "command_buffer_7"),
        event("nvjet_sm90_tst_128x128_64x6_2x4_h_bz_NTT", 3500, 800, "command_buffer_7"),
    ])
    plane = types.SimpleNamespace(name="/device:GPU:0", lines=[stream])
    events = [(e.name, profile_summary.op_name(stats, e.name)) for e, stats in profile_summary._op_events(plane)]
    assert events == [("loop_add_fusion", "loop_add_fusion"), ("gemm_fusion_dot", "gemm_fusion_dot"),
                      ("sm90_xmma_gemm_bf16bf16_bf16f32", "sm90_xmma_gemm_bf16bf16_bf16f32"),
                      ("loop_transpose_fusion", "loop_transpose_fusion"),
                      ("nvjet_sm90_tst_128x128_64x6_2x4_h_bz_NTT", "nvjet_sm90_tst_128x128_64x6_2x4_h_bz_NTT")]
    # nvjet_*: cuBLAS 12.9's Hopper GEMMs, which XLA 0.11 picks for the bf16 update and experience
    assert [profile_summary.kind_of(op, name) for name, op in events] == ["other", "gemm", "gemm", "transpose", "gemm"]
