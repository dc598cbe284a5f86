"""Settings: the one step from an `ml_collections` ConfigDict to typed, frozen, validated sections.

Every trainer's schema is a tree of frozen dataclasses (`ppo_jax.rl.settings`,
`ppo_jax.supervised.settings`, `ppo_jax.demo.settings`): field, default and a one-line comment in one
place. `config_dict(schema)` turns the defaults into the ConfigDict that files under `configs/` start
from and the command line overrides; `from_config(schema_type, config)` turns it back, once, at the
edge of the library. Below that edge nothing sees a ConfigDict. Each value is checked in one place,
the section's `validate()`, with a message that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from ppo_jax.models.config import ATTENTION_KINDS, REMAT_POLICIES, LoraConfig, ModelConfig, cudnn_head_dim


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field and the fix."""


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


HF_MODEL_DIR = "a Hugging Face model directory (config.json and *.safetensors)"
HF_REWARD_DIR = ("a Hugging Face ForSequenceClassification directory (config.json and *.safetensors), "
                 "e.g. a reward-model run's <workdir>/hf")
HF_TOKENIZER_DIR = "a Hugging Face tokenizer directory (tokenizer.json or the files of save_pretrained)"
PEFT_ADAPTER_DIR = "a PEFT LoRA adapter directory (adapter_config.json and adapter_model.safetensors)"


def check_directory(path: str, field: str, holds: str) -> None:
    """A path field ("" = unset) names an existing directory, or one line naming the field and what it
    should hold, before anything is built."""
    if not path:
        return
    check(os.path.exists(path), f"{field}={path!r} does not exist: it should be {holds}")
    check(os.path.isdir(path), f"{field}={path!r} is a file, not a directory: it should be {holds}")


# ----------------------------------------------------------------------------------------------
# Schema <-> ConfigDict.


def leaf_type(hint) -> type:
    """The concrete type of a field (`int | None` -> int), for ConfigDict placeholders and coercion."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and args:
        hint = args[0]
    origin = typing.get_origin(hint) or hint
    return origin if isinstance(origin, type) else object


def type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def config_dict(section: Any) -> ml_collections.ConfigDict:
    """The ConfigDict of a settings dataclass instance (nested sections become nested ConfigDicts)."""
    hints = type_hints(type(section))
    out = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = config_dict(value)
        elif value is None:
            # ConfigDict needs a type per field: a None default becomes a typed placeholder.
            kind = leaf_type(hints[f.name])
            out[f.name] = (ml_collections.config_dict.placeholder(ml_collections.ConfigDict)
                           if dataclasses.is_dataclass(kind) else ml_collections.config_dict.placeholder(kind))
        else:
            out[f.name] = value
    return ml_collections.ConfigDict(out)


def _coerce(value: Any, kind: type, where: str) -> Any:
    if value is None:
        return None
    if kind is ModelConfig:
        return model_config_from_dict(value)
    if dataclasses.is_dataclass(kind):
        return from_config(kind, value, where)
    if kind is bool:
        check(isinstance(value, (bool, int)), f"{where} must be true or false, got {value!r}")
        return bool(value)
    if kind in (int, float):
        check(isinstance(value, (int, float)) and not isinstance(value, bool),
              f"{where} must be a number, got {value!r}")
        if kind is int:
            check(float(value).is_integer(), f"{where} must be a whole number, got {value!r}")
        return kind(value)
    if kind is tuple:
        return tuple(value)
    if kind is str:
        return str(value)
    return value


def from_config(schema: type, config: Mapping[str, Any] | ml_collections.ConfigDict | Any, where: str = ""):
    """The typed section `schema` read from a ConfigDict / mapping (or returned as is when it already
    is one). Unknown keys are refused by name; missing keys keep their defaults."""
    if isinstance(config, schema):
        return config
    if isinstance(config, ml_collections.ConfigDict):
        config = config.to_dict()
    hints = type_hints(schema)
    names = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(set(config) - names)
    prefix = f"{where}." if where else ""
    check(not unknown, f"unknown config field(s) {', '.join(prefix + u for u in unknown)}; "
          f"the section has {', '.join(sorted(names))}")
    values = {name: _coerce(value, leaf_type(hints[name]), prefix + name) for name, value in config.items()}
    return schema(**values)


class RunSettings:
    """Base of a whole run's settings (a frozen dataclass tree): converted and validated in one call."""

    @classmethod
    def from_config(cls, config, **checks):
        """The typed settings of a ConfigDict (or of settings, validated again); `checks` go to
        `validate`."""
        settings = from_config(cls, config)
        settings.validate(**checks)
        settings.check_paths()
        return settings

    def validate(self, **checks) -> None:
        raise NotImplementedError

    def path_fields(self) -> tuple[tuple[str, str, str], ...]:
        """(path, its field's name, what it should hold) of every directory the run reads."""
        return ()

    def check_paths(self) -> None:
        """Every path field names an existing directory (separate from `validate`: the demo validates
        its stages before the directories they read are written)."""
        for path, field, holds in self.path_fields():
            check_directory(path, field, holds)


