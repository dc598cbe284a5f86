"""Supervised fine-tuning: next-token loss on response tokens only (prompt tokens are context, not
targets), on the mesh, with Orbax checkpoints, JSONL + TensorBoard metrics and a Hugging Face export.

    trainer = SFTTrainer(sft_config(), workdir, tokenizer=tok, train_records=[{"prompt", "response"}, ...])
    trainer.train()            # -> logged rows; <workdir>/hf is the fine-tuned model (GPT2LMHeadModel, ...)

With model.lora.rank > 0 only LoRA adapters train, on the frozen base (model.path or the seed's init):
the train state is the adapters and their optimizer state, checkpoints record the base's checksums,
and <workdir>/hf is the merged model or, with train.lora_export="adapter", a PEFT adapter directory.

Shapes: B examples, L = data.max_prompt_length + data.max_response_length (one static length, so one
compiled step), V vocabulary. Sequences are prompt + response + EOS, left-padded (`ppo_jax.data`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ppo_jax import data as data_lib
from ppo_jax import sharding
from ppo_jax.config import ConfigError, to_dict
from ppo_jax.data.host_packing import PackedSFTBatch, pack_sft
from ppo_jax.models import CausalLM, positions_from_mask
from ppo_jax.models.forward import hidden_states, variables
from ppo_jax.models.moe import RouterCoefs, RouterLosses
from ppo_jax.models.lora import trained_variables
from ppo_jax.supervised import base as supervised
from ppo_jax.supervised.settings import SFTSettings, sft_config  # noqa: F401  (sft_config: the defaults)
from ppo_jax.wandb_run import metric_writer

Array = jax.Array


def response_token_nll(model: CausalLM, params, tokens: Array, mask: Array, loss_mask: Array, adapters=None,
                       router: bool = False, positions: Array | None = None, segment_ids: Array | None = None):
    """Per-token negative log-likelihood of the targets, and whether the argmax got them right.

    tokens, mask, loss_mask [B, L] (left-padded). Position t predicts token t + 1; a target counts
    where loss_mask[t + 1] = 1 (response tokens and their EOS). adapters: LoRA adapters on `params`
    (None: the model without). positions, segment_ids [B, L]: packed rows (`PackedSFTBatch`: several
    examples per row, attention within each); None: one left-padded example per row. Returns nll,
    correct, weight, each [B, L - 1] float32, zero where weight is 0; with `router` (an MoE model)
    also the forward's RouterLosses, fourth.
    """
    positions = positions_from_mask(mask) if positions is None else positions
    hidden, router_losses = hidden_states(model, variables(params, adapters), tokens, positions, mask, segment_ids,
                                          router=router)
    logits = model.apply(variables(params, adapters), hidden, method=CausalLM.project)[:, :-1]
    targets = tokens[:, 1:]
    weight = loss_mask[:, 1:].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    nll = (-picked * weight, correct * weight, weight)
    return nll + (router_losses,) if router else nll


def router_metrics(losses: RouterLosses, prefix: str) -> dict[str, Array]:
    """An MoE model's router losses and expert load, as metrics."""
    return {f"{prefix}moe/balance_loss": losses.balance, f"{prefix}moe/z_loss": losses.z,
            f"{prefix}moe/expert_load_max": losses.load_max}


def batch_token_nll(model: CausalLM, params, batch: data_lib.SFTBatch | PackedSFTBatch, adapters=None,
                    router: bool = False):
    """`response_token_nll` of a padded or a packed batch."""
    packed = {}
    if isinstance(batch, PackedSFTBatch):
        packed = {"positions": batch.positions, "segment_ids": batch.segment_ids}
    return response_token_nll(model, params, batch.tokens, batch.mask, batch.loss_mask, adapters, router, **packed)


def sft_loss(model: CausalLM, params, batch: data_lib.SFTBatch | PackedSFTBatch, adapters=None,
             router: RouterCoefs | None = None) -> tuple[Array, dict[str, Array]]:
    """Token-mean NLL over every response token of the batch (each token weighs the same), padded or
    packed alike; with `router` (an MoE model) plus the weighted router losses of the forward. The
    metric train/loss is the NLL alone (comparable with eval/loss)."""
    out = batch_token_nll(model, params, batch, adapters, router is not None)
    nll, correct, weight = out[:3]
    count = jnp.maximum(weight.sum(), 1.0)
    loss = nll.sum() / count
    metrics = {"train/loss": loss, "train/accuracy": correct.sum() / count, "train/tokens": weight.sum(),
               "train/token_slots": jnp.float32(batch.tokens.size)}  # what the step computed: packed or padded
    if router is not None:
        loss = loss + router.penalty(out[3])
        metrics.update(router_metrics(out[3], "train/"))
    return loss, metrics


