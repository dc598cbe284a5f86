"""Seconds per PPO iteration: ppo_jax against TRL's PPO trainer (PyTorch CPU), same shapes, one run.

One PPO iteration = rollout (sampling) + scoring (old/reference log-probs, values, reward model)
+ KL-shaped rewards and GAE + `epochs` PPO epochs of updates on policy and value models.

Both trainers start from the same weights: a GPT-2-style policy (`GPT2LMHeadModel`) and a separate
reward model (`GPT2ForSequenceClassification`, 1 label), built with random weights by `transformers`
and saved to a temporary directory with a local word-level tokenizer (pad != eos). The value model
is a copy of the reward model in both trainers (ppo_jax `value.init="reward"`; TRL `value_model`
loaded from the reward directory).

Every response is exactly `response_length` tokens on both sides:
  * TRL: `stop_token_id=None`, so `generate` has no EOS and never stops early, and nothing is truncated.
  * ppo_jax: the stop token is EOS but `rollout.min_new_tokens = response_length`, so the sampler
    suppresses it at every step (no row ever stops; the script checks `response/length_mean`).

What is timed:
  * ppo_jax: wall time of `PPOTrainer.run_iteration()` (next prompt batch, sampling, experience step,
    update step, metrics to host), plus its own per-phase times (time/generate, time/experience,
    time/update). The first iteration compiles; compile time = first iteration - the median of the
    steady iterations of the same round (run right after it, under the same machine load).
  * TRL: `trl.experimental.ppo.PPOTrainer.train()` itself, untouched. A `TrainerCallback` stamps the
    clock at `on_train_begin` and at every `on_step_end` (called once per PPO iteration, after the
    update epochs, logging and the LR-scheduler step); one iteration = the interval between
    consecutive stamps. TRL runs `gc.collect()` twice per iteration (before the update epochs and
    right after `on_step_end`), so an interval holds both, except the first of each round (the
    previous round's trailing one falls between rounds). `train()` is called once per round with
    `total_episodes = batch_size * iterations_per_round`, so each call runs exactly that many
    iterations. TRL's generation and gc.collect() times are measured by wrapping its module-level
    `batch_generation` and `gc` (the wrappers only time the calls).
    TRL runs in float32 (`bf16=False`) without gradient checkpointing, like ppo_jax, with
    OMP_WAIT_POLICY=PASSIVE (see `set_omp_wait_policy`).
  * The two trainers alternate in rounds (TRL block, ppo_jax block, ...) so a change in machine load
    hits both sides; the medians are over all steady-state iterations, and the speed-up is also given
    per round (TRL's round median / ppo_jax's, from minutes of similar load). The first TRL iteration
    (PyTorch warm-up) is reported separately and excluded, like ppo_jax's compile.

Run (from the repository root, with the `[bench]` extra installed):
    python bench/bench_ppo.py                      # the issue's shapes, 3 rounds x 3 iterations
    python bench/bench_ppo.py --layers 1 --hidden 64 --vocab 512 --rounds 1 --iterations 2   # smoke test
    python bench/bench_ppo.py --arch qwen3_moe --layers 2 --hidden 128 --vocab 1024   # a tiny MoE policy
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

@dataclasses.dataclass(frozen=True)
class Shapes:
    layers: int
    hidden: int
    heads: int
    vocab: int
    batch: int
    prompt: int
    response: int
    epochs: int
    minibatches: int
    arch: str = "gpt2"  # "gpt2", or "qwen3_moe": 8 experts of `hidden`, 2 per token

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Shapes":
        """The shapes given by the `add_shape_arguments` flags."""
        return cls(*(getattr(args, f.name) for f in dataclasses.fields(cls)))


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The model and batch flags of the PPO benchmarks (defaults: the bench_ppo shapes)."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--minibatches", type=int, default=1)
    p.add_argument("--arch", choices=("gpt2", "qwen3_moe"), default="gpt2",
                   help="policy and reward architecture: GPT-2, or a Qwen3-MoE (8 experts of --hidden, top 2)")


@dataclasses.dataclass(frozen=True)
class Hyper:
    """Hyper-parameters given to both trainers (TRL's defaults where ppo_jax has a free choice)."""

    temperature: float = 0.7
    learning_rate: float = 3e-6  # policy and value (TRL: one optimizer over both)
    adam_eps: float = 1e-8
    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    clip_eps: float = 0.2
    value_clip: float = 0.2
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95
    seed: int = 0
    # TRL's loop calls optimizer.step() without clipping gradients, so ppo_jax clips nothing either.
    max_grad_norm: float = 0.0


# --------------------------------------------------------------------------------------------
# Shared assets: tokenizer, random HF models on disk, prompts.


def build_assets(shapes: Shapes, workdir: str) -> dict:
    """Word tokenizer of exactly `vocab` tokens; random GPT-2 policy and reward model saved with it."""
    import torch
    import transformers

    from ppo_jax.data import build_word_tokenizer

    specials = 4  # pad, bos, eos, unk (ids 0..3)
    tokenizer = build_word_tokenizer([f"w{i}" for i in range(shapes.vocab - specials)])
    assert len(tokenizer) == shapes.vocab, len(tokenizer)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id

    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    if shapes.arch == "qwen3_moe":
        config_class, lm_class = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
        reward_class = transformers.Qwen3MoeForSequenceClassification
        hf_config = dict(
            vocab_size=shapes.vocab, hidden_size=shapes.hidden, num_hidden_layers=shapes.layers,
            num_attention_heads=shapes.heads, num_key_value_heads=shapes.heads, intermediate_size=4 * shapes.hidden,
            moe_intermediate_size=shapes.hidden, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            max_position_embeddings=shapes.prompt + shapes.response, tie_word_embeddings=False, **ids)
    else:
        config_class, lm_class = transformers.GPT2Config, transformers.GPT2LMHeadModel
        reward_class = transformers.GPT2ForSequenceClassification
        hf_config = dict(
            vocab_size=shapes.vocab, n_embd=shapes.hidden, n_layer=shapes.layers, n_head=shapes.heads,
            n_positions=shapes.prompt + shapes.response, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    torch.manual_seed(0)
    policy = lm_class(config_class(**hf_config))
    torch.manual_seed(1)
    reward = reward_class(config_class(**hf_config, num_labels=1))
    paths = {"policy": os.path.join(workdir, "policy"), "reward": os.path.join(workdir, "reward")}
    for name, model in (("policy", policy), ("reward", reward)):
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])

    # Prompts of exactly `prompt` words = `prompt` tokens: no padding on either side.
    rng = np.random.default_rng(0)
    words = rng.integers(0, shapes.vocab - specials, size=(8 * shapes.batch, shapes.prompt))
    prompts = [" ".join(f"w{i}" for i in row) for row in words]
    return {"tokenizer": tokenizer, "paths": paths, "prompts": prompts,
            "num_params": {"policy": sum(p.numel() for p in policy.parameters()),
                           "reward": sum(p.numel() for p in reward.parameters())}}


