"""Direct preference optimisation: the policy learns from (prompt, chosen, rejected) pairs directly,
with no reward model and no sampling, held near a frozen reference (the initial policy) by beta.

    trainer = DPOTrainer(dpo_config(), workdir, tokenizer=tok, train_records=[{"prompt", "chosen", "rejected"}, ...])
    trainer.train()            # -> logged rows; <workdir>/hf is the fine-tuned causal LM

Each step: one jitted forward of the frozen reference over the batch gives its per-sequence log-probs;
then the policy's loss and gradient are accumulated over `train.num_microbatches` slices of the batch
(each normalised by whole-batch counts, so the update is the same for any slicing) and applied once.
The losses themselves (sigmoid DPO, conservative DPO, IPO, the optional NLL term) are pure functions
in `ppo_jax.supervised.dpo_loss`. Metrics carry TRL's names (`rewards/chosen`, ..., `loss`).

LoRA (model.lora.rank > 0): only adapters train, on the frozen base, and the reference is that same
base with the adapters off, `pair_logps(model, base, pairs, adapters=None)`: no reference tree is
copied, loaded or saved. It is exactly the initial policy (B starts at 0, so the adapters add exactly
0 at step 0 and the loss is log 2), and it cannot drift: the base never changes. Checkpoints hold the
adapters and their optimizer state, and the base's checksums (a resume on another base is refused).

Shapes: B pairs, L = data.max_prompt_length + data.max_response_length (one static length, one
compiled step). Sequences are prompt + response (+ EOS), left-padded (`ppo_jax.data`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from ppo_jax import data as data_lib
from ppo_jax import sharding
from ppo_jax.checkpoint import verify
from ppo_jax.config import ConfigError, to_dict
from ppo_jax.models import CausalLM
from ppo_jax.models.moe import RouterCoefs
from ppo_jax.ppo.stats import SumCount, finalize_metrics
from ppo_jax.models.lora import trained_variables
from ppo_jax.supervised import base as supervised
from ppo_jax.supervised.dpo_loss import Pair, dpo_loss
from ppo_jax.supervised.settings import DPOLossSettings, DPOSettings, dpo_config  # noqa: F401  (dpo_config: the defaults)
from ppo_jax.supervised.sft import response_token_nll, router_metrics
from ppo_jax.wandb_run import metric_writer

Array = jax.Array


@flax.struct.dataclass
class DPOBatch:
    """Preference pairs ([B, L] each) and the frozen reference's summed log-probs of them (Pair [B])."""

    pairs: data_lib.PreferenceBatch
    reference: Pair


def sequence_logps(model: CausalLM, params, tokens: Array, mask: Array, response_mask: Array, adapters=None,
                   router: bool = False):
    """(log p(response | prompt) [B], response tokens [B]) of left-padded sequences [B, L]: the sum
    of the response tokens' log-probs (EOS included); prompt and padding count for nothing.
    adapters: LoRA adapters on `params` (None: the model without them, e.g. the LoRA reference);
    with `router` (an MoE model) also the forward's RouterLosses, third."""
    out = response_token_nll(model, params, tokens, mask, response_mask, adapters, router)
    nll, _, weight = out[:3]
    return (-nll.sum(-1), weight.sum(-1)) + out[3:]


def pair_logps(model: CausalLM, params, pairs: data_lib.PreferenceBatch, adapters=None, router: bool = False):
    """(summed response log-probs, response token counts), each a Pair [B], from one [2B, L] forward;
    with `router` (an MoE model) also its RouterLosses, third."""
    b = pairs.chosen_tokens.shape[0]
    both = [jnp.concatenate([c, r], axis=0) for c, r in (
        (pairs.chosen_tokens, pairs.rejected_tokens), (pairs.chosen_mask, pairs.rejected_mask),
        (pairs.chosen_response_mask, pairs.rejected_response_mask))]
    out = sequence_logps(model, params, *both, adapters, router)
    logps, tokens = out[:2]
    return (Pair(chosen=logps[:b], rejected=logps[b:]), Pair(chosen=tokens[:b], rejected=tokens[b:])) + out[2:]


