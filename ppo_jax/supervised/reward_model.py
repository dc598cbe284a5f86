"""Reward model training: Bradley-Terry on (prompt, chosen, rejected) preferences.

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected))

r is a `ScalarModel` (a transformer with a scalar head) read at the last real token of
prompt + response (+ EOS), exactly as the PPO trainer reads it. The transformer starts from a causal
LM (usually the SFT model: `model.path`), the head from N(0, 1/sqrt(D + 1)) (Stiennon et al.).

Normalisation (optional, `normalize.source`): after training, scores of the SFT policy's own samples
(or of the responses in the preference data) are brought to mean 0 and std 1 by a gain and a bias on
the head: score' = gain * score + bias, folded exactly into the head's kernel and bias. GPT-2 exports
carry the bias (folded into the final LayerNorm bias by `hf.export_model`); Llama-family heads have
nowhere to store it, so for them the bias is only written to normalization.json - put it in the PPO
config as reward.bias.

LoRA (model.lora.rank > 0): the transformer's adapters and the score head train (the head is new, so
it must), the transformer's base stays frozen; normalisation folds into the trained head as above,
and the export is merged (full weights, adapters folded in): a PEFT adapter directory has no place for
a new head other than `modules_to_save`, which we do not write.

Shapes: B pairs, L = data.max_prompt_length + data.max_response_length, D hidden size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from etils import epath

from ppo_jax import data as data_lib
from ppo_jax import sampling, sharding
from ppo_jax.config import ConfigError, to_dict
from ppo_jax.models import CausalLM, ScalarModel, boxed_params, hf, init_params
from ppo_jax.data.host_packing import PackedPairs, pack_pairs
from ppo_jax.models.forward import response_scores, sequence_scores, variables
from ppo_jax.models.lora import trained_variables
from ppo_jax.supervised import base as supervised
from ppo_jax.supervised.settings import RewardModelSettings, reward_model_config  # noqa: F401  (the defaults)
from ppo_jax.wandb_run import metric_writer

Array = jax.Array

def pair_scores(model: ScalarModel, params, batch: data_lib.PreferenceBatch | PackedPairs, adapters=None
                ) -> tuple[Array, Array]:
    """(chosen [B], rejected [B]) scores from one [2B, L] forward, or one forward of the packed rows
    (adapters: LoRA on `params`, or None)."""
    if isinstance(batch, PackedPairs):
        return packed_pair_scores(model, params, batch, adapters)
    b = batch.chosen_tokens.shape[0]
    tokens = jnp.concatenate([batch.chosen_tokens, batch.rejected_tokens], axis=0)
    mask = jnp.concatenate([batch.chosen_mask, batch.rejected_mask], axis=0)
    scores = sequence_scores(model, params, tokens, mask, adapters)
    return scores[:b], scores[b:]


def token_slots(batch: data_lib.PreferenceBatch | PackedPairs) -> int:
    """The slots a step's forward computes: the packed rows', or both padded halves'."""
    if isinstance(batch, PackedPairs):
        return batch.tokens.size
    return batch.chosen_tokens.size + batch.rejected_tokens.size


def packed_pair_scores(model: ScalarModel, params, batch: PackedPairs, adapters=None) -> tuple[Array, Array]:
    """(chosen [B], rejected [B]) scores of packed rows [R, T]: the head's output at each sequence's
    last slot."""
    values, _ = model.apply(variables(params, adapters), batch.tokens, batch.positions, batch.mask, None,
                            batch.segment_ids)
    scores = values.reshape(-1)[batch.last_slots]
    b = scores.shape[0] // 2
    return scores[:b], scores[b:]


def bradley_terry_loss(chosen: Array, rejected: Array, weight: Array | None = None):
    """-log sigmoid(chosen - rejected), weighted mean over pairs; metrics alongside.

    chosen, rejected, weight [B]. Accuracy counts a tie as wrong (the model must prefer the chosen).
    """
    weight = jnp.ones_like(chosen) if weight is None else weight.astype(jnp.float32)
    count = jnp.maximum(weight.sum(), 1.0)
    margin = chosen - rejected
    losses = jax.nn.softplus(-margin)  # = -log sigmoid(margin), stable for large |margin|
    loss = (losses * weight).sum() / count
    metrics = {
        "loss": loss,
        "accuracy": ((margin > 0) * weight).sum() / count,
        "margin": (margin * weight).sum() / count,
        "score_mean": ((chosen + rejected) * weight).sum() / (2 * count),
    }
    return loss, metrics


def _zero_score_bias(grads):
    """The Bradley-Terry loss sees only score differences: the head bias has no gradient in exact
    arithmetic, but float rounding leaves ~1e-9 that Adam would blow up to a full step. Pin it."""
    if "score" in grads and "bias" in grads["score"]:
        grads = {**grads, "score": {**grads["score"], "bias": jnp.zeros_like(grads["score"]["bias"])}}
    return grads


