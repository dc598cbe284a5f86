"""What the SFT, reward-model and DPO trainers share: the model's config checks, the train state,
gradient accumulation over microbatches, checkpoint resume, and the training loop (metrics,
evaluation, checkpoints, progress bar).

The PPO trainer has its own loop (rollouts are not minibatches of a dataset); these three are plain
supervised learning over a `ppo_jax.data` loader.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from ppo_jax import data as data_lib
from ppo_jax import metrics as metrics_lib
from ppo_jax import sharding
from ppo_jax.checkpoint import CheckpointManager
from ppo_jax.config import ComputeSettings, ConfigError, check, check_positions, override_dtypes
from ppo_jax.models import ModelConfig, hf, init_params
from ppo_jax.optim import make_optimizer
from ppo_jax.supervised.settings import ModelSettings

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# The model.


def model_config(section: ModelSettings, tokenizer, *, what: str, length: int, kinds: tuple[str, ...],
                 compute: ComputeSettings) -> tuple[ModelConfig, str | None]:
    """(the model's ModelConfig, the kind of checkpoint at model.path or None for a fresh model).

    A fresh model takes the tokenizer's special ids; any model must fit `length` positions and hold the
    tokenizer's vocabulary. Checked before anything loads or compiles.
    """
    start_kind = None
    if section.path:
        cfg, start_kind = hf.load_config(section.path)
        check(start_kind in kinds, f"{what}: model.path={section.path} holds a {start_kind} checkpoint; "
              f"{what} starts from {' or '.join(kinds)}")
    else:
        ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}
        cfg = section.config.replace(**{k: v for k, v in ids.items() if v is not None})
    cfg = compute.apply(override_dtypes(cfg, section.param_dtype, section.dtype))
    check_tokenizer(tokenizer, cfg.vocab_size, what)
    check_positions(length, cfg.max_position_embeddings, f"{what}: data.max_prompt_length + data.max_response_length")
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
# Train state.


@flax.struct.dataclass
class TrainState:
    """Everything an optimizer step changes; donated to the step."""

    step: Array  # [] int32, optimizer steps done
    params: Any
    opt_state: Any


def init_train_state(params, param_shardings, boxed_abstract, tx: optax.GradientTransformation,
                     mesh) -> tuple[TrainState, TrainState]:
    """(state, shardings): optimizer state sharded like the params it mirrors.

    boxed_abstract: the model's abstract params with logical axis names (`hf.abstract_params`), so
    Adam's moments get the same shardings as the params.
    """
    opt_shardings = sharding.tree_shardings(jax.eval_shape(tx.init, boxed_abstract), mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    replicated = sharding.replicated(mesh)
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)
    state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), replicated), params=params,
                       opt_state=opt_state)
    return state, shardings


def apply_gradients(tx, state: TrainState, grads) -> TrainState:
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                      opt_state=opt_state)


def abstract_state(state: TrainState, shardings: TrainState):
    """Restore target: shapes, dtypes and shardings of `state`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


# ----------------------------------------------------------------------------------------------
# Batches.


def check_batch_size(batch_size: int, mesh, what: str) -> None:
    divisor = sharding.batch_divisor(mesh)
    if batch_size % divisor:
        raise ConfigError(
            f"{what}: train.batch_size={batch_size} does not split over the {divisor} data-parallel "
            f"devices (mesh data x fsdp = {dict(mesh.shape)}); use a multiple of {divisor}")


def split_microbatches(tree, num_microbatches: int):
    """Leaves [B, ...] -> [num_microbatches, B / num_microbatches, ...].

    Rows are dealt round-robin (microbatch i = rows i, i + n, ...), so with a batch-sharded input
    every microbatch still spans all data-parallel devices instead of landing on a few of them.
    """

    def split(x):
        x = x.reshape((x.shape[0] // num_microbatches, num_microbatches) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, tree)


def accumulate_gradients(loss_fn: Callable, params, microbatches, batch_sharding):
    """(loss, metrics, grads), each summed over the microbatches with one `lax.scan`.

    loss_fn(params, microbatch) -> (loss [], metrics): every loss term and metric must be a sum over
    the microbatch divided by a whole-batch count (or a `SumCount`), so that the sums are exactly the
    full-batch loss, gradient and metrics however the rows fall into microbatches.
    microbatches: leaves [n, b, ...] (`split_microbatches`).
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(acc, microbatch):
        microbatch = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, batch_sharding), microbatch)
        (loss, metrics), grads = grad_fn(params, microbatch)
        return jax.tree.map(jnp.add, acc, (loss, metrics, grads)), None

    first = jax.tree.map(lambda x: x[0], microbatches)
    (loss_shape, metric_shapes), grad_shapes = jax.eval_shape(grad_fn, params, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss_shape, metric_shapes, grad_shapes))
    totals, _ = jax.lax.scan(step, zeros, microbatches)
    return totals


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


def summary_line(trainer, history: list[dict[str, float]]) -> str:
    """The last logged train/eval metrics of a finished run (`trainer.summary_prefixes`), and where
    its export is."""
    prefixes = trainer.summary_prefixes
    logged = [row for row in history if any(k.startswith(prefixes) for k in row)]
    shown = {k: round(v, 4) for k, v in logged[-1].items() if k.startswith(prefixes)} if logged else {}
    return f"done: {trainer.step} steps {shown}; Hugging Face export in {os.path.join(trainer.workdir, 'hf')}"


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
    the jitted `_train_step`: one training step, checkpoint saves, export and shutdown.

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

    def _start_training(self, params, param_shardings, boxed_abstract, train_source, kind: str,
                        check_extra: Callable[[dict], None] | None = None) -> None:
        """The data pipeline, optimizer, train state and resume every trainer builds the same way once
        it has its initial params: sets `prompt_tokenizer`, `loader` (of `kind` batches), `tx`,
        `state`, `state_shardings` and `checkpoints` (the state restored from the newest valid one)."""
        s, d = self.settings, self.settings.data
        self.prompt_tokenizer = data_lib.PromptTokenizer(
            self.tokenizer, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
            max_response_length=d.max_response_length)
        self.loader = data_lib.PromptLoader(train_source, self.prompt_tokenizer, s.train.batch_size, kind=kind,
                                            seed=s.seed)
        self.tx = make_optimizer(s.optim, s.optim.lr, s.train.steps)
        self.state, self.state_shardings = init_train_state(params, param_shardings, boxed_abstract, self.tx,
                                                            self.mesh)
        self.checkpoints = checkpoint_manager(self.workdir, s.train.keep_checkpoints)
        self.state = resume(self.checkpoints, self.state, self.state_shardings, self.loader,
                            check_extra=check_extra)

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
        return self.state.params

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
        self.state, metrics = self._train_step(self.state, self._device_batch(batch))
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
        """The JSON saved beside each step's state: the data position (subclasses add to it)."""
        return {"data": self.loader.state()}

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

    def export(self, out_dir: str | None = None) -> str:
        """The current params as a Hugging Face model of `export_kind`, with the tokenizer; default
        <workdir>/hf."""
        out_dir = out_dir or os.path.join(self.workdir, "hf")
        hf.export_model(out_dir, self.model_config, self.state.params, kind=self.export_kind,
                        tokenizer=self.tokenizer)
        return out_dir

    def close(self) -> None:
        """Waits for checkpoint saves in flight and releases the writers (safe to call twice)."""
        self.checkpoints.close()
        self.writer.close()