def make_loss_fn(model: CausalLM, hp: DPOLossSettings, batch: DPOBatch, weight: Array | None = None,
                 num_pairs=None, num_tokens=None, router: RouterCoefs | None = None):
    """(params, adapters=None) -> (loss, SumCount metrics) of `batch` under the configured loss; with
    `router` (an MoE policy) plus the forward's weighted router losses, weighted by the batch's share
    of the `num_pairs` pairs (the microbatches' sum: a pair-weighted mean) and reported."""

    def loss_fn(params, adapters=None):
        out = pair_logps(model, params, batch.pairs, adapters, router is not None)
        loss, metrics = dpo_loss(out[0], batch.reference, out[1], loss_type=hp.type, beta=hp.beta,
                                 label_smoothing=hp.label_smoothing, sft_coef=hp.sft_coef, weight=weight,
                                 num_pairs=num_pairs, num_tokens=num_tokens)
        if router is not None:
            pairs = jnp.asarray(batch.reference.chosen.shape[0], jnp.float32)
            loss = loss + pairs / (num_pairs or pairs) * router.penalty(out[2])
            metrics.update({name: SumCount(value * pairs, pairs) for name, value in router_metrics(out[2], "").items()})
        return loss, metrics

    return loss_fn


def make_train_step(model: CausalLM, tx, hp: DPOLossSettings, num_microbatches: int, batch_sharding,
                    router: RouterCoefs | None = None):
    """(state, base, DPOBatch) -> (state, metrics): one optimizer step, gradients (over state.params:
    the policy, or with LoRA its adapters on the frozen `base`) accumulated over `num_microbatches`
    slices, each normalised by the whole batch's pair and chosen-token counts; `router`: the router
    losses' weights (MoE policies; None: off)."""

    def train_step(state: supervised.TrainState, base, batch: DPOBatch):
        num_pairs = batch.reference.chosen.shape[0]
        num_tokens = batch.pairs.chosen_response_mask.sum().astype(jnp.float32)

        def loss_fn(trainable, microbatch):
            fn = make_loss_fn(model, hp, microbatch, num_pairs=num_pairs, num_tokens=num_tokens, router=router)
            return fn(*trained_variables(trainable, base))

        loss, metrics, grads = supervised.accumulate_gradients(
            loss_fn, state.params, supervised.split_microbatches(batch, num_microbatches), batch_sharding)
        metrics = finalize_metrics(metrics)
        del metrics["pair_loss"]  # = loss (less sft_coef * nll_loss)
        metrics.update(loss=loss, grad_norm=optax.tree.norm(grads))
        return supervised.apply_gradients(tx, state, grads), metrics

    return train_step


def make_eval_step(model: CausalLM, hp: DPOLossSettings):
    """(trainable, base, DPOBatch, valid [B]) -> SumCount metrics over the valid pairs (an eval pass
    adds them)."""

    def eval_step(trainable, base, batch: DPOBatch, valid: Array):
        _, metrics = make_loss_fn(model, hp, batch, weight=valid)(*trained_variables(trainable, base))
        return metrics

    return eval_step


# ----------------------------------------------------------------------------------------------
# The trainer.


