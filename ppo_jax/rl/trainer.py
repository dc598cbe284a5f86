"""The only Python loop: data -> rollout -> host rewards -> experience -> update -> metrics -> checkpoints.

`PPOTrainer(config, workdir)` builds the mesh, the four parameter trees and the jitted steps once,
validates everything before compiling, then `train()` runs the iterations. It owns its parts, each
with its own state: `rollouts` (`rl/rollouts.py`: the sampler's side, the weight sync, the batches in
flight), `checkpointing` (`rl/checkpointing.py`: the checkpoint manager and the frozen-tree checksums)
and `health` (`rl/health.py`: the streak of skipped updates).
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
from tqdm.auto import tqdm

from ppo_jax import metrics as metrics_lib
from ppo_jax import sampling, sharding
from ppo_jax.checkpoint import CheckpointError, CheckpointManager
from ppo_jax.checkpoint.step_items import ARRAYS_ITEM
from ppo_jax.config import to_dict
from ppo_jax.data.prompt_stream import PromptStream
from ppo_jax.models import hf
from ppo_jax.rl import build, initial_weights, precompile, roles, shared_programs
from ppo_jax.rl.checkpointing import Checkpointing
from ppo_jax.rl.episodes import EpisodeModel
from ppo_jax.rl.errors import PREEMPTION_NOTICE, NonFiniteError, RunFailedError
from ppo_jax.rl.experience import make_scoring_fn
from ppo_jax.rl.health import NONFINITE_SAMPLES_FILE, NonFiniteGuard
from ppo_jax.rl.rollouts import IN_FLIGHT_ITEM, Texts, make_rollouts
from ppo_jax.rl.run_inputs import checked_inputs
from ppo_jax.rl.sample_sources import WholeSamples
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import FrozenParams, Rollout
from ppo_jax.wandb_run import metric_writer

Array = jax.Array
SAMPLES_FILE = "samples.jsonl"


class PPOTrainer:
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
        self.keys = build.run_keys(s.seed)
        # -- Everything that can be checked is checked before any weights load or anything compiles.
        inputs = checked_inputs(s, self.meshes, tokenizer, reward_functions)
        self.policy_config, self.reward_config, self.tokenizer = inputs.policy_config, inputs.reward_config, \
            inputs.tokenizer
        self.teacher_config = inputs.teacher_config
        self.reward_functions, self.sizes, self.hp = inputs.reward_functions, inputs.sizes, inputs.hp
        self.stop_ids, self.turn_stops = inputs.stop_ids, inputs.turn_stops
        stream = dict(batch_size=s.rollout.batch_size, seed=s.seed, vocab_size=self.policy_config.vocab_size)
        self.prompts = PromptStream(s.data, self.tokenizer, prompts=prompts, **stream)
        self.eval_prompts = (PromptStream(s.data, self.tokenizer, split="eval", **stream)
                             if s.train.eval_every else None)
        # -- Modules, optimizers and the shardings of everything, from abstract shapes.
        self.modules = build.make_modules(s.ppo, s.value, self.policy_config, self.reward_config, self.teacher_config)
        self.policy_tx, self.value_tx = shared_programs.shared_optimizers(s)
        self.abstract_state, self.state_shardings = build.abstract_train_state(
            s.ppo, self.modules, self.policy_tx, self.value_tx, self.mesh)
        # -- Weights: the frozen reward model, then a checkpoint to resume or fresh trainable state.
        reward_params = None
        if self.modules.reward is not None:
            reward_params = build.load_reward_params(s.reward, self.reward_config, self.mesh)
        teacher_params = None
        if self.modules.teacher is not None:  # on-policy distillation's frozen teacher
            teacher_params = build.load_teacher_params(s.distill, self.teacher_config, self.mesh)
        self.checkpointing = Checkpointing(s, self.workdir, self.modules, self.mesh, self.abstract_state,
                                           self.state_shardings, self.keys.init)
        weights, extra = self._start_weights(reward_params)
        self.state = weights.state
        # A LoRA value base is a subtree of these trees (the same arrays): nothing is copied for it.
        frozen = build.frozen_params(s.value, self.modules, weights.reference, reward_params, weights.base,
                                     teacher_params)
        if build.value_lora(self.modules):
            self.checkpointing.record_value_base(frozen.value)
        base_shardings = roles.policy_shardings(self.modules, self.mesh) if weights.base is not None else None
        frozen_shardings = build.frozen_shardings(s.policy, s.value, self.modules, self.state_shardings, reward_params,
                                                  base_shardings, teacher_params)
        self.steps = shared_programs.shared_steps(
            s, self.mesh, self.sizes, self.hp, self.modules, self.policy_tx, self.value_tx, self.state_shardings,
            frozen_shardings, self.stop_ids, int(self.tokenizer.pad_token_id), sampler_mesh=self.meshes.sampler)
        episode_model = (EpisodeModel(self.modules.policy, self.tokenizer, self.turn_stops, s.data.prompt_length)
                         if s.environment.enabled else None)  # multi-turn episodes (rl/episodes.py)
        self.rollouts = make_rollouts(s, self.meshes, self.steps, frozen, lora=self.policy_config.lora,
                                      texts=Texts(self.tokenizer, tuple(self.stop_ids)),
                                      reward_functions=self.reward_functions, prompts=self.prompts,
                                      sample_key=self.keys.sample, episode_model=episode_model)
        # roles.scoring="sampler": the reference and reward model live with the rollouts' scorer only.
        self.frozen, self.frozen_shardings = ((roles.trainer_frozen(frozen), roles.trainer_frozen(frozen_shardings))
                                              if self.hp.scored_outside else (frozen, frozen_shardings))
        if extra is not None:
            self._restore_positions(extra)
        self.writer = self._open_logs()
        self.health = NonFiniteGuard(self.workdir, self.checkpoints, s.train.max_consecutive_nonfinite,
                                     checked_step=self.resumed_from)
        self.history: list[dict[str, float]] = []
        self._stop_signal: str | None = None
        self.stopped_by: str | None = None  # the signal (or preemption notice) that stopped train()
        self._score_jit = None
        # compute.precompile: the phases compiled side by side before the first iteration (rl/precompile.py)
        self._precompile_due = precompile.applies(s.compute.precompile, build.mesh_platform(self.mesh)[0])
        self.compile_report: precompile.CompileReport | None = None

    # ------------------------------------------------------------------ setup

    def _start_weights(self, reward_params) -> tuple[initial_weights.StartWeights, dict | None]:
        """The newest checkpoint's weights and extra items, or a fresh run's weights (and None)."""
        if self.checkpointing.resumable:
            return self.checkpointing.restore()
        weights = initial_weights.fresh_weights(self.settings, self.modules, self.state_shardings, self.mesh, self.keys,
                                      reward_params, self.policy_tx, self.value_tx)
        self.checkpointing.start_fresh(weights)
        return weights, None

    def _restore_positions(self, extra: dict) -> None:
        """Where a resumed run's data streams stood, and the samples it had in flight."""
        self.prompts.restore(extra["data"])
        if self.eval_prompts is not None and extra.get("eval_data"):
            self.eval_prompts.restore(extra["eval_data"])
        self.rollouts.restore_in_flight(extra.get(IN_FLIGHT_ITEM), int(self.state.step), extra.get(ARRAYS_ITEM))

    def _open_logs(self) -> metrics_lib.MetricWriter:
        """The metrics writer; on process 0 the sample logs cut back to the step resumed from (they
        restart with the steps too) and the tokenizer saved beside them."""
        step = self.resumed_from or 0
        writer = metric_writer(self.workdir, resume_step=step, wandb=self.settings.wandb,
                               run_config=to_dict(self.settings), job_type="ppo")
        if jax.process_index() == 0:
            for name in (SAMPLES_FILE, NONFINITE_SAMPLES_FILE):
                metrics_lib.truncate_after(os.path.join(self.workdir, name), step)
            hf.save_tokenizer(self.tokenizer, os.path.join(self.workdir, "tokenizer"))
        return writer

    # ------------------------------------------------------------------ the parts, as the trainer's API

    @property
    def checkpoints(self) -> CheckpointManager:
        return self.checkpointing.manager

    @property
    def resumed_from(self) -> int | None:
        return self.checkpointing.resumed_from

    @property
    def sampler(self) -> sampling.Sampler:
        return self.steps.sampler

    @property
    def trace_counts(self) -> dict[str, int]:
        """How often each jitted step was traced (1 each in a run that never recompiles)."""
        return self.steps.trace_counts

    @property
    def scorer(self) -> FrozenParams | None:
        """roles.scoring="sampler": the reference and reward model on the sampler's mesh."""
        return self.rollouts.scorer

    @property
    def reference_params(self):
        """The frozen reference tree, wherever it lives (the trainer's or the scorer's)."""
        return (self.scorer or self.frozen).reference

    def sampler_weights(self) -> roles.SyncedWeights:
        """The current policy on the sampler's mesh (synced once per train step)."""
        return self.rollouts.sampler_weights(self.state)

    def sample(self, prompt_tokens, prompt_mask, key) -> sampling.SampleOutput:
        """Responses of the current policy (its adapters applied, with LoRA) to prompts [B, Lq]
        batch-sharded on the sampler's mesh (`self.meshes.sampler`; global arrays, e.g.
        `sharding.put_batch`), with a key replicated there."""
        return self.rollouts.sample(self.state, prompt_tokens, prompt_mask, key)

    def rollout(self, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key) -> tuple[Rollout, Any]:
        """Samples responses with the current policy and scores them with the Python reward functions."""
        return self.rollouts.rollout(self.state, prompt_tokens, prompt_mask, key)

    def iteration_key(self, iteration: int):
        return self.rollouts.iteration_key(iteration)

    def decode(self, prompt_tokens, prompt_mask, tokens, mask) -> tuple[list[str], list[str]]:
        """Host arrays -> prompt and response texts (stop tokens and padding dropped)."""
        return self.rollouts.texts.decode(prompt_tokens, prompt_mask, tokens, mask)

    def score_responses(self, prompt_tokens, prompt_mask, tokens, mask) -> tuple[jax.Array, jax.Array]:
        """Reference log-probs [B, Lr] and reward-model scores [B] (gain and bias applied) of responses
        to prompts, by the run's frozen models: batch-sharded global arrays in (e.g. a `sampler`
        output's fields; moved to the mesh the frozen models live on), the same out, on that mesh.
        With roles.scoring="sampler" this is the rollouts' own scoring program; else it is compiled
        once per shape on first use."""
        scorer = self.scorer is not None  # roles.scoring="sampler": the frozen models are on the sampler's mesh
        mesh = self.meshes.sampler if scorer else self.mesh
        data = sharding.data_sharding(mesh)
        if scorer:
            self._score_jit = self.steps.scoring_jit
        elif self._score_jit is None:
            self._score_jit = jax.jit(make_scoring_fn(self.modules, self.hp),
                                      in_shardings=(self.frozen_shardings,) + (data,) * 4, out_shardings=(data, data))
        inputs = sharding.reshard((prompt_tokens, prompt_mask, tokens, mask), (data,) * 4)
        with sharding.mesh_context(mesh):
            ref_logprobs, scores = self._score_jit(self.scorer if scorer else self.frozen, *inputs)
        if self.modules.reward is not None:
            scores = scores * self.hp.score_gain + self.hp.score_bias
        return ref_logprobs, scores

    def save_checkpoint(self, force: bool = False) -> bool:
        """Saves trainable state + data position + the samples in flight (the reference once, in frozen/;
        a LoRA base, imported adapters and a LoRA value base never, only their checksums)."""
        in_flight = self.rollouts.in_flight_record()  # off-policy: the samples started ahead (waits for them)
        items = {"data": self.prompts.state(),
                 "eval_data": self.eval_prompts.state() if self.eval_prompts is not None else None,
                 IN_FLIGHT_ITEM: in_flight.records}
        return self.checkpointing.save(self.state, self.reference_params, items,
                                       self.history[-1] if self.history else None, force=force,
                                       arrays=in_flight.arrays)

    def _experience(self, state, frozen, rollout):
        with sharding.mesh_context(self.mesh):
            return self.steps.experience_jit(state, frozen, rollout)

    def _update(self, state, exp):
        with sharding.mesh_context(self.mesh):
            return self.steps.update_jit(state, self.frozen, exp)

    # ------------------------------------------------------------------ the loop

    def compile_ahead(self) -> precompile.CompileReport | None:
        """Compiles the programs an iteration runs side by side (`rl/precompile.py`); `run_iteration`
        calls it first under compute.precompile. Returns what it took; None where nothing was
        compiled: the programs were already, the iteration decodes nothing (its whole samples were
        all begun earlier), or the rollouts are partial or multi-turn (programs of their own)."""
        if (self.compile_report is not None or not isinstance(self.rollouts.training, WholeSamples)
                or not self.rollouts.pipeline.decodes(int(self.state.step))):
            return None
        self.compile_report = precompile.precompile(self.steps, self.settings, self.hp, self.meshes, self.state,
                                                    self.frozen, self.scorer)
        if jax.process_index() == 0:
            print(self.compile_report.text(), flush=True)
        return self.compile_report

    def run_iteration(self) -> dict[str, float]:
        if self._precompile_due:
            self._precompile_due = False
            self.compile_ahead()
        timer = metrics_lib.PhaseTimer()
        with timer.measure("generate"):  # off-policy: only the wait for the sample started k iterations ago
            rollout, sample = self.rollouts.next(self.state)
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
        inside = self.rollouts.pop_generate_metrics()  # the syncs (and an environment's steps) ran inside "generate"
        scalars["time/generate"] -= inside["time/weight_sync"] + inside.get("time/environment", 0.0)
        scalars.update(inside)
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
            key = jax.random.fold_in(jax.random.fold_in(self.keys.sample, (1 << 30) + int(self.state.step)), i)
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

    def _failed(self, err: Exception) -> RunFailedError:
        """Saves the last good state if it is not saved yet, logs the traceback, and returns the
        one-line error that says what failed and what was kept."""
        step = int(self.state.step)
        saved = self.checkpoints.latest_step()
        # Only a state that passed the finiteness check, with no streak of skipped updates in flight
        # (a streak is never saved mid-run, as in train()), and only once.
        if self.health.may_save(step) and step != saved:
            try:
                self.save_checkpoint(force=True)
                self.checkpoints.wait()
                saved = step
            except Exception as save_err:  # noqa: BLE001 (e.g. an episode batch in flight failing as well:
                # the error to report is the first one)
                metrics_lib.warn(f"the emergency save of step {step} failed: {type(save_err).__name__}: {save_err}")
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
                self.health.check_state(step, scalars)
                self.health.count_skipped(step, scalars, *self._last_rollout, decode=self.decode)
                if cfg.eval_every and step % cfg.eval_every == 0:
                    scalars.update(self.evaluate())
                if on_iteration is not None:
                    scalars.update(on_iteration(step, scalars) or {})
                if step % cfg.log_every == 0 or step == cfg.iterations:
                    self.writer.write(step, scalars)
                if cfg.sample_every and step % cfg.sample_every == 0:
                    self.writer.write_samples(step, self.samples(), filename=SAMPLES_FILE)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(score=f"{scalars['objective/scores']:.3f}",
                                         kl=f"{scalars['objective/kl']:.3f}",
                                         tok_s=f"{scalars['perf/tokens_per_sec']:.0f}")
                preempted = self.checkpoints.reached_preemption(step)
                stop = self._stop_signal is not None or preempted
                healthy = self.health.healthy
                due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
                final = step == cfg.iterations
                # Mid-run, a streak of skipped updates is not saved (the last good checkpoint keeps the
                # data position before it). The final save always happens: skipped updates left the
                # parameters as they were and the health check vouched for them, so this is the
                # last good state, and the run's work is never lost.
                if final or (healthy and (due or stop)):
                    self.save_checkpoint(force=True)
                if final and not healthy:
                    self.checkpoints.wait()
                    raise self.health.ended_unhealthy(step)
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
        """Ends what the trainer opened: its rollout workers, checkpoint manager and metric writer (a
        trainer stepped with `run_iteration` and closed kept TensorBoard's writer thread and event file)."""
        self.rollouts.close()
        self.checkpoints.close()
        self.writer.close()
