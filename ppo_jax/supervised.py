"""What the SFT and reward-model trainers share: config sections, the train state, batch placement,
checkpoint resume, and the training loop (metrics, evaluation, checkpoints, progress bar).

The PPO trainer has its own loop (rollouts are not minibatches of a dataset); these two are plain
supervised learning over a `ppo_jax.data` loader.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from ppo_jax import config as config_lib
from ppo_jax import metrics as metrics_lib
from ppo_jax import sharding
from ppo_jax.models import ModelConfig

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# Config sections (the same field names and meanings as the PPO config's where they overlap).


def optim_section(lr: float) -> ml_collections.ConfigDict:
    """AdamW settings read by `step.make_optimizer`."""
    o = ml_collections.ConfigDict()
    o.lr = lr  # peak learning rate
    o.schedule = "cosine"  # after warmup: "constant", "linear" (to 0) or "cosine" (to 0)
    o.warmup_steps = 20  # optimizer steps of linear warmup
    o.weight_decay = 0.0  # AdamW weight decay
    o.b1 = 0.9  # Adam beta1
    o.b2 = 0.999  # Adam beta2
    o.eps = 1e-8  # Adam epsilon
    o.eps_root = 0.0  # epsilon inside the square root (TF-style Adam places epsilon here)
    o.max_grad_norm = 1.0  # global-norm gradient clipping; 0 = off
    return o


def model_section() -> ml_collections.ConfigDict:
    m = ml_collections.ConfigDict()
    m.path = ""  # Hugging Face directory to start from; "" = a fresh model from model.config
    m.config = config_lib.model_config_dict(
        vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
        max_position_embeddings=128)  # architecture when model.path is "" (vocab_size >= the tokenizer's)
    m.param_dtype = ""  # override parameter dtype ("" = keep the checkpoint's / model's)
    m.dtype = ""  # override compute dtype ("" = keep)
    return m


def train_section(batch_size: int, steps: int) -> ml_collections.ConfigDict:
    t = ml_collections.ConfigDict()
    t.batch_size = batch_size  # examples per optimizer step (global, across all devices and hosts)
    t.steps = steps  # optimizer steps
    t.log_every = 10  # write training metrics every N steps
    t.eval_every = 0  # evaluate on data.eval every N steps (0 = only at the end, when data.eval is given)
    t.eval_batches = 0  # eval batches per evaluation; 0 = the whole eval set
    t.checkpoint_every = 0  # save a checkpoint every N steps; 0 = only at the end
    t.keep_checkpoints = 2  # checkpoints kept
    t.export = True  # write a Hugging Face checkpoint to <workdir>/hf at the end
    t.progress = True  # tqdm progress bar
    return t


def validate_common(config, what: str) -> None:
    """Checks shared by the SFT and reward-model configs (before anything compiles)."""
    t, o, d = config.train, config.optim, config.data

    def check(cond, message):
        if not cond:
            raise config_lib.ConfigError(f"{what}: {message}")

    check(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    check(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    for name in ("log_every", "eval_every", "eval_batches", "checkpoint_every"):
        check(t[name] >= 0, f"train.{name} must be >= 0, got {t[name]}")
    check(t.log_every >= 1, f"train.log_every must be >= 1, got {t.log_every}")
    check(t.keep_checkpoints >= 1, f"train.keep_checkpoints must be >= 1, got {t.keep_checkpoints}")
    check(o.lr >= 0, f"optim.lr must be >= 0, got {o.lr}")
    for name in ("weight_decay", "max_grad_norm", "warmup_steps"):
        check(o[name] >= 0, f"optim.{name} must be >= 0, got {o[name]}")
    check(o.schedule in ("constant", "linear", "cosine"),
          f"optim.schedule={o.schedule!r}: use constant, linear or cosine")
    check(d.max_prompt_length >= 1, f"data.max_prompt_length must be >= 1, got {d.max_prompt_length}")
    check(d.max_response_length >= 1,
          f"data.max_response_length must be >= 1 (it includes the EOS), got {d.max_response_length}")
    check(d.truncation in ("left", "error"), f"data.truncation={d.truncation!r}: use left or error")


def model_config_from_section(section, tokenizer) -> ModelConfig:
    """A fresh model's ModelConfig from `model.config`, with the tokenizer's special ids filled in."""
    cfg = config_lib.model_config_from_dict(section.config)
    kw = {k: getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}
    cfg = cfg.replace(**{f"{k}_token_id": v for k, v in kw.items() if v is not None})
    return override_dtypes(cfg, section)


def override_dtypes(cfg: ModelConfig, section) -> ModelConfig:
    kw = {}
    if section.get("param_dtype"):
        kw["param_dtype"] = section.param_dtype
    if section.get("dtype"):
        kw["dtype"] = section.dtype
    return cfg.replace(**kw) if kw else cfg


def check_tokenizer(tokenizer, vocab_size: int, what: str) -> None:
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise config_lib.ConfigError(
            f"{what}: the tokenizer needs a pad token distinct from its EOS token (pad "
            f"{tokenizer.pad_token!r}, eos {tokenizer.eos_token!r}); set tokenizer.pad_token")
    if len(tokenizer) > vocab_size:
        raise config_lib.ConfigError(
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


def place_local_batch(tree: Any, mesh) -> Any:
    """This process's rows (host NumPy, [b, ...]) -> global arrays batch-sharded over the mesh.

    One process: b is the global batch. Several: each process holds its consecutive block of the
    global batch, as `ppo_jax.data` loaders hand it out.
    """
    batch_sharding = sharding.data_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(tree, batch_sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharding, np.asarray(x)),
                        tree)


def check_batch_size(batch_size: int, mesh, what: str) -> None:
    divisor = sharding.batch_divisor(mesh)
    if batch_size % divisor:
        raise config_lib.ConfigError(
            f"{what}: train.batch_size={batch_size} does not split over the {divisor} data-parallel "
            f"devices (mesh data x fsdp = {dict(mesh.shape)}); use a multiple of {divisor}")


def wrap_mesh(fn: Callable, mesh) -> Callable:
    """Runs a jitted model function under the mesh and the logical activation rules."""

    def run(*args):
        with jax.set_mesh(mesh), sharding.activation_rules():
            return fn(*args)

    return run


# ----------------------------------------------------------------------------------------------
# The loop.


def host_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(np.asarray(v)) for k, v in jax.device_get(dict(metrics)).items()}


def run_loop(*, desc: str, total_steps: int, state_step: Callable[[], int],
             train_step: Callable[[], dict[str, float]], evaluate: Callable[[], dict[str, float]] | None,
             save: Callable[[int, dict[str, float] | None], None], config_train, writer,
             on_log: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
    """Steps until `total_steps`, logging every `log_every`, evaluating every `eval_every` (and at the
    end), checkpointing every `checkpoint_every` (and at the end). Returns the logged rows."""
    t = config_train
    history: list[dict[str, float]] = []
    progress = None
    if t.progress and jax.process_index() == 0:
        from tqdm.auto import tqdm

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
                shown = {k.split("/")[-1]: f"{v:.3f}" for k, v in scalars.items()
                         if k in ("train/loss", "train/accuracy", "eval/loss", "eval/accuracy")}
                progress.set_postfix(shown)
    finally:
        if progress is not None:
            progress.close()
    return history


def checkpoint_manager(workdir: str, keep: int):
    from ppo_jax import checkpoint

    return checkpoint.CheckpointManager(os.path.join(workdir, "checkpoints"), max_to_keep=int(keep))


def resume(manager, state: TrainState, shardings: TrainState, loader) -> TrainState:
    """The latest checkpoint's state and data position, or `state` unchanged when there is none."""
    if manager.latest_step() is None:
        return state
    restored, extra = manager.restore(abstract_state=abstract_state(state, shardings))
    if loader is not None and "data" in extra:
        loader.restore(extra["data"])
    return restored


