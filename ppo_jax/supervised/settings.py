"""SFT, reward-model and DPO settings: their schemas (every field with its default and a one-line
comment) and validation. `sft_config()` / `reward_model_config()` / `dpo_config()` are the ConfigDicts
that files under `configs/` start from; the trainers convert one, once, with `SFTSettings.from_config`
/ `RewardModelSettings.from_config` / `DPOSettings.from_config`. Field names match the PPO settings'
where the idea is the same (model.lora.* is PPO's policy.lora.*: `ppo_jax.config.LoraSettings`).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from ppo_jax.config import (HF_MODEL_DIR, HF_TOKENIZER_DIR, AdamWSettings, ComputeSettings, LoraSettings, MeshSettings,
                            RunSettings, WandbSettings, check, config_dict)
from ppo_jax.models.config import ModelConfig
from ppo_jax.models.moe import RouterCoefs
from ppo_jax.supervised.dpo_loss import LOSS_TYPES

NORMALIZE_SOURCES = ("none", "policy", "preferences")
# train.lora_export: a LoRA run's export as full weights with the adapters folded in, or as a PEFT
# adapter directory (causal LMs only: the reward model's new score head has no PEFT home we write).
LORA_EXPORTS = ("merged", "adapter")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The model to start from."""

    path: str = ""  # Hugging Face directory to start from; "" = a fresh model from model.config
    config: ModelConfig = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                                      max_position_embeddings=128)  # architecture when model.path is "" (vocab_size >= the tokenizer's)
    param_dtype: str = ""  # override parameter dtype ("" = keep the checkpoint's / model's)
    dtype: str = ""  # override compute dtype ("" = keep)
    # LoRA: model.lora.rank > 0 trains low-rank adapters (and the reward model's head) on a frozen base
    # (model.path or the seed's init); model.lora.alpha, model.lora.targets as PPO's policy.lora.*
    lora: LoraSettings = LoraSettings()
    router_aux_coef: float = 0.0  # mixture-of-experts models: load-balancing loss coefficient (transformers' router_aux_loss_coef, e.g. 0.001); 0 = off
    router_z_coef: float = 0.0  # mixture-of-experts models: router z-loss coefficient (e.g. 0.001); 0 = off

    def validate(self, what: str) -> None:
        """LoraConfig's own checks, the field named; the model family is checked with the model."""
        self.lora.lora_config(f"{what}: model")
        check(self.router_aux_coef >= 0 and self.router_z_coef >= 0,
              f"{what}: model.router_aux_coef and model.router_z_coef must be >= 0, got {self.router_aux_coef} "
              f"and {self.router_z_coef}")

    @property
    def router(self) -> RouterCoefs | None:
        """The router losses' coefficients, None when both are off."""
        return RouterCoefs(self.router_aux_coef, self.router_z_coef) if self.router_aux_coef or self.router_z_coef else None


@dataclasses.dataclass(frozen=True)
class SupervisedTrainSettings:
    batch_size: int = 32  # examples per optimizer step (global, across all devices and hosts)
    steps: int = 1000  # optimizer steps
    log_every: int = 10  # write training metrics every N steps
    eval_every: int = 0  # evaluate on data.eval every N steps (0 = only at the end, when data.eval is given)
    eval_batches: int = 0  # eval batches per evaluation; 0 = the whole eval set
    checkpoint_every: int = 0  # save a checkpoint every N steps; 0 = only at the end
    keep_checkpoints: int = 2  # checkpoints kept
    export: bool = True  # write a Hugging Face checkpoint to <workdir>/hf at the end
    # with model.lora.rank > 0, what train.export writes: "merged" (full weights, adapters folded in) or
    # "adapter" (a PEFT adapter directory for model.path; causal LMs only)
    lora_export: str = "merged"
    progress: bool = True  # tqdm progress bar

    def validate(self, what: str) -> None:
        check(self.batch_size >= 1, f"{what}: train.batch_size must be >= 1, got {self.batch_size}")
        check(self.steps >= 1, f"{what}: train.steps must be >= 1, got {self.steps}")
        for name in ("eval_every", "eval_batches", "checkpoint_every"):
            check(getattr(self, name) >= 0, f"{what}: train.{name} must be >= 0, got {getattr(self, name)}")
        check(self.log_every >= 1, f"{what}: train.log_every must be >= 1, got {self.log_every}")
        check(self.keep_checkpoints >= 1, f"{what}: train.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        check(self.lora_export in LORA_EXPORTS,
              f"{what}: train.lora_export={self.lora_export!r}: use one of {', '.join(LORA_EXPORTS)}")