def to_dict(section: Any) -> dict[str, Any]:
    """JSON-serialisable copy of a settings tree (for checkpoints and run records)."""
    return dataclasses.asdict(section)


# ----------------------------------------------------------------------------------------------
# Sections every trainer shares.


def model_config_dict(**overrides) -> ml_collections.ConfigDict:
    """A ConfigDict with every ModelConfig field (for models built from scratch)."""
    return config_dict(ModelConfig(**overrides))


def model_config_from_dict(d: ml_collections.ConfigDict | Mapping[str, Any] | ModelConfig) -> ModelConfig:
    if isinstance(d, ModelConfig):
        return d
    d = dict(d.to_dict() if isinstance(d, ml_collections.ConfigDict) else d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = tuple(tuple(x) for x in d["rope_scaling"])
    return ModelConfig(**d)


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    # (data, fsdp, tensor), (data, fsdp, tensor, expert) or (data, fsdp, tensor, expert, context); one entry
    # may be -1 = all remaining devices
    shape: tuple = (1, -1, 1)


FLOAT32_MAX = 3.4028234663852886e38
# Adam's first moment may be stored in a narrower dtype than the parameters. The second moment is not
# offered: squared gradients span more range than bfloat16's 8 mantissa bits keep useful.
MOMENT_DTYPES = ("", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class AdamWSettings:
    """AdamW behind global-norm clipping, with linear warmup then a schedule (`ppo_jax.optim`).

    The learning rate(s) live in each trainer's own optim section (PPO has one per trainable model).
    """

    schedule: str = "constant"  # after warmup: "constant", "linear" (to 0) or "cosine" (to 0)
    warmup_steps: int = 0  # optimizer steps of linear warmup
    weight_decay: float = 0.0  # AdamW weight decay
    b1: float = 0.9  # Adam beta1
    b2: float = 0.999  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    eps_root: float = 0.0  # epsilon inside the square root (TF-style Adam places epsilon here)
    max_grad_norm: float = 1.0  # global-norm gradient clipping; 0 = off
    mu_dtype: str = ""  # dtype of Adam's first moment ("" = the parameters'; "bfloat16" halves it for float32 params)

    def validate(self, prefix: str = "optim", learning_rates: Mapping[str, float] = ()) -> None:
        for name, lr in dict(learning_rates).items():
            # A Python float beyond float32's range is "finite" here but inf on the devices.
            check(0 <= lr <= FLOAT32_MAX, f"{prefix}.{name} must be >= 0 and at most float32's largest value "
                                          f"({FLOAT32_MAX:.3g}), got {lr}")
        for name in ("weight_decay", "max_grad_norm", "warmup_steps", "eps_root"):
            value = getattr(self, name)
            check(value >= 0 and math.isfinite(value), f"{prefix}.{name} must be >= 0 and finite, got {value}")
        for name in ("b1", "b2"):
            value = getattr(self, name)
            check(0 <= value < 1, f"{prefix}.{name} must be in [0, 1), got {value}")
        check(self.eps > 0 and math.isfinite(self.eps), f"{prefix}.eps must be finite and > 0, got {self.eps}")
        check(self.schedule in ("constant", "linear", "cosine"),
              f"{prefix}.schedule={self.schedule!r}: use constant, linear or cosine")
        check(self.mu_dtype in MOMENT_DTYPES,
              f"{prefix}.mu_dtype={self.mu_dtype!r}: use one of {MOMENT_DTYPES} (\"\" = the parameters' dtype)")


DECODE_PROJECTIONS = ("auto", "merged", "apart")
PRECOMPILE = ("auto", "on", "off")
# compute.decode_projections="auto": ModelConfig.merge_decode_projections_above on a GPU. XLA:GPU's dot
# merger joins the projections itself while each kernel is at most 32 MiB; past that one GEMM over both
# of Llama-3-8B's gate and up ran 1.41x faster than two (H200, docs/benchmarks.md). Elsewhere nothing
# has measured it, so "auto" leaves XLA:CPU and XLA:TPU alone.
GPU_DOT_MERGER_LIMIT = 32 << 20


@dataclasses.dataclass(frozen=True)
class ComputeSettings:
    """How every model of the run executes (kernels, layer loop, remat): never what it computes.

    "auto" picks what was measured fastest on the platform the run is on (docs/gpu_probe.md): on a GPU,
    cuDNN flash attention (when computing in bf16/fp16), an update without remat where it fits the
    devices' memory and full remat where not (`rl/remat_choice.py`) and unscanned per-layer params
    (scanned when FSDP shards them); on a TPU, splash attention (the fused kernel, DESIGN.md §8; not
    yet timed on a TPU) and scanned layers; elsewhere the einsum attention and the scanned layers,
    whose compile is the fastest. The platform is this
    process's backend, or the one a plan compiles for (`platform=`: the planner compiles GPU programs
    on a CPU host, and they must be the programs a GPU run would build).
    """

    attention: str = "auto"  # "auto", "einsum" (reference, any platform), "cudnn" (GPU, bf16/fp16), "xla" or "splash" (TPU)
    layer_loop: str = "auto"  # "auto" (unrolled on a GPU whose layers FSDP does not shard, else scan), "scan" (stacked [L, ...] params) or "unrolled" (per-layer params)
    remat: str = "auto"  # "auto" (on a GPU, unless the model sets remat: the update without remat where XLA's buffer assignment says it fits the devices' free memory, else "full", rl/remat_choice.py; elsewhere "keep"), "keep" the model's own setting, "none", "full" (save nothing) or "dots" (keep matmuls)
    decode_projections: str = "auto"  # a decode step's projections that share their input (q/k/v, gate/up): "auto" (one GEMM on a GPU where a kernel is past XLA's dot-merger limit, 32 MiB), "merged" (one GEMM always), "apart" (each its own dot)
    precompile: str = "auto"  # PPO: the sampler, experience and update programs compiled side by side before the first iteration (rl/precompile.py): "auto" (on a GPU or TPU), "on", "off" (each at its first call)
    compilation_cache: str = "auto"  # jax's persistent compilation cache: "auto" (jax's own setting if one is made, else ~/.cache/ppo_jax/xla, at most 4 GiB), a directory, or "" (off)

    def validate(self, prefix: str = "compute") -> None:
        check(self.attention in ("auto",) + ATTENTION_KINDS,
              f"{prefix}.attention={self.attention!r}: use auto, {', '.join(ATTENTION_KINDS)}")
        check(self.layer_loop in ("auto", "scan", "unrolled"),
              f"{prefix}.layer_loop={self.layer_loop!r}: use auto, scan or unrolled")
        check(self.decode_projections in DECODE_PROJECTIONS,
              f"{prefix}.decode_projections={self.decode_projections!r}: use {', '.join(DECODE_PROJECTIONS)}")
        check(self.precompile in PRECOMPILE, f"{prefix}.precompile={self.precompile!r}: use {', '.join(PRECOMPILE)}")
        check(self.remat in ("auto", "keep", "none") + REMAT_POLICIES,
              f"{prefix}.remat={self.remat!r}: use auto, keep, none, {', '.join(REMAT_POLICIES)}")

    def execution(self, cfg: ModelConfig, platform: str | None = None, fsdp: int = 1) -> dict[str, Any]:
        """The ModelConfig execution fields this section sets for the model `cfg`, "auto" resolved for
        `platform` ("cpu", "gpu", "tpu"; None: this process's backend) and a mesh whose fsdp axis has
        `fsdp` devices."""
        platform = platform or jax.default_backend()
        on_gpu = platform == "gpu"
        attention = self.attention
        if attention == "auto":
            # cuDNN's fused call cannot soft-cap scores (Gemma 2): such models run the einsum kernel.
            # Splash can, in any dtype.
            fusable = (cfg.jnp_dtype in (jnp.bfloat16, jnp.float16) and cfg.attn_logit_softcap is None
                       and cudnn_head_dim(cfg.dim_per_head))
            attention = "splash" if platform == "tpu" else "cudnn" if on_gpu and fusable else "einsum"
        # Per-layer params on one GPU (or replicated weights); scanned layers when FSDP shards them:
        # unrolled, XLA:GPU gathers every layer's weights up front (Llama-3-70B + 8B on 8 H200s,
        # compile-only: sampler peak 144.8 GiB unrolled, 86.1 scanned; docs/benchmarks.md).
        loop = self.layer_loop if self.layer_loop != "auto" else ("unrolled" if on_gpu and fsdp == 1 else "scan")
        if cfg.moe_layers is not None:  # dense and MoE layers cannot share one scanned body
            check(self.layer_loop != "scan", "compute.layer_loop='scan': this model mixes dense and MoE layers "
                  "(moe_layers), which run as per-layer params only; use auto or unrolled")
            loop = "unrolled"
        merge = {"merged": 0, "apart": None}.get(self.decode_projections, GPU_DOT_MERGER_LIMIT if on_gpu else None)
        out = dict(attention=attention, scan_layers=loop == "scan", merge_decode_projections_above=merge)
        remat = self.remat
        if remat == "auto":
            # Full remat frees most of the update's activations (the fp32-master TinyLlama update needs
            # it to fit its 40 GiB target, compile-only: 36.6 GiB, dots 44.7) but costs +21% of a bf16
            # update (H200, 2026-11-27). Every program is built with it; the update alone is compiled
            # without it first and keeps that where it fits (rl/remat_choice.py, in build_steps).
            remat = "full" if on_gpu and not cfg.remat else "keep"
        if remat == "none":
            out["remat"] = False
        elif remat != "keep":
            out.update(remat=True, remat_policy=remat)
        return out

    def apply(self, cfg: ModelConfig, platform: str | None = None, fsdp: int = 1) -> ModelConfig:
        """`cfg` as a run on `platform` (None: this process's backend) executes it (checked: cuDNN
        attention needs a GPU and a bf16/fp16 compute dtype). Reads the backend, so it runs after
        `jax.distributed.initialize`, never in validate()."""
        platform = platform or jax.default_backend()
        for kind, needs in (("cudnn", "gpu"), ("splash", "tpu")):
            check(self.attention != kind or platform == needs,
                  f"compute.attention={kind!r} needs a {needs.upper()}, but this run's platform is {platform}; "
                  "use auto or einsum")
        try:
            return cfg.replace(**self.execution(cfg, platform, fsdp))
        except ValueError as err:
            raise ConfigError(str(err).replace("model.attention", "compute.attention")) from None

    def enable_compilation_cache(self) -> str | None:
        """Points jax's persistent compilation cache at `compilation_cache`, so a rerun or a resumed
        run skips the compile of every program it has compiled before. Returns the directory in use
        (None: off).

        "auto" leaves a cache the user configured for jax (`JAX_COMPILATION_CACHE_DIR`,
        `jax.config`) as it is; otherwise it uses one per user, shared by every run: the cache key is
        the program, the devices and the flags, so runs of different models never collide, and the
        least recently used entries go once it passes `AUTO_CACHE_MAX_BYTES`."""
        if not self.compilation_cache:
            return None
        if self.compilation_cache == "auto":
            configured = jax.config.jax_compilation_cache_dir
            if configured:
                return configured
            directory = os.path.expanduser(AUTO_CACHE_DIR)
            if jax.config.jax_compilation_cache_max_size == -1:
                jax.config.update("jax_compilation_cache_max_size", AUTO_CACHE_MAX_BYTES)
        else:
            directory = os.path.expanduser(self.compilation_cache)
        jax.config.update("jax_compilation_cache_dir", directory)
        # Only programs worth caching: the tiny ones recompile faster than a disk round trip.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        return directory


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """LoRA: train low-rank adapters (`ppo_jax.models.lora`) on a frozen base. The block of PPO's
    `policy.lora` and of the supervised trainers' `model.lora`; `where` (the block's parent, e.g.
    "policy" or "sft: model") names the field in every error."""

    rank: int = 0  # adapter rank; 0 = off (every parameter trains)
    alpha: float = 16.0  # adapter scale = alpha / rank
    targets: str = "q,k,v,o"  # comma-separated projections to adapt: q,k,v,o,fc,proj (GPT-2) or q,k,v,o,gate,up,down (Llama family)

    def lora_config(self, where: str) -> LoraConfig | None:
        """The model's LoraConfig, None when off; raises ConfigError naming the bad field."""
        if self.rank == 0:
            return None
        targets = tuple(t.strip() for t in self.targets.split(",") if t.strip())
        try:
            return LoraConfig(rank=self.rank, alpha=self.alpha, targets=targets)
        except ValueError as err:  # LoraConfig's own checks ("lora.rank ..."), with the field's full name
            raise ConfigError(f"{where}.{err}") from None

    def apply(self, cfg: ModelConfig, where: str) -> ModelConfig:
        """`cfg` with these adapters (`with_lora`)."""
        return with_lora(cfg, self.lora_config(where), where)


def with_lora(cfg: ModelConfig, lora: LoraConfig | None, where: str) -> ModelConfig:
    """`cfg` with `lora` as its adapters (None: off, whatever `cfg` said); a target the model family
    lacks (gate on GPT-2) is a ConfigError naming `<where>.lora.targets`."""
    try:
        return cfg.replace(lora=lora)
    except ValueError as err:
        raise ConfigError(f"{where}.{err}") from None


WANDB_MODES = ("disabled", "online", "offline")
WANDB_INSTALL = 'pip install "ppo_jax[wandb]"'


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    """Weights & Biases: the run's metrics (the names and steps of metrics.jsonl), its config, its samples
    (a table) and plots mirrored to a W&B run (`ppo_jax.wandb_run`). Off unless `mode` asks for it: the
    package is then imported, and only then (the `[wandb]` extra)."""

    mode: str = "disabled"  # "disabled" (nothing to W&B), "online" (sent as the run goes) or "offline" (files under the workdir; `wandb sync` sends them later)
    project: str = "ppo_jax"  # W&B project
    entity: str = ""  # W&B team or user; "" = the account's default
    name: str = ""  # run name; "" = the workdir's name
    group: str = ""  # runs shown together; "" = $WANDB_RUN_GROUP (a sweep sets it to its name), else none
    tags: tuple = ()  # W&B tags, e.g. ("baseline", "kl-sweep")

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"

    def validate(self, prefix: str = "wandb") -> None:
        """The mode, and with W&B on, the package: one line naming the extra, before anything compiles."""
        check(self.mode in WANDB_MODES, f"{prefix}.mode={self.mode!r}: use one of {', '.join(WANDB_MODES)}")
        check(all(isinstance(t, str) and t for t in self.tags),
              f"{prefix}.tags={self.tags!r}: give non-empty strings, e.g. ('baseline',)")
        if self.enabled:
            try:
                import wandb  # noqa: F401 (lazy: the core install does without it)
            except ImportError:
                raise ConfigError(f"{prefix}.mode={self.mode!r} needs the wandb package, which is not installed: "
                                  f"{WANDB_INSTALL} (or {prefix}.mode=disabled)") from None


# The "auto" compilation cache: per user, like pip's and Hugging Face's caches.
AUTO_CACHE_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "ppo_jax", "xla")
AUTO_CACHE_MAX_BYTES = 4 << 30


def override_dtypes(cfg: ModelConfig, param_dtype: str, dtype: str) -> ModelConfig:
    """`cfg` with the parameter / compute dtypes replaced where a setting names one ("" = keep)."""
    kw = {k: v for k, v in (("param_dtype", param_dtype), ("dtype", dtype)) if v}
    return cfg.replace(**kw) if kw else cfg


def check_positions(lengths: Mapping[str, int], max_positions: int, where: str = "") -> None:
    """Every family has a position limit (learned table or the RoPE range the model was trained on).
    lengths: {dotted field: value} of the lengths a sequence adds up; the error gives flags that fit,
    each length cut in proportion (at least 1)."""
    total = sum(lengths.values())
    if total <= max_positions:
        return
    fitted = {name: max(1, value * max_positions // total) for name, value in lengths.items()}
    last = list(lengths)[-1]
    fitted[last] = max(1, max_positions - sum(v for k, v in fitted.items() if k != last))
    flags = " ".join(f"--config.{name}={value}" for name, value in fitted.items())
    raise ConfigError(f"{where}{' + '.join(lengths)} = {total} exceeds the model's max_position_embeddings="
                      f"{max_positions}; shorten them to fit, e.g. {flags}")
