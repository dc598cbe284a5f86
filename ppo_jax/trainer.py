"""The only Python loop: data -> rollout -> host rewards -> experience -> update -> metrics -> checkpoints.

`PPOTrainer(config, workdir)` builds the mesh, the four parameter trees and the jitted steps once,
validates everything before compiling, then `train()` runs the iterations.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from ppo_jax import config as config_lib
from ppo_jax import metrics as metrics_lib
from ppo_jax import ppo, reward_fns, sampling, sharding, step as step_lib
from ppo_jax.checkpoint import CheckpointManager
from ppo_jax.supervised import override_dtypes
from ppo_jax.models import CausalLM, ModelConfig, ScalarModel, init_params

Array = jax.Array


class NonFiniteError(RuntimeError):
    """Too many consecutive updates were skipped for non-finite losses, gradients or rewards."""


def save_tokenizer(tokenizer, directory: str) -> None:
    """`save_pretrained` into a local or remote (gs://) directory."""
    if "://" not in directory:
        tokenizer.save_pretrained(directory)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        target = epath.Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        for f in os.listdir(tmp):
            (target / f).write_bytes(open(os.path.join(tmp, f), "rb").read())


def _copy_tree(params, shardings):
    """A real copy on the same shardings (a reference aliasing the policy would die on donation)."""
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(params)


def policy_model_config(config) -> ModelConfig:
    """The policy architecture, read without loading weights (config.json or policy.model)."""
    if config.policy.path:
        from ppo_jax.models import hf

        cfg, _ = hf.load_config(config.policy.path)
    else:
        cfg = config_lib.model_config_from_dict(config.policy.model)
    return override_dtypes(cfg, config.policy)


def reward_model_config(config) -> ModelConfig | None:
    if not config.reward.path:
        return None
    from ppo_jax.models import hf

    cfg, kind = hf.load_config(config.reward.path)
    if kind != "reward":
        raise config_lib.ConfigError(
            f"reward.path={config.reward.path!r} holds a {kind} checkpoint; the reward model must be a "
            "sequence classifier with one label (ForSequenceClassification, num_labels=1)")
    return cfg


def boxed_params(module) -> Any:
    """Abstract params of `module` with their logical axis names (nothing allocated)."""
    dummy = jnp.zeros((1, 2), jnp.int32)
    return jax.eval_shape(lambda: module.init(jax.random.key(0), dummy, dummy, dummy + 1)["params"])


@dataclasses.dataclass(frozen=True)
class Modules:
    """The Flax modules of the four trees (definitions only, no parameters)."""

    policy: CausalLM
    value: ScalarModel | None  # None for critic-free estimators
    reward: ScalarModel | None  # None when only Python reward functions score


def make_modules(config, policy_cfg: ModelConfig, reward_cfg: ModelConfig | None, uses_critic: bool) -> Modules:
    value = None
    if uses_critic:
        value = (ScalarModel(reward_cfg, head_init="reward") if config.value.init == "reward"
                 else ScalarModel(policy_cfg, head_init="zero"))
    reward = ScalarModel(reward_cfg, head_init="reward") if reward_cfg is not None else None
    return Modules(policy=CausalLM(policy_cfg), value=value, reward=reward)


def make_optimizers(config, uses_critic: bool):
    opt_steps = int(config.train.iterations) * int(config.ppo.epochs) * int(config.ppo.num_minibatches)
    policy_tx = step_lib.make_optimizer(config, config.optim.policy_lr, opt_steps)
    value_tx = step_lib.make_optimizer(config, config.optim.value_lr, opt_steps) if uses_critic else None
    return policy_tx, value_tx


def init_kl(config):
    p = config.ppo
    return ppo.init_kl_controller(p.kl_controller, p.kl_coef, target=p.kl_target, horizon=p.kl_horizon)


def abstract_train_state(config, modules: Modules, policy_tx, value_tx, mesh):
    """(abstract TrainState of ShapeDtypeStructs carrying shardings, TrainState of shardings).

    Built once from `jax.eval_shape` and the logical axis rules: the shardings every step is
    jitted with, and the target a checkpoint restores onto (whatever mesh it was saved on).
    """
    policy = boxed_params(modules.policy)
    value = boxed_params(modules.value) if modules.value is not None else None
    boxed = step_lib.TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32), policy=policy,
        policy_opt=jax.eval_shape(policy_tx.init, policy),
        value=value, value_opt=jax.eval_shape(value_tx.init, value) if value is not None else None,
        kl=jax.eval_shape(lambda: init_kl(config)), key=jax.eval_shape(lambda: jax.random.key(0)))
    shardings = sharding.tree_shardings(boxed, mesh)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            nn.unbox(boxed), shardings)
    return abstract, shardings