class DPOTrainer(supervised.SupervisedTrainer):
    """Builds the policy, its frozen reference, data and jitted steps once from a config; `train()`
    runs the loop and exports the policy to <workdir>/hf."""

    name = "dpo"
    settings_type = DPOSettings
    export_kind = "causal_lm"
    progress_keys = ("loss", "rewards/accuracies", "eval/loss", "eval/rewards/accuracies")
    summary_prefixes = ("loss", "rewards/", "logps/", "eval/")

    def __init__(self, config, workdir: str, *, tokenizer=None,
                 train_records: Sequence[Mapping[str, Any]] | None = None,
                 eval_records: Sequence[Mapping[str, Any]] | None = None, mesh=None):
        """config: a DPO ConfigDict (`dpo_config()` and overrides) or `DPOSettings`, converted and
        validated here, once. train_records / eval_records: data given in code instead of files."""
        s = self._start(config, workdir, mesh)
        micro = s.train.batch_size // s.train.num_microbatches
        divisor = sharding.batch_divisor(self.mesh)
        if micro % divisor:
            raise ConfigError(f"dpo: a microbatch of {micro} pairs (train.batch_size / train.num_microbatches) does "
                              f"not split over the {divisor} data-parallel devices; make it a multiple of {divisor}")
        d = s.data
        fields = {"prompt": d.prompt_field, "chosen": d.chosen_field, "rejected": d.rejected_field}
        train_source = supervised.data_source(d.train, train_records, fields, "dpo train data")
        if train_source is None:
            raise ConfigError("dpo: no training data; set data.train (a JSONL file of prompt/chosen/rejected) "
                              "or pass train_records")
        self.eval_source = supervised.data_source(d.eval, eval_records, fields, "dpo eval data")
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self._check_prompts(train_source, self.eval_source)

        self.length = d.max_prompt_length + d.max_response_length
        cfg, _ = supervised.model_config(s.model, self.tokenizer, what="dpo", data=d,
                                         kinds=("causal_lm",), compute=s.compute, lora_export=s.train.lora_export,
                                         mesh=self.mesh)
        self.model_config = cfg
        self.module = CausalLM(cfg)
        params, param_shardings = self._causal_lm_params()
        trainable = self._trainable(params, param_shardings)
        if trainable.base is None:
            # The reference is the initial policy, a real copy: the policy's buffers are donated each step.
            self.reference = sharding.copy_tree(params, param_shardings)
        else:
            # LoRA: the reference is the frozen base itself, run with the adapters off (no copy; never
            # donated). Checkpoints tie it to the steps by the base's checksums (`SupervisedTrainer`).
            self.reference = trainable.base
        self._reference_record: dict | None = None  # its checksums, computed at the first save

        self._start_training(trainable, train_source, "preference",
                             check_extra=self._check_reference if trainable.base is None else None)

        data_sh = sharding.data_sharding(self.mesh)
        replicated = sharding.replicated(self.mesh)
        pairs_sh = data_lib.PreferenceBatch(*([data_sh] * 6))
        batch_sh = DPOBatch(pairs=pairs_sh, reference=Pair(chosen=data_sh, rejected=data_sh))
        self._reference_logps = sharding.on_mesh(jax.jit(
            lambda p, pairs: pair_logps(self.module, p, pairs)[0], in_shardings=(param_shardings, pairs_sh),
            out_shardings=batch_sh.reference), self.mesh)
        self._train_step = sharding.on_mesh(jax.jit(
            make_train_step(self.module, self.tx, s.loss, s.train.num_microbatches, data_sh,
                            supervised.router_coefs(s.model, self.module.config)),
            in_shardings=(self.state_shardings, self.base_shardings, batch_sh),
            out_shardings=(self.state_shardings, replicated), donate_argnums=(0,)), self.mesh)  # never the base
        self._eval_step = sharding.on_mesh(jax.jit(
            make_eval_step(self.module, s.loss),
            in_shardings=(self.state_shardings.params, self.base_shardings, batch_sh, data_sh),
            out_shardings=replicated), self.mesh)
        # drops rows past the checkpoint; mirrors them to W&B when settings.wandb asks
        self.writer = metric_writer(workdir, resume_step=self.step, wandb=s.wandb,
                                    run_config=to_dict(s), job_type="dpo")

    # -- the reference

    def _device_batch(self, pairs: data_lib.PreferenceBatch) -> DPOBatch:
        """Placed pairs and the reference's log-probs of them (one jitted forward)."""
        pairs = self._place(pairs)
        return DPOBatch(pairs=pairs, reference=self._reference_logps(self.reference, pairs))

    def _reference_checksums(self) -> dict:
        if self._reference_record is None:
            self._reference_record = verify.record(self.reference)
        return self._reference_record

    def _check_reference(self, extra: dict) -> None:
        """The checkpoints' steps were taken against one reference; resuming against another (a changed
        model.path) would silently train a different objective."""
        recorded = extra.get("reference")
        if recorded is None:
            return
        changed = verify.mismatches(self.reference, recorded)
        if changed:
            raise ConfigError(
                f"dpo: the checkpoints in {self.checkpoints.directory} were trained against another reference "
                f"model than model.path={self.settings.model.path!r} gives ({len(changed)} tensors differ, e.g. "
                f"{changed[0]}); resume with the original model.path or start in a new workdir")
        self._reference_record = recorded

    def checkpoint_extra(self) -> dict[str, Any]:
        extra = super().checkpoint_extra()  # with LoRA: the base's checksums, which are the reference's
        return extra if self.base is not None else {**extra, "reference": self._reference_checksums()}

    # -- steps

    def evaluate(self) -> dict[str, float]:
        """Loss and the TRL metrics (rewards/accuracies, margins, ...) over every eval pair (or
        train.eval_batches batches), as `eval/<name>`."""
        if self.eval_source is None:
            return {}
        totals = None
        for i, records in enumerate(data_lib.iterate_once(self.eval_source, self.settings.train.batch_size)):
            if self.settings.train.eval_batches and i >= self.settings.train.eval_batches:
                break
            batch = self._device_batch(self.prompt_tokenizer.preferences(records.records, length=self.length))
            out = self._eval_step(self.state.params, self.base, batch, self._place(records.valid))
            totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
        metrics = {k: float(v) for k, v in jax.device_get(finalize_metrics(totals)).items()}
        metrics["loss"] = metrics.pop("pair_loss") + self.settings.loss.sft_coef * metrics.get("nll_loss", 0.0)
        metrics["pairs"] = float(jax.device_get(totals["pair_loss"].count))
        return {f"eval/{k}": v for k, v in metrics.items()}
