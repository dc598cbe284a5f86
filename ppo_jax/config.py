"""PPO configuration: the full default tree (every field commented) and validation with clear errors.

Files under `configs/` start from `ppo_config()` and override what they need. `validate(config, ...)`
runs before anything is compiled or written and names the offending field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections

from ppo_jax.models.config import ModelConfig


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field and the fix."""


def model_config_dict(**overrides) -> ml_collections.ConfigDict:
    """A ConfigDict with every ModelConfig field (for models built from scratch)."""
    fields = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    fields.update(overrides)
    # ConfigDict needs a type per field: None defaults become placeholders.
    return ml_collections.ConfigDict(
        {k: ml_collections.config_dict.placeholder(_field_type(k)) if v is None else v
         for k, v in fields.items()})


def _field_type(name: str):
    return {"rope_scaling": tuple, "activation": str}.get(name, int)


def model_config_from_dict(d: ml_collections.ConfigDict | dict) -> ModelConfig:
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = tuple(tuple(x) for x in d["rope_scaling"])
    return ModelConfig(**d)


# rollout.decode -> SamplingConfig.unroll_layers (None: decided by the backend).
DECODE_LOOPS = {"auto": None, "scan": False, "unrolled": True}


def ppo_config() -> ml_collections.ConfigDict:
    """Default PPO config: a tiny GPT-2-shaped policy on the built-in toy task (runs on a CPU)."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds parameter init, data order and sampling
    c.mesh = ml_collections.ConfigDict()
    c.mesh.shape = (1, -1, 1)  # (data, fsdp, tensor); one entry may be -1 = all remaining devices

    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator_address = ""  # "host:port" of process 0 for multi-host runs ("" = env or single process)
    c.distributed.num_processes = 0  # processes in the job (with coordinator_address)
    c.distributed.process_id = -1  # this process's index (with coordinator_address)
    c.distributed.auto = False  # let JAX detect the cluster (TPU VMs, SLURM); also PPO_JAX_DISTRIBUTED=auto

    c.policy = ml_collections.ConfigDict()
    c.policy.path = ""  # Hugging Face directory or ppo_jax checkpoint of the initial policy; "" = build from policy.model
    c.policy.model = model_config_dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                                       max_position_embeddings=128)  # architecture when policy.path is ""
    c.policy.param_dtype = ""  # override parameter dtype ("" = keep the checkpoint's / model's)
    c.policy.dtype = ""  # override compute dtype ("" = keep)

    c.reward = ml_collections.ConfigDict()
    c.reward.path = ""  # reward model (HF ForSequenceClassification dir or ppo_jax checkpoint); "" = none
    c.reward.model_weight = 1.0  # weight of the reward model's score in the total score
    c.reward.functions = ""  # comma-separated Python reward functions: registered names or "module:function"
    c.reward.function_weights = ""  # comma-separated weights for reward.functions ("" = all 1.0)
    c.reward.gain = 1.0  # score normalisation: score * gain + bias
    c.reward.bias = 0.0  # score normalisation bias
    c.reward.clip = 0.0  # clip |score| to this value; 0 = no clipping
    c.reward.missing_stop = "none"  # rows without a stop token: "none", "replace" (score := missing_stop_value) or "penalty"
    c.reward.missing_stop_value = -1.0  # the replacement score ("replace") or the penalty subtracted ("penalty")

    c.value = ml_collections.ConfigDict()
    c.value.init = "policy"  # value model from "policy" (zero-init head) or "reward" (the reward model, N+ style)

    c.data = ml_collections.ConfigDict()
    c.data.prompts = "toy"  # prompt source: "toy" (built-in task), a .jsonl file (field data.field) or a .txt file
    c.data.field = "prompt"  # JSONL field holding the prompt
    c.data.eval_prompts = ""  # held-out prompt source for evaluation ("" = a held-out split of the toy task)
    c.data.prompt_length = 16  # static prompt length (tokens, left-padded)
    c.data.truncation = "left"  # over-long prompts: "left" (drop the oldest tokens) or "error"
    c.data.chat_template = False  # wrap prompts in the tokenizer's chat template (with the generation prompt)

    c.rollout = ml_collections.ConfigDict()
    c.rollout.batch_size = 32  # prompts per PPO iteration (global, across all devices and hosts)
    c.rollout.num_samples = 1  # responses sampled per prompt (> 1 for grpo / rloo)
    c.rollout.response_length = 16  # maximum new tokens per response
    c.rollout.min_new_tokens = 0  # stop tokens are suppressed before this many tokens
    c.rollout.temperature = 1.0  # sampling temperature; also divides the logits of every log-prob forward
    c.rollout.top_k = 0  # 0 = off; training rollouts should sample the full distribution
    c.rollout.top_p = 1.0  # 1.0 = off
    c.rollout.stop_token_ids = ""  # comma-separated stop ids; "" = the tokenizer's / model's EOS
    c.rollout.cache_dtype = ""  # KV cache dtype ("" = compute dtype; "bfloat16" halves it)
    c.rollout.decode = "auto"  # "scan" layers, "unrolled" (faster on CPU, copies weights), "auto": unrolled on CPU
    c.rollout.forward_microbatch = 0  # rows per forward pass in the experience step; 0 = whole batch

    c.ppo = ml_collections.ConfigDict()
    c.ppo.advantage_estimator = "gae"  # "gae", "grpo", "rloo" or "reinforce_pp"
    c.ppo.epochs = 4  # PPO epochs over each rollout batch
    c.ppo.num_minibatches = 1  # optimizer steps per epoch
    c.ppo.num_microbatches = 1  # gradient-accumulation slices per minibatch
    c.ppo.clip_eps = 0.2  # policy ratio clip (lower side, and upper side unless clip_eps_high is set)
    c.ppo.clip_eps_high = 0.0  # upper ratio clip for asymmetric clipping; 0 = same as clip_eps
    c.ppo.dual_clip = 0.0  # dual-clip constant c > 1 for negative advantages; 0 = off
    c.ppo.value_clip = 0.2  # value prediction clip range
    c.ppo.vf_coef = 0.1  # value loss coefficient
    c.ppo.ent_coef = 0.0  # entropy bonus coefficient
    c.ppo.gamma = 1.0  # discount
    c.ppo.lam = 0.95  # GAE lambda
    c.ppo.whiten_advantages = True  # masked whitening of advantages
    c.ppo.whiten_rewards = False  # masked whitening of per-token rewards before GAE
    c.ppo.kl_estimator = "k1"  # per-token KL estimator: "k1", "k2" or "k3"
    c.ppo.kl_in_reward = True  # KL as a per-token reward penalty (True) or as a loss term (False)
    c.ppo.kl_controller = "fixed"  # "fixed" or "adaptive" (Ziegler et al. 2019)
    c.ppo.kl_coef = 0.05  # initial KL coefficient beta
    c.ppo.kl_target = 6.0  # adaptive controller target KL (per sequence)
    c.ppo.kl_horizon = 10000  # adaptive controller horizon (samples)

    c.optim = ml_collections.ConfigDict()
    c.optim.policy_lr = 1e-4  # policy peak learning rate
    c.optim.value_lr = 1e-4  # value model peak learning rate
    c.optim.schedule = "constant"  # after warmup: "constant", "linear" (to 0) or "cosine" (to 0)
    c.optim.warmup_steps = 0  # optimizer steps of linear warmup
    c.optim.weight_decay = 0.0  # AdamW weight decay
    c.optim.b1 = 0.9  # Adam beta1
    c.optim.b2 = 0.999  # Adam beta2
    c.optim.eps = 1e-5  # Adam epsilon
    c.optim.eps_root = 0.0  # epsilon inside the square root (TF-style Adam places epsilon here)
    c.optim.max_grad_norm = 1.0  # global-norm gradient clipping; 0 = off

    c.train = ml_collections.ConfigDict()
    c.train.iterations = 20  # PPO iterations (rollout + update)
    c.train.log_every = 1  # write metrics every N iterations
    c.train.sample_every = 5  # write (prompt, response, score, KL) samples every N iterations
    c.train.eval_every = 0  # evaluate on held-out prompts every N iterations; 0 = never
    c.train.eval_batches = 1  # held-out batches per evaluation
    c.train.checkpoint_every = 0  # save a checkpoint every N iterations; 0 = only at the end
    c.train.keep_checkpoints = 2  # checkpoints kept
    c.train.best_metric = ""  # also keep the best checkpoint by this metric (e.g. "eval/scores"); "" = off
    c.train.best_mode = "max"  # "max" or "min" for train.best_metric
    c.train.max_consecutive_nonfinite = 3  # stop after this many iterations in a row with skipped (non-finite) updates
    c.train.progress = True  # tqdm progress bar
    return c


def stop_token_ids(config, default_eos: int | None) -> tuple[int, ...]:
    spec = config.rollout.stop_token_ids
    if spec:
        try:
            return tuple(int(x) for x in str(spec).split(","))
        except ValueError:
            raise ConfigError(f"rollout.stop_token_ids={spec!r}: use comma-separated integers") from None
    return (default_eos,) if default_eos is not None else ()


@dataclasses.dataclass(frozen=True)
class DerivedSizes:
    """Sizes that follow from the config and the mesh."""

    rollout_rows: int  # prompts * samples per prompt
    minibatch_rows: int
    microbatch_rows: int
    forward_rows: int


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(config, *, batch_divisor: int = 1, max_positions: int | None = None,
             vocab_size: int | None = None) -> DerivedSizes:
    """Checks the config before any compile; returns the derived batch sizes."""
    r, p, o = config.rollout, config.ppo, config.optim
    _check(r.batch_size > 0, f"rollout.batch_size must be positive, got {r.batch_size}")
    _check(r.num_samples >= 1, f"rollout.num_samples must be >= 1, got {r.num_samples}")
    _check(r.response_length > 0, f"rollout.response_length must be positive, got {r.response_length}")
    _check(config.data.prompt_length > 0, f"data.prompt_length must be positive, got {config.data.prompt_length}")
    _check(r.temperature > 0 and math.isfinite(r.temperature),
           f"rollout.temperature must be > 0 (it divides the logits), got {r.temperature}")
    _check(0 <= r.min_new_tokens <= r.response_length,
           f"rollout.min_new_tokens={r.min_new_tokens} must be in [0, rollout.response_length={r.response_length}]")
    _check(r.top_k >= 0, f"rollout.top_k must be >= 0 (0 = off), got {r.top_k}")
    _check(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    _check(r.decode in DECODE_LOOPS, f"rollout.decode={r.decode!r}: use one of {sorted(DECODE_LOOPS)}")
    _check(p.advantage_estimator in ("gae", "grpo", "rloo", "reinforce_pp"),
           f"ppo.advantage_estimator={p.advantage_estimator!r}: use one of gae, grpo, rloo, reinforce_pp")
    if p.advantage_estimator in ("grpo", "rloo"):
        _check(r.num_samples >= 2, f"ppo.advantage_estimator={p.advantage_estimator!r} compares samples of the same "
               f"prompt: set rollout.num_samples >= 2 (got {r.num_samples})")
    _check(p.epochs >= 1, f"ppo.epochs must be >= 1, got {p.epochs}")
    _check(p.num_minibatches >= 1, f"ppo.num_minibatches must be >= 1, got {p.num_minibatches}")
    _check(p.num_microbatches >= 1, f"ppo.num_microbatches must be >= 1, got {p.num_microbatches}")
    _check(p.clip_eps > 0, f"ppo.clip_eps must be > 0, got {p.clip_eps}")
    _check(p.clip_eps_high >= 0, f"ppo.clip_eps_high must be >= 0 (0 = same as clip_eps), got {p.clip_eps_high}")
    _check(p.dual_clip == 0 or p.dual_clip > 1, f"ppo.dual_clip must be 0 (off) or > 1, got {p.dual_clip}")
    _check(p.value_clip > 0, f"ppo.value_clip must be > 0, got {p.value_clip}")
    _check(0 < p.gamma <= 1, f"ppo.gamma must be in (0, 1], got {p.gamma}")
    _check(0 <= p.lam <= 1, f"ppo.lam must be in [0, 1], got {p.lam}")
    _check(p.kl_estimator in ("k1", "k2", "k3"), f"ppo.kl_estimator={p.kl_estimator!r}: use k1, k2 or k3")
    _check(p.kl_controller in ("fixed", "adaptive"), f"ppo.kl_controller={p.kl_controller!r}: use fixed or adaptive")
    _check(p.kl_coef >= 0, f"ppo.kl_coef must be >= 0, got {p.kl_coef}")
    if p.kl_controller == "adaptive":
        _check(p.kl_target > 0 and p.kl_horizon > 0, "ppo.kl_target and ppo.kl_horizon must be > 0 for the adaptive controller")
    for name in ("policy_lr", "value_lr", "weight_decay", "max_grad_norm", "warmup_steps"):
        _check(o[name] >= 0, f"optim.{name} must be >= 0, got {o[name]}")
    _check(o.schedule in ("constant", "linear", "cosine"), f"optim.schedule={o.schedule!r}: use constant, linear or cosine")
    _check(config.value.init in ("policy", "reward"), f"value.init={config.value.init!r}: use policy or reward")
    if config.value.init == "reward" and p.advantage_estimator == "gae":
        _check(bool(config.reward.path), "value.init='reward' needs reward.path (a reward model to start the value model from)")
    _check(config.reward.missing_stop in ("none", "replace", "penalty"),
           f"reward.missing_stop={config.reward.missing_stop!r}: use none, replace or penalty")
    _check(bool(config.reward.path) or bool(config.reward.functions),
           "no reward: set reward.path (a reward model) and/or reward.functions (Python reward functions)")
    _check(config.data.truncation in ("left", "error"), f"data.truncation={config.data.truncation!r}: use left or error")
    _check(config.train.iterations >= 1, f"train.iterations must be >= 1, got {config.train.iterations}")
    _check(config.train.keep_checkpoints >= 1, f"train.keep_checkpoints must be >= 1, got {config.train.keep_checkpoints}")
    _check(config.train.best_mode in ("max", "min"), f"train.best_mode={config.train.best_mode!r}: use max or min")
    _check(config.train.max_consecutive_nonfinite >= 1,
           f"train.max_consecutive_nonfinite must be >= 1, got {config.train.max_consecutive_nonfinite}")

    rows = r.batch_size * r.num_samples
    _check(rows % p.num_minibatches == 0,
           f"rollout.batch_size * rollout.num_samples = {rows} is not divisible by ppo.num_minibatches="
           f"{p.num_minibatches}; change one of them")
    mini = rows // p.num_minibatches
    _check(mini % p.num_microbatches == 0,
           f"a minibatch of {mini} rows is not divisible by ppo.num_microbatches={p.num_microbatches}")
    micro = mini // p.num_microbatches
    _check(micro % batch_divisor == 0,
           f"a microbatch of {micro} rows does not split over the {batch_divisor} data-parallel devices "
           f"(mesh data x fsdp); make rollout.batch_size * rollout.num_samples / (ppo.num_minibatches * "
           f"ppo.num_microbatches) a multiple of {batch_divisor}")
    _check(r.batch_size % batch_divisor == 0,
           f"rollout.batch_size={r.batch_size} is not a multiple of the {batch_divisor} data-parallel devices")
    fwd = r.forward_microbatch or rows
    _check(rows % fwd == 0 and fwd % batch_divisor == 0,
           f"rollout.forward_microbatch={r.forward_microbatch} must divide {rows} rows and be a multiple of "
           f"{batch_divisor}")
    if max_positions is not None:
        total = config.data.prompt_length + r.response_length
        _check(total <= max_positions,
               f"data.prompt_length + rollout.response_length = {total} exceeds the model's "
               f"max_position_embeddings={max_positions}; shorten one of them")
    if vocab_size is not None and config.rollout.stop_token_ids:
        for t in stop_token_ids(config, None):
            _check(0 <= t < vocab_size, f"rollout.stop_token_ids: {t} is outside the vocabulary (size {vocab_size})")
    return DerivedSizes(rollout_rows=rows, minibatch_rows=mini, microbatch_rows=micro, forward_rows=fwd)


def to_dict(config) -> dict[str, Any]:
    """JSON-serialisable copy (for checkpoints and run records)."""
    return config.to_dict()