def initial_params(config, modules: Modules, shardings: step_lib.TrainState, mesh, key, reward_params):
    """Fresh policy and value params: from policy.path (Hugging Face) or a random init."""
    if config.policy.path:
        from ppo_jax.models import hf

        loaded = hf.load_model(config.policy.path, mesh, kind="causal_lm",
                               param_dtype=config.policy.param_dtype or None, dtype=config.policy.dtype or None)
        policy = jax.device_put(loaded.params, shardings.policy)
    else:
        policy, _ = init_params(modules.policy, key, mesh)
    value = None
    if modules.value is not None:
        if config.value.init == "reward":
            value = _copy_tree(reward_params, shardings.value)
        else:
            head = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                nn.unbox(boxed_params(modules.value))["score"])
            value = jax.jit(lambda t: {"transformer": jax.tree.map(jnp.copy, t), "score": head},
                            out_shardings=shardings.value)(policy["transformer"])
    return policy, value


def rollout_sampling_config(config, stop_ids: Sequence[int], pad_id: int,
                            unroll_layers: bool | None = None) -> sampling.SamplingConfig:
    """The sampler settings of a PPO config (rollout.*); unroll_layers, if given, overrides
    rollout.decode."""
    r = config.rollout
    if unroll_layers is None:
        unroll_layers = config_lib.DECODE_LOOPS[r.decode]
    return sampling.SamplingConfig(
        max_new_tokens=int(r.response_length), min_new_tokens=int(r.min_new_tokens),
        temperature=float(r.temperature), top_k=int(r.top_k), top_p=float(r.top_p),
        stop_token_ids=tuple(stop_ids), pad_token_id=int(pad_id), num_samples=int(r.num_samples),
        cache_dtype=r.cache_dtype or None, unroll_layers=unroll_layers)


@dataclasses.dataclass
class Steps:
    """The three compiled phases of a PPO iteration, with their shardings and donation.

    sampler: rollout sampling; experience_jit(state, frozen, rollout) -> (Experience, metrics);
    update_jit(state, experience) -> (state, metrics), the state donated. trace_counts counts the
    traces of the two jitted steps (the sampler counts its own).
    """

    sampling_config: sampling.SamplingConfig
    sampler: sampling.Sampler
    experience_jit: Callable
    update_jit: Callable
    trace_counts: dict[str, int]