def _validate_lora_export(model: ModelSettings, train: SupervisedTrainSettings, what: str) -> None:
    """An adapter export needs adapters, and a base on disk for them to apply to."""
    if train.lora_export != "adapter":
        return
    check(model.lora.rank > 0, f"{what}: train.lora_export='adapter' needs model.lora.rank > 0 (there are no "
                               "adapters without LoRA); use merged")
    check(bool(model.path), f"{what}: train.lora_export='adapter' needs model.path: the adapters apply to that "
                            "base, and a fresh base (model.path \"\") is written nowhere; use merged")


@dataclasses.dataclass(frozen=True)
class DPOTrainSettings(SupervisedTrainSettings):
    num_microbatches: int = 1  # gradient-accumulation slices per batch: the same update in less memory

    def validate(self, what: str) -> None:
        super().validate(what)
        check(self.num_microbatches >= 1, f"{what}: train.num_microbatches must be >= 1, got {self.num_microbatches}")
        check(self.batch_size % self.num_microbatches == 0,
              f"{what}: train.batch_size={self.batch_size} does not split into train.num_microbatches="
              f"{self.num_microbatches} equal microbatches")


@dataclasses.dataclass(frozen=True)
class SupervisedOptimSettings(AdamWSettings):
    """AdamW (the shared fields: `ppo_jax.config.AdamWSettings`)."""

    lr: float = 1e-3  # peak learning rate
    schedule: str = "cosine"  # after warmup: "constant", "linear" (to 0) or "cosine" (to 0)
    warmup_steps: int = 20  # optimizer steps of linear warmup


@dataclasses.dataclass(frozen=True)
class SFTDataSettings:
    train: str = ""  # JSONL file of {prompt, response} records; "" = records passed in code
    eval: str = ""  # held-out JSONL file; "" = none (or records passed in code)
    prompt_field: str = "prompt"  # JSONL field holding the prompt
    response_field: str = "response"  # JSONL field holding the response
    max_prompt_length: int = 16  # longest prompt kept, in tokens
    max_response_length: int = 32  # longest response kept, in tokens including its EOS
    truncation: str = "left"  # over-long examples: "left" (cut and count them) or "error"


@dataclasses.dataclass(frozen=True)
class PreferenceDataSettings:
    train: str = ""  # JSONL file of {prompt, chosen, rejected} records; "" = records passed in code
    eval: str = ""  # held-out JSONL file (validation accuracy); "" = none (or records passed in code)
    prompt_field: str = "prompt"  # JSONL field holding the prompt
    chosen_field: str = "chosen"  # JSONL field holding the preferred response
    rejected_field: str = "rejected"  # JSONL field holding the other response
    max_prompt_length: int = 16  # longest prompt kept, in tokens (use the PPO data.prompt_length)
    # longest response, tokens incl. EOS (use the PPO rollout.response_length: a longer response is cut
    # without EOS, as an unfinished rollout is)
    max_response_length: int = 32
    truncation: str = "left"  # over-long examples: "left" (cut and count them) or "error"


@dataclasses.dataclass(frozen=True)
class DPOLossSettings:
    type: str = "sigmoid"  # "sigmoid" (DPO; conservative DPO with label_smoothing > 0) or "ipo" (on per-token mean log-ratios, as TRL)
    beta: float = 0.1  # strength of the implicit KL leash to the reference: larger stays closer
    label_smoothing: float = 0.0  # conservative DPO: the assumed chance a label is flipped, in [0, 0.5); sigmoid only
    sft_coef: float = 0.0  # weight of the chosen answers' token-mean NLL added to the loss (RPO); 0 = none

    def validate(self, what: str) -> None:
        check(self.type in LOSS_TYPES, f"{what}: loss.type={self.type!r}: use one of {LOSS_TYPES}")
        check(self.beta > 0, f"{what}: loss.beta must be > 0, got {self.beta}")
        check(0 <= self.label_smoothing < 0.5,
              f"{what}: loss.label_smoothing must be in [0, 0.5) (0.5 would make every label a coin flip), "
              f"got {self.label_smoothing}")
        check(self.type == "sigmoid" or self.label_smoothing == 0,
              f"{what}: loss.label_smoothing={self.label_smoothing} applies to loss.type='sigmoid' only, "
              f"not {self.type!r}")
        check(self.sft_coef >= 0, f"{what}: loss.sft_coef must be >= 0, got {self.sft_coef}")