# --------------------------------------------------------------------------------------------
# ppo_jax.


class JaxSide:
    def __init__(self, shapes: Shapes, hp: Hyper, assets: dict, workdir: str):
        import jax

        from ppo_jax import sharding
        from ppo_jax.rl.settings import ppo_config
        from ppo_jax.rl.trainer import PPOTrainer

        c = ppo_config()
        c.seed = hp.seed
        c.policy.path = assets["paths"]["policy"]
        c.reward.path = assets["paths"]["reward"]
        c.value.init = "reward"
        c.data.prompt_length = shapes.prompt
        c.data.truncation = "error"  # prompts are exactly prompt_length tokens; anything else is a bug here
        c.rollout.batch_size = shapes.batch
        c.rollout.response_length = shapes.response
        c.rollout.min_new_tokens = shapes.response  # EOS suppressed at every step: full-length responses
        c.rollout.temperature = hp.temperature
        c.ppo.advantage_estimator = "gae"
        c.ppo.epochs = shapes.epochs
        c.ppo.num_minibatches = shapes.minibatches
        c.ppo.num_microbatches = 1
        c.ppo.clip_eps = hp.clip_eps
        c.ppo.value_clip = hp.value_clip
        c.ppo.vf_coef = hp.vf_coef
        c.ppo.gamma = hp.gamma
        c.ppo.lam = hp.lam
        c.ppo.kl_coef = hp.kl_coef
        c.ppo.kl_estimator = hp.kl_estimator
        c.ppo.whiten_advantages = True
        c.ppo.whiten_rewards = False
        c.optim.policy_lr = hp.learning_rate
        c.optim.value_lr = hp.learning_rate
        c.optim.eps = hp.adam_eps
        c.optim.max_grad_norm = hp.max_grad_norm
        c.optim.schedule = "constant"
        c.train.iterations = 10**6  # never reached: the benchmark calls run_iteration() itself
        c.train.progress = False
        self.shapes = shapes
        self.mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
        t0 = time.perf_counter()
        self.trainer = PPOTrainer(c, workdir, tokenizer=assets["tokenizer"], prompts=assets["prompts"],
                                  mesh=self.mesh)
        self.setup_s = time.perf_counter() - t0
        self.first: dict | None = None
        self.steady: list[dict] = []
        self.rounds: list[list[dict]] = []  # steady iterations of each round

    def iteration(self) -> dict:
        t0 = time.perf_counter()
        metrics = self.trainer.run_iteration()
        wall = time.perf_counter() - t0
        length = metrics["response/length_mean"]
        if length != self.shapes.response:
            raise RuntimeError(f"ppo_jax responses averaged {length} tokens, expected {self.shapes.response}")
        return {"wall": wall, **{k: metrics[k] for k in ("time/generate", "time/experience", "time/update")}}

    def run(self, iterations: int) -> None:
        if self.first is None:
            self.first = self.iteration()
        self.rounds.append([self.iteration() for _ in range(iterations)])
        self.steady.extend(self.rounds[-1])

    def summary(self) -> dict:
        med = {k: statistics.median(r[k] for r in self.steady) for k in self.steady[0]}
        traces = dict(self.trainer.trace_counts)
        if traces != {"experience": 1, "update": 1}:
            raise RuntimeError(f"ppo_jax recompiled: trace counts {traces}")
        # Compile = first iteration - the steady iterations that ran right after it (same round, so
        # the same machine load; the all-rounds median may come from a differently loaded minute).
        round0 = statistics.median(r["wall"] for r in self.rounds[0])
        return {"setup_s": self.setup_s, "first_iteration": self.first, "steady_median": med,
                "steady_all_wall": [r["wall"] for r in self.steady],
                "round_medians": [statistics.median(r["wall"] for r in rnd) for rnd in self.rounds],
                "compile_s": self.first["wall"] - round0, "trace_counts": traces}


