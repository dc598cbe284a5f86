"""The PPO trainer's rollouts: the policy synced to the sampler's mesh (`rl/roles.py`), sampling,
host rewards, the hand-over to the trainer's mesh, and the one-step off-policy pipeline
(rollout.off_policy_steps=1: the next batch is sampled with the weights before this update while
the trainer updates on this one). A mixin of `PPOTrainer` (ppo_jax/rl/trainer.py), which owns the
attributes it reads.

The pipelined iteration k (θ_k: the weights before update k):

    sync θ_k -> sampler;  start sample k+1 (θ_k)   ─┐ sampler devices, asynchronous
    wait for sample k (θ_{k-1}); host rewards        │
    experience k; update k -> θ_{k+1}               ─┘ trainer devices, meanwhile

The sample in flight at a checkpoint is saved with it (its arrays, in the step's JSON item), so a
resumed run continues with the very rollout the uninterrupted one would have used.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import jax
import numpy as np

from ppo_jax import metrics as metrics_lib
from ppo_jax import rewards, sampling, sharding
from ppo_jax.models import lora as lora_lib
from ppo_jax.rl import roles
from ppo_jax.rl.experience import make_scoring_fn
from ppo_jax.rl.state import FrozenParams, Rollout, policy_variables

IN_FLIGHT_ITEM = "in_flight_rollout"


def encode_arrays(arrays: dict[str, np.ndarray]) -> dict[str, dict]:
    """Host arrays -> JSON values that restore them bit for bit."""
    return {name: {"dtype": str(a.dtype), "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}
            for name, a in arrays.items()}


def decode_arrays(record: dict[str, dict]) -> dict[str, np.ndarray]:
    return {name: np.frombuffer(base64.b64decode(v["data"]), dtype=np.dtype(v["dtype"])).reshape(v["shape"])
            for name, v in record.items()}


@dataclasses.dataclass
class StartedRollout:
    """A rollout dispatched to the sampler's mesh: its sample and, with roles.scoring="sampler",
    the frozen models' outputs there (reference log-probs [B, Lr], raw model scores [B])."""

    sample: sampling.SampleOutput
    ref_logprobs: jax.Array | None = None
    model_scores: jax.Array | None = None


