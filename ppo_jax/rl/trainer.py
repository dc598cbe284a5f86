"""The only Python loop: data -> rollout -> host rewards -> experience -> update -> metrics -> checkpoints.

`PPOTrainer(config, workdir)` builds the mesh, the four parameter trees and the jitted steps once,
validates everything before compiling, then `train()` runs the iterations.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath
from tqdm.auto import tqdm

from ppo_jax import metrics as metrics_lib
from ppo_jax import rewards, sampling, sharding
from ppo_jax.checkpoint import CheckpointError
from ppo_jax.checkpoint import verify
from ppo_jax.config import ConfigError
from ppo_jax.data import toy
from ppo_jax.data.prompt_stream import PromptStream
from ppo_jax.models import hf
from ppo_jax.rl import build, roles
from ppo_jax.rl.errors import PREEMPTION_NOTICE, NonFiniteError, RunFailedError
from ppo_jax.rl.settings import PPOHyper, Settings, stop_token_ids
from ppo_jax.rl.sizes import derive_sizes
from ppo_jax.rl.trainer_checkpoints import TrainerCheckpoints
from ppo_jax.rl.trainer_rollouts import TrainerRollouts

Array = jax.Array
SAMPLES_FILE = "samples.jsonl"
NONFINITE_SAMPLES_FILE = "nonfinite_samples.jsonl"


class PPOTrainer(TrainerCheckpoints, TrainerRollouts):
    """Builds everything once from a config, then runs PPO iterations.

    A workdir that already holds a checkpoint is resumed from its newest complete step: trainable
    state, KL controller, keys and the data position, so the continued run is the run that would
    have happened without the interruption.
    """

    def __init__(self, config, workdir: str, *, tokenizer=None, prompts: Sequence[str] | None = None,
                 reward_functions: Sequence[tuple[Callable, float]] | None = None, mesh=None):
        """config: a PPO ConfigDict (`ppo_config()` and overrides) or `Settings`; converted and
        validated here, once. tokenizer, prompts, reward_functions: objects passed in code instead of
        the paths and names the config gives."""
        s = self.settings = Settings.from_config(config, reward_in_code=bool(reward_functions))
        self.workdir = str(workdir)
        self.meshes = roles.make_role_meshes(s.roles, s.mesh.shape, trainer_mesh=mesh)
        self.mesh = self.meshes.trainer  # the experience forwards and the update; the sampler's: self.meshes.sampler
        s.compute.enable_compilation_cache()
        keys = build.run_keys(s.seed)
        init_key, self._sample_key, state_key = keys.init, keys.sample, keys.state

        # -- Everything that can be checked is checked before any weights load or anything compiles.
        self.policy_config = build.policy_model_config(s, self.mesh)
        self.reward_config = build.reward_model_config(s, self.mesh)
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.reward_functions = (list(reward_functions) if reward_functions is not None else
                                 rewards.parse(s.reward.functions, s.reward.function_weights))
        self.sizes = derive_sizes(s, batch_divisor=sharding.batch_divisor(self.mesh),
                                  max_positions=self.policy_config.max_position_embeddings,
                                  vocab_size=self.policy_config.vocab_size,
                                  platform=build.mesh_platform(self.mesh)[0],
                                  sampler_divisor=sharding.batch_divisor(self.meshes.sampler))
        self._check_tokenizers()
        self.hp = PPOHyper.from_settings(s, self.sizes)
        self.stop_ids = stop_token_ids(s.rollout, self._eos_id())
        if not self.stop_ids:
            raise ConfigError("rollout.stop_token_ids is empty and the tokenizer has no EOS token; "
                              "set rollout.stop_token_ids")
        vocab = self.policy_config.vocab_size
        stream = dict(batch_size=s.rollout.batch_size, seed=s.seed, vocab_size=vocab)
        self.prompts = PromptStream(s.data, self.tokenizer, prompts=prompts, **stream)
        self.eval_prompts = (PromptStream(s.data, self.tokenizer, split="eval", **stream)
                             if s.train.eval_every else None)

        # -- Modules, optimizers and the shardings of everything, from abstract shapes.
        self.modules = build.make_modules(s, self.policy_config, self.reward_config)
        self.policy_tx, self.value_tx = build.make_optimizers(s)
        self.abstract_state, self.state_shardings = build.abstract_train_state(
            s, self.modules, self.policy_tx, self.value_tx, self.mesh)
        self.abstract_reference = build.as_reference(s, self.abstract_state.policy)  # a restore's target
        # LoRA: the trainable policy is the adapters; the base is frozen and is also the reference
        # (with imported adapters, policy.lora.init_from: the base + a frozen copy of them).
        self.lora = self.policy_config.lora is not None
        self.imported = bool(s.policy.lora.init_from)
        self.value_lora = build.value_lora(self.modules)  # adapters + head on a shared frozen transformer
        self.base_shardings = roles.policy_shardings(self.modules, self.mesh) if self.lora else None

        # -- Weights: the frozen reward model, then a checkpoint to resume or fresh trainable state.
        reward_params = None
        if self.modules.reward is not None:
            reward_params = hf.load_model(s.reward.path, self.mesh, kind="reward",
                                          execution=self.reward_config.execution()).params
        checkpoint_dir = os.path.join(self.workdir, "checkpoints")
        # Opening the manager writes nothing; the first save does, after every input was read and checked.
        self.checkpoints = self._checkpoint_manager(checkpoint_dir) if epath.Path(checkpoint_dir).is_dir() else None
        self.resumed_from: int | None = None
        self._init_key = init_key  # rebuilds the reference (or the LoRA base) from its source
        base = None
        self._in_flight = None  # off-policy: the next iteration's StartedRollout
        self._recorded: dict = {}  # the frozen checksums of the checkpoint resumed from
        if self.checkpoints is not None and self.checkpoints.all_steps():
            self.state, reference, base, self.resumed_from = self._restore()
        else:
            policy, value = build.initial_params(s, self.modules, self.state_shardings, self.mesh, init_key,
                                                 reward_params)
            if self.checkpoints is None:
                self.checkpoints = self._checkpoint_manager(checkpoint_dir)
            if self.lora:  # no reference copy: the base with the adapters off is the reference
                base, reference = policy, None
                policy = build.initial_adapters(s, self.modules, self.state_shardings.policy, self.mesh, init_key)
                self._base_record = verify.record(base)  # identifies the base in every checkpoint
                if self.imported:  # the reference is base + the imported adapters: a frozen copy (undonated)
                    reference = sharding.copy_tree(policy, self.state_shardings.policy)
                    self._imported_record = verify.record(reference)
            else:
                reference = build.reference_copy(s, policy, self.state_shardings.policy)
                self._reference_record: dict | None = None  # its checksums, from the first save (or the check below)
                self._reference_saved = self._adopt_saved_reference(reference)
            self.state = build.fresh_state(s, policy, value, state_key, self.policy_tx, self.value_tx,
                                           self.state_shardings, self.mesh)
        # A LoRA value base is a subtree of these trees (the same arrays): nothing is copied for it.
        self.frozen = build.frozen_params(s, self.modules, reference, reward_params, base)
        self._value_base_record = self._value_base_checksums() if self.value_lora else None
        self.frozen_shardings = build.frozen_shardings(s, self.modules, self.state_shardings, reward_params,
                                                       self.base_shardings)
        self.steps = build.build_steps(s, self.mesh, self.sizes, self.hp, self.modules, self.policy_tx,
                                       self.value_tx, self.state_shardings, self.frozen_shardings, self.stop_ids,
                                       int(self.tokenizer.pad_token_id), sampler_mesh=self.meshes.sampler)
        self._init_rollouts()  # after this, with roles.scoring="sampler", the reference and reward live there
        self.writer = metrics_lib.MetricWriter(self.workdir, resume_step=self.resumed_from or 0)
        if jax.process_index() == 0:
            for name in (SAMPLES_FILE, NONFINITE_SAMPLES_FILE):  # sample logs restart with the steps too
                metrics_lib.truncate_after(os.path.join(self.workdir, name), self.resumed_from or 0)
            hf.save_tokenizer(self.tokenizer, os.path.join(self.workdir, "tokenizer"))
        self.history: list[dict[str, float]] = []
        self._stop_signal: str | None = None
        self._consecutive_nonfinite = 0
        self.stopped_by: str | None = None  # the signal (or preemption notice) that stopped train()
        self._checked_step = self.resumed_from  # newest step whose parameters passed the finiteness check
        self._score_jit = None

    @property
    def sampler(self) -> sampling.Sampler:
        return self.steps.sampler

    @property
    def trace_counts(self) -> dict[str, int]:
        """How often each jitted step was traced (1 each in a run that never recompiles)."""
        return self.steps.trace_counts

    # ------------------------------------------------------------------ setup helpers

    def _load_tokenizer(self):
        if self.settings.policy.path:
            return hf.load_tokenizer(self.settings.policy.path)
        return toy.tokenizer(self.policy_config.vocab_size)

    def _eos_id(self):
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return eos if eos is not None else self.policy_config.eos_token_id

    def _check_tokenizers(self):
        tok = self.tokenizer
        if tok.pad_token_id is None:
            raise ConfigError("the policy tokenizer has no pad token; set tokenizer.pad_token "
                                         "(a token distinct from EOS) before training")
        if len(tok) > self.policy_config.vocab_size:
            raise ConfigError(f"the tokenizer has {len(tok)} tokens but the policy's vocabulary has "
                                         f"{self.policy_config.vocab_size}")
        if self.settings.reward.path:
            reward_tok = hf.load_tokenizer(self.settings.reward.path)
            if reward_tok.get_vocab() != tok.get_vocab():
                raise ConfigError(
                    "the policy and reward-model tokenizers differ (reward.path vs policy.path): the reward "
                    "model would read different token ids; use a reward model trained with the policy's tokenizer")

    def _experience(self, state, frozen, rollout):
        with sharding.mesh_context(self.mesh):
            return self.steps.experience_jit(state, frozen, rollout)

    def _update(self, state, exp):
        with sharding.mesh_context(self.mesh):
            return self.steps.update_jit(state, self.frozen.policy, self.frozen.value, exp)

    # ------------------------------------------------------------------ the loop

    def run_iteration(self) -> dict[str, float]:
        timer = metrics_lib.PhaseTimer()
        iteration = int(self.state.step)
        with timer.measure("generate"):  # off-policy: only the wait for the sample started last iteration
            rollout, sample = self.next_rollout(iteration)
            jax.block_until_ready(rollout.tokens)
        with timer.measure("experience"):
            exp, exp_metrics = self._experience(self.state, self.frozen, rollout)
            jax.block_until_ready(exp_metrics)
        with timer.measure("update"):
            self.state, upd_metrics = self._update(self.state, exp)
            jax.block_until_ready(upd_metrics)
        occupancy = sampling.slot_occupancy(sample, self.steps.sampling_config, prompts=self.settings.rollout.batch_size)
        scalars = {**jax.device_get(exp_metrics), **jax.device_get(upd_metrics), **timer.pop(),
                   "perf/slot_occupancy": jax.device_get(occupancy)}
        sync = self.pop_sync_metrics()  # it ran inside "generate": time it once
        scalars["time/generate"] -= sync["time/weight_sync"]
        scalars.update(sync)
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
        n = self.settings.train.eval_batches
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

    def _check_state_finite(self, step: int, scalars: dict[str, float]) -> None:
        """Stops (saving nothing) when the update produced non-finite parameters."""
        if scalars.get("nonfinite/state", 0.0) == 0.0:
            return
        self.checkpoints.wait()
        last = self.checkpoints.latest_step()
        where = (f"the last good checkpoint is step {last} in {self.checkpoints.directory}" if last is not None
                 else "no checkpoint was saved")
        raise NonFiniteError(
            f"iteration {step}'s update produced non-finite parameters from finite gradients (check "
            f"optim.policy_lr / optim.value_lr and the Adam settings); the state was not saved; {where}")

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
            for r, p, t in zip(rows, prompts, responses)], filename=NONFINITE_SAMPLES_FILE)
        limit = self.settings.train.max_consecutive_nonfinite
        if self._consecutive_nonfinite >= limit:
            self.checkpoints.wait()
            last = self.checkpoints.latest_step()
            where = (f"the last good checkpoint, step {last} in {self.checkpoints.directory}, is intact"
                     if last is not None else "no checkpoint was saved")
            raise NonFiniteError(
                f"{self._consecutive_nonfinite} consecutive iterations had non-finite losses, gradients or "
                f"rewards (their updates were skipped; the samples are in "
                f"{os.path.join(self.workdir, NONFINITE_SAMPLES_FILE)}); {where}")

    def _failed(self, err: Exception) -> RunFailedError:
        """Saves the last good state if it is not saved yet, logs the traceback, and returns the
        one-line error that says what failed and what was kept."""
        step = int(self.state.step)
        saved = self.checkpoints.latest_step()
        # Only a state that passed the finiteness check, with no streak of skipped updates in flight
        # (a streak is never saved mid-run, as in train()), and only once.
        if step == self._checked_step and self._consecutive_nonfinite == 0 and step != saved:
            try:
                self.save_checkpoint(force=True)
                self.checkpoints.wait()
                saved = step
            except CheckpointError as save_err:
                metrics_lib.warn(f"the emergency save of step {step} failed: {save_err}")
        log = os.path.join(self.workdir, "error.log")
        if jax.process_index() == 0:
            stamp = datetime.datetime.now().isoformat(timespec="seconds")
            metrics_lib.append_lines(log, [f"--- {stamp}: iteration {step + 1} failed", *traceback.format_exception(err)])
        kept = (f"checkpoint step {saved} in {self.checkpoints.directory} holds the last good state; run the same "
                "command again to resume from it" if saved is not None else "no iteration completed, nothing was saved")
        return RunFailedError(f"iteration {step + 1} failed with {type(err).__name__}: {err}; {kept} "
                              f"(traceback in {log})")

    def _on_signal(self, signum, frame):
        del frame
        self._stop_signal = signal.Signals(signum).name

    def train(self, on_iteration: Callable[[int, dict[str, float]], dict[str, float] | None] | None = None
              ) -> list[dict[str, float]]:
        """Runs until train.iterations, a SIGTERM/SIGINT (saved, then stops) or a fatal error.

        on_iteration(step, scalars), if given, runs after every iteration (after the non-finite
        check, before metrics are written); the scalars it returns are logged with the iteration's.
        """
        cfg = self.settings.train
        progress = None
        if cfg.progress and jax.process_index() == 0:
            progress = tqdm(total=int(cfg.iterations), desc="ppo", initial=int(self.state.step))
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while int(self.state.step) < cfg.iterations:
                scalars = self.run_iteration()
                step = int(self.state.step)
                self.history.append(scalars)
                self._check_state_finite(step, scalars)
                self._checked_step = step
                self._handle_nonfinite(step, scalars)
                if cfg.eval_every and step % cfg.eval_every == 0:
                    scalars.update(self.evaluate())
                if on_iteration is not None:
                    scalars.update(on_iteration(step, scalars) or {})
                if step % cfg.log_every == 0 or step == cfg.iterations:
                    self.writer.write(step, scalars)
                if cfg.sample_every and step % cfg.sample_every == 0:
                    metrics_lib.write_samples(self.workdir, step, self.samples(), filename=SAMPLES_FILE)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(score=f"{scalars['objective/scores']:.3f}",
                                         kl=f"{scalars['objective/kl']:.3f}",
                                         tok_s=f"{scalars['perf/tokens_per_sec']:.0f}")
                preempted = self.checkpoints.reached_preemption(step)
                stop = self._stop_signal is not None or preempted
                healthy = self._consecutive_nonfinite == 0
                due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
                final = step == cfg.iterations
                # Mid-run, a streak of skipped updates is not saved (the last good checkpoint keeps the
                # data position before it). The final save always happens: skipped updates left the
                # parameters as they were and _check_state_finite vouched for them, so this is the
                # last good state, and the run's work is never lost.
                if final or (healthy and (due or stop)):
                    self.save_checkpoint(force=True)
                if final and not healthy:
                    self.checkpoints.wait()
                    raise NonFiniteError(
                        f"the run ended on {self._consecutive_nonfinite} iteration(s) whose updates were skipped "
                        f"for non-finite losses, gradients or rewards (samples in "
                        f"{os.path.join(self.workdir, NONFINITE_SAMPLES_FILE)}); checkpoint step {step} "
                        f"in {self.checkpoints.directory} holds the parameters from before them")
                if stop:
                    self.checkpoints.wait()
                    reason = self._stop_signal or PREEMPTION_NOTICE
                    self.stopped_by = reason
                    if progress is not None:  # the message on its own line, not after the bar's
                        progress.close()
                    print(f"Stopped by {reason} after iteration {step}; checkpoint step "
                          f"{self.checkpoints.latest_step()} saved in {self.checkpoints.directory}. "
                          "Run the same command again to resume exactly where it stopped.", flush=True)
                    break
        except (NonFiniteError, CheckpointError):
            raise  # they say what was kept; saving again could not help
        except Exception as err:
            raise self._failed(err) from err
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
