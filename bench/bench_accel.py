"""One PPO iteration of a ~1B Llama on an accelerator, phase by phase, with the PyTorch peers beside it.

The shape is the one of the team's GPU profile (TinyLlama-1.1B: vocab 32000, d 2048, 22 layers, 32 query
/ 4 KV heads, MLP 5632), built from a config with random weights (nothing downloaded): policy + value
trainable (AdamW), reference + reward model frozen; `--rows` prompts × (`--prompt` + `--response`)
tokens, 1 epoch of `--rows / --minibatch-rows` minibatches. Every response is full length (EOS is
suppressed), so every figure counts the same tokens.

Per phase of ppo_jax's iteration (median of `--iterations` steady iterations after the first):
  generate    time, tokens/s, ms per decode step, fraction of the HBM roofline
  experience  time, MFU (reference, reward, value and policy forwards)
  update      time, MFU (policy and value forward + backward, optimizer)
and compile time (first iteration - steady), trainer start-up, peak device memory of the whole run.

The generate phase is the trainer's whole rollout (sampling, scoring, the move to the trainer's
mesh). After the timed iterations the sampler alone is timed at N and at 1 new tokens: their difference
over the N program's decode steps is the decode loop's time per step apart from the prefill
(`decode_ms_per_step`, `decode_roofline_fraction`), also under each rollout.gemm of `--gemm-ab`.
`--sampler-gemm` (rollout.gemm) and `--train-gemm` (ppo.gemm: the experience and update programs)
choose each program's GEMM kernels on a GPU; a compile-time A/B needs a process per choice.

With torch installed, on the same device (`--no-peers` skips them):
  HF generate  `transformers` generate with a static KV cache, same weights, same lengths
  torch update a PyTorch eager update of the same policy + value (fused AdamW where CUDA has it):
               clipped policy loss + value loss per minibatch, the same rows and minibatches.
  torch.compile update / experience (a child process with a time limit; with CUDA, or
               `--torch-compile on`): the same update with each decoder layer and the loss compiled
               (compile time recorded), and the four experience forwards likewise; a peer that cannot
               compile or run gets its reason in the JSON instead of figures.

FLOPs (stated in the output): N = matmul parameters of a model (every projection and the LM head;
not the embedding lookup); forward = 2·N per token + attention 4·T·H·Dh per token per layer (no causal
halving); training = 3 × forward. MFU = FLOPs / time / `--peak-tflops` (a table gives H100/H200/A100
and TPU figures by device kind; none on CPU). Roofline of a decode step = bytes that must move (the
policy's weights once + the KV cache written so far) / `--hbm-tbps`; the generate phase's time per
step includes its prefill, as HF generate's does.

    python bench/bench_accel.py --json accel.json                 # the profile's setup (bf16, 16-row minibatches)
    python bench/bench_accel.py --minibatch-rows 32 --remat dots   # 32-row minibatches
    python bench/bench_accel.py --param-dtype float32               # fp32 master weights, bf16 compute
    python bench/bench_accel.py --tiny                              # CPU smoke test (tiny Llama, seconds)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

# jax would otherwise take 75% of the GPU's memory at start-up, leaving the torch peers too little;
# on demand, peak_bytes_in_use still reports what ppo_jax needed.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Dense bf16 peak TFLOP/s and HBM TB/s by `device_kind` substring (vendor figures).
DEVICE_PEAKS = {
    "H200": (989.0, 4.8), "H100": (989.0, 3.35), "A100": (312.0, 2.0), "L4": (121.0, 0.3),
    "TPU v5p": (459.0, 2.76), "TPU v5 lite": (197.0, 0.82), "TPU v5e": (197.0, 0.82),
    "TPU v6": (918.0, 1.64), "TPU v4": (275.0, 1.2),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int

    def model_config(self, param_dtype: str, dtype: str, max_positions: int):
        from ppo_jax.models import ModelConfig

        return ModelConfig(arch="llama", vocab_size=self.vocab, hidden_size=self.hidden, num_layers=self.layers,
                           num_heads=self.heads, num_kv_heads=self.kv_heads, intermediate_size=self.mlp,
                           max_position_embeddings=max_positions, tie_word_embeddings=False,
                           param_dtype=param_dtype, dtype=dtype, pad_token_id=0, bos_token_id=1, eos_token_id=2)


# rollout.gemm's and ppo.gemm's choices (ppo_jax.sampling.config.GEMM_OPTIONS; written out so that
# the torch.compile worker, this file run as a child process, never imports jax).
GEMMS = ("auto", "cublas", "triton_exhaustive")

_T0 = time.perf_counter()


def progress(message: str) -> None:
    """A line on stderr at once, seconds since start: a run cut by its time limit still says how far
    it got (the 2026-11-28 gemm2 session's runs printed nothing before their limits)."""
    print(f"[{time.perf_counter() - _T0:.0f} s] {message}", file=sys.stderr, flush=True)


TINYLLAMA = Shape(vocab=32000, hidden=2048, layers=22, heads=32, kv_heads=4, mlp=5632)
TINY = Shape(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128)
# --model: Llama-3-8B's gate and up kernels (117 MB each) are past XLA's 32 MiB dot-merger limit, so its
# decode step is where compute.decode_projections matters (on one H200 with --layers 4).
MODELS = {"tinyllama-1.1b": TINYLLAMA,
          "llama3-8b": Shape(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336)}


# --------------------------------------------------------------------------------------------
# FLOPs and bytes.


def matmul_params(cfg, lm_head: bool) -> int:
    """Parameters that take part in a matmul per token, counted from the model's own parameter shapes
    (nothing allocated): every `kernel` (projections, and the LM head or the scalar head), plus the
    embedding when a tied LM head reuses it; norms, biases and the embedding lookup are not matmuls."""
    import jax

    from ppo_jax.models import CausalLM, ScalarModel, boxed_params

    module = CausalLM(cfg) if lm_head else ScalarModel(cfg)
    leaves = jax.tree_util.tree_flatten_with_path(boxed_params(module), is_leaf=_is_boxed)[0]
    kernels = sum(int(np.prod(_unbox(leaf).shape)) for path, leaf in leaves if _last_key(path) == "kernel")
    tied_head = cfg.vocab_size * cfg.hidden_size if lm_head and cfg.tie_word_embeddings else 0
    return kernels + tied_head


def _is_boxed(x) -> bool:
    return hasattr(x, "unbox")


def _unbox(x):
    return x.unbox() if _is_boxed(x) else x


def _last_key(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def forward_flops(cfg, lm_head: bool, rows: int, seq: int) -> float:
    """One forward over [rows, seq] tokens."""
    attention = 4 * seq * cfg.num_heads * cfg.dim_per_head * cfg.num_layers
    return rows * seq * (2 * matmul_params(cfg, lm_head) + attention)


def decode_bytes_per_step(cfg, rows: int, prompt: int, response: int) -> float:
    """Bytes one decode step must move on average: the policy's weights once, plus the KV cache
    written so far (read back by every step's attention)."""
    weights = cfg.num_params(with_lm_head=True) * np.dtype(cfg.jnp_param_dtype).itemsize
    per_token_kv = 2 * cfg.num_layers * cfg.kv_heads * cfg.dim_per_head * np.dtype(cfg.jnp_dtype).itemsize
    mean_length = prompt + (response - 1) / 2
    return weights + rows * mean_length * per_token_kv


# --------------------------------------------------------------------------------------------
# The models, as Hugging Face directories (both sides load the same weights).


def build_assets(shape: Shape, args, workdir: str) -> dict:
    """Random policy and reward model, exported by ppo_jax (no torch needed), with a word tokenizer of
    exactly `vocab` tokens; prompts of exactly `--prompt` tokens (no padding on either side)."""
    import jax

    from ppo_jax import sharding
    from ppo_jax.data import build_word_tokenizer
    from ppo_jax.models import CausalLM, ScalarModel, hf, init_params

    tokenizer = build_word_tokenizer([f"w{i}" for i in range(shape.vocab - 4)])
    assert len(tokenizer) == shape.vocab and tokenizer.pad_token_id == 0
    cfg = shape.model_config(args.param_dtype, args.dtype, args.prompt + args.response)
    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    paths = {"policy": os.path.join(workdir, "policy"), "reward": os.path.join(workdir, "reward")}
    for (name, module, kind), seed in zip((("policy", CausalLM(cfg), "causal_lm"),
                                           ("reward", ScalarModel(cfg), "reward")), (0, 1)):
        params, _ = init_params(module, jax.random.key(seed), mesh)
        hf.export_model(paths[name], cfg, params, kind=kind, tokenizer=tokenizer)
        del params
    rng = np.random.default_rng(0)
    words = rng.integers(0, shape.vocab - 4, size=(4 * args.rows, args.prompt))
    return {"tokenizer": tokenizer, "config": cfg, "paths": paths,
            "prompts": [" ".join(f"w{i}" for i in row) for row in words]}


# --------------------------------------------------------------------------------------------
# ppo_jax.


def ppo_jax_settings(args, assets):
    from ppo_jax.rl.settings import ppo_config

    c = ppo_config()
    c.policy.path, c.reward.path = assets["paths"]["policy"], assets["paths"]["reward"]
    # The run's dtypes, which the value and reward models follow: without them a bf16 checkpoint is
    # upcast to fp32 (the loader's default), and every GEMM of the 2026-11-26/27 H200 runs was TF32.
    c.policy.param_dtype, c.policy.dtype = args.param_dtype, args.dtype
    c.value.init = "reward"
    c.data.prompt_length = args.prompt
    c.data.truncation = "error"  # prompts are exactly --prompt tokens
    c.rollout.batch_size = args.rows
    c.rollout.response_length = args.response
    c.rollout.min_new_tokens = args.response  # full-length responses
    c.rollout.decode = args.decode
    c.ppo.epochs = 1
    c.ppo.num_minibatches = args.rows // args.minibatch_rows
    c.compute.attention, c.compute.layer_loop, c.compute.remat = args.attention, args.layer_loop, args.remat
    c.compute.decode_projections = args.decode_projections
    c.compute.precompile = args.precompile
    if args.packing is not None:
        c.ppo.packing = args.packing
    # Compile time is one of the figures: no cache unless --compilation-cache names one (a second
    # process with the same cache then shows what a rerun or a resume compiles).
    c.compute.compilation_cache = args.compilation_cache
    c.rollout.steps_per_sync = args.steps_per_sync
    c.rollout.gemm = args.sampler_gemm
    c.ppo.gemm = args.train_gemm
    c.train.iterations = 10**6  # the benchmark calls run_iteration() itself
    c.train.progress = False
    return c


def run_ppo_jax(args, assets, workdir: str, on_timed=lambda ours: None) -> dict:
    import jax

    from ppo_jax import sharding
    from ppo_jax.rl.trainer import PPOTrainer

    mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    t0 = time.perf_counter()
    trainer = PPOTrainer(ppo_jax_settings(args, assets), workdir, tokenizer=assets["tokenizer"],
                         prompts=assets["prompts"], mesh=mesh)
    start_s = time.perf_counter() - t0
    progress(f"trainer start {start_s:.1f} s")
    phases = ("time/generate", "time/experience", "time/update")
    rows = []
    for i in range(1 + args.iterations):
        t0 = time.perf_counter()
        m = trainer.run_iteration()
        rows.append({"wall": time.perf_counter() - t0, **{k: float(m[k]) for k in phases}})
        progress(f"iteration {i} ({'compiles' if i == 0 else 'steady'}): {rows[-1]['wall']:.2f} s, "
                 + ", ".join(f"{k[5:]} {rows[-1][k]:.2f} s" for k in phases))
        if m["response/length_mean"] != args.response:
            raise RuntimeError(f"responses averaged {m['response/length_mean']} tokens, expected {args.response}")
    first, steady = rows[0], rows[1:]
    median = {k: statistics.median(r[k] for r in steady) for k in first}
    stats = jax.devices()[0].memory_stats() or {}
    ours = {"trainer_start_s": start_s, "first": first, "median": median,
            "compile_s": {k: first[k] - median[k] for k in first},
            # compute.precompile: what compiling ahead took (inside the first iteration's wall, not its phases')
            "precompile": dataclasses.asdict(trainer.compile_report) if trainer.compile_report else None,
            "peak_bytes": stats.get("peak_bytes_in_use"), "trace_counts": dict(trainer.trace_counts),
            "model": dataclasses.asdict(trainer.policy_config), "profile": None,
            # compute.remat=auto on a GPU: the remat the update kept (rl/remat_choice.py), else None
            "update_remat": getattr(trainer.steps.update_jit, "chosen", None)}
    on_timed(ours)  # the timings are saved before the trace, which a device session's limit may cut
    if not args.no_decode_split:
        ours["decode"] = {}
        for gemm in dict.fromkeys([args.sampler_gemm, *args.gemm_ab]):  # the run's own choice first
            ours["decode"][gemm] = decode_split(trainer, args, assets, gemm)
            on_timed(ours)
    if args.profile:
        ours["profile"] = traced_iteration(trainer, args.profile)
    return ours


def sampler_inputs(trainer, args, assets) -> tuple:
    """(params, prompt tokens [rows, prompt], mask [rows, prompt], key) on the sampler's mesh: the
    trainer's current policy and the benchmark's first `--rows` prompts (no padding)."""
    import jax

    from ppo_jax import sharding

    mesh = trainer.meshes.sampler
    tokens = np.asarray(assets["tokenizer"](assets["prompts"][:args.rows], return_tensors="np")["input_ids"])
    assert tokens.shape == (args.rows, args.prompt), tokens.shape
    toks, mask = sharding.put_local_batch((tokens.astype(np.int32), np.ones_like(tokens, np.int32)), mesh)
    weights = trainer.sampler_weights()
    assert weights.adapters is None, "the benchmark decodes a full policy, no LoRA"
    return weights.params, toks, mask, sharding.replicate(jax.random.key(0), mesh)


def time_calls(call, calls: int = 5) -> tuple[float, float]:
    """(first call's seconds, compile included; median of `calls` more), each until the result is ready."""
    import jax

    times = []
    for _ in range(1 + calls):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def decode_split(trainer, args, assets, gemm: str) -> dict:
    """The decode loop's time per step apart from the prefill, for the sampler with GEMM choice `gemm`.

    Two generation lengths, N and 1, and their difference: the N = 1 program is the prefill and the
    first token's choice alone (`loop.sample` compiles no loop for it), and everything else both pay
    (dispatch, the input and output buffers, the key's split) cancels, which timing the prefill inside
    the N-step program could not separate from the loop. N - 1 rounded up to the loop's K steps per
    iteration is the number of decode steps the N program runs (every response is full length)."""
    from ppo_jax.sampling.loop import decode_steps

    full = trainer.sampler if gemm == trainer.sampler.config.gemm else trainer.sampler.with_config(gemm=gemm)
    prefill = full.with_config(max_new_tokens=1, min_new_tokens=min(1, full.config.min_new_tokens))
    inputs = sampler_inputs(trainer, args, assets)
    full_first, full_s = time_calls(lambda: full(*inputs))
    prefill_first, prefill_s = time_calls(lambda: prefill(*inputs))
    steps = decode_steps(full.config)
    per_step = (full_s - prefill_s) / steps
    print(f"  sampler gemm={gemm}: {full_s * 1e3:.1f} ms for {args.response} tokens, prefill {prefill_s * 1e3:.1f} ms, "
          f"decode {per_step * 1e3:.3f} ms/step over {steps} steps; compile {full_first - full_s:.1f} s "
          f"(prefill program {prefill_first - prefill_s:.1f} s)", flush=True)
    return {"gemm": gemm, "sampler_s": full_s, "prefill_s": prefill_s, "decode_steps": steps,
            "decode_s_per_step": per_step, "compile_s": full_first - full_s,
            "prefill_compile_s": prefill_first - prefill_s}


def traced_iteration(trainer, trace_dir: str) -> dict:
    """One more iteration under `jax.profiler.trace`, after the timed ones (tracing slows the host
    side): device busy time per XLA program and kind of kernel (bench/profile_summary.py), printed
    and returned; the trace itself stays in `trace_dir` for TensorBoard / Perfetto."""
    import jax

    import profile_summary

    with jax.profiler.trace(trace_dir):
        trainer.run_iteration()
    modules = profile_summary.summarize(trace_dir)
    print("\nDevice time of one traced iteration, by program and kernel kind (ms):")
    print(profile_summary.format_summary(modules, top=8))
    return {m.name: {"seconds": m.seconds, "events": m.events, "by_kind": dict(m.by_kind),
                     "top_ops": dict(m.by_op.most_common(20))} for m in modules.values()}


# --------------------------------------------------------------------------------------------
# The PyTorch peers (optional).


def torch_device_and_dtype(args):
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def run_hf_generate(args, assets) -> dict:
    """transformers' generate with a static cache: same weights, prompts and full-length responses."""
    import torch
    import transformers

    device, dtype = torch_device_and_dtype(args)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        assets["paths"]["policy"], dtype=dtype, attn_implementation="sdpa").to(device).eval()
    ids = assets["tokenizer"](assets["prompts"][:args.rows], return_tensors="pt").input_ids.to(device)

    def generate():
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=args.response,
                                 min_new_tokens=args.response, cache_implementation="static", pad_token_id=0)
        _sync(device)
        assert out.shape[1] == args.prompt + args.response

    times = []
    for _ in range(1 + args.iterations):
        t0 = time.perf_counter()
        generate()
        times.append(time.perf_counter() - t0)
    return {"first": times[0], "median": statistics.median(times[1:]), "device": device}


