"""PPO settings: the schema of a PPO config (every field with its default and a one-line comment),
its validation, and the sampler settings that follow from it (the hyper-parameters the steps close
over are `rl/hyper.py`; the batch sizes on a mesh are `rl/sizes.py`).

`ppo_config()` is the ConfigDict that files under `configs/` start from; `Settings.from_config`
converts one, once, at the edge (`PPOTrainer`, `plan_memory`), and validates every value here.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from ppo_jax.config import (HF_MODEL_DIR, HF_REWARD_DIR, PEFT_ADAPTER_DIR,
                            AdamWSettings, ComputeSettings, ConfigError, LoraSettings, MeshSettings, RunSettings,
                            WandbSettings, check, config_dict)
from ppo_jax.data.prompt_stream import PromptDataSettings
from ppo_jax.distributed import DistributedSettings
from ppo_jax.models.config import LoraConfig, ModelConfig
from ppo_jax.rl.environment_settings import EnvironmentSettings
from ppo_jax.rl.distill_settings import DistillSettings
from ppo_jax.rl.dynamic_sampling_settings import DynamicSamplingSettings
from ppo_jax.rl.loss_settings import PPOLossSettings
from ppo_jax.rl.roles import RolesSettings
from ppo_jax.rl.router_replay import MoeSettings
from ppo_jax.sampling.config import ENGINES, GEMM_OPTIONS

# rollout.decode -> SamplingConfig.unroll_layers (None: decided by the backend).
DECODE_LOOPS = {"auto": None, "scan": False, "unrolled": True}
REFERENCE_DTYPES = ("", "bfloat16", "float16", "float32")
MAX_OFF_POLICY_STEPS = 4  # rollout.off_policy_steps: batches the sampler may run ahead of the trainer


@dataclasses.dataclass(frozen=True)
class PolicyLoraSettings(LoraSettings):
    """LoRA on the policy: train low-rank adapters on a frozen base (the base, adapters off, is the
    reference, so no reference copy exists; with init_from the reference is the base + the imported
    adapters, a frozen adapters-sized copy). rank 0 = off: the whole policy is trained against a
    frozen reference copy. The shared fields: `ppo_jax.config.LoraSettings`."""

    init_from: str = ""  # a PEFT LoRA adapter directory trained on this base: the adapters start from it and base + it is the reference; rank/alpha/targets come from its adapter_config.json (rank 0), or must agree with it

    def lora_config(self, where: str = "policy") -> LoraConfig | None:
        """The model's LoraConfig, None when off (or taken from init_from: `build.policy_model_config`);
        raises ConfigError naming the bad field."""
        return super().lora_config(where)


@dataclasses.dataclass(frozen=True)
class ValueLoraSettings(LoraSettings):
    """LoRA on the value model: adapters + the scalar head are trained on a frozen base that already
    exists in the run (the policy's base, the reference, or the reward model; never a copy). rank 0 =
    off: the whole value model is trained. The fields: `ppo_jax.config.LoraSettings`."""

    def lora_config(self, where: str = "value") -> LoraConfig | None:
        return super().lora_config(where)


@dataclasses.dataclass(frozen=True)
class PolicySettings:
    """The initial policy (and the reference, its frozen copy; with LoRA, the frozen base)."""

    path: str = ""  # initial policy: a Hugging Face model directory (e.g. written by python -m ppo_jax.cli.export), not a ppo_jax checkpoint; "" = build from policy.model
    model: ModelConfig = ModelConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                                     max_position_embeddings=128)  # architecture when policy.path is ""
    param_dtype: str = ""  # parameter dtype of the policy and value model ("" = policy.model's; float32 for a policy.path checkpoint, bf16 ones upcast)
    dtype: str = ""  # compute dtype of the policy and value model ("" = as param_dtype's ""); "bfloat16" beside fp32 params is mixed precision
    reference_dtype: str = ""  # dtype the frozen reference copy is held in ("" = the policy's; "bfloat16" beside fp32 master weights halves it; its matmuls already run in the compute dtype)
    lora: PolicyLoraSettings = PolicyLoraSettings()


@dataclasses.dataclass(frozen=True)
class RewardSettings:
    """What scores a response: a reward model and/or Python reward functions."""

    path: str = ""  # reward model: a Hugging Face ForSequenceClassification directory (e.g. a reward-model run's <workdir>/hf), not a ppo_jax checkpoint; "" = none
    model_weight: float = 1.0  # weight of the reward model's score in the total score
    functions: str = ""  # comma-separated Python reward functions: registered names or "module:function"
    function_weights: str = ""  # comma-separated weights for reward.functions ("" = all 1.0)
    gain: float = 1.0  # score normalisation: score * gain + bias
    bias: float = 0.0  # score normalisation bias
    clip: float = 0.0  # clip |score| to this value; 0 = no clipping
    missing_stop: str = "none"  # rows without a stop token: "none", "replace" (score := missing_stop_value) or "penalty"
    missing_stop_value: float = -1.0  # the replacement score ("replace") or the penalty subtracted ("penalty")
    overlong_buffer: int = 0  # soft overlong punishment (DAPO): over the budget's last N tokens a penalty rises to reward.overlong_penalty, all of it for a row cut without a stop token; 0 = off
    overlong_penalty: float = 1.0  # the largest overlong penalty (subtracted from the score; with reward.overlong_buffer)
    param_dtype: str = ""  # dtype the frozen reward model is held in ("" = the policy's parameter dtype)
    dtype: str = ""  # compute dtype of the reward model ("" = the policy's compute dtype)


@dataclasses.dataclass(frozen=True)
class ValueSettings:
    """Where the value model starts."""

    init: str = "policy"  # value model from "policy" (zero-init head) or "reward" (the reward model, N+ style)
    lora: ValueLoraSettings = ValueLoraSettings()


def check_gemm(name: str, gemm: str) -> None:
    """rollout.gemm, ppo.gemm: a GEMM choice of `GEMM_OPTIONS`."""
    check(gemm in GEMM_OPTIONS, f"{name}={gemm!r}: use one of {', '.join(GEMM_OPTIONS)}")


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """Sampling the responses of one iteration."""

    batch_size: int = 32  # prompts per PPO iteration (global, across all devices and hosts)
    num_samples: int = 1  # responses sampled per prompt (> 1 for grpo / rloo)
    response_length: int = 16  # maximum new tokens per response
    min_new_tokens: int = 0  # stop tokens are suppressed before this many tokens
    temperature: float = 1.0  # sampling temperature; also divides the logits of every log-prob forward
    top_k: int = 0  # 0 = off; training rollouts should sample the full distribution
    top_p: float = 1.0  # 1.0 = off
    stop_token_ids: str = ""  # comma-separated stop ids; "" = the tokenizer's / model's EOS
    cache_dtype: str = ""  # KV cache dtype ("" = compute dtype; "bfloat16" halves it)
    decode: str = "auto"  # with scanned layers: "scan" them, "unrolled" (per-layer copies; 2x faster decode on CPU and GPU), "auto": unrolled except on TPU
    forward_microbatch: int = 0  # rows per forward pass in the experience step; 0 = whole batch
    steps_per_sync: int = 0  # static engine: decode steps between two tests of "every row stopped" (XLA:GPU reads that test on the host, and waits, once per test); 0 = auto: 8 on a GPU, 1 elsewhere; the same tokens for any value
    engine: str = "static"  # "static": all batch_size * num_samples rows decoded at once until the longest stops; "continuous": `slots` decode rows fed from a queue of them, a finished row's slot refilled by the next prompt (sampling/continuous.py; same tokens for the same key)
    slots: int = 0  # continuous: decode rows held at once, a multiple of the data-parallel devices, <= the rows; 0 = half the rows (with an environment: one per episode; S = the episodes share S slots, agentic/slot_rollout.py)
    prefill_prompts: int = 0  # continuous: prompts prefilled together when a slot is free and no prefilled row waits; 0 = a quarter of the slots' worth (with an environment: the episodes one insert prefills)
    off_policy_steps: int = 0  # 0..4: 0: each rollout samples the policy being updated; k: the sampler runs k batches ahead, batch i+k sampled with the weights before update i while the trainer updates on batch i (overlapped on disaggregated roles; policy lag k; the correction: ppo.off_policy_ratio)
    partial_rollouts: bool = False  # continuous engine, off_policy_steps >= 1: a rollout in flight is decoded in segments, one per train step, each under the weights synced last (the rows in progress keep their KV cache); every token records its log-prob and the version of the weights that chose it, the policy lag is per token; multi-turn episodes advance by segments of turns (docs/off_policy.md, "Partial rollouts")
    gemm: str = "auto"  # GPU only, the sampler's program alone (prefill + decode): "auto" (XLA's choice: autotuned Triton GEMMs), "cublas" (xla_gpu_enable_triton_gemm off; compiles faster), "triton_exhaustive" (every Triton tiling autotuned; compiles slower); bench_accel.py --gemm-ab measures them (docs/benchmarks.md)
    tail_halvings: int = -1  # continuous: times the busy rows may move into half as many slots once nothing is left to insert (each a decode program of its own); -1 = 2 with the unrolled decode, 0 with the scanned one (TPU), whose stage caches cost memory there


@dataclasses.dataclass(frozen=True)
class PPOOptimSettings(AdamWSettings):
    """AdamW of the policy and value models (the shared fields: `ppo_jax.config.AdamWSettings`)."""

    policy_lr: float = 1e-4  # policy peak learning rate
    value_lr: float = 1e-4  # value model peak learning rate
    eps: float = 1e-5  # Adam epsilon (1e-5, not 1e-8: the PPO implementations the literature compares use it)


@dataclasses.dataclass(frozen=True)
class PPOTrainSettings:
    """The loop: iterations, logging, evaluation, checkpoints."""

    iterations: int = 20  # PPO iterations (rollout + update)
    log_every: int = 1  # write metrics every N iterations
    sample_every: int = 5  # write (prompt, response, score, KL) samples every N iterations
    eval_every: int = 0  # evaluate on held-out prompts every N iterations; 0 = never
    eval_batches: int = 1  # held-out batches per evaluation
    checkpoint_every: int = 0  # save a checkpoint every N iterations; 0 = only at the end
    keep_checkpoints: int = 2  # checkpoints kept
    best_metric: str = ""  # also keep the best checkpoint by this metric (e.g. "eval/scores"); "" = off
    best_mode: str = "max"  # "max" or "min" for train.best_metric
    max_consecutive_nonfinite: int = 3  # stop after this many iterations in a row with skipped (non-finite) updates
    progress: bool = True  # tqdm progress bar

@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """Read by `ppo_jax.plan` only."""

    reward_model: ModelConfig | None = None  # reward-model architecture to plan with (None: reward.path's or the policy's)


@dataclasses.dataclass(frozen=True)
class Settings(RunSettings):
    """A whole PPO run's settings; `Settings.from_config(config, reward_in_code=...)` converts and
    validates."""

    seed: int = 0  # seeds parameter init, data order and sampling
    mesh: MeshSettings = MeshSettings()
    roles: RolesSettings = RolesSettings()  # where the sampler runs (rl/roles.py); training uses mesh.shape
    compute: ComputeSettings = ComputeSettings()  # kernels, layer loop and remat of all four models
    distributed: DistributedSettings = DistributedSettings()
    policy: PolicySettings = PolicySettings()
    reward: RewardSettings = RewardSettings()
    value: ValueSettings = ValueSettings()
    data: PromptDataSettings = PromptDataSettings()
    rollout: RolloutSettings = RolloutSettings()
    ppo: PPOLossSettings = PPOLossSettings()
    moe: MoeSettings = MoeSettings()  # mixture-of-experts policies (rl/router_replay.py)
    environment: EnvironmentSettings = EnvironmentSettings()  # multi-turn episodes (rl/environment_settings.py)
    dynamic_sampling: DynamicSamplingSettings = DynamicSamplingSettings()  # DAPO's (rl/dynamic_sampling.py)
    distill: DistillSettings = DistillSettings()  # on-policy distillation from a frozen teacher (rl/distill_settings.py)
    optim: PPOOptimSettings = PPOOptimSettings()
    train: PPOTrainSettings = PPOTrainSettings()
    plan: PlanSettings = PlanSettings()
    wandb: WandbSettings = WandbSettings()  # Weights & Biases logging (off by default)

    def replace(self, **sections) -> "Settings":
        return dataclasses.replace(self, **sections)

    @property
    def uses_critic(self) -> bool:
        return self.ppo.uses_critic

    def path_fields(self) -> tuple[tuple[str, str, str], ...]:
        return ((self.policy.path, "policy.path", HF_MODEL_DIR),
                (self.policy.lora.init_from, "policy.lora.init_from", PEFT_ADAPTER_DIR),
                (self.reward.path, "reward.path", HF_REWARD_DIR),
                (self.distill.teacher_path, "distill.teacher_path", HF_MODEL_DIR))

    def validate(self, *, reward_in_code: bool = False) -> None:
        """Every value that needs no mesh, model or tokenizer; the rest is in `derive_sizes`.

        reward_in_code: reward functions are passed in code, so a config without any reward is fine.
        """
        t = self.train
        self._validate_rollout()
        self.compute.validate()
        self.wandb.validate()
        self._validate_models()
        self._validate_ppo()
        r = self.rollout
        self.environment.validate(engine=r.engine, slots=r.slots, prefill_prompts=r.prefill_prompts,
                                  router_replay=self.moe.router_replay,
                                  chat_template=self.data.chat_template)
        self.dynamic_sampling.validate(num_samples=r.num_samples, multi_turn=self.environment.enabled,
                                       reward_model=bool(self.reward.path), scoring=self.roles.scoring)
        self.optim.validate("optim", {"policy_lr": self.optim.policy_lr, "value_lr": self.optim.value_lr})
        check(self.reward.missing_stop in ("none", "replace", "penalty"),
              f"reward.missing_stop={self.reward.missing_stop!r}: use none, replace or penalty")
        check(0 <= self.reward.overlong_buffer <= self.rollout.response_length and self.reward.overlong_penalty >= 0,
              f"reward.overlong_buffer={self.reward.overlong_buffer}, reward.overlong_penalty="
              f"{self.reward.overlong_penalty}: the buffer is 0 (off) to rollout.response_length tokens, the penalty >= 0")
        self.distill.validate(scoring=self.roles.scoring, dtypes=REFERENCE_DTYPES)
        check(reward_in_code or bool(self.reward.path) or bool(self.reward.functions) or self.environment.enabled
              or self.distill.enabled,
              "no reward: set reward.path (a reward model) and/or reward.functions (Python reward functions)")
        check(self.data.truncation in ("left", "error"), f"data.truncation={self.data.truncation!r}: use left or error")
        check(t.iterations >= 1, f"train.iterations must be >= 1, got {t.iterations}")
        check(t.keep_checkpoints >= 1, f"train.keep_checkpoints must be >= 1, got {t.keep_checkpoints}")
        check(t.best_mode in ("max", "min"), f"train.best_mode={t.best_mode!r}: use max or min")
        check(t.max_consecutive_nonfinite >= 1,
              f"train.max_consecutive_nonfinite must be >= 1, got {t.max_consecutive_nonfinite}")

    def _validate_rollout(self) -> None:
        """rollout.*: the batch, sampling, the engine, how far the sampler runs ahead."""
        r = self.rollout
        check(r.batch_size > 0, f"rollout.batch_size must be positive, got {r.batch_size}")
        check(r.num_samples >= 1, f"rollout.num_samples must be >= 1, got {r.num_samples}")
        check(r.response_length > 0, f"rollout.response_length must be positive, got {r.response_length}")
        check(self.data.prompt_length > 0, f"data.prompt_length must be positive, got {self.data.prompt_length}")
        check(r.temperature > 0 and math.isfinite(r.temperature),
              f"rollout.temperature must be > 0 (it divides the logits), got {r.temperature}")
        check(0 <= r.min_new_tokens <= r.response_length,
              f"rollout.min_new_tokens={r.min_new_tokens} must be in [0, rollout.response_length={r.response_length}]")
        check(r.top_k >= 0, f"rollout.top_k must be >= 0 (0 = off), got {r.top_k}")
        check(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
        check(r.steps_per_sync >= 0, f"rollout.steps_per_sync must be >= 0 (0: by platform), got {r.steps_per_sync}")
        check(r.decode in DECODE_LOOPS, f"rollout.decode={r.decode!r}: use one of {sorted(DECODE_LOOPS)}")
        check(r.engine in ENGINES, f"rollout.engine={r.engine!r}: use one of {', '.join(ENGINES)}")
        check_gemm("rollout.gemm", r.gemm)
        check(r.slots >= 0 and r.prefill_prompts >= 0,
              f"rollout.slots and rollout.prefill_prompts must be >= 0 (0 = automatic), got {r.slots} and "
              f"{r.prefill_prompts}")
        check(r.tail_halvings >= -1, f"rollout.tail_halvings must be >= 0 (or -1: by the decode loop), got "
              f"{r.tail_halvings}")
        check(r.engine == "continuous" or not (r.slots or r.prefill_prompts),
              f"rollout.slots={r.slots}, rollout.prefill_prompts={r.prefill_prompts} are settings of the continuous "
              f"engine: set rollout.engine=continuous, or leave them 0")
        stop_token_ids(r, None)  # parses
        check(0 <= r.off_policy_steps <= MAX_OFF_POLICY_STEPS,
              f"rollout.off_policy_steps={r.off_policy_steps}: use 0 (on-policy) to {MAX_OFF_POLICY_STEPS} "
              "(batches the sampler runs ahead of the trainer)")
        check(not r.partial_rollouts or r.engine == "continuous",
              "partial rollouts need rollout.engine=continuous (the static engine decodes every row in one call)")
        check(not r.partial_rollouts or r.off_policy_steps >= 1,
              "rollout.partial_rollouts needs rollout.off_policy_steps >= 1 (on-policy, no weight sync lands "
              "while a rollout is in flight)")
        check(not r.partial_rollouts or not self.environment.enabled or not r.slots,
              f"rollout.partial_rollouts with environment.name and rollout.slots={r.slots}: partial multi-turn "
              "rollouts keep a decode row per episode between their segments; set rollout.slots=0")

    def _validate_models(self) -> None:
        """The policy's and value model's LoRA and dtypes, and where the roles put the frozen models."""
        for field in ("policy.reference_dtype", "reward.param_dtype", "reward.dtype"):
            value = getattr(getattr(self, field.split(".")[0]), field.split(".")[1])
            check(value in REFERENCE_DTYPES, f"{field}={value!r}: use one of {REFERENCE_DTYPES} (\"\" = the policy's)")
        self.policy.lora.lora_config()  # LoraConfig's checks (the model family is checked with the model)
        check(not self.policy.reference_dtype or self.policy.lora.rank == 0 and not self.policy.lora.init_from,
              f"policy.reference_dtype={self.policy.reference_dtype!r} with a LoRA policy: the frozen base is the "
              "reference, held in the policy's dtype (policy.param_dtype); set policy.reference_dtype=\"\"")
        self.roles.validate()
        lora_policy = self.policy.lora.rank > 0 or bool(self.policy.lora.init_from)
        # A LoRA value model shares a frozen transformer: the reward model's, or without a LoRA policy the reference's.
        value_base_is_scorers = bool(self.value.lora.rank) and self.uses_critic and (
            self.value.init == "reward" or not lora_policy)
        check(self.roles.scoring == "trainer" or not value_base_is_scorers,
              "roles.scoring=sampler moves the reference and reward model to the sampler's mesh, but the LoRA value "
              f"model's frozen base is {'the reward model' if self.value.init == 'reward' else 'the reference'}'s "
              "transformer, which the trainer needs; use a full value model (value.lora.rank=0) or roles.scoring=trainer")
        check(self.roles.lora_sync == "adapters" or lora_policy,
              f"roles.lora_sync={self.roles.lora_sync!r} applies to a LoRA policy (policy.lora.rank > 0)")
        check(self.value.init in ("policy", "reward"), f"value.init={self.value.init!r}: use policy or reward")
        self.value.lora.lora_config()  # LoraConfig's checks, as policy.lora's
        check(self.value.lora.rank == 0 or self.uses_critic,
              f"value.lora.rank={self.value.lora.rank}, but ppo.advantage_estimator="
              f"{self.ppo.advantage_estimator!r} trains no value model; set value.lora.rank=0")
        if self.value.init == "reward" and self.uses_critic:
            check(bool(self.reward.path), "value.init='reward' needs reward.path (a reward model to start the "
                  "value model from)")

    def _validate_ppo(self) -> None:
        """ppo.* (`PPOLossSettings.validate`), with what it depends on elsewhere in the config."""
        check_gemm("ppo.gemm", self.ppo.gemm)
        self.ppo.validate(num_samples=self.rollout.num_samples, off_policy_steps=self.rollout.off_policy_steps,
                          scoring=self.roles.scoring)


def ppo_config() -> ml_collections.ConfigDict:
    """Default PPO config: a tiny GPT-2-shaped policy on the built-in toy task (runs on a CPU)."""
    return config_dict(Settings())


def stop_token_ids(rollout: RolloutSettings, default_eos: int | None) -> tuple[int, ...]:
    spec = rollout.stop_token_ids
    if spec:
        try:
            return tuple(int(x) for x in str(spec).split(","))
        except ValueError:
            raise ConfigError(f"rollout.stop_token_ids={spec!r}: use comma-separated integers") from None
    return (default_eos,) if default_eos is not None else ()