# --------------------------------------------------------------------------------------------
# TRL.


class TrlSide:
    def __init__(self, shapes: Shapes, hp: Hyper, assets: dict, workdir: str, iterations_per_round: int):
        import datasets
        import torch
        import transformers
        from trl.experimental.ppo import PPOConfig, PPOTrainer
        from trl.experimental.ppo import ppo_trainer as trl_ppo_module

        self.shapes = shapes
        self.generate_s: list[float] = []
        self.gc_s: list[float] = [0.0]  # gc.collect() seconds of the iteration in progress
        self.iteration_s: list[float] = []
        self.round_bounds: list[int] = []  # index of each round's first iteration in iteration_s

        # Time TRL's own generation call without changing it.
        original = trl_ppo_module.batch_generation
        side = self

        def timed_batch_generation(*args, **kwargs):
            t0 = time.perf_counter()
            query_responses, logits = original(*args, **kwargs)
            side.generate_s.append(time.perf_counter() - t0)
            expected = shapes.prompt + shapes.response
            if query_responses.shape[1] != expected:
                raise RuntimeError(f"TRL generated {query_responses.shape[1] - shapes.prompt} tokens, "
                                   f"expected {shapes.response}")
            return query_responses, logits

        trl_ppo_module.batch_generation = timed_batch_generation

        # TRL calls gc.collect() twice per iteration; its cost grows with everything alive in the
        # process (here also ppo_jax's trainer), so it is timed and reported separately.
        import gc as real_gc

        class TimedGc:
            def __getattr__(self, name):
                return getattr(real_gc, name)

            def collect(self, *args):
                t0 = time.perf_counter()
                out = real_gc.collect(*args)
                side.gc_s[-1] += time.perf_counter() - t0
                return out

        trl_ppo_module.gc = TimedGc()

        class IterationClock(transformers.TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                side._last = time.perf_counter()
                side.round_bounds.append(len(side.iteration_s))
                side.gc_s[-1] = 0.0  # the previous round's trailing gc.collect() is outside every interval

            def on_step_end(self, args, state, control, **kwargs):
                now = time.perf_counter()
                side.iteration_s.append(now - side._last)
                side._last = now
                side.gc_s.append(0.0)

        tokenizer = assets["tokenizer"]
        ids = tokenizer(assets["prompts"])["input_ids"]
        assert all(len(row) == shapes.prompt for row in ids)
        dataset = datasets.Dataset.from_dict({"input_ids": ids})
        t0 = time.perf_counter()
        lm, scorer = transformers.AutoModelForCausalLM, transformers.AutoModelForSequenceClassification
        policy = lm.from_pretrained(assets["paths"]["policy"])
        ref_policy = lm.from_pretrained(assets["paths"]["policy"])
        reward = scorer.from_pretrained(assets["paths"]["reward"])
        value = scorer.from_pretrained(assets["paths"]["reward"])
        self.attn_implementation = policy.config._attn_implementation
        self.config = PPOConfig(
            output_dir=os.path.join(workdir, "trl_out"),
            per_device_train_batch_size=shapes.batch,
            gradient_accumulation_steps=1,
            num_mini_batches=shapes.minibatches,
            num_ppo_epochs=shapes.epochs,
            local_rollout_forward_batch_size=shapes.batch,  # one forward per phase, like ppo_jax
            total_episodes=shapes.batch * iterations_per_round,
            response_length=shapes.response,
            stop_token_id=None,  # no stop token: generate never stops early, nothing truncated
            temperature=hp.temperature,
            learning_rate=hp.learning_rate,
            adam_epsilon=hp.adam_eps,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            kl_coef=hp.kl_coef,
            kl_estimator=hp.kl_estimator,
            cliprange=hp.clip_eps,
            cliprange_value=hp.value_clip,
            vf_coef=hp.vf_coef,
            gamma=hp.gamma,
            lam=hp.lam,
            whiten_rewards=False,
            missing_eos_penalty=None,
            num_sample_generations=0,  # no extra debugging generations inside the timed loop
            bf16=False,  # float32 like ppo_jax (TRL's default would be bf16 autocast)
            gradient_checkpointing=False,  # ppo_jax does not rematerialise either (TRL default: on)
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=hp.seed,
        )
        self.trainer = PPOTrainer(
            args=self.config, processing_class=tokenizer, model=policy, ref_model=ref_policy,
            # eval_dataset is never read (num_sample_generations=0); TRL builds a DataLoader over it.
            reward_model=reward, train_dataset=dataset, value_model=value, eval_dataset=dataset,
            callbacks=[IterationClock()])
        # Silence per-iteration log printing (TRL's self.log still runs; only the printer goes).
        self.trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        self.trainer.remove_callback(transformers.trainer_callback.ProgressCallback)
        self.setup_s = time.perf_counter() - t0
        self.torch_threads = torch.get_num_threads()

    def run(self, iterations: int) -> None:
        assert self.config.num_total_batches == iterations, (self.config.num_total_batches, iterations)
        self.trainer.train()

    def summary(self) -> dict:
        first, steady = self.iteration_s[0], self.iteration_s[1:]
        steady_gen = self.generate_s[1:]
        steady_gc = self.gc_s[1:len(self.iteration_s)]
        bounds = self.round_bounds + [len(self.iteration_s)]
        rounds = [self.iteration_s[max(a, 1):b] for a, b in zip(bounds, bounds[1:])]  # first one excluded
        return {"setup_s": self.setup_s, "first_iteration_s": first,
                "round_medians": [statistics.median(r) for r in rounds],
                "steady_median": {"wall": statistics.median(steady),
                                  "generate": statistics.median(steady_gen),
                                  "gc_collect": statistics.median(steady_gc)},
                "steady_all_wall": steady, "torch_threads": self.torch_threads,
                "attn_implementation": self.attn_implementation}


# --------------------------------------------------------------------------------------------


def set_omp_wait_policy(policy: str) -> None:
    """Sets libgomp's OMP_WAIT_POLICY for PyTorch; it is read once, when torch loads.

    PyTorch's CPU kernels run on libgomp (OpenMP), whose default wait policy spins on barriers. On a
    machine whose cores are shared with other work (load above the core count) every small parallel
    op then waits for a descheduled spinning thread: measured on the 2-core benchmark machine at load
    ~7, a [128,64]x[64,256] addmm took 20 ms with the default and 0.3 ms with PASSIVE (large matmuls:
    the same speed either way). PASSIVE is the faster setting for TRL, so it is the default here. XLA's
    CPU backend does not use OpenMP, so ppo_jax is unaffected.
    """
    if not policy:
        return
    if "torch" in sys.modules and os.environ.get("OMP_WAIT_POLICY") != policy:
        raise RuntimeError(f"torch is already imported: OMP_WAIT_POLICY={policy} would have no effect; "
                           "run this script as the main program")
    os.environ["OMP_WAIT_POLICY"] = policy


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "trl", "accelerate"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(p)
    p.add_argument("--rounds", type=int, default=3, help="alternating TRL / ppo_jax blocks")
    p.add_argument("--iterations", type=int, default=3, help="PPO iterations per side per round")
    p.add_argument("--torch-omp-wait-policy", default="PASSIVE",
                   help="OMP_WAIT_POLICY for PyTorch (read before torch loads); '' = leave unset")
    p.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads; 0 = torch's default")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    shapes = Shapes.from_args(args)
    hp = Hyper()
    set_omp_wait_policy(args.torch_omp_wait_policy)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    loads = [("start", os.getloadavg())]

    with tempfile.TemporaryDirectory(prefix="bench_ppo_") as tmp:
        assets = build_assets(shapes, tmp)
        jax_side = JaxSide(shapes, hp, assets, os.path.join(tmp, "jax_workdir"))
        trl_side = TrlSide(shapes, hp, assets, tmp, args.iterations)
        for r in range(args.rounds):
            trl_side.run(args.iterations)
            loads.append((f"round {r} after TRL", os.getloadavg()))
            jax_side.run(args.iterations)
            loads.append((f"round {r} after ppo_jax", os.getloadavg()))
            print(f"round {r}: TRL {['%.2f' % s for s in trl_side.iteration_s[-args.iterations:]]} s, "
                  f"ppo_jax {['%.2f' % s['wall'] for s in jax_side.steady[-args.iterations:]]} s, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
        results = {"shapes": dataclasses.asdict(shapes), "hyper": dataclasses.asdict(hp),
                   "num_params": assets["num_params"], "ppo_jax": jax_side.summary(), "trl": trl_side.summary(),
                   "loadavg": loads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""), "cpus": os.cpu_count(), "versions": versions(),
                   "command": " ".join([os.path.basename(sys.executable), *sys.argv])}

    j, t = results["ppo_jax"], results["trl"]
    ratio = t["steady_median"]["wall"] / j["steady_median"]["wall"]
    round_ratios = [a / b for a, b in zip(t["round_medians"], j["round_medians"])]
    results["speedup"] = ratio
    results["speedup_per_round"] = round_ratios
    jm = j["steady_median"]
    print()
    print(f"shapes: {results['shapes']}")
    print(f"params: policy {assets['num_params']['policy']:,}, reward/value {assets['num_params']['reward']:,}")
    print(f"steady-state iterations per side: {len(j['steady_all_wall'])} (ppo_jax), "
          f"{len(t['steady_all_wall'])} (TRL)")
    print(f"ppo_jax  s/iteration (median): {jm['wall']:.3f}  "
          f"[generate {jm['time/generate']:.3f}, experience {jm['time/experience']:.3f}, "
          f"update {jm['time/update']:.3f}]")
    print(f"ppo_jax  first iteration {j['first_iteration']['wall']:.2f} s -> compile ~{j['compile_s']:.2f} s "
          f"(generate {j['first_iteration']['time/generate']:.2f}, experience "
          f"{j['first_iteration']['time/experience']:.2f}, update {j['first_iteration']['time/update']:.2f}); "
          f"setup {j['setup_s']:.2f} s")
    print(f"TRL      s/iteration (median): {t['steady_median']['wall']:.3f}  "
          f"[generate {t['steady_median']['generate']:.3f}, rest "
          f"{t['steady_median']['wall'] - t['steady_median']['generate']:.3f}, of which gc.collect "
          f"{t['steady_median']['gc_collect']:.3f}]; first iteration "
          f"{t['first_iteration_s']:.2f} s; setup {t['setup_s']:.2f} s; torch threads {t['torch_threads']}, "
          f"attention {t['attn_implementation']}, OMP_WAIT_POLICY={results['omp_wait_policy'] or 'unset'}")
    print(f"speed-up ppo_jax vs TRL (TRL s / ppo_jax s): {ratio:.2f}x over all steady iterations; per round "
          f"{', '.join(f'{x:.2f}x' for x in round_ratios)} (round medians: TRL "
          f"{', '.join(f'{x:.2f}' for x in t['round_medians'])} s, ppo_jax "
          f"{', '.join(f'{x:.2f}' for x in j['round_medians'])} s)")
    print(f"load average (1 min) during the run: "
          f"{min(l[1][0] for l in loads):.2f} .. {max(l[1][0] for l in loads):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