def load_update_models(args, paths: dict, device: str, dtype) -> tuple:
    """(policy, value backbone, value head) as the update peers train them: the benchmark's policy
    checkpoint, the reward checkpoint's backbone with a fresh scalar head (`value.init = "reward"`)."""
    import torch
    import transformers

    torch.manual_seed(0)
    policy = transformers.AutoModelForCausalLM.from_pretrained(
        paths["policy"], dtype=dtype, attn_implementation="sdpa").to(device)
    backbone = transformers.AutoModel.from_pretrained(
        paths["reward"], dtype=dtype, attn_implementation="sdpa").to(device)
    head = torch.nn.Linear(backbone.config.hidden_size, 1, dtype=dtype, device=device)
    return policy, backbone, head


def update_inputs(args, vocab: int, device: str) -> tuple:
    """Seeded update batch: tokens [rows, T], old log-probs, advantages, returns [rows, response]."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(4, vocab, (args.rows, args.prompt + args.response), generator=gen)
    old_logp = -torch.rand(args.rows, args.response, generator=gen) * 5
    advantages = torch.randn(args.rows, args.response, generator=gen)
    returns = torch.randn(args.rows, args.response, generator=gen)
    return tuple(x.to(device) for x in (tokens, old_logp, advantages, returns))


def ppo_losses(logits, values, tokens, old_logp, advantages, returns, prompt: int):
    """The peers' minibatch loss: clipped policy surrogate + 0.1 x value loss on the response tokens.
    logits [b, T, V], values [b, T - prompt] (positions prompt - 1 .. T - 2), tokens [b, T]; the rest
    [b, T - prompt]."""
    import torch

    logits = logits[:, prompt - 1:-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, prompt:, None]).squeeze(-1)
    ratio = torch.exp(logp - old_logp)
    policy_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2)).mean()
    value_loss = 0.5 * ((values.float() - returns) ** 2).mean()
    return policy_loss + 0.1 * value_loss


def timed_torch_update(args, models: tuple, inputs: tuple, device: str, losses=ppo_losses) -> dict:
    """1 + `--iterations` PPO updates (each the rows' minibatches: forward, backward, clipping, fused
    AdamW where CUDA has it), timed; `losses` is `ppo_losses` or its compiled version."""
    import torch

    policy, backbone, head = models
    params = [*policy.parameters(), *backbone.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-6, eps=1e-5, fused=device == "cuda")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens, old_logp, advantages, returns = inputs
    P = args.prompt

    def update():
        for start in range(0, args.rows, args.minibatch_rows):
            rows = slice(start, start + args.minibatch_rows)
            x = tokens[rows]
            values = head(backbone(x).last_hidden_state[:, P - 1:-1]).squeeze(-1)
            loss = losses(policy(x).logits, values, x, old_logp[rows], advantages[rows], returns[rows], P)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _sync(device)

    times = []
    for _ in range(1 + args.iterations):
        t0 = time.perf_counter()
        update()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return {"first": times[0], "median": statistics.median(times[1:]), "compile_s": times[0] - statistics.median(times[1:]),
            "peak_bytes": peak, "device": device}


def run_torch_update(args, assets) -> dict:
    """A PyTorch eager PPO update of policy + value: for each minibatch, the policy's clipped surrogate
    on the response tokens and the value model's squared error, one backward, clipping, AdamW."""
    device, dtype = torch_device_and_dtype(args)
    models = load_update_models(args, assets["paths"], device, dtype)
    return timed_torch_update(args, models, update_inputs(args, assets["config"].vocab_size, device), device)


