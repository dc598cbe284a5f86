"""The only Python loop: data -> rollout -> host rewards -> experience -> update -> metrics -> checkpoints.

`PPOTrainer(config, workdir)` builds the mesh, the four parameter trees and the jitted steps once,
validates everything before compiling, then `train()` runs the iterations.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ppo_jax import config as config_lib
from ppo_jax import metrics as metrics_lib
from ppo_jax import ppo, reward_fns, sampling, sharding, step as step_lib
from ppo_jax.models import CausalLM, ModelConfig, ScalarModel, init_params

Array = jax.Array


@dataclasses.dataclass
class ModelBundle:
    """A model definition, its params and their shardings."""

    module: Any
    params: Any
    shardings: Any
    config: ModelConfig


def _copy_tree(params, shardings):
    """A real copy on the same shardings (a reference aliasing the policy would die on donation)."""
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(params)


def _override_dtypes(cfg: ModelConfig, section) -> ModelConfig:
    kw = {}
    if section.get("param_dtype"):
        kw["param_dtype"] = section.param_dtype
    if section.get("dtype"):
        kw["dtype"] = section.dtype
    return cfg.replace(**kw) if kw else cfg


def policy_model_config(config) -> ModelConfig:
    """The policy architecture, read without loading weights (config.json or policy.model)."""
    if config.policy.path:
        from ppo_jax.models import hf

        cfg, _ = hf.load_config(config.policy.path)
    else:
        cfg = config_lib.model_config_from_dict(config.policy.model)
    return _override_dtypes(cfg, config.policy)


def load_policy(config, mesh, key) -> ModelBundle:
    """The initial policy: a Hugging Face directory, or a fresh model from `policy.model`."""
    if config.policy.path:
        from ppo_jax.models import hf

        loaded = hf.load_model(config.policy.path, mesh, kind="causal_lm",
                               param_dtype=config.policy.param_dtype or None,
                               dtype=config.policy.dtype or None)
        module = CausalLM(loaded.config)
        shardings = jax.tree.map(lambda x: x.sharding, loaded.params)
        return ModelBundle(module, loaded.params, shardings, loaded.config)
    cfg = policy_model_config(config)
    module = CausalLM(cfg)
    params, shardings = init_params(module, key, mesh)
    return ModelBundle(module, params, shardings, cfg)


def load_reward(config, mesh) -> ModelBundle | None:
    if not config.reward.path:
        return None
    from ppo_jax.models import hf

    loaded = hf.load_model(config.reward.path, mesh, kind="reward")
    module = ScalarModel(loaded.config, head_init="reward")
    return ModelBundle(module, loaded.params, jax.tree.map(lambda x: x.sharding, loaded.params),
                       loaded.config)


def init_value(config, mesh, policy: ModelBundle, reward: ModelBundle | None) -> ModelBundle:
    """Value model from the reward model (N+ style) or from the policy backbone with a zero head."""
    if config.value.init == "reward":
        assert reward is not None
        return ModelBundle(reward.module, _copy_tree(reward.params, reward.shardings), reward.shardings,
                           reward.config)
    module = ScalarModel(policy.config, head_init="zero")
    abstract = jax.eval_shape(lambda: module.init(
        jax.random.key(0), jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32),
        jnp.ones((1, 2), jnp.int32))["params"])
    shardings = sharding.tree_shardings(abstract, mesh)
    head = jax.tree.map(lambda s: jnp.zeros(s.value.shape, s.value.dtype), abstract["score"],
                        is_leaf=lambda x: hasattr(x, "names"))

    def build(transformer):
        return {"transformer": jax.tree.map(jnp.copy, transformer), "score": head}

    params = jax.jit(build, out_shardings=shardings)(policy.params["transformer"])
    return ModelBundle(module, params, shardings, policy.config)


def _opt_shardings(tx, params_shardings_boxed_abstract, mesh):
    return sharding.tree_shardings(jax.eval_shape(tx.init, params_shardings_boxed_abstract), mesh)


class PPOTrainer:
    """Builds everything once from a config, then runs PPO iterations."""

    def __init__(self, config, workdir: str, *, tokenizer=None, prompts: Sequence[str] | None = None,
                 reward_functions: Sequence[tuple[Callable, float]] | None = None, mesh=None):
        self.config = config
        self.workdir = workdir
        self.mesh = mesh or sharding.make_mesh(tuple(config.mesh.shape))
        key = jax.random.key(config.seed)
        init_key, self._sample_key, state_key = jax.random.split(key, 3)

        # -- Everything that can be checked is checked before any weights load or anything compiles.
        self.policy_config = policy_model_config(config)
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

        # -- Weights.
        self.policy = load_policy(config, self.mesh, init_key)
        self.reward = load_reward(config, self.mesh)

        # -- The four trees.
        reference = _copy_tree(self.policy.params, self.policy.shardings)
        self.value = init_value(config, self.mesh, self.policy, self.reward) if self.hp.uses_critic else None
        iters = int(config.train.iterations)
        opt_steps = iters * self.hp.epochs * self.hp.num_minibatches
        self.policy_tx = step_lib.make_optimizer(config, config.optim.policy_lr, opt_steps)
        self.value_tx = step_lib.make_optimizer(config, config.optim.value_lr, opt_steps) if self.value else None
        self.state, self.state_shardings = self._init_state(state_key)
        self.frozen = step_lib.FrozenParams(reference=reference,
                                            reward=self.reward.params if self.reward else None)
        self.frozen_shardings = step_lib.FrozenParams(
            reference=self.policy.shardings, reward=self.reward.shardings if self.reward else None)
        self._build_steps()
        self.writer = metrics_lib.MetricWriter(workdir)
        self.history: list[dict[str, float]] = []

    # ------------------------------------------------------------------ setup helpers

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

    def _init_state(self, key):
        def abstract_boxed(bundle):
            return jax.eval_shape(lambda: bundle.module.init(
                jax.random.key(0), jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32),
                jnp.ones((1, 2), jnp.int32))["params"])

        policy_opt_sh = _opt_shardings(self.policy_tx, abstract_boxed(self.policy), self.mesh)
        policy_opt = jax.jit(self.policy_tx.init, out_shardings=policy_opt_sh)(self.policy.params)
        if self.value is not None:
            value_opt_sh = _opt_shardings(self.value_tx, abstract_boxed(self.value), self.mesh)
            value_opt = jax.jit(self.value_tx.init, out_shardings=value_opt_sh)(self.value.params)
        else:
            value_opt_sh = value_opt = None
        p = self.config.ppo
        kl = ppo.init_kl_controller(p.kl_controller, p.kl_coef, target=p.kl_target, horizon=p.kl_horizon)
        replicated = sharding.replicated(self.mesh)
        state = step_lib.TrainState(
            step=jnp.zeros((), jnp.int32), policy=self.policy.params, policy_opt=policy_opt,
            value=self.value.params if self.value else None, value_opt=value_opt, kl=kl, key=key)
        shardings = step_lib.TrainState(
            step=replicated, policy=self.policy.shardings, policy_opt=policy_opt_sh,
            value=self.value.shardings if self.value else None, value_opt=value_opt_sh,
            kl=jax.tree.map(lambda _: replicated, kl), key=replicated)
        state = jax.device_put(state, shardings)
        return state, shardings

    def _build_steps(self):
        mesh, hp = self.mesh, self.hp
        batch = sharding.data_sharding(mesh)
        rows = self.sizes.rollout_rows
        replicated = sharding.replicated(mesh)
        r = self.config.rollout
        self.sampling_config = sampling.SamplingConfig(
            max_new_tokens=int(r.response_length), min_new_tokens=int(r.min_new_tokens),
            temperature=float(r.temperature), top_k=int(r.top_k), top_p=float(r.top_p),
            stop_token_ids=tuple(self.stop_ids), pad_token_id=int(self.tokenizer.pad_token_id),
            num_samples=int(r.num_samples), cache_dtype=r.cache_dtype or None)
        self.sampler = sampling.make_sampler(self.policy.module, self.sampling_config, mesh,
                                             self.policy.shardings)
        experience = step_lib.make_experience_fn(
            self.policy.module, self.value.module if self.value else None,
            self.reward.module if self.reward else None, hp)
        update = step_lib.make_update_fn(
            self.policy.module, self.value.module if self.value else None, self.policy_tx,
            self.value_tx, hp, rows, batch)
        rollout_sh = jax.tree.map(lambda _: batch, step_lib.Rollout(*([0] * 7)))
        exp_sh = jax.tree.map(lambda _: batch, step_lib.Experience(*([0] * 10)))

        self.trace_counts = {"experience": 0, "update": 0}

        def traced(name, fn):
            def counted(*args):
                self.trace_counts[name] += 1  # runs once per trace, never per call
                return fn(*args)
            return counted

        self.experience_jit = jax.jit(
            traced("experience", experience),
            in_shardings=(self.state_shardings, self.frozen_shardings, rollout_sh),
            out_shardings=(exp_sh, replicated))
        self.update_jit = jax.jit(
            traced("update", update), in_shardings=(self.state_shardings, exp_sh),
            out_shardings=(self.state_shardings, replicated), donate_argnums=(0,))

    def _experience(self, state, frozen, rollout):
        with jax.set_mesh(self.mesh), sharding.activation_rules():
            return self.experience_jit(state, frozen, rollout)

    def _update(self, state, exp):
        with jax.set_mesh(self.mesh), sharding.activation_rules():
            return self.update_jit(state, exp)

    # ------------------------------------------------------------------ the loop

    def rollout(self, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key) -> tuple[step_lib.Rollout, Any]:
        """Samples responses and scores them with the Python reward functions (host)."""
        toks, mask = sharding.put_local_batch((prompt_tokens, prompt_mask), self.mesh)
        out = self.sampler(self.state.policy, toks, mask, key)
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
            key = jax.random.fold_in(jax.random.fold_in(self._sample_key, 1 << 30), i)
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

    def train(self) -> list[dict[str, float]]:
        cfg = self.config.train
        progress = None
        if cfg.progress and jax.process_index() == 0:
            from tqdm.auto import tqdm

            progress = tqdm(total=int(cfg.iterations), desc="ppo", initial=int(self.state.step))
        try:
            while int(self.state.step) < cfg.iterations:
                scalars = self.run_iteration()
                step = int(self.state.step)
                self.history.append(scalars)
                if cfg.eval_every and step % cfg.eval_every == 0:
                    scalars.update(self.evaluate())
                if step % cfg.log_every == 0 or step == cfg.iterations:
                    self.writer.write(step, scalars)
                if cfg.sample_every and step % cfg.sample_every == 0:
                    metrics_lib.write_samples(self.workdir, step, self.samples())
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(score=f"{scalars['objective/scores']:.3f}",
                                         kl=f"{scalars['objective/kl']:.3f}",
                                         tok_s=f"{scalars['perf/tokens_per_sec']:.0f}")
        finally:
            if progress is not None:
                progress.close()
            self.writer.close()
        return self.history


def _with_reward_functions(config):
    """Validation sees 'some reward' when reward functions are passed in code."""
    c = config.copy_and_resolve_references()
    with c.unlocked():
        if not c.reward.path and not c.reward.functions:
            c.reward.functions = "<passed in code>"
    return c