def make_train_step(model: CausalLM, tx, router: RouterCoefs | None = None):
    """(state, base, batch) -> (state, metrics). The gradient is over state.params only: the whole
    model, or with LoRA the adapters (`base` is the frozen rest, None without LoRA); `router`: the
    router losses' weights (MoE models; None: off)."""

    def train_step(state: supervised.TrainState, base, batch: data_lib.SFTBatch):
        def loss_fn(trainable):
            params, adapters = trained_variables(trainable, base)
            return sft_loss(model, params, batch, adapters, router)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        metrics["train/grad_norm"] = optax.tree.norm(grads)
        return supervised.apply_gradients(tx, state, grads), metrics

    return train_step


def make_eval_step(model: CausalLM):
    """Sums (not means), so batches of an eval pass add up exactly: nll, correct, tokens."""

    def eval_step(trainable, base, batch: data_lib.SFTBatch):
        params, adapters = trained_variables(trainable, base)
        nll, correct, weight = response_token_nll(model, params, batch.tokens, batch.mask, batch.loss_mask, adapters)
        return {"nll": nll.sum(), "correct": correct.sum(), "tokens": weight.sum()}

    return eval_step


# ----------------------------------------------------------------------------------------------
# The trainer.


class SFTTrainer(supervised.SupervisedTrainer):
    """Builds the model, data and jitted steps once from a config; `train()` runs the loop."""

    name = "sft"
    settings_type = SFTSettings
    export_kind = "causal_lm"

    def __init__(self, config, workdir: str, *, tokenizer=None,
                 train_records: Sequence[Mapping[str, Any]] | None = None,
                 eval_records: Sequence[Mapping[str, Any]] | None = None, mesh=None):
        """config: an SFT ConfigDict (`sft_config()` and overrides) or `SFTSettings`, converted and
        validated here, once. train_records / eval_records: data given in code instead of files."""
        s = self._start(config, workdir, mesh)
        d = s.data
        fields = {"prompt": d.prompt_field, "response": d.response_field}
        train_source = supervised.data_source(d.train, train_records, fields, "sft train data")
        if train_source is None:
            raise ConfigError("sft: no training data; set data.train (a JSONL file) or pass train_records")
        eval_source = supervised.data_source(d.eval, eval_records, fields, "sft eval data")
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self._check_prompts(train_source, eval_source)

        # Model (validated before any compile).
        self.length = d.max_prompt_length + d.max_response_length
        self.packed_shape = self._check_packing(s.packing.shape(self.length))
        cfg, _ = supervised.model_config(s.model, self.tokenizer, what="sft", data=d,
                                         kinds=("causal_lm",), compute=s.compute, lora_export=s.train.lora_export,
                                         mesh=self.mesh)
        self.model_config = cfg
        self.module = CausalLM(cfg)
        params, param_shardings = self._causal_lm_params()

        self.eval_source = eval_source
        self._start_training(self._trainable(params, param_shardings), train_source, "sft")

        batch_sh = sharding.data_sharding(self.mesh)  # every leaf of a padded or a packed batch
        replicated = sharding.replicated(self.mesh)
        # One jit for both batch kinds: a packed batch and the padded one it falls back to trace apart.
        self._train_step = sharding.on_mesh(jax.jit(
            make_train_step(self.module, self.tx, supervised.router_coefs(s.model, self.module.config)),
            in_shardings=(self.state_shardings, self.base_shardings, batch_sh),
            out_shardings=(self.state_shardings, replicated), donate_argnums=(0,)), self.mesh)  # never the base
        self._eval_step = sharding.on_mesh(jax.jit(
            make_eval_step(self.module), in_shardings=(self.state_shardings.params, self.base_shardings, batch_sh),
            out_shardings=replicated), self.mesh)
        # drops rows past the checkpoint; mirrors them to W&B when settings.wandb asks
        self.writer = metric_writer(workdir, resume_step=self.step, wandb=s.wandb,
                                    run_config=to_dict(s), job_type="sft")

    # -- steps

    def _device_batch(self, batch: data_lib.SFTBatch):
        """The step's batch on the mesh: packed when packing.rows is set and its examples fit."""
        packed = pack_sft(batch, *self.packed_shape) if self.packed_shape else None
        return self._place(batch if packed is None else packed)

    def evaluate(self) -> dict[str, float]:
        """Token-mean NLL, perplexity and next-token accuracy on the eval data (all of it, or
        train.eval_batches batches)."""
        if self.eval_source is None:
            return {}
        totals = {"nll": 0.0, "correct": 0.0, "tokens": 0.0}
        for i, records in enumerate(data_lib.iterate_once(self.eval_source, self.settings.train.batch_size)):
            if self.settings.train.eval_batches and i >= self.settings.train.eval_batches:
                break
            batch = self.prompt_tokenizer.sft(records.records, length=self.length)
            # Filler rows of the last batch (valid=False) count for nothing.
            batch = batch.replace(loss_mask=batch.loss_mask * records.valid[:, None].astype(np.int32))
            out = jax.device_get(self._eval_step(self.state.params, self.base, self._place(batch)))
            for k in totals:
                totals[k] += float(out[k])
        count = max(totals["tokens"], 1.0)
        nll = totals["nll"] / count
        return {"eval/loss": nll, "eval/perplexity": float(np.exp(min(nll, 50.0))),
                "eval/accuracy": totals["correct"] / count, "eval/tokens": totals["tokens"]}
