"""What the SFT, reward-model and DPO trainers share: the model's config checks, what is trained (the
whole model, or with LoRA the adapters and any new head on a frozen base; the train state and gradient
accumulation are in `train_state`), the start-up checks of the data, checkpoint resume, the training
loop (metrics, evaluation, checkpoints, progress bar) and the export.

The PPO trainer has its own loop (rollouts are not minibatches of a dataset); these three are plain
supervised learning over a `ppo_jax.data` loader.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from ppo_jax import data as data_lib
from ppo_jax.data import prompt_checks
from ppo_jax import metrics as metrics_lib
from ppo_jax import sharding
from ppo_jax.checkpoint import CheckpointManager, verify
from ppo_jax.config import ComputeSettings, ConfigError, check, check_positions, override_dtypes
from ppo_jax.models import ModelConfig, boxed_params, hf, init_adapters, init_params
from ppo_jax.models.config import MOE_ARCHS
from ppo_jax.models.moe import RouterCoefs
from ppo_jax.models.hf.layouts import lora_tensor_maps
from ppo_jax.models.lora import COLLECTION as LORA
from ppo_jax.models.lora import trained_variables
from ppo_jax.optim import make_optimizer
from ppo_jax.supervised.settings import ModelSettings
from ppo_jax.supervised.train_state import (  # noqa: F401 (the trainers' names for them: supervised.X)
    TrainState, abstract_state, accumulate_gradients, apply_gradients, check_batch_size, init_train_state,
    split_microbatches)

Array = jax.Array
# frozen_checksums[BASE_KEY] in a LoRA run's checkpoints: its frozen base's checksums (PPO's is "policy_base").
BASE_KEY = "model_base"


# ----------------------------------------------------------------------------------------------
# The model.


def router_coefs(section: ModelSettings, cfg: ModelConfig) -> RouterCoefs | None:
    """The router losses' weights for the loss of a model with experts (zero unless the config sets
    them: the losses are still reported), None for a dense model."""
    return (section.router or RouterCoefs()) if cfg.num_experts else None


def model_config(section: ModelSettings, tokenizer, *, what: str, data, kinds: tuple[str, ...],
                 compute: ComputeSettings, lora_export: str = "merged", mesh=None) -> tuple[ModelConfig, str | None]:
    """(the model's ModelConfig, the kind of checkpoint at model.path or None for a fresh model).

    A fresh model takes the tokenizer's special ids; any model must fit the data section's
    max_prompt_length + max_response_length positions and hold the
    tokenizer's vocabulary; model.lora's adapters become ModelConfig.lora (None when off, whatever the
    checkpoint's config said); an MoE model's experts must split over `mesh`'s expert axis. Checked
    before anything loads or compiles.
    """
    start_kind = None
    if section.path:
        cfg, start_kind = hf.load_config(section.path)
        check(start_kind in kinds, f"{what}: model.path={section.path} holds a {start_kind} checkpoint; "
              f"{what} starts from {' or '.join(kinds)}")
    else:
        ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}
        cfg = section.config.replace(**{k: v for k, v in ids.items() if v is not None})
    cfg = section.lora.apply(compute.apply(override_dtypes(cfg, section.param_dtype, section.dtype)),
                             f"{what}: model")
    check_tokenizer(tokenizer, cfg.vocab_size, what)
    check_positions({"data.max_prompt_length": data.max_prompt_length,
                     "data.max_response_length": data.max_response_length}, cfg.max_position_embeddings, f"{what}: ")
    check(not cfg.num_experts or cfg.arch in MOE_ARCHS,
          f"{what}: model.num_experts={cfg.num_experts} on arch {cfg.arch!r}: the run ends in a Hugging Face "
          f"export, which holds experts only as {' or '.join(MOE_ARCHS)}; set model.arch to one of them")
    check(section.router is None or cfg.num_experts,
          f"{what}: model.router_aux_coef={section.router_aux_coef}, model.router_z_coef={section.router_z_coef}: "
          f"router losses need a mixture-of-experts model, and this {cfg.arch} model has no experts")
    sharding.check_experts_split(cfg.num_experts, mesh, what, ConfigError)
    if cfg.lora is not None and lora_export == "adapter":
        try:  # the PEFT names of every adapter: refused by name when a target is a window of a fused tensor
            lora_tensor_maps(cfg)
        except hf.HFModelError as err:
            raise ConfigError(f"{what}: train.lora_export='adapter' with model.lora.targets="
                              f"{section.lora.targets!r}: {err}; use merged, or other targets") from None
    return cfg, start_kind


def check_tokenizer(tokenizer, vocab_size: int, what: str) -> None:
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ConfigError(
            f"{what}: the tokenizer needs a pad token distinct from its EOS token (pad "
            f"{tokenizer.pad_token!r}, eos {tokenizer.eos_token!r}); set tokenizer.pad_token")
    if len(tokenizer) > vocab_size:
        raise ConfigError(
            f"{what}: the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has "
            f"{vocab_size}; raise model.config.vocab_size (or use the model's own tokenizer)")


# ----------------------------------------------------------------------------------------------
# What trains and what stays frozen.


@dataclasses.dataclass(frozen=True)
class Trainable:
    """The tree the optimizer trains, and the frozen base beside it.

    Without LoRA: `params` is the whole model, `base` None. With LoRA: `params` is
    {"lora": adapters, **heads} (heads: new top-level params that must train, the reward model's
    "score") and `base` the model's params less those heads, frozen: never donated, no optimizer state.
    `models.lora.trained_variables(params, base)` gives back what the model applies.
    """

    params: Any
    shardings: Any
    boxed: Any  # `params`' abstract tree with logical axis names (shards the optimizer state like it)
    base: Any = None
    base_shardings: Any = None


def whole_model(module, params, shardings) -> Trainable:
    """Every parameter trains (LoRA off)."""
    return Trainable(params=params, shardings=shardings, boxed=boxed_params(module))


def lora_adapters(module, params, shardings, mesh, key, heads: tuple[str, ...] = ()) -> Trainable:
    """Fresh adapters (A random from `key`, B = 0: at step 0 the model is the base exactly) and `heads`
    train; the rest of `params` is the frozen base."""
    adapters, adapter_shardings = init_adapters(module, key, mesh)
    boxed = boxed_params(module)

    def split(tree):
        return {k: v for k, v in tree.items() if k not in heads}, {k: tree[k] for k in heads}

    (base, head), (base_sh, head_sh) = split(params), split(shardings)
    return Trainable(params={LORA: adapters, **head}, shardings={LORA: adapter_shardings, **head_sh},
                     boxed={LORA: boxed_params(module, collection=LORA), **split(boxed)[1]},
                     base=base, base_shardings=base_sh)


# ----------------------------------------------------------------------------------------------
# The loop.


def host_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(np.asarray(v)) for k, v in jax.device_get(dict(metrics)).items()}


def run_loop(*, desc: str, total_steps: int, state_step: Callable[[], int],
             train_step: Callable[[], dict[str, float]], evaluate: Callable[[], dict[str, float]] | None,
             save: Callable[[int, dict[str, float] | None], None], config_train, writer,
             on_log: Callable[[int, dict[str, float]], None] | None = None,
             shown: tuple[str, ...] = ("train/loss", "train/accuracy", "eval/loss", "eval/accuracy"),
             ) -> list[dict[str, float]]:
    """Steps until `total_steps`, logging every `log_every`, evaluating every `eval_every` (and at the
    end), checkpointing every `checkpoint_every` (and at the end). Returns the logged rows.
    shown: the metrics on the progress bar (by their last name component)."""
    t = config_train
    history: list[dict[str, float]] = []
    progress = None
    if t.progress and jax.process_index() == 0:
        progress = tqdm(total=int(total_steps), desc=desc, initial=state_step())
    try:
        while state_step() < total_steps:
            scalars = train_step()
            step = state_step()
            last = step == total_steps
            if t.eval_every and step % t.eval_every == 0 and not last and evaluate is not None:
                scalars.update(evaluate())
            if last and evaluate is not None:
                scalars.update(evaluate())
            if step % t.log_every == 0 or last or any(k.startswith("eval/") for k in scalars):
                row = {"step": step, **writer.write(step, scalars)}
                history.append(row)
                if on_log is not None:
                    on_log(step, row)
            if (t.checkpoint_every and step % t.checkpoint_every == 0) or last:
                save(step, scalars)
            if progress is not None:
                progress.update(1)
                progress.set_postfix({k.split("/")[-1]: f"{v:.3f}" for k, v in scalars.items() if k in shown})
    finally:
        if progress is not None:
            progress.close()
    return history


def checkpoint_manager(workdir: str, keep: int):
    return CheckpointManager(os.path.join(workdir, "checkpoints"), max_to_keep=int(keep))


def resume(manager, state: TrainState, shardings: TrainState, loader,
           check_extra: Callable[[dict], None] | None = None) -> TrainState:
    """The latest checkpoint's state and data position, or `state` unchanged when there is none.
    check_extra: called with the checkpoint's JSON extra before it is used (raises if it does not fit)."""
    if manager.latest_step() is None:
        return state
    restored = manager.restore_newest_valid(abstract_state=abstract_state(state, shardings))
    for line in restored.skipped:
        metrics_lib.warn(line)
    if check_extra is not None:
        check_extra(restored.extra)
    if loader is not None and "data" in restored.extra:
        loader.restore(restored.extra["data"])
    return restored.state


def batches_forever(loader) -> Iterator[Any]:
    while True:
        yield next(loader)


def _figure(value: float) -> str:
    """A metric as a person reads it: counts whole (`tokens 64`), rates to four places."""
    value = float(value)
    return str(int(value)) if value.is_integer() and abs(value) >= 2 else f"{value:.4f}"


def summary_line(trainer, history: list[dict[str, float]]) -> str:
    """The last logged train/eval metrics of a finished run (`trainer.summary_prefixes`), and where
    its export is."""
    prefixes = trainer.summary_prefixes
    logged = [row for row in history if any(k.startswith(prefixes) for k in row)]
    shown = [f"{k} {_figure(v)}" for k, v in logged[-1].items() if k.startswith(prefixes)] if logged else []
    adapter = trainer.model_config.lora is not None and trainer.settings.train.lora_export == "adapter"
    export = "PEFT adapter" if adapter else "Hugging Face export"
    metrics = f" ({', '.join(shown)})" if shown else ""
    return f"done: {trainer.step} steps{metrics}; {export} in {os.path.join(trainer.workdir, 'hf')}"


# ----------------------------------------------------------------------------------------------
# The trainer classes' shared surface.


def data_source(path: str, records, fields: Mapping[str, str], what: str):
    """Training or eval data from a JSONL file (config) or from records (code); None if neither.

    fields: {our field name: the file's field name} (the config's *_field settings); records given in
    code use our names.
    """
    if path and records is not None:
        raise ValueError(f"{what}: both a file (config) and records (code) were given; pass one")
    if path:
        return data_lib.from_jsonl(path, fields=fields)
    if records is not None:
        return data_lib.from_list(list(records), fields=tuple(fields), name=what)
    return None


class SupervisedTrainer:
    """What the SFT, reward-model and DPO trainers share once their __init__ has built `config`,
    `workdir`, `mesh`, `tokenizer`, `model_config`, `state`, `loader`, `checkpoints`, `writer` and
    the jitted `_train_step(state, base, batch)` (state donated, the LoRA base never): one training
    step, checkpoint saves, export and shutdown.

    Subclasses set `name` (config/CLI name, used in messages) and `export_kind` (the Hugging Face
    kind written by `export`: "causal_lm" or "reward").
    """

    name: str
    export_kind: str
    settings_type: type  # SFTSettings / RewardModelSettings / DPOSettings
    progress_keys: tuple[str, ...] = ("train/loss", "train/accuracy", "eval/loss", "eval/accuracy")  # on the bar
    summary_prefixes: tuple[str, ...] = ("train/", "eval/")  # metrics in the command line's last line

    def _start(self, config, workdir: str, mesh):
        """Validated settings, the workdir and the mesh: the first lines of every __init__, before
        anything loads or compiles."""
        s = self.settings = self.settings_type.from_config(config)
        self.workdir = workdir
        self.mesh = mesh or sharding.make_mesh(s.mesh.shape)
        s.compute.enable_compilation_cache()
        check_batch_size(s.train.batch_size, self.mesh, self.name)
        return s

    def _trainable(self, params, shardings, heads: tuple[str, ...] = ()) -> Trainable:
        """The whole model, or with model.lora the adapters (and `heads`) on the frozen rest."""
        if self.model_config.lora is None:
            return whole_model(self.module, params, shardings)
        # Folded off the seed's key: the adapters never share random bits with a fresh base's init.
        key = jax.random.fold_in(jax.random.key(self.settings.seed), 1)
        return lora_adapters(self.module, params, shardings, self.mesh, key, heads)

    def _start_training(self, trainable: Trainable, train_source, kind: str,
                        check_extra: Callable[[dict], None] | None = None) -> None:
        """The data pipeline, optimizer, train state and resume every trainer builds the same way once
        it has its initial params: sets `base` / `base_shardings` (None without LoRA),
        `prompt_tokenizer`, `loader` (of `kind` batches), `tx`, `state`, `state_shardings` and
        `checkpoints` (the state restored from the newest valid one, its LoRA base checked)."""
        s, d = self.settings, self.settings.data
        self.base, self.base_shardings = trainable.base, trainable.base_shardings
        self._base_record: dict | None = None  # the base's checksums, from the first save (or a resume)
        self.prompt_tokenizer = data_lib.PromptTokenizer(
            self.tokenizer, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
            max_response_length=d.max_response_length)
        self.loader = data_lib.PromptLoader(train_source, self.prompt_tokenizer, s.train.batch_size, kind=kind,
                                            seed=s.seed)
        self.tx = make_optimizer(s.optim, s.optim.lr, s.train.steps)
        self.state, self.state_shardings = init_train_state(trainable.params, trainable.shardings, trainable.boxed,
                                                            self.tx, self.mesh)
        self.checkpoints = checkpoint_manager(self.workdir, s.train.keep_checkpoints)

        def check(extra: dict) -> None:
            if self.base is not None:
                self._check_base(extra.get("frozen_checksums", {}).get(BASE_KEY))
            if check_extra is not None:
                check_extra(extra)

        self.state = resume(self.checkpoints, self.state, self.state_shardings, self.loader, check_extra=check)

    def _check_packing(self, shape: tuple[int, int] | None) -> tuple[int, int] | None:
        """packing.rows for this mesh, rounded up to a multiple of its batch split (the rows are
        split like a padded batch's), in one process only (checked before any compile)."""
        if shape is None:
            return None
        if jax.process_count() > 1:
            # Each process would decide alone whether its rows fit, and the processes must run one program.
            raise ConfigError(f"{self.name}: packing.rows runs in one process; this run has {jax.process_count()} "
                              "(use packing.rows=0)")
        divisor = sharding.batch_divisor(self.mesh)
        return -(-shape[0] // divisor) * divisor, shape[1]

    def _check_base(self, recorded: dict | None) -> None:
        """A LoRA checkpoint holds adapters, not the base they were trained on, only its checksums:
        resuming them on another base (a changed model.path or seed) would silently train another model."""
        m = self.settings.model
        source = f"model.path={m.path}" if m.path else f"seed={self.settings.seed}"
        verify.check_rebuilt(self.base, recorded, f"{self.checkpoints.directory} ({self.name})", "LoRA base",
                             "base model", source, "use the original model.path and seed")
        self._base_record = recorded

    def _check_prompts(self, train_source, eval_source) -> None:
        """Every prompt has tokens of its own under the run's tokenizer, before anything compiles
        (`data.prompt_checks`; a tokenizer that loses the first prompts' words gets one warning)."""
        prompt_checks.check_source(self.tokenizer, train_source, warn=metrics_lib.warn)
        if eval_source is not None:
            prompt_checks.check_source(self.tokenizer, eval_source)

    def _load_tokenizer(self):
        path = self.settings.tokenizer_path or self.settings.model.path
        if not path:
            raise ConfigError(f"{self.name}: no tokenizer; pass tokenizer=..., or set "
                                         f"tokenizer_path or model.path")
        return hf.load_tokenizer(path)

    def _causal_lm_params(self):
        """(params, shardings) of the causal LM at model.path, or of a fresh `self.module` (seeded)."""
        m = self.settings.model
        if m.path:
            loaded = hf.load_model(m.path, self.mesh, kind="causal_lm", param_dtype=m.param_dtype or None,
                                   dtype=m.dtype or None, execution=self.model_config.execution())
            return loaded.params, jax.tree.map(lambda x: x.sharding, loaded.params)
        return init_params(self.module, jax.random.key(self.settings.seed), self.mesh)

    @property
    def params(self):
        """The trained tree: the whole model, or with LoRA {"lora": adapters, **heads}."""
        return self.state.params

    def model_variables(self) -> tuple[Any, Any]:
        """(params, adapters) of the current model (`trained_variables`; adapters None without LoRA)."""
        return trained_variables(self.state.params, self.base)

    @property
    def step(self) -> int:
        return int(self.state.step)

    def _place(self, tree):
        return sharding.put_local_batch(tree, self.mesh)

    def _device_batch(self, batch):
        """A host batch as the jitted step takes it: placed on the mesh (DPO adds the reference's
        log-probs)."""
        return self._place(batch)

    def train_step(self) -> dict[str, float]:
        """One optimizer step on the next batch; its metrics and the loader's, as host floats."""
        batch = next(self.loader)
        self.state, metrics = self._train_step(self.state, self.base, self._device_batch(batch))
        scalars = host_scalars(metrics)
        scalars.update(self.loader.metrics())
        return scalars

    def run_steps(self) -> list[dict[str, float]]:
        """`run_loop` to train.steps on this trainer's step, evaluation, saves and writer."""
        return run_loop(desc=self.name.replace("_", " "), total_steps=self.settings.train.steps,
                        state_step=lambda: self.step, train_step=self.train_step,
                        evaluate=self.evaluate if self.eval_source is not None else None,
                        save=self.save, config_train=self.settings.train, writer=self.writer,
                        shown=self.progress_keys)

    def checkpoint_extra(self) -> dict[str, Any]:
        """The JSON saved beside each step's state: the data position and, with LoRA, the frozen base's
        checksums (checked on resume; the base itself is model.path or the seed's, never copied).
        Subclasses add to it."""
        extra: dict[str, Any] = {"data": self.loader.state()}
        if self.base is not None:
            if self._base_record is None:
                self._base_record = verify.record(self.base)
            extra["frozen_checksums"] = {BASE_KEY: self._base_record}
        return extra

    def save(self, step: int, scalars=None) -> None:
        if step not in self.checkpoints.all_steps():
            self.checkpoints.save(step, self.state, extra=self.checkpoint_extra(), force=True)

    def train(self) -> list[dict[str, float]]:
        """Runs to train.steps (resuming from the latest checkpoint), then exports to <workdir>/hf."""
        try:
            history = self.run_steps()
        finally:
            self.close()
        if self.settings.train.export:
            self.export()
        return history

    def export(self, out_dir: str | None = None, lora_export: str | None = None) -> str:
        """The current model as a Hugging Face model of `export_kind`, with the tokenizer; default
        <workdir>/hf. With LoRA, lora_export (default train.lora_export) "merged" writes full weights
        with the adapters folded in, "adapter" a PEFT adapter directory for model.path (causal LMs)."""
        out_dir = out_dir or os.path.join(self.workdir, "hf")
        lora_export = lora_export or self.settings.train.lora_export
        params, adapters = self.model_variables()
        if adapters is not None and lora_export == "adapter":
            check(self.export_kind == "causal_lm", f"{self.name}: a {self.export_kind} model exports merged only")
            hf.export_adapter(out_dir, self.model_config, adapters,
                              base_model_name_or_path=self.settings.model.path or None)
            return out_dir
        hf.export_model(out_dir, self.model_config, params, kind=self.export_kind, tokenizer=self.tokenizer,
                        adapters=adapters)
        return out_dir

    def close(self) -> None:
        """Waits for checkpoint saves in flight and releases the writers (safe to call twice)."""
        self.checkpoints.close()
        self.writer.close()