def build_steps(config, mesh, sizes, hp, modules: Modules, policy_tx, value_tx, state_shardings,
                frozen_shardings, stop_ids: Sequence[int], pad_id: int,
                unroll_layers: bool | None = None) -> Steps:
    """The sampler and the jitted experience and update steps of a run (also what `ppo_jax.plan`
    lowers and measures, so the planner sees exactly the programs a run compiles). unroll_layers:
    overrides rollout.decode (see `rollout_sampling_config`)."""
    batch = sharding.data_sharding(mesh)
    replicated = sharding.replicated(mesh)
    sampling_config = rollout_sampling_config(config, stop_ids, pad_id, unroll_layers)
    sampler = sampling.make_sampler(modules.policy, sampling_config, mesh, state_shardings.policy)
    experience = step_lib.make_experience_fn(modules.policy, modules.value, modules.reward, hp)
    update = step_lib.make_update_fn(modules.policy, modules.value, policy_tx, value_tx, hp,
                                     sizes.rollout_rows, batch)
    rollout_sh = jax.tree.map(lambda _: batch, step_lib.Rollout(*([0] * 7)))
    exp_sh = jax.tree.map(lambda _: batch, step_lib.Experience(*([0] * 10)))
    trace_counts = {"experience": 0, "update": 0}

    def traced(name, fn):
        def counted(*args):
            trace_counts[name] += 1  # runs once per trace, never per call
            return fn(*args)
        return counted

    experience_jit = jax.jit(traced("experience", experience),
                             in_shardings=(state_shardings, frozen_shardings, rollout_sh),
                             out_shardings=(exp_sh, replicated))
    update_jit = jax.jit(traced("update", update), in_shardings=(state_shardings, exp_sh),
                         out_shardings=(state_shardings, replicated), donate_argnums=(0,))
    return Steps(sampling_config, sampler, experience_jit, update_jit, trace_counts)