def _validate_lengths(d, what: str) -> None:
    check(d.max_prompt_length >= 1, f"{what}: data.max_prompt_length must be >= 1, got {d.max_prompt_length}")
    check(d.max_response_length >= 1,
          f"{what}: data.max_response_length must be >= 1 (it includes the EOS), got {d.max_response_length}")
    check(d.truncation in ("left", "error"), f"{what}: data.truncation={d.truncation!r}: use left or error")


@dataclasses.dataclass(frozen=True)
class PackingSettings:
    """Host packing of a supervised step (data/host_packing.py): the SFT examples, or a reward model's
    chosen and rejected answers, of a step placed into fewer, longer rows, attention within each
    sequence (a reward model reads each score at its sequence's last slot): the same loss on fewer slots.
    A batch that does not fit runs padded (a second compiled step). One process only; the rows are
    rounded up to a multiple of the mesh's batch split."""

    rows: int = 0  # packed rows a step; 0 = off (padded rows)
    length: int = 0  # slots per packed row, >= data.max_prompt_length + data.max_response_length; 0 = twice that

    def validate(self, what: str, padded_length: int) -> None:
        check(self.rows >= 0, f"{what}: packing.rows must be >= 0 (0 = off), got {self.rows}")
        check(self.length == 0 or self.length >= padded_length,
              f"{what}: packing.length={self.length} is shorter than one example (data.max_prompt_length + "
              f"data.max_response_length = {padded_length}); use 0 (twice that) or at least {padded_length}")

    def shape(self, padded_length: int) -> tuple[int, int] | None:
        """(rows, slots per row) of a step's packed sequences; None: padded rows (packing off)."""
        return (self.rows, self.length or 2 * padded_length) if self.rows else None


@dataclasses.dataclass(frozen=True)
class NormalizeSettings:
    # samples to normalise on: "none", "policy" (sample normalize.policy_path) or "preferences" (the chosen
    # and rejected responses of data.train)
    source: str = "none"
    policy_path: str = ""  # causal LM to sample from for source="policy"; "" = model.path
    num_prompts: int = 512  # prompts (policy) or pairs (preferences) to normalise on
    temperature: float = 1.0  # sampling temperature for source="policy" (use the PPO rollout temperature)


@dataclasses.dataclass(frozen=True)
class SFTSettings(RunSettings):
    seed: int = 0  # seeds parameter init and data order
    mesh: MeshSettings = MeshSettings()
    compute: ComputeSettings = ComputeSettings()  # attention kernel, layer loop, remat
    model: ModelSettings = ModelSettings()
    tokenizer_path: str = ""  # Hugging Face tokenizer directory; "" = model.path's (a tokenizer passed in code wins)
    data: SFTDataSettings = SFTDataSettings()
    packing: PackingSettings = PackingSettings()  # the examples of a step packed into fewer rows (off by default)
    train: SupervisedTrainSettings = SupervisedTrainSettings(steps=1000)
    optim: SupervisedOptimSettings = SupervisedOptimSettings(lr=1e-3)
    wandb: WandbSettings = WandbSettings()  # Weights & Biases logging (off by default)

    def path_fields(self) -> tuple[tuple[str, str, str], ...]:
        what = "sft"
        return ((self.model.path, f"{what}: model.path", HF_MODEL_DIR),
                (self.tokenizer_path, f"{what}: tokenizer_path", HF_TOKENIZER_DIR),)

    def validate(self) -> None:
        self.compute.validate("sft: compute")
        self.wandb.validate("sft: wandb")
        self.model.validate("sft")
        self.train.validate("sft")
        _validate_lora_export(self.model, self.train, "sft")
        self.optim.validate("sft: optim", {"lr": self.optim.lr})
        _validate_lengths(self.data, "sft")
        self.packing.validate("sft", self.data.max_prompt_length + self.data.max_response_length)