def batches_forever(loader) -> Iterator[Any]:
    while True:
        yield next(loader)


def command_line(make_trainer: Callable[[Any, str], Any], name: str, argv=None) -> None:
    """`python -m ppo_jax.<name> --config=FILE --workdir=DIR [--config.x=y ...]` for a trainer whose
    data and model come from the config (files and Hugging Face directories). The config is locked,
    so a misspelled override fails instead of being silently ignored."""
    import sys

    from absl import app, flags
    from ml_collections import config_flags

    config_flag = config_flags.DEFINE_config_file("config", None, f"{name} config file (get_config()).",
                                                  lock_config=True)
    workdir_flag = flags.DEFINE_string("workdir", None, "directory for metrics, checkpoints and the export")
    flags.mark_flags_as_required(["config", "workdir"])

    def main(args):
        if len(args) > 1:
            raise app.UsageError(f"unexpected arguments {args[1:]}")
        if not flags.FLAGS["verbosity"].present:  # JAX's and Orbax's INFO lines would bury the progress
            from absl import logging

            logging.set_verbosity(logging.WARNING)
        try:
            trainer = make_trainer(config_flag.value, workdir_flag.value)
        except (config_lib.ConfigError, ValueError, KeyError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        history = trainer.train()
        logged = [row for row in history if any(k.startswith(("train/", "eval/")) for k in row)]
        shown = {k: round(v, 4) for k, v in logged[-1].items() if k.startswith(("train/", "eval/"))} if logged else {}
        print(f"done: {trainer.step} steps {shown}; Hugging Face export in {os.path.join(trainer.workdir, 'hf')}")

    app.run(main, argv=argv)


# ----------------------------------------------------------------------------------------------
# The trainer classes' shared surface.


def data_source(path: str, records, fields: Mapping[str, str], what: str):
    """Training or eval data from a JSONL file (config) or from records (code); None if neither.

    fields: {our field name: the file's field name} (the config's *_field settings); records given in
    code use our names.
    """
    from ppo_jax import data as data_lib

    if path and records is not None:
        raise ValueError(f"{what}: both a file (config) and records (code) were given; pass one")
    if path:
        return data_lib.from_jsonl(path, fields=fields)
    if records is not None:
        return data_lib.from_list(list(records), fields=tuple(fields), name=what)
    return None


class SupervisedTrainer:
    """What the SFT and reward-model trainers share once their __init__ has built `config`,
    `workdir`, `mesh`, `tokenizer`, `model_config`, `state`, `loader`, `checkpoints`, `writer` and
    the jitted `_train_step`: one training step, checkpoint saves, export and shutdown.

    Subclasses set `name` (config/CLI name, used in messages) and `export_kind` (the Hugging Face
    kind written by `export`: "causal_lm" or "reward").
    """

    name: str
    export_kind: str

    def _load_tokenizer(self):
        from ppo_jax.models import hf

        path = self.config.tokenizer_path or self.config.model.path
        if not path:
            raise config_lib.ConfigError(f"{self.name}: no tokenizer; pass tokenizer=..., or set "
                                         f"tokenizer_path or model.path")
        return hf.load_tokenizer(path)

    @property
    def params(self):
        return self.state.params

    @property
    def step(self) -> int:
        return int(self.state.step)

    def _place(self, tree):
        return place_local_batch(tree, self.mesh)

    def train_step(self) -> dict[str, float]:
        """One optimizer step on the next batch; its metrics and the loader's, as host floats."""
        batch = next(self.loader)
        self.state, metrics = self._train_step(self.state, self._place(batch))
        scalars = host_scalars(metrics)
        scalars.update(self.loader.metrics())
        return scalars

    def save(self, step: int, scalars=None) -> None:
        if step not in self.checkpoints.all_steps():
            self.checkpoints.save(step, self.state, extra={"data": self.loader.state()}, force=True)

    def export(self, out_dir: str | None = None) -> str:
        """The current params as a Hugging Face model of `export_kind`, with the tokenizer; default
        <workdir>/hf."""
        from ppo_jax.models import hf

        out_dir = out_dir or os.path.join(self.workdir, "hf")
        hf.export_model(out_dir, self.model_config, self.state.params, kind=self.export_kind,
                        tokenizer=self.tokenizer)
        return out_dir

    def close(self) -> None:
        """Waits for checkpoint saves in flight and releases the writers (safe to call twice)."""
        self.checkpoints.close()
        self.writer.close()