class TrainerRollouts:
    """Sampling and rollouts of a `PPOTrainer` (settings, meshes, steps, state, frozen trees,
    prompts and reward functions are the trainer's)."""

    def _init_rollouts(self) -> None:
        """After the steps are built: the LoRA base on the sampler's mesh (once: it never changes);
        with roles.scoring="sampler" the reference and reward model moved there (the trainer keeps
        neither: `self.scorer` holds them)."""
        self._synced: roles.SyncedWeights | None = None
        self._sync_log: list[tuple[float, int]] = []  # (seconds, bytes) of the syncs since the last iteration
        self._sampler_base = None
        self._merge_jit = None
        if self.lora:
            self._sampler_base, seconds, nbytes = roles.sync_to(self.frozen.policy, self.steps.sampler_shardings.params)
            if nbytes:
                metrics_lib.warn(f"copied the frozen LoRA base to the sampler's mesh once ({nbytes / 2**30:.3f} GiB, "
                                 f"{seconds:.2f} s); each iteration syncs only the adapters")
        self.scorer: FrozenParams | None = None
        if self.hp.scored_outside:
            where, frozen = self.steps.scorer_shardings, self.frozen
            self.scorer = FrozenParams(
                reference=None if frozen.reference is None else sharding.reshard(frozen.reference, where.reference),
                reward=None if frozen.reward is None else sharding.reshard(frozen.reward, where.reward),
                policy=self._sampler_base)
            self.frozen = roles.trainer_frozen(frozen)
            self.frozen_shardings = roles.trainer_frozen(self.frozen_shardings)
        if self._in_flight is not None:  # restored from a checkpoint, unscored
            self._in_flight = self._scored(self._in_flight.sample)

    @property
    def reference_params(self):
        """The frozen reference tree, wherever it lives (the trainer's or the scorer's)."""
        return (self.scorer or self.frozen).reference

    def _merge_adapters(self, base, adapters):
        """base + scale * A @ B on the sampler's shardings (roles.lora_sync="merged")."""
        if self._merge_jit is None:
            config = self.policy_config.lora
            self._merge_jit = jax.jit(lambda p, a: lora_lib.merge_lora(p, a, config),
                                      out_shardings=self.steps.sampler_shardings.params)
        with sharding.mesh_context(self.meshes.sampler):
            return self._merge_jit(base, adapters)

    @property
    def off_policy(self) -> bool:
        return self.settings.rollout.off_policy_steps == 1

    def sampler_weights(self) -> roles.SyncedWeights:
        """The current policy on the sampler's mesh: synced once per train step (nothing is copied
        when the sampler shares the trainer's mesh; with LoRA only the adapters travel)."""
        step = int(self.state.step)
        if self._synced is not None and self._synced.step == step:
            return self._synced
        self._synced = None  # the older copy goes before the new one arrives (an in-flight sample keeps its own)
        where = self.steps.sampler_shardings
        params, adapters = policy_variables(self.state.policy, self.frozen.policy)
        if self.lora:
            adapters, seconds, nbytes = roles.sync_to(adapters, where.synced_adapters)
            params = self._sampler_base
            if where.merged:  # folded into the decoding copy on the sampler's devices (the base stays)
                params, adapters = self._merge_adapters(params, adapters), None
        else:
            params, seconds, nbytes = roles.sync_to(params, where.params)
        self._sync_log.append((seconds, nbytes))
        self._synced = roles.SyncedWeights(step, params, adapters)
        return self._synced

    def sample(self, prompt_tokens, prompt_mask, key) -> sampling.SampleOutput:
        """Responses of the current policy (its adapters applied, with LoRA) to prompts [B, Lq]
        batch-sharded on the sampler's mesh (`self.meshes.sampler`; global arrays, e.g.
        `sharding.put_batch`), with a key replicated there."""
        weights = self.sampler_weights()
        return self.steps.sampler(weights.params, prompt_tokens, prompt_mask, key, adapters=weights.adapters)

    def start_rollout(self, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key) -> StartedRollout:
        """Dispatches the sampling of this process's prompt rows (host arrays), and with
        roles.scoring="sampler" its scoring, and returns at once."""
        mesh = self.meshes.sampler
        toks, mask = sharding.put_local_batch((prompt_tokens, prompt_mask), mesh)
        return self._scored(self.sample(toks, mask, sharding.replicate(key, mesh)))

    def _scored(self, out: sampling.SampleOutput) -> StartedRollout:
        if self.scorer is None:
            return StartedRollout(out)
        with sharding.mesh_context(self.meshes.sampler):
            ref_logprobs, model_scores = self.steps.scoring_jit(self.scorer, out.prompt_tokens, out.prompt_mask,
                                                                out.tokens, out.mask)
        return StartedRollout(out, ref_logprobs, model_scores)

    def finish_rollout(self, started: StartedRollout) -> Rollout:
        """A sample scored by the Python reward functions (on the host; this waits for it) and moved to
        the trainer's mesh."""
        out = started.sample
        if self.reward_functions:
            host = sharding.to_host({"pt": out.prompt_tokens, "pm": out.prompt_mask, "t": out.tokens, "m": out.mask})
            prompts_text, responses_text = self.decode(host["pt"], host["pm"], host["t"], host["m"])
            host_scores = rewards.combined_scores(self.reward_functions, prompts_text, responses_text)
        else:
            host_scores = np.zeros(out.tokens.shape[0], np.float32)
        fields = dict(prompt_tokens=out.prompt_tokens, prompt_mask=out.prompt_mask, tokens=out.tokens,
                      mask=out.mask, sampler_logprobs=out.logprobs, stopped=out.stopped)
        if started.ref_logprobs is not None:
            fields.update(ref_logprobs=started.ref_logprobs, model_scores=started.model_scores)
        data = sharding.data_sharding(self.mesh)  # a no-op when the sampler shares the trainer's mesh
        fields = sharding.reshard(fields, {k: data for k in fields})
        return Rollout(**fields, host_scores=sharding.put_batch(host_scores, self.mesh))

    def rollout(self, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key) -> tuple[Rollout, Any]:
        """Samples responses with the current policy and scores them with the Python reward functions."""
        started = self.start_rollout(prompt_tokens, prompt_mask, key)
        return self.finish_rollout(started), started.sample

    def iteration_key(self, iteration: int):
        return jax.random.fold_in(self._sample_key, iteration)

    def next_rollout(self, iteration: int) -> tuple[Rollout, sampling.SampleOutput]:
        """Iteration `iteration`'s rollout. On-policy: sampled now. One-step off-policy: the one
        started in the previous iteration (or now, in a run's first), after starting the next one
        with the current weights (the last iteration starts none). Same prompts and keys either way."""
        if not self.off_policy:
            return self.rollout(*self.prompts.next_batch(), self.iteration_key(iteration))
        current = self._in_flight
        if current is None:
            current = self.start_rollout(*self.prompts.next_batch(), self.iteration_key(iteration))
        self._in_flight = None
        if iteration + 1 < self.settings.train.iterations:
            self._in_flight = self.start_rollout(*self.prompts.next_batch(), self.iteration_key(iteration + 1))
        return self.finish_rollout(current), current.sample

    def pop_sync_metrics(self) -> dict[str, float]:
        seconds = sum(s for s, _ in self._sync_log)
        nbytes = sum(b for _, b in self._sync_log)
        self._sync_log = []
        return {"time/weight_sync": seconds, "perf/weight_sync_bytes": float(nbytes)}

    # ------------------------------------------------------------------ the sample in flight, in checkpoints

    def in_flight_record(self) -> dict | None:
        """The sample in flight as JSON values (waits for it), or None."""
        if self._in_flight is None:
            return None
        out = self._in_flight.sample  # its scores are recomputed on restore: the same program on the same inputs
        host = sharding.to_host({f.name: getattr(out, f.name) for f in dataclasses.fields(out)})
        return encode_arrays({k: np.asarray(v) for k, v in host.items()})

    def restore_in_flight(self, record: dict | None) -> None:
        """The sample a checkpoint saved in flight, back on the sampler's mesh."""
        self._in_flight = None
        if record is None:
            return
        if not self.off_policy:
            metrics_lib.warn("the checkpoint holds a rollout sampled ahead (rollout.off_policy_steps=1), but this run "
                             "is on-policy: that batch of prompts is skipped")
            return
        arrays = decode_arrays(record)
        # Scored (roles.scoring="sampler") once the scorer is in place: `_init_rollouts`.
        self._in_flight = StartedRollout(sampling.SampleOutput(**sharding.put_batch(arrays, self.meshes.sampler)))

    # ------------------------------------------------------------------ scoring and decoding

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

    def decode(self, prompt_tokens, prompt_mask, tokens, mask) -> tuple[list[str], list[str]]:
        """Host arrays -> prompt and response texts (stop tokens and padding dropped)."""
        stop = set(self.stop_ids)
        prompts = [self.tokenizer.decode([int(t) for t, m in zip(row, rm) if m], skip_special_tokens=True)
                   for row, rm in zip(prompt_tokens, prompt_mask)]
        responses = [self.tokenizer.decode([int(t) for t, m in zip(row, rm) if m and int(t) not in stop],
                                           skip_special_tokens=True)
                     for row, rm in zip(tokens, mask)]
        return prompts, responses
