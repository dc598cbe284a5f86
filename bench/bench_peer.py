"""The demo's problem in a peer: ppo_jax's PPO, GRPO and DPO against TRL's, paired seed by seed (issue 62).

Per seed: the demo's SFT policy, preference pairs and reward model (`ppo_jax.demo.stages`, run once
and reused from the workdir), then six training runs from those exports, then one judge for all six:

  ppo_jax  ppo   the demo's PPO stage (`DemoSettings.ppo_stage`: 120 iterations of 64 prompts, ...)
  ppo_jax  grpo  the same with the methods table's GRPO (16 prompts x 4 samples = the same 64 rows)
  ppo_jax  dpo   the demo's DPO stage on the reward model's 6,144 pairs (beta 0.3, 300 steps of 64)
  trl      ppo   trl.experimental.ppo.PPOTrainer: policy and reference from the SFT export, reward
                 and value models from the reward-model export
  trl      grpo  trl.GRPOTrainer, the reward model (and the KL leash, as ppo_jax puts it in the
                 sequence reward) as its reward function
  trl      dpo   trl.DPOTrainer on the same pairs, tokenised as ppo_jax tokenises them

Every TRL field is set from the ppo_jax setting it pairs with (`PAIRS`; what cannot be matched is
`DIFFERENCES`; `--fields` prints both as the docs' table). Every final policy is exported as a
Hugging Face directory and judged by the demo's own evaluator (`PolicyEvaluator` on a PPO trainer
built as the demo's PPO stage, its policy replaced): the same 256 held-out prompts, sampling keys
and gold reward, KL (k1) to the SFT policy. gap_closed = (gold - SFT gold) / (best - SFT gold), the
SFT gold measured by the same judge. max_kl: the largest mean KL to the SFT policy of one
iteration's training rollouts (nats per response, summed k1, as the demo's max_rollout_kl; none for
DPO). seconds: the training run's wall time, from building the trainer (models loaded, programs
compiled) to its exported policy, without the judge, less any time the process was stopped
(`PauseClock`; paused_seconds, wall_seconds and cpu_seconds beside it).

Resumable: every finished (library, method, seed) goes into the JSON at once and is never run again;
a seed with all six is skipped, stages included; a stage whose outputs exist in the workdir is
reused; a run cut short is started over in a clean directory.

    pip install -e ".[bench]"       # in a venv of its own: trl==0.29.1 (TRL 1.x has no PPO trainer)
    python bench/bench_peer.py --seeds=5                              # -> bench/results/<date>-cpu-peer.json
    python bench/bench_peer.py --seeds=5 --table                      # the docs' results tables
    python bench/bench_peer.py --fields                               # the docs' field table
    python bench/bench_peer.py --seeds=1 --quick                      # smoke run: the reduced demo, labelled so

Flags: --libraries, --methods (subsets), --workdir (default runs/peer; runs/peer_quick with
--quick), --json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

LIBRARIES = ("ppo_jax", "trl")
METHODS = ("ppo", "grpo", "dpo")
ENTRY_KEYS = ("seed", "gap_closed", "kl", "max_kl", "seconds")
GRPO_GROUP = 4  # samples per prompt of the methods table's GRPO (docs/demo.md)
HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------------------------
# Settings: the demo's, per method, and TRL's paired with them field by field.


def demo_settings(seed: int, quick: bool, overrides: Sequence[str] = ()):
    """The demo's settings for `seed` (`--quick`: the reduced demo, `configs/demo_small.py`), with
    demo-config overrides FIELD=VALUE (`--override`, e.g. ppo.ppo.dense_kl_coef=0.0)."""
    from ppo_jax.demo.settings import DemoSettings, get_config, small_config

    c = small_config() if quick else get_config()
    c.seed, c.progress, c.plots = seed, False, False
    for item in overrides:  # as bench/demo_ppo_stage.py's
        name, value = item.split("=", 1)
        *path, last = name.split(".")
        node = c
        for part in path:
            node = node[part]
        current = node[last]
        node[last] = value == "True" if isinstance(current, bool) else type(current)(value)
    return DemoSettings.from_config(c)


# The demo sections the stages read (SFT, preferences, reward model): what a seed's workdir is made with.
STAGE_SECTIONS = ("seed", "prompt_length", "world", "corpus", "sft", "preferences", "reward_model")


def ppo_jax_settings(method: str, demo, sft_dir: str = "<sft>/hf", rm_dir: str = "<reward_model>/hf"):
    """ppo_jax's settings of one method: the demo's PPO stage, the methods table's GRPO (the same
    rows per iteration in groups of GRPO_GROUP), the demo's DPO stage."""
    if method == "dpo":
        d = demo.dpo_stage(sft_dir)
        return dataclasses.replace(d, train=dataclasses.replace(d.train, progress=False))
    s = demo.ppo_stage(sft_dir, rm_dir)
    if method == "grpo":
        r = s.rollout
        if r.batch_size % GRPO_GROUP:
            raise ValueError(f"ppo.rollout.batch_size={r.batch_size} is not a multiple of {GRPO_GROUP}")
        s = s.replace(ppo=dataclasses.replace(s.ppo, advantage_estimator="grpo"),
                      rollout=dataclasses.replace(r, num_samples=GRPO_GROUP, batch_size=r.batch_size // GRPO_GROUP))
    return s


def field(settings, dotted: str):
    node = settings
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def flat_fields(obj, prefix: str = "") -> dict[str, Any]:
    """Nested dataclasses -> {dotted field: value} of their leaves."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(flat_fields(value, name + "."))
        else:
            out[name] = value
    return out


def _same(value, settings):
    return value


def _updates_per_iteration(s) -> int:
    return s.ppo.epochs * s.ppo.num_minibatches


@dataclasses.dataclass(frozen=True)
class Pair:
    """One ppo_jax setting and the TRL field set from it: TRL value = convert(ppo_jax value, settings).
    argument: the TRL side is a trainer argument (a model), not a config field."""

    ours: str
    theirs: str
    convert: Callable[[Any, Any], Any] = _same
    note: str = ""
    argument: bool = False


@dataclasses.dataclass(frozen=True)
class Difference:
    """What could not be matched: the ppo_jax side, the TRL side, and what it means."""

    ours: str  # a ppo_jax field ("" when it is no field of ours)
    ppo_jax: str
    trl: str
    note: str


_SHARED_OPTIM = [
    Pair("optim.eps", "adam_epsilon"), Pair("optim.b1", "adam_beta1"), Pair("optim.b2", "adam_beta2"),
    Pair("optim.weight_decay", "weight_decay"),
]

PAIRS: dict[str, list[Pair]] = {
    "ppo": [
        Pair("seed", "seed"),
        Pair("policy.path", "PPOTrainer(model=, ref_model=)", note="two copies of the SFT export", argument=True),
        Pair("reward.path", "PPOTrainer(reward_model=)", note="the reward-model export (normalisation folded in)",
             argument=True),
        Pair("value.init", "PPOTrainer(value_model=)", note="'reward': a copy of the reward-model export", argument=True),
        Pair("rollout.batch_size", "per_device_train_batch_size", note="prompts per iteration (gradient_accumulation_steps=1)"),
        Pair("rollout.forward_microbatch", "local_rollout_forward_batch_size", lambda v, s: v or s.rollout.batch_size,
             note="0 = the whole batch in one forward"),
        Pair("train.iterations", "total_episodes", lambda v, s: v * s.rollout.batch_size,
             note="iterations x prompts"),
        Pair("rollout.response_length", "response_length"),
        Pair("rollout.temperature", "temperature"),
        Pair("rollout.stop_token_ids", "stop_token", lambda v, s: "eos" if v == "" else None,
             note="'' = the tokenizer's EOS"),
        Pair("reward.missing_stop", "missing_eos_penalty", lambda v, s: None if v == "none" else s.reward.missing_stop_value),
        Pair("ppo.epochs", "num_ppo_epochs"),
        Pair("ppo.num_minibatches", "num_mini_batches"),
        Pair("ppo.num_microbatches", "gradient_accumulation_steps"),
        Pair("ppo.clip_eps", "cliprange"),
        Pair("ppo.value_clip", "cliprange_value"),
        Pair("ppo.vf_coef", "vf_coef"),
        Pair("ppo.gamma", "gamma"),
        Pair("ppo.lam", "lam"),
        Pair("ppo.kl_coef", "kl_coef"),
        Pair("ppo.kl_estimator", "kl_estimator"),
        Pair("ppo.whiten_rewards", "whiten_rewards"),
        Pair("optim.policy_lr", "learning_rate", note="one AdamW over policy and value in TRL: policy_lr = value_lr"),
        Pair("optim.value_lr", "learning_rate"),
        Pair("optim.schedule", "lr_scheduler_type",
             lambda v, s: {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[v]),
        Pair("optim.warmup_steps", "warmup_steps", lambda v, s: v // _updates_per_iteration(s),
             note="TRL steps its scheduler once per iteration: optimizer steps / (epochs x minibatches)"),
        *_SHARED_OPTIM,
    ],
    "grpo": [
        Pair("seed", "seed"),
        Pair("ppo.advantage_estimator", "GRPOTrainer", note="'grpo': group-normalised sequence rewards", argument=True),
        Pair("policy.path", "GRPOTrainer(model=)", note="the SFT export", argument=True),
        Pair("reward.path", "GRPOTrainer(reward_funcs=)", note="the reward-model export scores the sampled token ids "
             "(EOS kept), minus the KL leash: see ppo.kl_coef", argument=True),
        Pair("rollout.num_samples", "num_generations"),
        Pair("rollout.batch_size", "per_device_train_batch_size",
             lambda v, s: v * s.rollout.num_samples // s.ppo.num_minibatches,
             note="rows per optimizer step = prompts x samples / minibatches; TRL's generation_batch_size = this x "
                  "steps_per_generation = the iteration's rows (checked)"),
        Pair("ppo.num_minibatches", "steps_per_generation"),
        Pair("ppo.num_microbatches", "gradient_accumulation_steps"),
        Pair("ppo.epochs", "num_iterations"),
        Pair("train.iterations", "max_steps", lambda v, s: v * _updates_per_iteration(s),
             note="optimizer steps: iterations x epochs x minibatches"),
        Pair("rollout.response_length", "max_completion_length"),
        Pair("rollout.temperature", "temperature"),
        Pair("rollout.top_k", "top_k"),
        Pair("rollout.top_p", "top_p"),
        Pair("ppo.clip_eps", "epsilon"),
        Pair("ppo.clip_eps_high", "epsilon_high", lambda v, s: v or None),
        Pair("ppo.grpo_divide_by_std", "scale_rewards", lambda v, s: "group" if v else "none"),
        Pair("ppo.loss_aggregation", "loss_type", lambda v, s: {"auto": "bnpo", "token_mean": "bnpo"}[v],
             note="token_mean over the minibatch = TRL's bnpo (its default dapo divides by the tokens of the whole "
                  "generation batch, here twice a minibatch's)"),
        Pair("ppo.kl_in_reward", "beta", lambda v, s: 0.0 if v else s.ppo.kl_coef,
             note="KL in the reward: no KL loss term in TRL (beta 0)"),
        Pair("ppo.kl_coef", "reward function: score - kl_coef x sum k1", note="ppo_jax's sequence reward R = score - "
             "kl_coef x sum of k1 over the response, computed by the reward function with the live policy and an SFT "
             "copy", argument=True),
        Pair("optim.policy_lr", "learning_rate"),
        Pair("optim.schedule", "lr_scheduler_type",
             lambda v, s: {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[v]),
        Pair("optim.warmup_steps", "warmup_steps", note="per optimizer step on both sides"),
        Pair("optim.max_grad_norm", "max_grad_norm"),
        *_SHARED_OPTIM,
    ],
    "dpo": [
        Pair("seed", "seed"),
        Pair("model.path", "DPOTrainer(model=)", note="the SFT export; TRL copies it as the reference", argument=True),
        Pair("train.batch_size", "per_device_train_batch_size"),
        Pair("train.num_microbatches", "gradient_accumulation_steps"),
        Pair("train.steps", "max_steps"),
        Pair("loss.type", "loss_type"),
        Pair("loss.beta", "beta"),
        Pair("loss.label_smoothing", "label_smoothing"),
        Pair("data.max_prompt_length", "max_length", lambda v, s: v + s.data.max_response_length,
             note="the pairs are tokenised by ppo_jax's PromptTokenizer (prompt <= 10, answer <= 16 tokens, EOS "
                  "included when the answer stopped) and handed to TRL as token ids"),
        Pair("data.max_response_length", "max_length", lambda v, s: v + s.data.max_prompt_length),
        Pair("optim.lr", "learning_rate"),
        Pair("optim.schedule", "lr_scheduler_type"),
        Pair("optim.warmup_steps", "warmup_steps"),
        Pair("optim.max_grad_norm", "max_grad_norm"),
        *_SHARED_OPTIM,
    ],
}

# TRL fields set to a value of their own: no ppo_jax field (ppo_jax has no such switch, or fixes it).
TRL_FIXED: dict[str, dict[str, tuple[Any, str]]] = {
    "ppo": {
        "bf16": (False, "float32, as ppo_jax (TRL's default: bf16)"),
        "gradient_checkpointing": (False, "ppo_jax does not rematerialise here (TRL's default: on)"),
        "num_sample_generations": (0, "no extra sampling inside the loop"),
    },
    "grpo": {
        "bf16": (False, "float32, as ppo_jax"),
        "gradient_checkpointing": (False, "as ppo_jax"),
        "disable_dropout": (True, "ppo_jax's GPT-2 has no dropout"),
        "mask_truncated_completions": (False, "ppo_jax trains on rows cut at the budget too"),
        "importance_sampling_level": ("token", "PPO's token ratio (ppo.policy_objective=ppo)"),
        "shuffle_dataset": (True, "prompts drawn in a shuffled order, as ppo_jax's prompt stream"),
    },
    "dpo": {
        "bf16": (False, "float32, as ppo_jax"),
        "gradient_checkpointing": (False, "as ppo_jax"),
        "disable_dropout": (True, "ppo_jax's GPT-2 has no dropout"),
        "truncation_mode": ("keep_start", "nothing is cut: max_length holds every pair"),
        "precompute_ref_log_probs": (False, "the reference runs beside the policy, as ppo_jax's"),
    },
}

# TRL fields of the harness: files, logging, devices (nothing the learning sees).
TRL_HARNESS = {"output_dir", "report_to", "save_strategy", "logging_steps", "disable_tqdm", "use_cpu",
               "dataloader_num_workers", "eval_strategy", "log_completions"}

# ppo_jax fields the demo sets that a method does not read.
UNUSED: dict[str, dict[str, str]] = {
    "ppo": {}, "dpo": {},
    "grpo": {"value.init": "no value model", "optim.value_lr": "no value model"},
}

# ppo_jax fields the demo sets that the learning does not see (paths of outputs, logging, safety stops,
# when the programs compile).
OURS_HARNESS = {"train.progress", "train.sample_every", "train.max_consecutive_nonfinite", "train.log_every",
                "train.eval_every", "compute.precompile"}

DIFFERENCES: dict[str, list[Difference]] = {
    "ppo": [
        Difference("ppo.packing", "off: padded rows", "padded rows", "the same layout on both sides"),
        Difference("ppo.dense_kl_coef", "0.1: the exact KL over the vocabulary at every visited position, a loss term "
                   "(the demo's default since the spike, docs/demo.md)", "no such term",
                   "ppo_jax's extra leash; both keep the sampled k1 (0.1) in the reward"),
        Difference("optim.max_grad_norm", "1.0 (global-norm clipping, policy and value each)",
                   "none: the PPO loop calls optimizer.step() without clipping",
                   "TRL's max_grad_norm is not read by its PPO loop"),
        Difference("optim.policy_lr, optim.value_lr", "two AdamW optimizers", "one AdamW over policy and value",
                   "the same learning rate; Adam is per parameter, so only the clipping above differs"),
        Difference("optim.warmup_steps", "linear over 40 optimizer steps (8 per iteration)",
                   "constant_with_warmup over 5 iterations, stepped per iteration",
                   "TRL's first iteration runs at learning rate 0; both reach the peak at iteration 6"),
        Difference("", "the score on the last response token (EOS)",
                   "the score one position after it (sequence_length + 1) where that is inside the 16-token window, "
                   "the value model trained there too",
                   "TRL's padding_mask_p1; GAE with lam 0.95 carries it back one more step"),
        Difference("data.prompt_length", "prompts left-padded to 10 tokens", "prompts left-padded to the batch's longest",
                   "positions from the attention mask on both sides: the same logits"),
        Difference("", "prompt order, sampling and minibatch keys from the seed (JAX)",
                   "from the seed (torch, NumPy)", "random streams of their own: paired by seed, not by sample"),
    ],
    "grpo": [
        Difference("ppo.packing", "off: padded rows", "padded rows", "the same layout on both sides"),
        Difference("ppo.dense_kl_coef", "0.1 (as PPO)", "no such term", "ppo_jax's extra leash"),
        Difference("ppo.kl_coef", "k1 of the sampler's log-probs, in the sequence reward",
                   "the reward function recomputes both log-probs (policy and SFT copy) in PyTorch on the same ids",
                   "the same estimator on the same tokens, another forward"),
        Difference("ppo.epochs, ppo.num_minibatches", "the 64 rows reshuffled into 2 minibatches every epoch",
                   "shuffled once per generation, the same 2 halves in each of the 4 passes",
                   "TRL's buffered inputs; ppo_jax's ppo.minibatch_order=fixed is TRL's (docs/demo.md: no "
                   "measurable effect on five seeds)"),
        Difference("", "positions from the attention mask in every forward",
                   "TRL's training forward passes no position_ids (GPT-2 would count left padding); the harness adds "
                   "them from the mask, as TRL's generation and its PPO trainer do",
                   "without it TRL trains at shifted positions for prompts shorter than their batch's longest"),
        Difference("", "the reward model reads the sampled token ids", "TRL's built-in reward-model path re-tokenises "
                   "prompt + completion text (EOS dropped, no space between them): not used",
                   "the reward function scores the ids, as ppo_jax does"),
        Difference("data.prompt_length", "prompts left-padded to 10 tokens", "prompts left-padded to the batch's longest",
                   "positions from the attention mask (with the hook above): the same logits"),
        Difference("", "prompt order and sampling keys from the seed (JAX)", "from the seed (torch)", "random streams"),
    ],
    "dpo": [
        Difference("", "answers tokenised with EOS when they stopped, without when cut at 16 tokens",
                   "TRL appends EOS to every answer text", "the harness hands TRL ppo_jax's token ids (TRL's "
                   "_prepare_dataset skipped)"),
        Difference("train.eval_every", "100 (validation accuracy on the gold pairs)", "no evaluation",
                   "neither library evaluates during the timed runs here (nothing the learning sees)"),
        Difference("", "pair order from the seed (JAX)", "from the seed (torch)", "random streams"),
    ],
}


def covered(method: str) -> set[str]:
    """The ppo_jax fields the tables account for: paired, not matched, not read, or the harness's."""
    unmatched = {name.strip() for d in DIFFERENCES[method] for name in d.ours.split(",") if name.strip()}
    return {p.ours for p in PAIRS[method]} | unmatched | set(UNUSED[method]) | OURS_HARNESS


def changed_fields(method: str, s) -> list[str]:
    """The fields of ppo_jax's settings `s` that differ from the library's defaults (what the demo and
    this bench set)."""
    from ppo_jax.rl.settings import Settings
    from ppo_jax.supervised.settings import DPOSettings

    base = flat_fields(DPOSettings() if method == "dpo" else Settings())
    return sorted(k for k, v in flat_fields(s).items() if v != base.get(k))


def trl_kwargs(method: str, s) -> dict[str, Any]:
    """TRL's config fields for `method`, from ppo_jax's settings `s` (`ppo_jax_settings`): the pairs,
    the fixed values (`TRL_FIXED`) and the harness's own (output_dir etc. are added by the runner)."""
    out: dict[str, Any] = {}
    for pair in PAIRS[method]:
        if pair.argument:
            continue
        value = pair.convert(field(s, pair.ours), s)
        if pair.theirs in out and out[pair.theirs] != value:
            raise ValueError(f"{method}: {pair.theirs} would be both {out[pair.theirs]!r} and {value!r} "
                             f"(from {pair.ours}): TRL cannot match this run")
        out[pair.theirs] = value
    for name, (value, _) in TRL_FIXED[method].items():
        if value is not None:
            out[name] = value
    return out


def fields_markdown() -> str:
    """The docs' table: each pair of matched fields, the values the demo gives them, and every difference."""
    demo = demo_settings(0, quick=False)
    lines = []
    for method in METHODS:
        s = ppo_jax_settings(method, demo)
        kwargs = trl_kwargs(method, s)
        lines += [f"**{method.upper()}** (ppo_jax `{'DPOSettings' if method == 'dpo' else 'Settings'}` ↔ TRL "
                  f"`{ {'ppo': 'trl.experimental.ppo.PPOConfig', 'grpo': 'GRPOConfig', 'dpo': 'DPOConfig'}[method]}`)",
                  "", "| ppo_jax field | value | TRL field | value | note |", "|---|---|---|---|---|"]
        for pair in PAIRS[method]:
            ours = field(s, pair.ours)
            theirs = "(argument)" if pair.argument else repr(kwargs.get(pair.theirs))
            ours_text = "(the export)" if pair.ours.endswith("path") else repr(ours)
            lines.append(f"| `{pair.ours}` | {ours_text} | `{pair.theirs}` | {theirs} | {pair.note} |")
        for name, (value, why) in TRL_FIXED[method].items():
            shown = kwargs.get(name, value)
            lines.append(f"| — | | `{name}` | {shown!r} | {why} |")
        lines += ["", "| not matched | ppo_jax | TRL | what it means |", "|---|---|---|---|"]
        for d in DIFFERENCES[method]:
            lines.append(f"| {('`' + d.ours + '`') if d.ours else '—'} | {d.ppo_jax} | {d.trl} | {d.note} |")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Results: the JSON, what is left to run, the tables.


def new_results(quick: bool, overrides: Sequence[str] = ()) -> dict:
    return {"ppo_jax": {m: [] for m in METHODS}, "trl": {m: [] for m in METHODS}, "quick": quick,
            "smoke_run": quick, "overrides": list(overrides), "stages": {}, "commands": [], "versions": {},
            "machine": {}}


def load_results(path: str, quick: bool, overrides: Sequence[str] = ()) -> dict:
    """The JSON at `path` (a new one if there is none); refused if it holds runs of other settings."""
    if not os.path.exists(path):
        return new_results(quick, overrides)
    with open(path) as f:
        results = json.load(f)
    check_schema(results)
    if bool(results.get("quick")) != quick:
        raise SystemExit(f"error: {path} holds {'--quick' if results.get('quick') else 'full'} runs; "
                         f"{'--quick' if quick else 'a full run'} goes to a JSON of its own (--json)")
    if list(results.get("overrides", [])) != list(overrides):
        raise SystemExit(f"error: {path} holds runs with overrides {results.get('overrides', [])}, not "
                         f"{list(overrides)}; give these runs a JSON of their own (--json)")
    return results


def save_results(results: dict, path: str) -> None:
    """Written to a temporary file and renamed: a kill never leaves half a JSON."""
    check_schema(results)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def check_schema(results: Mapping) -> None:
    """{"ppo_jax": {"ppo": [entry, ...], "grpo": [...], "dpo": [...]}, "trl": {...}, ...}; an entry
    has ENTRY_KEYS (max_kl None for DPO), one entry per seed."""
    for lib in LIBRARIES:
        if set(results.get(lib, {})) != set(METHODS):
            raise ValueError(f"results[{lib!r}] must hold exactly {METHODS}, got {sorted(results.get(lib, {}))}")
        for method in METHODS:
            seeds = []
            for entry in results[lib][method]:
                missing = [k for k in ENTRY_KEYS if k not in entry]
                if missing:
                    raise ValueError(f"{lib} {method} entry {entry} lacks {missing}")
                for k in ENTRY_KEYS[1:]:
                    v = entry[k]
                    if not (v is None and k == "max_kl") and not isinstance(v, (int, float)):
                        raise ValueError(f"{lib} {method} seed {entry['seed']}: {k}={v!r} is not a number")
                if (entry["max_kl"] is None) != (method == "dpo"):
                    raise ValueError(f"{lib} {method} seed {entry['seed']}: max_kl is None exactly for DPO")
                seeds.append(entry["seed"])
            if len(seeds) != len(set(seeds)):
                raise ValueError(f"{lib} {method}: a seed twice in {seeds}")


def done(results: Mapping, lib: str, method: str, seed: int) -> bool:
    return any(e["seed"] == seed for e in results[lib][method])


def pending(results: Mapping, seeds: Sequence[int], libraries: Sequence[str] = LIBRARIES,
            methods: Sequence[str] = METHODS) -> list[tuple[int, str, str]]:
    """(seed, library, method) still to run, seed-major, each method's libraries side by side (so a
    change in machine load hits both). A seed whose cells are all in the JSON does not appear."""
    return [(seed, lib, method) for seed in seeds for method in methods for lib in libraries
            if not done(results, lib, method, seed)]


def add_entry(results: dict, lib: str, method: str, entry: Mapping) -> None:
    if done(results, lib, method, entry["seed"]):
        raise ValueError(f"{lib} {method} seed {entry['seed']} is already in the results")
    results[lib][method].append(dict(entry))
    results[lib][method].sort(key=lambda e: e["seed"])


def interval(values: Sequence[float]):
    """Mean and 95% Student-t half-width (`ppo_jax.sweep.results.stat`)."""
    from ppo_jax.sweep.results import stat

    return stat([float(v) for v in values])


def paired(results: Mapping, method: str, metric: str):
    """ppo_jax minus TRL, seed by seed over the seeds both have: (Stat of the differences, seeds)."""
    ours = {e["seed"]: e[metric] for e in results["ppo_jax"][method] if e[metric] is not None}
    theirs = {e["seed"]: e[metric] for e in results["trl"][method] if e[metric] is not None}
    seeds = sorted(set(ours) & set(theirs))
    return interval([ours[s] - theirs[s] for s in seeds]), seeds


METRICS = (("gap_closed", "gap closed", 100.0, "%", 1), ("kl", "final KL (nats)", 1.0, "", 2),
           ("max_kl", "largest training KL (nats)", 1.0, "", 2), ("seconds", "wall time (s)", 1.0, "", 0))


def _fmt(st, scale: float, unit: str, digits: int) -> str:
    if st.n == 0:
        return "–"
    mean = f"{st.mean * scale:.{digits}f}{unit}"
    return mean if math.isnan(st.half_width) else f"{mean} ± {st.half_width * scale:.{digits}f}"


def table_markdown(results: Mapping) -> str:
    """Per library and method: mean ± 95% interval of each metric over its seeds; then ppo_jax minus
    TRL, paired by seed, with its interval."""
    lines = ["| method | library | seeds | " + " | ".join(m[1] for m in METRICS) + " |",
             "|---|---|---|" + "---:|" * len(METRICS)]
    for method in METHODS:
        for lib in LIBRARIES:
            entries = results[lib][method]
            seeds = ",".join(str(e["seed"]) for e in entries) or "none"
            cells = []
            for key, _, scale, unit, digits in METRICS:
                values = [e[key] for e in entries if e[key] is not None]
                cells.append(_fmt(interval(values), scale, unit, digits) if values or method != "dpo" or key != "max_kl"
                             else "— (no rollouts)")
            lines.append(f"| {method.upper()} | {lib} | {seeds} | " + " | ".join(cells) + " |")
    lines += ["", "| method | paired seeds | " + " | ".join(f"ppo_jax − TRL: {m[1]}" for m in METRICS) + " |",
              "|---|---|" + "---:|" * len(METRICS)]
    for method in METHODS:
        cells, common = [], []
        for key, _, scale, unit, digits in METRICS:
            st, seeds = paired(results, method, key)
            common = common or seeds
            cells.append("— (no rollouts)" if method == "dpo" and key == "max_kl" else
                         _fmt(st, scale, " points" if unit == "%" else unit, digits))
        lines.append(f"| {method.upper()} | {','.join(map(str, common)) or 'none'} | " + " | ".join(cells) + " |")
    if results.get("overrides"):
        lines.append("\nppo_jax and TRL ran with the demo-config overrides " + ", ".join(
            f"`{o}`" for o in results["overrides"]) + " (TRL's fields follow their pairs).")
    note = ("\nMean ± half-width of the 95% interval (Student's t over the seeds; one seed: no interval). "
            "Paired: the mean of each seed's difference, ppo_jax minus TRL, on the same SFT policy, reward "
            "model and pairs, with its interval.")
    if results.get("quick"):
        note += " SMOKE RUN (--quick: the reduced demo, configs/demo_small.py): not the comparison."
    return "\n".join(lines) + "\n" + note


# --------------------------------------------------------------------------------------------
# Per seed: the demo's stages (run once, reused).


@dataclasses.dataclass
class SeedAssets:
    seed: int
    demo: Any  # DemoSettings
    dir: str
    sft_dir: str
    rm_dir: str
    train_pairs: list
    val_pairs: list
    record: dict  # results["stages"][seed]


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _exported(hf_dir: str) -> bool:
    return os.path.exists(os.path.join(hf_dir, "config.json")) and any(
        name.endswith(".safetensors") for name in os.listdir(hf_dir))


def seed_assets(demo, workdir: str, record: dict, log) -> SeedAssets:
    """The demo's SFT policy, preference pairs and reward model for one seed, in <workdir>/seed_<k>/
    as the demo lays them out; a stage whose outputs exist is reused (one cut short is redone)."""
    from ppo_jax.demo.pipeline import rm_val_accuracy
    from ppo_jax.demo.stages import sample_preferences, train_reward_model, train_sft

    seed_dir = os.path.join(workdir, f"seed_{demo.seed}")
    os.makedirs(seed_dir, exist_ok=True)
    stamp = os.path.join(seed_dir, "demo_settings.json")
    from ppo_jax.config import to_dict

    wanted = {k: v for k, v in json.loads(json.dumps(to_dict(demo), default=str)).items() if k in STAGE_SECTIONS}
    if os.path.exists(stamp):
        with open(stamp) as f:
            if {k: v for k, v in json.load(f).items() if k in STAGE_SECTIONS} != wanted:
                raise SystemExit(f"error: {seed_dir} was made with other SFT / preference / reward-model settings "
                                 "(e.g. --quick); use another --workdir")
    else:
        with open(stamp, "w") as f:
            json.dump(wanted, f, indent=1)
    seconds = record.setdefault("seconds", {})
    sft_dir = os.path.join(seed_dir, "sft", "hf")
    if not _exported(sft_dir):
        shutil.rmtree(os.path.join(seed_dir, "sft"), ignore_errors=True)
        log(f"seed {demo.seed}: SFT")
        seconds["sft"] = train_sft(demo, seed_dir).seconds
    prefs = os.path.join(seed_dir, "preferences")
    if os.path.exists(os.path.join(prefs, "train.jsonl")) and os.path.exists(os.path.join(prefs, "val.jsonl")):
        train_pairs, val_pairs = _read_jsonl(os.path.join(prefs, "train.jsonl")), _read_jsonl(os.path.join(prefs, "val.jsonl"))
    else:
        log(f"seed {demo.seed}: preferences")
        t0 = time.perf_counter()
        train_pairs, val_pairs = sample_preferences(demo, sft_dir, seed_dir)
        seconds["preferences"] = time.perf_counter() - t0
    rm_dir = os.path.join(seed_dir, "reward_model", "hf")
    if not _exported(rm_dir):
        shutil.rmtree(os.path.join(seed_dir, "reward_model"), ignore_errors=True)
        log(f"seed {demo.seed}: reward model")
        rm = train_reward_model(demo, sft_dir, train_pairs, val_pairs, seed_dir)
        seconds["reward_model"] = rm.seconds
        record["rm_val_accuracy"] = rm_val_accuracy(rm.history)
    elif "rm_val_accuracy" not in record:
        from ppo_jax.sweep.results import read_log

        rows = read_log(os.path.join(seed_dir, "reward_model", "metrics.jsonl"))
        record["rm_val_accuracy"] = rm_val_accuracy(rows)
    return SeedAssets(demo.seed, demo, seed_dir, sft_dir, rm_dir, train_pairs, val_pairs, record)


# --------------------------------------------------------------------------------------------
# The judge: the demo's evaluator on any exported policy.


class Judge:
    """A PPO trainer built as the demo's PPO stage (SFT reference, the reward model) and never
    trained; each policy to judge takes its policy's place, and `PolicyEvaluator` samples the
    demo's held-out prompts with fixed keys and scores them with the gold reward (train_dpo's way)."""

    def __init__(self, assets: SeedAssets, tag: str = ""):
        from ppo_jax.demo.evaluator import PolicyEvaluator
        from ppo_jax.rl.trainer import PPOTrainer

        demo = assets.demo
        out = os.path.join(assets.dir, "judge" + tag)
        shutil.rmtree(out, ignore_errors=True)
        s = ppo_jax_settings("ppo", demo, assets.sft_dir, assets.rm_dir)
        self.trainer = PPOTrainer(s, out, prompts=demo.world.all_prompts("train"))
        prompts = demo.world.prompts(demo.eval.num_prompts, "eval", seed=demo.seed + 29)
        self.evaluator = PolicyEvaluator(self.trainer, demo.world, prompts, seed=demo.seed)
        self.judged = 0  # policies judged so far

    def __call__(self, hf_dir: str):
        import jax
        import jax.numpy as jnp

        from ppo_jax.models import hf

        t = self.trainer
        loaded = hf.load_model(hf_dir, t.mesh, kind="causal_lm", execution=t.modules.policy.config.execution())
        # A new step too: the sampler's copy of the policy is synced once per step (rl/weight_sync.py), so
        # a policy swapped in at the same step would be sampled from the previous one's copy.
        self.judged += 1
        step = jax.device_put(jnp.asarray(self.judged, t.state.step.dtype), t.state.step.sharding)
        t.state = t.state.replace(policy=jax.device_put(loaded.params, t.state_shardings.policy), step=step)
        point, _ = self.evaluator(self.judged)
        return point

    def close(self):
        self.trainer.close()


# --------------------------------------------------------------------------------------------
# The six training runs. Each returns (exported policy dir, largest training KL or None).


def run_ppo_jax_rl(method: str, assets: SeedAssets, out: str):
    from ppo_jax.models import hf
    from ppo_jax.rl.errors import RunStopped
    from ppo_jax.rl.state import policy_variables
    from ppo_jax.rl.trainer import PPOTrainer

    s = ppo_jax_settings(method, assets.demo, assets.sft_dir, assets.rm_dir)
    trainer = PPOTrainer(s, out, prompts=assets.demo.world.all_prompts("train"))
    try:
        trainer.train()
    finally:
        trainer.close()
    if trainer.stopped_by:
        raise RunStopped(trainer.stopped_by)
    hf_dir = os.path.join(out, "hf")
    params, adapters = policy_variables(trainer.state.policy, trainer.frozen.policy)
    hf.export_model(hf_dir, trainer.policy_config, params, kind="causal_lm", tokenizer=trainer.tokenizer,
                    adapters=adapters)
    kls = [row["objective/kl"] for row in trainer.history if "objective/kl" in row]
    return hf_dir, float(max(kls))


def run_ppo_jax_dpo(assets: SeedAssets, out: str):
    from ppo_jax.supervised.dpo import DPOTrainer

    s = ppo_jax_settings("dpo", assets.demo, assets.sft_dir)
    trainer = DPOTrainer(s, out, tokenizer=assets.demo.world.tokenizer, train_records=assets.train_pairs,
                         eval_records=None)
    trainer.train()
    return os.path.join(out, "hf"), None


def _torch_models(assets: SeedAssets):
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(assets.sft_dir)

    def lm():
        return transformers.AutoModelForCausalLM.from_pretrained(assets.sft_dir, dtype=torch.float32)

    def scorer():
        return transformers.AutoModelForSequenceClassification.from_pretrained(assets.rm_dir, dtype=torch.float32)

    return tok, lm, scorer


def _trl_common(out: str) -> dict:
    return dict(output_dir=os.path.join(out, "trl_out"), report_to="none", save_strategy="no", disable_tqdm=True,
                use_cpu=True, dataloader_num_workers=0)


def keep_logs(rows: list):
    """A TrainerCallback appending every logged row to `rows`."""
    import transformers

    class KeepLogs(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            rows.append(dict(logs or {}))

    return KeepLogs()


def _quiet(trainer) -> None:
    import transformers

    for cb in (transformers.trainer_callback.PrinterCallback, transformers.trainer_callback.ProgressCallback):
        trainer.remove_callback(cb)


def _encoder(tok, s_or_lengths):
    from ppo_jax.data import PromptTokenizer

    return PromptTokenizer(tok, **s_or_lengths)


def run_trl_ppo(assets: SeedAssets, out: str):
    import datasets
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    s = ppo_jax_settings("ppo", assets.demo, assets.sft_dir, assets.rm_dir)
    if s.optim.policy_lr != s.optim.value_lr:
        raise ValueError("TRL's PPO has one learning rate for policy and value")
    tok, lm, scorer = _torch_models(assets)
    tok.padding_side = "left"  # TRL's PPO reads the prompt as the left-padded first columns
    ids = _encoder(tok, dict(max_prompt_length=s.data.prompt_length)).encode_prompts(
        assets.demo.world.all_prompts("train"))
    data = datasets.Dataset.from_dict({"input_ids": ids})
    logs: list[dict] = []
    args = PPOConfig(**trl_kwargs("ppo", s), **_trl_common(out))
    trainer = PPOTrainer(args=args, processing_class=tok, model=lm(), ref_model=lm(), reward_model=scorer(),
                         value_model=scorer(), train_dataset=data, eval_dataset=data, callbacks=[keep_logs(logs)])
    _quiet(trainer)
    trainer.train()
    hf_dir = os.path.join(out, "hf")
    trainer.accelerator.unwrap_model(trainer.model).policy.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    with open(os.path.join(out, "logs.json"), "w") as f:
        json.dump(logs, f)
    kls = [row["objective/kl"] for row in logs if "objective/kl" in row]
    if len(kls) != s.train.iterations:
        raise RuntimeError(f"TRL's PPO logged {len(kls)} iterations, expected {s.train.iterations}")
    return hf_dir, float(max(kls))


def mask_positions(module, args, kwargs):
    """A forward pre-hook: position_ids from the attention mask when a forward without a cache passes
    none (TRL's GRPO training forward), as generation and TRL's PPO trainer compute them."""
    mask = kwargs.get("attention_mask")
    if kwargs.get("position_ids") is None and mask is not None and kwargs.get("past_key_values") is None and mask.ndim == 2:
        mask = mask.long()
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return args, kwargs


class RewardMinusKL:
    """TRL GRPO's reward function: the reward model's score of the sampled ids (prompt as ppo_jax
    tokenises it, the completion's ids with its EOS), minus kl_coef x the response's summed k1
    between the live policy and the SFT policy: ppo_jax's sequence reward with the KL in the reward.
    Keeps each generation batch's mean summed k1 (the rollout KL) in `rollout_kl`."""

    __name__ = "reward_model_minus_kl"

    def __init__(self, assets: SeedAssets, s, tok, lm, scorer):
        self.kl_coef, self.temperature = float(s.ppo.kl_coef), float(s.rollout.temperature)
        self.encoder = _encoder(tok, dict(max_prompt_length=s.data.prompt_length))
        self.pad = int(tok.pad_token_id)
        self.reward, self.reference = scorer().eval(), lm().eval()
        self.policy = None  # the trainer's model, set once the trainer exists
        self.rollout_kl: list[float] = []
        self.scores: list[float] = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        import torch

        prompt_ids = self.encoder.encode_prompts(list(prompts))
        rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        last = mask.sum(-1) - 1
        with torch.no_grad():
            hidden = self.reward.transformer(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
            score = self.reward.score(hidden)[torch.arange(len(rows)), last, 0]
            was_training = self.policy.training
            self.policy.eval()
            logp = torch.log_softmax(self.policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits
                                     / self.temperature, -1)
            self.policy.train(was_training)
            ref = torch.log_softmax(self.reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
                                    / self.temperature, -1)
        kl = torch.zeros(len(rows))
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
            if not len(c):
                continue
            at = torch.arange(len(p) - 1, len(p) + len(c) - 1)
            token = torch.tensor(list(c))
            kl[i] = (logp[i, at, token] - ref[i, at, token]).sum()
        self.rollout_kl.append(float(kl.mean()))
        self.scores.append(float(score.mean()))
        return (score - self.kl_coef * kl).tolist()


def run_trl_grpo(assets: SeedAssets, out: str):
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    s = ppo_jax_settings("grpo", assets.demo, assets.sft_dir, assets.rm_dir)
    tok, lm, scorer = _torch_models(assets)
    data = datasets.Dataset.from_dict({"prompt": assets.demo.world.all_prompts("train")})
    reward = RewardMinusKL(assets, s, tok, lm, scorer)
    policy = lm()
    policy.register_forward_pre_hook(mask_positions, with_kwargs=True)
    logs: list[dict] = []
    args = GRPOConfig(**trl_kwargs("grpo", s), **_trl_common(out), logging_steps=_updates_per_iteration(s),
                      log_completions=False)
    if args.generation_batch_size != s.rollout.batch_size * s.rollout.num_samples:
        raise RuntimeError(f"TRL's generation batch is {args.generation_batch_size} rows, ppo_jax's iteration "
                           f"{s.rollout.batch_size * s.rollout.num_samples}")
    trainer = GRPOTrainer(model=policy, reward_funcs=[reward], args=args, train_dataset=data, processing_class=tok,
                          callbacks=[keep_logs(logs)])
    _quiet(trainer)
    reward.policy = trainer.accelerator.unwrap_model(trainer.model)
    trainer.train()
    hf_dir = os.path.join(out, "hf")
    reward.policy.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    if len(reward.rollout_kl) != s.train.iterations:
        raise RuntimeError(f"TRL's GRPO scored {len(reward.rollout_kl)} generation batches, expected "
                           f"{s.train.iterations}")
    with open(os.path.join(out, "rollouts.json"), "w") as f:
        json.dump({"rollout_kl": reward.rollout_kl, "score": reward.scores, "logs": logs}, f)
    return hf_dir, float(max(reward.rollout_kl))


def run_trl_dpo(assets: SeedAssets, out: str):
    import datasets
    from trl import DPOConfig, DPOTrainer

    s = ppo_jax_settings("dpo", assets.demo, assets.sft_dir)
    tok, lm, _ = _torch_models(assets)
    encoder = _encoder(tok, dict(max_prompt_length=s.data.max_prompt_length,
                                 max_response_length=s.data.max_response_length, truncation=s.data.truncation))
    columns: dict[str, list] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for (chosen, flags), (rejected, _) in encoder.encode_preferences(assets.train_pairs):
        n = flags.index(1)
        columns["prompt_ids"].append(chosen[:n])
        columns["chosen_ids"].append(chosen[n:])
        columns["rejected_ids"].append(rejected[n:])

    class TokenIdsDPOTrainer(DPOTrainer):
        """TRL's DPO on ids tokenised as ppo_jax tokenises them (its own preparation would append EOS
        to the answers that never stopped)."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    logs: list[dict] = []
    args = DPOConfig(**trl_kwargs("dpo", s), **_trl_common(out), logging_steps=s.train.log_every, eval_strategy="no")
    trainer = TokenIdsDPOTrainer(model=lm(), args=args, train_dataset=datasets.Dataset.from_dict(columns),
                                 processing_class=tok, callbacks=[keep_logs(logs)])
    _quiet(trainer)
    trainer.train()
    hf_dir = os.path.join(out, "hf")
    trainer.accelerator.unwrap_model(trainer.model).save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    with open(os.path.join(out, "logs.json"), "w") as f:
        json.dump(logs, f)
    return hf_dir, None


def run_cell(lib: str, method: str, assets: SeedAssets, out: str):
    if lib == "ppo_jax":
        return run_ppo_jax_dpo(assets, out) if method == "dpo" else run_ppo_jax_rl(method, assets, out)
    return {"ppo": run_trl_ppo, "grpo": run_trl_grpo, "dpo": run_trl_dpo}[method](assets, out)


# --------------------------------------------------------------------------------------------


class PauseClock:
    """Wall time the process spent stopped (SIGSTOP: on a shared machine another job may pause this
    one): a thread wakes every `tick` seconds and counts any gap longer than `gap` as a pause. A
    training run's `seconds` are its wall time minus its pauses."""

    def __init__(self, tick: float = 0.5, gap: float = 10.0):
        import threading

        self.tick, self.gap, self.paused = tick, gap, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        last = time.monotonic()
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            if now - last > self.gap:
                self.paused += now - last - self.tick
            last = now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "trl", "accelerate", "datasets"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def run_tag(overrides: Sequence[str]) -> str:
    """A suffix for the run and judge directories of runs with `--override`s: they share the seed's
    stages with the plain runs, not their directories."""
    import hashlib

    return "+" + hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:8] if overrides else ""


def default_json(quick: bool) -> str:
    name = f"{datetime.date.today().isoformat()}-cpu-peer{'-quick' if quick else ''}.json"
    return os.path.join(HERE, "results", name)


def main(argv=None) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before anything imports jax (a CUDA plugin may be installed)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from ppo_jax.sweep.spec import parse_seeds

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="5", help="a count (5: seeds 0-4) or a list (0,3)")
    p.add_argument("--libraries", default=",".join(LIBRARIES))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--workdir", default="", help="stages and runs (default runs/peer, runs/peer_quick)")
    p.add_argument("--json", default="", help="results (default bench/results/<date>-cpu-peer[-quick].json)")
    p.add_argument("--quick", action="store_true", help="smoke run: the reduced demo (configs/demo_small.py)")
    p.add_argument("--table", action="store_true", help="print the results tables from the JSON; run nothing")
    p.add_argument("--fields", action="store_true", help="print the matched-fields table; run nothing")
    p.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                   help="a demo-config override for the runs (e.g. ppo.ppo.dense_kl_coef=0.0; TRL's fields follow "
                        "their pairs); the JSON records it and takes no runs of other settings")
    p.add_argument("--torch-omp-wait-policy", default="PASSIVE", help="OMP_WAIT_POLICY for torch (bench_ppo.py)")
    args = p.parse_args(argv)
    if args.fields:
        print(fields_markdown())
        return {}
    path = args.json or default_json(args.quick)
    if args.table:
        if not os.path.exists(path):
            raise SystemExit(f"error: no results at {path} (--json names them)")
        results = load_results(path, args.quick, args.override)
        print(table_markdown(results))
        return results
    if "torch" not in sys.modules and args.torch_omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.torch_omp_wait_policy
    seeds = parse_seeds(args.seeds)
    libraries = [x for x in args.libraries.split(",") if x]
    methods = [x for x in args.methods.split(",") if x]
    if set(libraries) - set(LIBRARIES) or set(methods) - set(METHODS):
        raise SystemExit(f"error: --libraries from {LIBRARIES}, --methods from {METHODS}")
    workdir = args.workdir or os.path.join("runs", "peer_quick" if args.quick else "peer")
    results = load_results(path, args.quick, args.override)
    results["commands"].append({"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                                "started": datetime.datetime.now().isoformat(timespec="seconds"),
                                "commit": git_commit()})
    results["versions"], results["machine"] = versions(), {
        "cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}
    save_results(results, path)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    todo = pending(results, seeds, libraries, methods)
    log(f"{len(todo)} runs to do: " + ", ".join(f"{lib} {m} seed {s}" for s, lib, m in todo) if todo else "nothing to do")
    by_seed: dict[int, list[tuple[str, str]]] = {}
    for seed, lib, method in todo:
        by_seed.setdefault(seed, []).append((lib, method))
    for seed, cells in by_seed.items():
        record = results["stages"].setdefault(str(seed), {})
        assets = seed_assets(demo_settings(seed, args.quick, args.override), workdir, record, log)
        tag = run_tag(args.override)
        judge = Judge(assets, tag)
        try:
            if "sft_gold" not in record:
                sft = judge(assets.sft_dir)
                record.update(sft_gold=sft.gold, sft_kl=sft.kl, sft_eos_rate=sft.eos_rate, sft_length=sft.length,
                              sft_rm_score=sft.rm_score, best_gold=assets.demo.world.best_gold)
                save_results(results, path)
            sft_gold, best = record["sft_gold"], record["best_gold"]
            for lib, method in cells:
                out = os.path.join(assets.dir, f"{lib}_{method}{tag}")
                shutil.rmtree(out, ignore_errors=True)  # a run cut short starts over
                log(f"seed {seed}: {lib} {method}")
                load = os.getloadavg()
                t0, cpu0 = time.perf_counter(), time.process_time()
                with PauseClock() as pauses:
                    hf_dir, max_kl = run_cell(lib, method, assets, out)
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                seconds = wall - pauses.paused
                point = judge(hf_dir)
                entry = {"seed": seed, "gap_closed": (point.gold - sft_gold) / (best - sft_gold), "kl": point.kl,
                         "max_kl": max_kl, "seconds": seconds, "gold": point.gold, "rm_score": point.rm_score,
                         "eos_rate": point.eos_rate, "length": point.length, "wall_seconds": wall,
                         "paused_seconds": pauses.paused, "cpu_seconds": cpu,
                         "load_average": [round(load[0], 2), round(os.getloadavg()[0], 2)]}
                add_entry(results, lib, method, entry)
                save_results(results, path)
                log(f"seed {seed}: {lib} {method}: gap closed {entry['gap_closed']:.1%}, KL {point.kl:.2f}, "
                    f"largest training KL {max_kl if max_kl is not None else '-'}, {seconds:.0f} s")
        finally:
            judge.close()
    print(table_markdown(results))
    return results


if __name__ == "__main__":
    main()