# --------------------------------------------------------------------------------------------
# The torch.compile peers, in a child process with a time limit: a compile that hangs or takes longer
# than the device session allows cannot take ppo_jax's figures with it, and what it cannot do is
# written into the JSON as the reason.

TORCH_COMPILE_PEERS = ("torch_compile_update", "torch_compile_experience")


def compile_regions(*models) -> None:
    """torch.compile each decoder layer in place (regional compilation, torchtitan's choice), in
    inductor's default mode (no max-autotune: its compile alone would not fit a device session).
    Dynamo keeps one graph per layer index (on the H200, 23 graphs for the update: layer i of the
    policy and of the value share one, plus the loss), hence the raised recompile limit: at torch's
    default of 8 the later layers would run eager without a word."""
    import torch

    limits = ("recompile_limit", "cache_size_limit")  # the layers must not fall back to eager silently
    for name in limits:
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    for model in models:
        base = getattr(model, "model", model)  # a *ForCausalLM holds its decoder in .model
        for layer in base.layers:
            layer.compile()


def dynamo_stats() -> dict:
    """torch._dynamo's counters: compiled graphs, recompiles, graph breaks (a peer that fell back to
    eager shows here)."""
    from torch._dynamo.utils import counters

    return {group: dict(counters[group]) for group in ("stats", "recompiles", "graph_break") if counters[group]}