def make_train_step(model: ScalarModel, tx):
    """(state, base, batch) -> (state, metrics); the gradient is over state.params: the whole model,
    or with LoRA the adapters and the head (`base`: the frozen transformer, None without LoRA)."""

    def train_step(state: supervised.TrainState, base, batch: data_lib.PreferenceBatch):
        def loss_fn(trainable):
            params, adapters = trained_variables(trainable, base)
            chosen, rejected = pair_scores(model, params, batch, adapters)
            return bradley_terry_loss(chosen, rejected)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        grads = _zero_score_bias(grads)
        metrics = {f"train/{k}": v for k, v in metrics.items()}
        metrics["train/grad_norm"] = optax.tree.norm(grads)
        metrics["train/token_slots"] = jnp.float32(token_slots(batch))  # what the step computed: packed or padded
        return supervised.apply_gradients(tx, state, grads), metrics

    return train_step


def make_eval_step(model: ScalarModel):
    """Sums over valid pairs (batches of an eval pass add up exactly)."""

    def eval_step(trainable, base, batch: data_lib.PreferenceBatch, valid: Array):
        params, adapters = trained_variables(trainable, base)
        chosen, rejected = pair_scores(model, params, batch, adapters)
        margin = chosen - rejected
        w = valid.astype(jnp.float32)
        return {"loss": (jax.nn.softplus(-margin) * w).sum(), "correct": ((margin > 0) * w).sum(),
                "margin": (margin * w).sum(), "pairs": w.sum()}

    return eval_step


def fold_normalization(params, gain: float, bias: float):
    """Head params with score' = gain * score + bias folded in (exact: the head is affine)."""
    score = params["score"]
    new_score = {"kernel": score["kernel"] * jnp.asarray(gain, score["kernel"].dtype),
                 "bias": score["bias"] * jnp.asarray(gain, score["bias"].dtype) + jnp.asarray(bias, score["bias"].dtype)}
    return {**params, "score": new_score}


# ----------------------------------------------------------------------------------------------
# The trainer.