@dataclasses.dataclass(frozen=True)
class RewardModelSettings(RunSettings):
    seed: int = 0  # seeds the head init, data order and normalisation samples
    mesh: MeshSettings = MeshSettings()
    compute: ComputeSettings = ComputeSettings()  # attention kernel, layer loop, remat
    # model.path: a causal LM (the SFT model: its transformer, a fresh head) or a reward model; "" = fresh
    model: ModelSettings = ModelSettings()
    tokenizer_path: str = ""  # Hugging Face tokenizer directory; "" = model.path's (a tokenizer passed in code wins)
    data: PreferenceDataSettings = PreferenceDataSettings()
    packing: PackingSettings = PackingSettings()  # the answers of a step packed into fewer rows (off by default)
    normalize: NormalizeSettings = NormalizeSettings()
    train: SupervisedTrainSettings = SupervisedTrainSettings(steps=500)
    optim: SupervisedOptimSettings = SupervisedOptimSettings(lr=3e-4)
    wandb: WandbSettings = WandbSettings()  # Weights & Biases logging (off by default)

    def path_fields(self) -> tuple[tuple[str, str, str], ...]:
        what = "reward_model"
        return ((self.model.path, f"{what}: model.path", HF_MODEL_DIR),
                (self.tokenizer_path, f"{what}: tokenizer_path", HF_TOKENIZER_DIR),
                (self.normalize.policy_path, f"{what}: normalize.policy_path", HF_MODEL_DIR),)

    def validate(self) -> None:
        what = "reward_model"
        self.compute.validate(f"{what}: compute")
        self.wandb.validate(f"{what}: wandb")
        self.model.validate(what)
        self.train.validate(what)
        # A PEFT directory cannot carry our new score head (it would need modules_to_save): merged only.
        check(self.train.lora_export == "merged",
              f"{what}: train.lora_export={self.train.lora_export!r}: a reward model exports merged only (its "
              "score head is trained from scratch and is not a LoRA adapter)")
        self.optim.validate(f"{what}: optim", {"lr": self.optim.lr})
        _validate_lengths(self.data, what)
        self.packing.validate(what, self.data.max_prompt_length + self.data.max_response_length)
        n = self.normalize
        check(n.source in NORMALIZE_SOURCES, f"{what}: normalize.source={n.source!r}: use one of {NORMALIZE_SOURCES}")
        if n.source != "none":
            check(n.num_prompts >= 2, f"{what}: normalize.num_prompts must be >= 2, got {n.num_prompts}")
        if n.source == "policy":
            check(bool(n.policy_path or self.model.path),
                  f"{what}: normalize.source='policy' needs normalize.policy_path (or model.path): the policy "
                  "whose samples should score mean 0")
            check(n.temperature > 0, f"{what}: normalize.temperature must be > 0, got {n.temperature}")


@dataclasses.dataclass(frozen=True)
class DPOSettings(RunSettings):
    seed: int = 0  # seeds a fresh model's init and the data order
    mesh: MeshSettings = MeshSettings()
    compute: ComputeSettings = ComputeSettings()  # attention kernel, layer loop, remat
    # model.path: the causal LM to start from (usually the SFT model); it is also the frozen reference (with
    # model.lora: the frozen base, run with the adapters off)
    model: ModelSettings = ModelSettings()
    tokenizer_path: str = ""  # Hugging Face tokenizer directory; "" = model.path's (a tokenizer passed in code wins)
    data: PreferenceDataSettings = PreferenceDataSettings()
    loss: DPOLossSettings = DPOLossSettings()
    train: DPOTrainSettings = DPOTrainSettings(steps=500)
    optim: SupervisedOptimSettings = SupervisedOptimSettings(lr=1e-4)
    wandb: WandbSettings = WandbSettings()  # Weights & Biases logging (off by default)

    def path_fields(self) -> tuple[tuple[str, str, str], ...]:
        what = "dpo"
        return ((self.model.path, f"{what}: model.path", HF_MODEL_DIR),
                (self.tokenizer_path, f"{what}: tokenizer_path", HF_TOKENIZER_DIR),)

    def validate(self) -> None:
        what = "dpo"
        self.compute.validate(f"{what}: compute")
        self.wandb.validate(f"{what}: wandb")
        self.model.validate(what)
        self.train.validate(what)
        _validate_lora_export(self.model, self.train, what)
        self.optim.validate(f"{what}: optim", {"lr": self.optim.lr})
        self.loss.validate(what)
        _validate_lengths(self.data, what)


def sft_config() -> ml_collections.ConfigDict:
    """Default SFT config: every field commented (above). Files under configs/ override what they need."""
    return config_dict(SFTSettings())


def reward_model_config() -> ml_collections.ConfigDict:
    """Default reward-model config: every field commented (above). Files under configs/ override it."""
    return config_dict(RewardModelSettings())


def dpo_config() -> ml_collections.ConfigDict:
    """Default DPO config: every field commented (above). Files under configs/ override it."""
    return config_dict(DPOSettings())