def torch_compile_update(args, paths: dict, vocab: int) -> tuple[dict, tuple]:
    """The eager peer's update with every decoder layer and the loss compiled (bf16, SDPA attention,
    fused AdamW): its timings (compile_s = first iteration - steady) and the models, for the next peer."""
    import torch

    device, dtype = torch_device_and_dtype(args)
    models = load_update_models(args, paths, device, dtype)
    compile_regions(models[0], models[1])
    result = timed_torch_update(args, models, update_inputs(args, vocab, device), device,
                                losses=torch.compile(ppo_losses))
    return {**result, "dynamo": dynamo_stats(), "mode": "regional: each decoder layer and the loss"}, models


def response_logprobs(logits, tokens, prompt: int):
    """log-probs [b, T - prompt] (fp32) of the response tokens under logits [b, T, V]."""
    import torch

    logits = logits[:, prompt - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, prompt:, None]).squeeze(-1)


def torch_compile_experience(args, models: tuple, vocab: int) -> dict:
    """The experience forwards, compiled layers and log-prob head: policy and reference log-probs,
    values and the reward model's score, on all rows at once (as ppo_jax's experience step). The
    reference and reward forwards reuse the policy's and the value's modules (the same shapes and FLOPs
    as the frozen copies ppo_jax holds; the weights are read once per forward either way)."""
    import torch

    device = torch_device_and_dtype(args)[0]
    policy, backbone, head = models
    tokens = update_inputs(args, vocab, device)[0]
    logprobs = torch.compile(response_logprobs)
    P = args.prompt

    def experience():
        with torch.inference_mode():
            out = [logprobs(policy(tokens).logits, tokens, P) for _ in ("policy", "reference")]
            hidden = [backbone(tokens).last_hidden_state for _ in ("value", "reward")]
            out += [head(hidden[0][:, P - 1:-1]), head(hidden[1][:, -1])]
        _sync(device)
        return out

    times = []
    for _ in range(1 + args.iterations):
        t0 = time.perf_counter()
        experience()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times[1:])
    return {"first": times[0], "median": median, "compile_s": times[0] - median, "dynamo": dynamo_stats()}