class RewardModelTrainer(supervised.SupervisedTrainer):
    """Builds the reward model, data and jitted steps once from a config; `train()` runs the loop,
    normalises (optionally) and exports to <workdir>/hf."""

    name = "reward_model"
    settings_type = RewardModelSettings
    export_kind = "reward"

    def __init__(self, config, workdir: str, *, tokenizer=None,
                 train_records: Sequence[Mapping[str, Any]] | None = None,
                 eval_records: Sequence[Mapping[str, Any]] | None = None, mesh=None):
        """config: a reward-model ConfigDict (`reward_model_config()` and overrides) or
        `RewardModelSettings`, converted and validated here, once. train_records / eval_records: data
        given in code instead of files."""
        s = self._start(config, workdir, mesh)
        d = s.data
        fields = {"prompt": d.prompt_field, "chosen": d.chosen_field, "rejected": d.rejected_field}
        train_source = supervised.data_source(d.train, train_records, fields, "reward_model train data")
        if train_source is None:
            raise ConfigError("reward_model: no training data; set data.train (a JSONL file of "
                              "prompt/chosen/rejected) or pass train_records")
        self.train_source = train_source
        self.eval_source = supervised.data_source(d.eval, eval_records, fields, "reward_model eval data")
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self._check_prompts(train_source, self.eval_source)

        head_key, self._normalize_key = jax.random.split(jax.random.key(s.seed))
        self.length = d.max_prompt_length + d.max_response_length
        self.packed_shape = self._check_packing(s.packing.shape(self.length))
        cfg, start_kind = supervised.model_config(s.model, self.tokenizer, what="reward_model", data=d,
                                                  kinds=("causal_lm", "reward"), compute=s.compute, mesh=self.mesh)
        self.model_config = cfg
        self.module = ScalarModel(cfg, head_init="reward")
        self.param_shardings = sharding.tree_shardings(boxed_params(self.module), self.mesh)
        params = self._initial_params(start_kind, head_key)

        self._start_training(self._trainable(params, self.param_shardings, heads=("score",)), train_source,
                             "preference")
        trained_sh = (self.state_shardings.params, self.base_shardings)  # (trainable, base) of every step

        data_sh = sharding.data_sharding(self.mesh)
        batch_sh = data_sh  # every leaf of a padded or a packed batch (one jit traces each kind)
        replicated = sharding.replicated(self.mesh)
        self._train_step = sharding.on_mesh(jax.jit(
            make_train_step(self.module, self.tx), in_shardings=(self.state_shardings, self.base_shardings, batch_sh),
            out_shardings=(self.state_shardings, replicated), donate_argnums=(0,)), self.mesh)  # never the base
        self._eval_step = sharding.on_mesh(jax.jit(
            make_eval_step(self.module), in_shardings=(*trained_sh, batch_sh, data_sh),
            out_shardings=replicated), self.mesh)

        def scores(trainable, base, tokens, mask):
            params, adapters = trained_variables(trainable, base)
            return sequence_scores(self.module, params, tokens, mask, adapters)

        self._score = sharding.on_mesh(jax.jit(scores, in_shardings=(*trained_sh, data_sh, data_sh),
                                               out_shardings=data_sh), self.mesh)
        # drops rows past the checkpoint; mirrors them to W&B when settings.wandb asks
        self.writer = metric_writer(workdir, resume_step=self.step, wandb=s.wandb,
                                    run_config=to_dict(s), job_type="reward_model")
        self.normalization: dict[str, float] | None = None

    def _initial_params(self, start_kind: str | None, head_key):
        """A reward model checkpoint as is; a causal LM's transformer + a fresh N(0, 1/sqrt(D+1)) head;
        or a fresh model."""
        m = self.settings.model
        if start_kind is not None:
            loaded = hf.load_model(m.path, self.mesh, kind=start_kind, param_dtype=m.param_dtype or None,
                                   dtype=m.dtype or None, execution=self.model_config.execution())
        if start_kind == "reward":
            return loaded.params
        if start_kind == "causal_lm":
            cfg = self.model_config
            head_sh = self.param_shardings["score"]
            dtype = cfg.jnp_param_dtype

            def head(key):
                kernel = jax.random.normal(key, (cfg.hidden_size, 1), jnp.float32) / math.sqrt(cfg.hidden_size + 1)
                return {"kernel": kernel.astype(dtype), "bias": jnp.zeros((1,), dtype)}

            score = jax.jit(head, out_shardings=head_sh)(head_key)
            return {"transformer": loaded.params["transformer"], "score": score}
        params, _ = init_params(self.module, head_key, self.mesh)
        return params

    # -- steps

    def _device_batch(self, batch: data_lib.PreferenceBatch):
        """The step's pairs on the mesh: packed when packing.rows is set and their sequences fit."""
        packed = pack_pairs(batch, *self.packed_shape) if self.packed_shape else None
        return self._place(batch if packed is None else packed)

    def evaluate(self, source=None, prefix: str = "eval") -> dict[str, float]:
        """Bradley-Terry loss, accuracy (chosen scored strictly higher) and mean margin on every pair of
        the eval data (or train.eval_batches batches of it)."""
        source = self.eval_source if source is None else source
        if source is None:
            return {}
        totals = {"loss": 0.0, "correct": 0.0, "margin": 0.0, "pairs": 0.0}
        for i, records in enumerate(data_lib.iterate_once(source, self.settings.train.batch_size)):
            if self.settings.train.eval_batches and i >= self.settings.train.eval_batches:
                break
            batch = self.prompt_tokenizer.preferences(records.records, length=self.length)
            out = jax.device_get(self._eval_step(self.state.params, self.base, *self._place((batch, records.valid))))
            for k in totals:
                totals[k] += float(out[k])
        n = max(totals["pairs"], 1.0)
        return {f"{prefix}/loss": totals["loss"] / n, f"{prefix}/accuracy": totals["correct"] / n,
                f"{prefix}/margin": totals["margin"] / n, f"{prefix}/pairs": totals["pairs"]}

    def score_tokens(self, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Scores of left-padded sequences [N, L] (prompt + response), in batches of train.batch_size."""
        b = self.settings.train.batch_size
        n = tokens.shape[0]
        out = []
        for start in range(0, n, b):
            t, m = tokens[start:start + b], mask[start:start + b]
            fill = b - t.shape[0]
            if fill:  # a full batch keeps one compiled shape; the filler rows are dropped below
                t = np.concatenate([t, np.repeat(t[-1:], fill, 0)])
                m = np.concatenate([m, np.repeat(m[-1:], fill, 0)])
            # Global rows, identical on every process: put_batch / to_host, not the per-process path.
            scores = np.asarray(sharding.to_host(self._score(self.state.params, self.base,
                                                             *sharding.put_batch((t, m), self.mesh))))
            out.append(scores[:b - fill])
        return np.concatenate(out) if out else np.zeros((0,), np.float32)

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        """Scores of (prompt, response) texts; each response gets an EOS unless it is over-long."""
        encoded = self.prompt_tokenizer.encode_sft([{"prompt": p, "response": r} for p, r in zip(prompts, responses)])
        batch = self.prompt_tokenizer.pad_sft(encoded, length=self.length)
        return self.score_tokens(batch.tokens, batch.mask)

    # -- normalisation

    def _normalization_scores(self) -> np.ndarray:
        n = self.settings.normalize
        if n.source == "preferences":
            count = min(int(n.num_prompts), len(self.train_source))
            records = [self.train_source[i] for i in range(count)]
            prompts = [r["prompt"] for r in records] * 2
            responses = [r["chosen"] for r in records] + [r["rejected"] for r in records]
            return self.score(prompts, responses)
        return self._policy_sample_scores()

    def _policy_sample_scores(self) -> np.ndarray:
        """Scores of the policy's own samples on the training prompts (as PPO will score them)."""
        n, d = self.settings.normalize, self.settings.data
        path = n.policy_path or self.settings.model.path
        execution = self.settings.compute.apply(hf.load_config(path)[0]).execution()
        loaded = hf.load_model(path, self.mesh, kind="causal_lm", execution=execution)
        policy = CausalLM(loaded.config)
        prompts = []
        seen: dict[str, None] = {}
        for i in range(len(self.train_source)):  # distinct prompts, in data order
            p = self.train_source[i]["prompt"]
            if isinstance(p, str) and p not in seen:
                seen[p] = None
                prompts.append(p)
            if len(prompts) == int(n.num_prompts):
                break
        b = self.settings.train.batch_size
        sampler = sampling.make_sampler(policy, sampling.SamplingConfig(
            max_new_tokens=int(d.max_response_length), pad_token_id=int(self.tokenizer.pad_token_id),
            stop_token_ids=(int(self.tokenizer.eos_token_id),), temperature=float(n.temperature)),
            self.mesh, jax.tree.map(lambda x: x.sharding, loaded.params))
        data_sh = sharding.data_sharding(self.mesh)
        def policy_sample_scores(trainable, base, prompt_tokens, prompt_mask, tokens, mask):
            params, adapters = trained_variables(trainable, base)
            return response_scores(self.module, params, prompt_tokens, prompt_mask, tokens, mask, adapters)

        score_fn = sharding.on_mesh(jax.jit(
            policy_sample_scores,
            in_shardings=(self.state_shardings.params, self.base_shardings) + (data_sh,) * 4,
            out_shardings=data_sh), self.mesh)
        scores = []
        for start in range(0, len(prompts), b):
            chunk = prompts[start:start + b]
            chunk = chunk + [chunk[-1]] * (b - len(chunk))
            batch = self.prompt_tokenizer.prompts(chunk, length=int(d.max_prompt_length))
            toks, mask = sharding.put_batch((batch.tokens, batch.mask), self.mesh)
            out = sampler(loaded.params, toks, mask, jax.random.fold_in(self._normalize_key, start))
            s = sharding.to_host(score_fn(self.state.params, self.base, out.prompt_tokens, out.prompt_mask, out.tokens,
                                          out.mask))
            scores.append(np.asarray(s)[:min(b, len(prompts) - start)])
        return np.concatenate(scores)

    def normalize(self) -> dict[str, float]:
        """Sets the head so the normalisation samples score mean 0, std 1; returns the statistics."""
        scores = self._normalization_scores().astype(np.float64)
        mean, std = float(scores.mean()), float(scores.std())
        if not std > 1e-8:
            raise ValueError(f"reward_model: normalisation samples all score {mean:.4g} (std {std:.2g}); the "
                             f"reward model does not tell them apart, so there is no scale to normalise")
        gain, bias = 1.0 / std, -mean / std
        fold_bias = self.model_config.family == "gpt2"  # only GPT-2 exports can carry a score offset
        # state.params has the head at "score" with or without LoRA ({"lora", "score"}): fold it there.
        params = fold_normalization(self.state.params, gain, bias if fold_bias else 0.0)
        params = jax.device_put(params, self.state_shardings.params)
        self.state = self.state.replace(params=params)
        self.normalization = {"mean": mean, "std": std, "gain": gain, "bias": bias,
                              "bias_in_head": fold_bias, "ppo_reward_bias": 0.0 if fold_bias else bias,
                              "num_samples": int(scores.size), "source": self.settings.normalize.source}
        if jax.process_index() == 0:  # epath: a gs:// workdir works too
            out = epath.Path(self.workdir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "normalization.json").write_text(json.dumps(self.normalization, indent=2))
        return self.normalization

    # -- the loop

    def train(self) -> list[dict[str, float]]:
        """Runs to train.steps (resuming from the latest checkpoint), normalises, exports <workdir>/hf."""
        try:
            history = self.run_steps()
            if self.settings.normalize.source != "none":
                stats = self.normalize()
                row = {"step": self.step, **self.writer.write(
                    self.step, {f"normalize/{k}": float(v) for k, v in stats.items() if k != "source"})}
                history.append(row)
        finally:
            self.close()
        if self.settings.train.export:
            self.export()
        return history