class PPOTrainer:
    """Builds everything once from a config, then runs PPO iterations.

    A workdir that already holds a checkpoint is resumed from its newest complete step: trainable
    state, KL controller, keys and the data position, so the continued run is the run that would
    have happened without the interruption.
    """

    def __init__(self, config, workdir: str, *, tokenizer=None, prompts: Sequence[str] | None = None,
                 reward_functions: Sequence[tuple[Callable, float]] | None = None, mesh=None):
        self.config = config
        self.workdir = str(workdir)
        self.mesh = mesh or sharding.make_mesh(tuple(config.mesh.shape))
        init_key, self._sample_key, state_key = jax.random.split(jax.random.key(config.seed), 3)

        # -- Everything that can be checked is checked before any weights load or anything compiles.
        self.policy_config = policy_model_config(config)
        self.reward_config = reward_model_config(config)
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.reward_functions = (list(reward_functions) if reward_functions is not None else
                                 reward_fns.parse(config.reward.functions, config.reward.function_weights))
        self.sizes = config_lib.validate(
            _with_reward_functions(config) if reward_functions else config,
            batch_divisor=sharding.batch_divisor(self.mesh),
            max_positions=self.policy_config.max_position_embeddings,
            vocab_size=self.policy_config.vocab_size)
        self._check_tokenizers()
        self.hp = step_lib.PPOHyper.from_config(config, self.sizes)
        self.stop_ids = config_lib.stop_token_ids(config, self._eos_id())
        if not self.stop_ids:
            raise config_lib.ConfigError("rollout.stop_token_ids is empty and the tokenizer has no EOS token; "
                                         "set rollout.stop_token_ids")
        self.prompts = self._load_prompts(prompts)

        # -- Modules, optimizers and the shardings of everything, from abstract shapes.
        self.modules = make_modules(config, self.policy_config, self.reward_config, self.hp.uses_critic)
        self.policy_tx, self.value_tx = make_optimizers(config, self.hp.uses_critic)
        self.abstract_state, self.state_shardings = abstract_train_state(
            config, self.modules, self.policy_tx, self.value_tx, self.mesh)

        # -- Weights: the frozen reward model, then a checkpoint to resume or fresh trainable state.
        reward_params = None
        if self.modules.reward is not None:
            from ppo_jax.models import hf

            reward_params = hf.load_model(config.reward.path, self.mesh, kind="reward").params
        checkpoint_dir = os.path.join(self.workdir, "checkpoints")
        resuming = epath.Path(checkpoint_dir).is_dir()
        if resuming:
            self.checkpoints = self._checkpoint_manager(checkpoint_dir)
            resuming = self.checkpoints.latest_step() is not None
        if resuming:
            self.resumed_from = self.checkpoints.latest_step()
            self.state, reference = self._restore()
        else:
            self.resumed_from = None
            policy, value = initial_params(config, self.modules, self.state_shardings, self.mesh,
                                           init_key, reward_params)
            reference = _copy_tree(policy, self.state_shardings.policy)
            self.state = self._fresh_state(policy, value, state_key)
            # Only now, with every input read and checked, does the run write anything.
            if not hasattr(self, "checkpoints"):
                self.checkpoints = self._checkpoint_manager(checkpoint_dir)
        self.frozen = step_lib.FrozenParams(reference=reference, reward=reward_params)
        self.frozen_shardings = step_lib.FrozenParams(
            reference=self.state_shardings.policy,
            reward=jax.tree.map(lambda x: x.sharding, reward_params) if reward_params is not None else None)
        self.steps = build_steps(config, self.mesh, self.sizes, self.hp, self.modules, self.policy_tx,
                                 self.value_tx, self.state_shardings, self.frozen_shardings, self.stop_ids,
                                 int(self.tokenizer.pad_token_id))
        start = self.resumed_from or 0
        self.writer = metrics_lib.MetricWriter(self.workdir, resume_step=start)
        if jax.process_index() == 0:
            save_tokenizer(self.tokenizer, os.path.join(self.workdir, "tokenizer"))
        self.history: list[dict[str, float]] = []
        self._stop_signal: str | None = None
        self._consecutive_nonfinite = 0
        self._reference_saved = self.checkpoints.has_frozen("reference")

    @property
    def sampler(self) -> sampling.Sampler:
        return self.steps.sampler

    @property
    def trace_counts(self) -> dict[str, int]:
        """How often each jitted step was traced (1 each in a run that never recompiles)."""
        return self.steps.trace_counts

    # ------------------------------------------------------------------ setup helpers

    def _checkpoint_manager(self, directory: str) -> CheckpointManager:
        t = self.config.train
        return CheckpointManager(directory, max_to_keep=int(t.keep_checkpoints),
                                 best_metric=t.best_metric or None, best_mode=t.best_mode)

    def _fresh_state(self, policy, value, key) -> step_lib.TrainState:
        """Optimizer states, KL controller, step and key built straight onto their shardings."""
        sh, config = self.state_shardings, self.config

        def build(policy, value, key):
            return step_lib.TrainState(
                step=jnp.zeros((), jnp.int32), policy=policy, policy_opt=self.policy_tx.init(policy),
                value=value, value_opt=self.value_tx.init(value) if value is not None else None,
                kl=init_kl(config), key=key)

        return jax.jit(build, out_shardings=sh)(policy, value, sharding.replicate(key, self.mesh))

    def _restore(self):
        state, extra = self.checkpoints.restore(abstract_state=self.abstract_state)
        if extra.get("reward_source") != self._reward_source():
            raise config_lib.ConfigError(
                f"the checkpoint in {self.workdir} was trained against reward {extra.get('reward_source')} "
                f"but the config now names {self._reward_source()}; resume with the original reward or use a "
                "new workdir")
        reference = self.checkpoints.restore_frozen("reference", self.abstract_state.policy)
        self.prompts.restore(extra["data"])
        if self.eval_prompts is not None and extra.get("eval_data"):
            self.eval_prompts.restore(extra["eval_data"])
        return state, reference

    def _reward_source(self) -> dict[str, Any]:
        """What scores this run (recorded in checkpoints; a resume must use the same)."""
        source: dict[str, Any] = {"path": self.config.reward.path, "functions": self.config.reward.functions}
        if self.config.reward.path:
            from ppo_jax.models import hf

            source["files"] = hf.fingerprint(self.config.reward.path)
        return source

    def save_checkpoint(self, force: bool = False) -> bool:
        """Saves trainable state + data position (the reference once, in frozen/)."""
        step = int(self.state.step)
        if not self._reference_saved:
            self.checkpoints.save_frozen("reference", self.frozen.reference)
            self._reference_saved = True
        extra = {
            "data": self.prompts.state(),
            "eval_data": self.eval_prompts.state() if self.eval_prompts is not None else None,
            "config": json.loads(self.config.to_json_best_effort()),
            "policy_model": dataclasses.asdict(self.policy_config),
            "value_model": dataclasses.asdict(self.modules.value.config) if self.modules.value else None,
            "value_head_init": self.modules.value.head_init if self.modules.value else None,
            "reward_source": self._reward_source(),
        }
        metrics = self.history[-1] if self.history else None
        best = self.config.train.best_metric
        metrics = {best: metrics[best]} if (best and metrics and best in metrics) else None
        return self.checkpoints.save(step, self.state, extra=extra, metrics=metrics, force=force)

    def _load_tokenizer(self):
        if self.config.policy.path:
            from ppo_jax.models import hf

            return hf.load_tokenizer(self.config.policy.path)
        from ppo_jax import toy

        return toy.tokenizer(self.policy_config.vocab_size)

    def _eos_id(self):
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return eos if eos is not None else self.policy_config.eos_token_id

    def _check_tokenizers(self):
        tok = self.tokenizer
        if tok.pad_token_id is None:
            raise config_lib.ConfigError("the policy tokenizer has no pad token; set tokenizer.pad_token "
                                         "(a token distinct from EOS) before training")
        if len(tok) > self.policy_config.vocab_size:
            raise config_lib.ConfigError(f"the tokenizer has {len(tok)} tokens but the policy's vocabulary has "
                                         f"{self.policy_config.vocab_size}")
        if self.config.reward.path:
            from ppo_jax.models import hf

            reward_tok = hf.load_tokenizer(self.config.reward.path)
            if reward_tok.get_vocab() != tok.get_vocab():
                raise config_lib.ConfigError(
                    "the policy and reward-model tokenizers differ (reward.path vs policy.path): the reward "
                    "model would read different token ids; use a reward model trained with the policy's tokenizer")

    def _load_prompts(self, prompts):
        from ppo_jax.prompts import PromptStream

        vocab = self.policy_config.vocab_size
        self.eval_prompts = (PromptStream(self.config, self.tokenizer, split="eval", vocab_size=vocab)
                             if self.config.train.eval_every else None)
        return PromptStream(self.config, self.tokenizer, prompts=prompts, vocab_size=vocab)

    def _experience(self, state, frozen, rollout):
        with jax.set_mesh(self.mesh), sharding.activation_rules():
            return self.steps.experience_jit(state, frozen, rollout)

    def _update(self, state, exp):
        with jax.set_mesh(self.mesh), sharding.activation_rules():
            return self.steps.update_jit(state, exp)

    # ------------------------------------------------------------------ the loop

    def rollout(self, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key) -> tuple[step_lib.Rollout, Any]:
        """Samples responses and scores them with the Python reward functions (host)."""
        toks, mask = sharding.put_local_batch((prompt_tokens, prompt_mask), self.mesh)
        out = self.steps.sampler(self.state.policy, toks, mask, sharding.replicate(key, self.mesh))
        if self.reward_functions:
            host = sharding.to_host({"pt": out.prompt_tokens, "pm": out.prompt_mask, "t": out.tokens,
                                     "m": out.mask})
            prompts_text, responses_text = self.decode(host["pt"], host["pm"], host["t"], host["m"])
            host_scores = reward_fns.combined_scores(self.reward_functions, prompts_text, responses_text)
        else:
            host_scores = np.zeros(out.tokens.shape[0], np.float32)
        rollout = step_lib.Rollout(
            prompt_tokens=out.prompt_tokens, prompt_mask=out.prompt_mask, tokens=out.tokens,
            mask=out.mask, sampler_logprobs=out.logprobs, stopped=out.stopped,
            host_scores=sharding.put_batch(host_scores, self.mesh))
        return rollout, out

    def decode(self, prompt_tokens, prompt_mask, tokens, mask) -> tuple[list[str], list[str]]:
        """Host arrays -> prompt and response texts (stop tokens and padding dropped)."""
        stop = set(self.stop_ids)
        prompts = [self.tokenizer.decode([int(t) for t, m in zip(row, rm) if m], skip_special_tokens=True)
                   for row, rm in zip(prompt_tokens, prompt_mask)]
        responses = [self.tokenizer.decode([int(t) for t, m in zip(row, rm) if m and int(t) not in stop],
                                           skip_special_tokens=True)
                     for row, rm in zip(tokens, mask)]
        return prompts, responses

    def iteration_key(self, iteration: int):
        return jax.random.fold_in(self._sample_key, iteration)

    def run_iteration(self) -> dict[str, float]:
        timer = metrics_lib.PhaseTimer()
        iteration = int(self.state.step)
        prompt_tokens, prompt_mask = self.prompts.next_batch()
        with timer.measure("generate"):
            rollout, sample = self.rollout(prompt_tokens, prompt_mask, self.iteration_key(iteration))
            jax.block_until_ready(rollout.tokens)
        with timer.measure("experience"):
            exp, exp_metrics = self._experience(self.state, self.frozen, rollout)
            jax.block_until_ready(exp_metrics)
        with timer.measure("update"):
            self.state, upd_metrics = self._update(self.state, exp)
            jax.block_until_ready(upd_metrics)
        scalars = {**jax.device_get(exp_metrics), **jax.device_get(upd_metrics), **timer.pop()}
        total = sum(v for k, v in scalars.items() if k.startswith("time/"))
        tokens = float(scalars["response/length_mean"]) * self.sizes.rollout_rows
        scalars["time/iteration"] = total
        scalars["perf/tokens_per_sec"] = tokens / max(total, 1e-9)
        scalars["data/truncated_prompts"] = float(self.prompts.truncated)
        self._last_rollout = (rollout, exp)
        return {k: float(np.asarray(v)) for k, v in scalars.items()}

    def evaluate(self) -> dict[str, float]:
        """Scores responses to held-out prompts (same compiled rollout and experience functions)."""
        totals: dict[str, float] = {}
        n = int(self.config.train.eval_batches)
        for i in range(n):
            tokens, mask = self.eval_prompts.next_batch()
            key = jax.random.fold_in(jax.random.fold_in(self._sample_key, (1 << 30) + int(self.state.step)), i)
            rollout, _ = self.rollout(tokens, mask, key)
            _, metrics = self._experience(self.state, self.frozen, rollout)
            for k in ("objective/scores", "objective/kl", "objective/rlhf_reward", "response/length_mean",
                      "val/eos_rate"):
                totals[k] = totals.get(k, 0.0) + float(metrics[k]) / n
        return {f"eval/{k.split('/')[1]}": v for k, v in totals.items()}

    def samples(self, max_rows: int = 8) -> list[dict[str, Any]]:
        rollout, exp = self._last_rollout
        host = sharding.to_host({"pt": rollout.prompt_tokens, "pm": rollout.prompt_mask,
                                 "t": rollout.tokens, "m": rollout.mask, "s": exp.scores,
                                 "old": exp.old_logprobs, "ref": exp.ref_logprobs})
        prompts, responses = self.decode(host["pt"][:max_rows], host["pm"][:max_rows],
                                         host["t"][:max_rows], host["m"][:max_rows])
        kl = ((host["old"] - host["ref"]) * host["m"]).sum(-1)
        return [{"prompt": p, "response": r, "score": float(s), "kl": float(k)}
                for p, r, s, k in zip(prompts, responses, host["s"], kl)]

    def _handle_nonfinite(self, step: int, scalars: dict[str, float]) -> None:
        """Counts skipped updates, writes the offending samples, stops after too many in a row."""
        if scalars.get("nonfinite/skipped_minibatches", 0.0) == 0.0:
            self._consecutive_nonfinite = 0
            return
        self._consecutive_nonfinite += 1
        rollout, exp = self._last_rollout
        host = sharding.to_host({"s": exp.scores, "a": exp.advantages, "old": exp.old_logprobs,
                                 "pt": rollout.prompt_tokens, "pm": rollout.prompt_mask,
                                 "t": rollout.tokens, "m": rollout.mask})
        # The source first: a bad score or log-prob; advantages are whitened over the whole batch,
        # so one bad row makes them all non-finite.
        rows = np.arange(min(8, len(host["s"])))
        for bad in (~np.isfinite(host["s"]), ~np.isfinite(host["old"]).all(-1), ~np.isfinite(host["a"]).all(-1)):
            if bad.any():
                rows = np.nonzero(bad)[0]
                break
        prompts, responses = self.decode(host["pt"][rows], host["pm"][rows], host["t"][rows], host["m"][rows])
        metrics_lib.write_samples(self.workdir, step, [
            {"row": int(r), "prompt": p, "response": t, "score": float(host["s"][r])}
            for r, p, t in zip(rows, prompts, responses)], filename="nonfinite_samples.jsonl")
        limit = int(self.config.train.max_consecutive_nonfinite)
        if self._consecutive_nonfinite >= limit:
            self.checkpoints.wait()
            last = self.checkpoints.latest_step()
            where = (f"the last good checkpoint, step {last} in {self.checkpoints.directory}, is intact"
                     if last is not None else "no checkpoint was saved")
            raise NonFiniteError(
                f"{self._consecutive_nonfinite} consecutive iterations had non-finite losses, gradients or "
                f"rewards (their updates were skipped; the samples are in "
                f"{os.path.join(self.workdir, 'nonfinite_samples.jsonl')}); {where}")

    def _on_signal(self, signum, frame):
        del frame
        self._stop_signal = signal.Signals(signum).name

    def train(self, on_iteration: Callable[[int, dict[str, float]], dict[str, float] | None] | None = None
              ) -> list[dict[str, float]]:
        """Runs until train.iterations, a SIGTERM/SIGINT (saved, then stops) or a fatal error.

        on_iteration(step, scalars), if given, runs after every iteration (after the non-finite
        check, before metrics are written); the scalars it returns are logged with the iteration's.
        """
        cfg = self.config.train
        progress = None
        if cfg.progress and jax.process_index() == 0:
            from tqdm.auto import tqdm

            progress = tqdm(total=int(cfg.iterations), desc="ppo", initial=int(self.state.step))
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while int(self.state.step) < cfg.iterations:
                scalars = self.run_iteration()
                step = int(self.state.step)
                self.history.append(scalars)
                self._handle_nonfinite(step, scalars)
                if cfg.eval_every and step % cfg.eval_every == 0:
                    scalars.update(self.evaluate())
                if on_iteration is not None:
                    scalars.update(on_iteration(step, scalars) or {})
                if step % cfg.log_every == 0 or step == cfg.iterations:
                    self.writer.write(step, scalars)
                if cfg.sample_every and step % cfg.sample_every == 0:
                    metrics_lib.write_samples(self.workdir, step, self.samples())
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(score=f"{scalars['objective/scores']:.3f}",
                                         kl=f"{scalars['objective/kl']:.3f}",
                                         tok_s=f"{scalars['perf/tokens_per_sec']:.0f}")
                preempted = self.checkpoints.reached_preemption(step)
                stop = self._stop_signal is not None or preempted
                healthy = self._consecutive_nonfinite == 0
                due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
                if healthy and (due or stop or step == cfg.iterations):
                    self.save_checkpoint(force=True)
                if stop:
                    self.checkpoints.wait()
                    reason = self._stop_signal or "a TPU preemption notice"
                    self.stopped_by = reason
                    print(f"Stopped by {reason} after iteration {step}; checkpoint step "
                          f"{self.checkpoints.latest_step()} saved in {self.checkpoints.directory}. "
                          "Run the same command again to resume exactly where it stopped.", flush=True)
                    break
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if progress is not None:
                progress.close()
            self.writer.close()
            self.checkpoints.wait()
        return self.history

    def close(self):
        self.checkpoints.close()


def _with_reward_functions(config):
    """Validation sees 'some reward' when reward functions are passed in code."""
    c = config.copy_and_resolve_references()
    with c.unlocked():
        if not c.reward.path and not c.reward.functions:
            c.reward.functions = "<passed in code>"
    return c