def torch_compile_worker(job_path: str) -> None:
    """The child process: both torch.compile peers, each result (or its error) written to the job's
    `out` file as soon as it is known."""
    import traceback

    with open(job_path) as f:
        job = json.load(f)
    args = argparse.Namespace(**job["args"])
    out: dict = {}

    def save():
        with open(job["out"], "w") as f:
            json.dump(out, f, default=str)

    def attempt(name: str, run):
        try:
            return run()
        except Exception as err:  # noqa: BLE001 - the reason goes into the JSON, the bench goes on
            traceback.print_exc()
            out[name] = {"error": f"{type(err).__name__}: {err}"[:4000]}
            return None
        finally:
            save()

    def update():
        out["torch_compile_update"], models = torch_compile_update(args, job["paths"], job["vocab"])
        return models

    models = attempt("torch_compile_update", update)
    if models is not None:
        attempt("torch_compile_experience",
                lambda: out.__setitem__("torch_compile_experience", torch_compile_experience(args, models, job["vocab"])))
    else:
        out["torch_compile_experience"] = {"error": "not run: the compiled update failed"}
        save()


def run_torch_compile_peers(args, assets, workdir: str) -> dict:
    """Both torch.compile peers in a child process (`--torch-compile-worker`) killed after
    `--torch-compile-timeout` s; a peer it did not finish gets {"error": why}."""
    import signal
    import subprocess

    job = {"args": vars(args), "paths": assets["paths"], "vocab": assets["config"].vocab_size,
           "out": os.path.join(workdir, "torch_compile.json")}
    job_path = os.path.join(workdir, "torch_compile_job.json")
    with open(job_path, "w") as f:
        json.dump(job, f, default=str)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--torch-compile-worker", job_path],
                            start_new_session=True)  # its own group: inductor's compile workers go with it

    def kill_group(*_):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    # A SIGTERM to this process (the session script's per-run `timeout`) must not leave the worker,
    # outside its process group, running on the GPU through the next runs.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: (kill_group(), sys.exit(128 + signum)))
    try:
        why = f"the worker exited with status {proc.wait(timeout=args.torch_compile_timeout)} before this peer finished"
    except subprocess.TimeoutExpired:
        kill_group()
        proc.wait()
        why = f"not finished within --torch-compile-timeout={args.torch_compile_timeout} s (compile and timed runs)"
    finally:
        signal.signal(signal.SIGTERM, previous)
        kill_group()  # inductor's compile workers, if any outlived the worker
    results = {}
    if os.path.exists(job["out"]):
        with open(job["out"]) as f:
            results = json.load(f)
    return {name: results.get(name, {"error": why}) for name in TORCH_COMPILE_PEERS}


def torch_compile_wanted(args) -> str | None:
    """None when the torch.compile peers should run, else why not (recorded in the JSON)."""
    import torch

    if args.torch_compile == "off":
        return "--torch-compile off"
    if args.torch_compile == "auto" and not torch.cuda.is_available():
        return "no CUDA device (--torch-compile on runs them on the CPU too)"
    return None


def release_torch_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# The report.


def device_peaks(args) -> tuple[float | None, float | None]:
    import jax

    kind = jax.devices()[0].device_kind
    known = next((v for k, v in DEVICE_PEAKS.items() if k.lower() in kind.lower()), (None, None))
    return args.peak_tflops or known[0], args.hbm_tbps or known[1]


def figures(args, cfg, ours: dict, peers: dict) -> dict:
    """Phase times -> tokens/s, MFU, roofline fraction, for ppo_jax and each peer."""
    peak_tflops, hbm_tbps = device_peaks(args)
    rows, T = args.rows, args.prompt + args.response
    flops = {
        "experience": forward_flops(cfg, True, rows, T) * 2 + forward_flops(cfg, False, rows, T) * 2,
        "update": 3 * (forward_flops(cfg, True, rows, T) + forward_flops(cfg, False, rows, T)),
    }
    step_bytes = decode_bytes_per_step(cfg, rows, args.prompt, args.response)

    def mfu(phase, seconds):
        return flops[phase] / seconds / (peak_tflops * 1e12) if peak_tflops else None

    def decode(seconds):
        per_step = seconds / args.response
        roofline = step_bytes / (hbm_tbps * 1e12) / per_step if hbm_tbps else None
        return {"seconds": seconds, "ms_per_step": 1e3 * per_step, "tokens_per_s": rows * args.response / seconds,
                "roofline_fraction": roofline}

    def decode_loop(split: dict) -> dict:
        per_step = split["decode_s_per_step"]
        roofline = step_bytes / (hbm_tbps * 1e12) / per_step if hbm_tbps and per_step > 0 else None
        return {"decode_ms_per_step": 1e3 * per_step, "decode_roofline_fraction": roofline,
                "prefill_ms": 1e3 * split["prefill_s"], "sampler_ms": 1e3 * split["sampler_s"],
                "compile_s": split["compile_s"], "prefill_compile_s": split["prefill_compile_s"]}

    med = ours["median"]
    splits = {gemm: decode_loop(split) for gemm, split in (ours.get("decode") or {}).items()}
    generate = decode(med["time/generate"])
    if args.sampler_gemm in splits:  # the trainer's own sampler: its decode loop apart from the prefill
        own = splits[args.sampler_gemm]
        generate.update(decode_ms_per_step=own["decode_ms_per_step"],
                        decode_roofline_fraction=own["decode_roofline_fraction"], prefill_ms=own["prefill_ms"])
    out = {"ppo_jax": {
        "generate": generate,
        "sampler_gemm": splits,
        "experience": {"seconds": med["time/experience"], "mfu": mfu("experience", med["time/experience"])},
        "update": {"seconds": med["time/update"], "mfu": mfu("update", med["time/update"]),
                   "tokens_per_s": rows * T / med["time/update"]},
        "iteration_seconds": med["wall"], "compile_s": ours["compile_s"], "trainer_start_s": ours["trainer_start_s"],
        "precompile": ours.get("precompile"),
        "peak_gib": ours["peak_bytes"] / 2**30 if ours["peak_bytes"] else None,
    }}
    if "hf_generate" in peers:
        out["hf_generate"] = decode(peers["hf_generate"]["median"])
    if "torch_update" in peers:
        t = peers["torch_update"]
        out["torch_update"] = {"seconds": t["median"], "mfu": mfu("update", t["median"]),
                               "peak_gib": t["peak_bytes"] / 2**30 if t["peak_bytes"] else None}
    if "torch_compile_update" in peers:
        t = peers["torch_compile_update"]
        out["torch_compile_update"] = {"error": t["error"]} if "error" in t else {
            "seconds": t["median"], "mfu": mfu("update", t["median"]), "compile_s": t["compile_s"],
            "peak_gib": t["peak_bytes"] / 2**30 if t["peak_bytes"] else None}
    if "torch_compile_experience" in peers:
        t = peers["torch_compile_experience"]
        out["torch_compile_experience"] = {"error": t["error"]} if "error" in t else {
            "seconds": t["median"], "mfu": mfu("experience", t["median"]), "compile_s": t["compile_s"]}
    out["flops"] = flops
    out["decode_bytes_per_step"] = step_bytes
    out["peaks"] = {"tflops": peak_tflops, "hbm_tbps": hbm_tbps}
    return out


def environment() -> dict:
    """Where and when the figures were measured: device, software, XLA flags, date, commit."""
    import subprocess
    import datetime

    import flax
    import jax

    # PPO_JAX_COMMIT first: a tree exported without .git (git archive) into a repository's folder would
    # otherwise report that repository's HEAD, not the code that ran (the 2026-11-28 session did).
    commit = os.environ.get("PPO_JAX_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                          capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"device_kind": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "device_count": jax.device_count(), "jax": jax.__version__, "flax": flax.__version__,
            "torch": _version("torch"), "transformers": _version("transformers"),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit}


def _version(distribution: str) -> str | None:
    """An installed distribution's version (the peers' software), None if absent."""
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fmt(x, spec=".3f", unit=""):
    return "—" if x is None else f"{x:{spec}}{unit}"


def print_table(args, fig: dict, ours: dict) -> None:
    import jax

    ppo = fig["ppo_jax"]
    print(f"\ndevice: {jax.devices()[0].device_kind} ({jax.default_backend()}); peaks {fig['peaks']}")
    model = ours["model"]  # what the trainer resolved, not what was asked for
    print(f"shape: {args.shape}, {model['param_dtype']} params / {model['dtype']} compute, {args.rows} rows × "
          f"({args.prompt} + {args.response}) tokens, minibatches of {args.minibatch_rows}; "
          f"attention={args.attention} ({model['attention']}) layer_loop={args.layer_loop} "
          f"(scan {model['scan_layers']}) remat={args.remat} ({model['remat_policy'] if model['remat'] else 'none'}"
          f"{'; update ' + ours['update_remat'] if ours.get('update_remat') else ''}) "
          f"decode={args.decode} decode_projections={args.decode_projections} gemm: sampler {args.sampler_gemm}, experience and update {args.train_gemm}")
    g = ppo["generate"]
    print(f"  generate    {g['seconds']:.3f} s  {g['ms_per_step']:.2f} ms/step  {g['tokens_per_s']:.0f} tok/s  "
          f"roofline {_fmt(g['roofline_fraction'], '.0%')}")
    if "hf_generate" in fig:
        h = fig["hf_generate"]
        print(f"    HF generate (static cache) {h['seconds']:.3f} s  {h['ms_per_step']:.2f} ms/step  "
              f"roofline {_fmt(h['roofline_fraction'], '.0%')}  -> ppo_jax {h['seconds'] / g['seconds']:.2f}×")
    for gemm, split in ppo["sampler_gemm"].items():
        print(f"    sampler alone, gemm={gemm}: decode {split['decode_ms_per_step']:.3f} ms/step, roofline "
              f"{_fmt(split['decode_roofline_fraction'], '.0%')}; prefill {split['prefill_ms']:.1f} ms; "
              f"compile {split['compile_s']:.1f} s + prefill program {split['prefill_compile_s']:.1f} s")
    e = ppo["experience"]
    print(f"  experience  {e['seconds']:.3f} s  MFU {_fmt(e['mfu'], '.1%')}  ({fig['flops']['experience']:.3g} FLOP)")
    _print_peer(fig, "torch_compile_experience", "torch.compile experience", e["seconds"])
    u = ppo["update"]
    print(f"  update      {u['seconds']:.3f} s  MFU {_fmt(u['mfu'], '.1%')}  ({fig['flops']['update']:.3g} FLOP)")
    if "torch_update" in fig:
        t = fig["torch_update"]
        print(f"    torch eager update {t['seconds']:.3f} s  MFU {_fmt(t['mfu'], '.1%')}  peak "
              f"{_fmt(t['peak_gib'], '.1f', ' GiB')}  -> ppo_jax {t['seconds'] / u['seconds']:.2f}×")
    _print_peer(fig, "torch_compile_update", "torch.compile update", u["seconds"])
    c = ppo["compile_s"]
    print(f"  iteration {ppo['iteration_seconds']:.3f} s; compile (first - steady) {c['wall']:.1f} s "
          f"(generate {c['time/generate']:.1f}, experience {c['time/experience']:.1f}, update {c['time/update']:.1f}); "
          f"trainer start {ppo['trainer_start_s']:.1f} s; peak {_fmt(ppo['peak_gib'], '.1f', ' GiB')}")
    if ppo.get("precompile"):
        ahead = ppo["precompile"]
        print(f"  compiled ahead, side by side: {ahead['wall_s']:.1f} s wall ("
              + ", ".join(f"{k} {v:.1f}" for k, v in ahead["seconds"].items()) + ")")
    if ours["trace_counts"] != {"experience": 1, "update": 1}:
        print(f"  WARNING: recompiled: {ours['trace_counts']}")


def _print_peer(fig: dict, name: str, label: str, ours_s: float) -> None:
    if name not in fig:
        return
    t = fig[name]
    if "error" in t:
        print(f"    {label}: {t['error'][:300]}")
        return
    print(f"    {label} {t['seconds']:.3f} s  MFU {_fmt(t['mfu'], '.1%')}  compile {t['compile_s']:.1f} s"
          f"  -> ppo_jax {t['seconds'] / ours_s:.2f}×")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny Llama, tiny batch")
    p.add_argument("--rows", type=int, default=None, help="prompts per iteration (default 64; tiny 4)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; tiny 8)")
    p.add_argument("--response", type=int, default=None, help="response tokens (default 128; tiny 8)")
    p.add_argument("--minibatch-rows", type=int, default=None, help="rows per minibatch (default 16; tiny 2)")
    p.add_argument("--iterations", type=int, default=3, help="steady iterations timed after the first")
    p.add_argument("--param-dtype", default="bfloat16", help="stored weights (float32 = fp32 master weights)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype")
    p.add_argument("--attention", default="auto")
    p.add_argument("--layer-loop", default="auto")
    p.add_argument("--remat", default="keep")
    p.add_argument("--decode", default="auto")
    p.add_argument("--decode-projections", default="auto", choices=("auto", "merged", "apart"),
                   help="compute.decode_projections: q/k/v and gate/up as one GEMM in a decode step")
    p.add_argument("--precompile", default="auto", choices=("auto", "on", "off"),
                   help="compute.precompile: the three programs compiled side by side before the first iteration")
    p.add_argument("--model", default="tinyllama-1.1b", choices=sorted(MODELS),
                   help="the model's shape (random weights); llama3-8b with --layers 4 fits the update on one H200")
    p.add_argument("--packing", choices=("on", "off"), default=None, help="ppo.packing (default: the library's)")
    p.add_argument("--steps-per-sync", type=int, default=0,
                   help="rollout.steps_per_sync: decode steps per test for stopped rows (0: the library's auto)")
    p.add_argument("--layers", type=int, default=None,
                   help="layers of the --model shape (default all: TinyLlama 22, Llama-3-8B 32): a slice of the model for quick A/B runs")
    p.add_argument("--compilation-cache", default="", metavar="DIR",
                   help="jax's persistent compilation cache (default: off, compile time being a figure)")
    p.add_argument("--sampler-gemm", default="auto", choices=GEMMS,
                   help="rollout.gemm: the sampler program's GEMM kernels on a GPU")
    p.add_argument("--train-gemm", default="auto", choices=GEMMS,
                   help="ppo.gemm: the experience and update programs' GEMM kernels on a GPU")
    p.add_argument("--gemm-ab", type=lambda v: [x for x in v.split(",") if x], default=[], metavar="LIST",
                   help="after the timed iterations, also time the sampler alone under these rollout.gemm "
                        "choices (comma-separated), each a program of its own in the same process; XLA's "
                        "in-process autotuning results may be reused for identical fusions, so a choice that "
                        "changes only the autotuning (triton_exhaustive) needs a process of its own "
                        "(--sampler-gemm)")
    p.add_argument("--no-decode-split", action="store_true",
                   help="skip timing the sampler alone at N and 1 new tokens (the decode loop apart from the prefill)")
    p.add_argument("--no-peers", action="store_true", help="skip HF generate and the torch updates")
    p.add_argument("--torch-compile", choices=("auto", "on", "off"), default="auto",
                   help="the torch.compile peers (update, experience): auto = with a CUDA device")
    p.add_argument("--torch-compile-timeout", type=float, default=150.0,
                   help="seconds for both torch.compile peers, compile included (a child process, then killed)")
    p.add_argument("--torch-compile-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak (default: by device kind)")
    p.add_argument("--hbm-tbps", type=float, default=None, help="device memory bandwidth (default: by kind)")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="trace one extra iteration into DIR and print its device time by program and kernel kind")
    args = p.parse_args(argv)
    if args.torch_compile_worker:
        return args
    unknown = set(args.gemm_ab) - set(GEMMS)
    if unknown:
        p.error(f"--gemm-ab: unknown choice(s) {sorted(unknown)}")
    defaults = dict(rows=4, prompt=8, response=8, minibatch_rows=2) if args.tiny else \
        dict(rows=64, prompt=128, response=128, minibatch_rows=16)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tiny and args.dtype == "bfloat16" and args.param_dtype == "bfloat16":
        args.param_dtype = args.dtype = "float32"  # CPUs compute bf16 slowly and the torch peer too
    args.shape = "tiny" if args.tiny else args.model + (f" ({args.layers} layers)" if args.layers else "")
    if args.rows % args.minibatch_rows:
        p.error(f"--rows={args.rows} must be a multiple of --minibatch-rows={args.minibatch_rows}")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.torch_compile_worker:
        return torch_compile_worker(args.torch_compile_worker)
    shape = TINY if args.tiny else MODELS[args.model]
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)
    with tempfile.TemporaryDirectory(prefix="bench_accel_") as workdir:
        progress(f"start: {shape}, gemm sampler {args.sampler_gemm}, experience and update {args.train_gemm}")
        assets = build_assets(shape, args, workdir)
        progress("assets built (random weights exported, tokenizer, prompts)")
        # The peers run first and hand their memory back (torch's cache emptied) before ppo_jax
        # starts; jax allocates on demand here (no preallocation, see the top), so both fit.
        peers = {}
        if not args.no_peers:
            if importlib.util.find_spec("torch") is None:
                print("torch is not installed: the peers are skipped", file=sys.stderr)
            else:
                import transformers

                transformers.logging.set_verbosity_error()  # the value backbone's unused score head
                peers["hf_generate"] = run_hf_generate(args, assets)
                peers["torch_update"] = run_torch_update(args, assets)
                release_torch_memory()
                why_not = torch_compile_wanted(args)
                peers.update({name: {"error": f"skipped: {why_not}"} for name in TORCH_COMPILE_PEERS} if why_not
                             else run_torch_compile_peers(args, assets, workdir))

        def save(ours: dict) -> dict:
            result = {"args": vars(args), "environment": environment(),
                      "figures": figures(args, assets["config"], ours, peers), "ppo_jax_raw": ours,
                      "peers_raw": peers}
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=2, default=str)
            return result

        result = save(run_ppo_jax(args, assets, os.path.join(workdir, "run"), on_timed=save))
    print_table(args, result["figures"], result["ppo_jax_raw"])
    return result


if __name__ == "__main__":
    main()
