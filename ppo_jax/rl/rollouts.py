"""A PPO run's rollouts: the policy synced to the sampler's mesh (`rl/roles.py`), sampling, host
rewards, the hand-over to the trainer's mesh, and the one-step off-policy pipeline
(rollout.off_policy_steps=1: the next batch is sampled with the weights before this update while
the trainer updates on this one).

`Rollouts` holds the sampler's side of a run: the policy's copy on the sampler's mesh (synced once
per train step; with LoRA the frozen base, copied there once), the log of the syncs since the last
iteration, with roles.scoring="sampler" the scorer (the reference and reward model on the sampler's
mesh), and the sample in flight. It reads the trainer's state only as the argument of each call.

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
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ppo_jax import metrics as metrics_lib
from ppo_jax import reward_functions, sampling, sharding
from ppo_jax.data.prompt_stream import PromptStream
from ppo_jax.models import LoraConfig
from ppo_jax.models import lora as lora_lib
from ppo_jax.rl import roles
from ppo_jax.rl.build import Steps
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import FrozenParams, Rollout, PPOState

IN_FLIGHT_ITEM = "in_flight_rollout"


def encode_arrays(arrays: dict[str, np.ndarray]) -> dict[str, dict]:
    """Host arrays -> JSON values that restore them bit for bit."""
    return {name: {"dtype": str(a.dtype), "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}
            for name, a in arrays.items()}


def decode_arrays(record: dict[str, dict]) -> dict[str, np.ndarray]:
    return {name: np.frombuffer(base64.b64decode(v["data"]), dtype=np.dtype(v["dtype"])).reshape(v["shape"])
            for name, v in record.items()}


@dataclasses.dataclass(frozen=True)
class Texts:
    """Token ids -> texts, for the Python reward functions and the sample logs."""

    tokenizer: Any
    stop_ids: tuple[int, ...]

    def decode(self, prompt_tokens, prompt_mask, tokens, mask) -> tuple[list[str], list[str]]:
        """Host arrays [B, Lq], [B, Lr] -> prompt and response texts (stop tokens and padding dropped)."""
        stop = set(self.stop_ids)
        prompts = [self.tokenizer.decode([int(t) for t, m in zip(row, rm) if m], skip_special_tokens=True)
                   for row, rm in zip(prompt_tokens, prompt_mask)]
        responses = [self.tokenizer.decode([int(t) for t, m in zip(row, rm) if m and int(t) not in stop],
                                           skip_special_tokens=True)
                     for row, rm in zip(tokens, mask)]
        return prompts, responses


@dataclasses.dataclass
class StartedRollout:
    """A rollout dispatched to the sampler's mesh: its sample and, with roles.scoring="sampler",
    the frozen models' outputs there (reference log-probs [B, Lr], raw model scores [B])."""

    sample: sampling.SampleOutput
    ref_logprobs: jax.Array | None = None
    model_scores: jax.Array | None = None


class Rollouts:
    """The sampler's side of a PPO run (see the module docstring for what it holds)."""

    def __init__(self, settings: Settings, meshes: roles.RoleMeshes, steps: Steps, frozen: FrozenParams, *,
                 lora: LoraConfig | None, texts: Texts, reward_functions: Sequence[tuple[Callable, float]],
                 prompts: PromptStream, sample_key: jax.Array):
        """frozen: the run's frozen trees on the trainer's mesh; with roles.scoring="sampler" the
        reference and reward model are copied to the sampler's (`scorer`), and the trainer then
        keeps neither. lora: the policy's adapters' config (None without LoRA)."""
        self.settings, self.meshes, self.steps = settings, meshes, steps
        self.lora, self.texts, self.reward_functions = lora, texts, reward_functions
        self.prompts, self.sample_key = prompts, sample_key
        self.synced: roles.SyncedWeights | None = None  # the policy on the sampler's mesh, as of a train step
        self.sync_log: list[tuple[float, int]] = []  # (seconds, bytes) of the syncs since the last iteration
        self.in_flight: StartedRollout | None = None  # off-policy: the next iteration's sample
        self.merge_jit = None
        self.sampler_base = None  # LoRA: the frozen base on the sampler's mesh (copied once: it never changes)
        if lora is not None:
            self.sampler_base, seconds, nbytes = roles.sync_to(frozen.policy, steps.sampler_shardings.params)
            if nbytes:
                metrics_lib.warn(f"copied the frozen LoRA base to the sampler's mesh once ({nbytes / 2**30:.3f} GiB, "
                                 f"{seconds:.2f} s); each iteration syncs only the adapters")
        self.scorer: FrozenParams | None = None  # roles.scoring="sampler": the frozen models on the sampler's mesh
        if settings.roles.scoring == "sampler":
            where = steps.scorer_shardings
            self.scorer = FrozenParams(
                reference=None if frozen.reference is None else sharding.reshard(frozen.reference, where.reference),
                reward=None if frozen.reward is None else sharding.reshard(frozen.reward, where.reward),
                policy=self.sampler_base)

    @property
    def off_policy(self) -> bool:
        return self.settings.rollout.off_policy_steps == 1

    def _merge_adapters(self, base, adapters):
        """base + scale * A @ B on the sampler's shardings (roles.lora_sync="merged")."""
        if self.merge_jit is None:
            config = self.lora
            self.merge_jit = jax.jit(lambda p, a: lora_lib.merge_lora(p, a, config),
                                     out_shardings=self.steps.sampler_shardings.params)
        with sharding.mesh_context(self.meshes.sampler):
            return self.merge_jit(base, adapters)

    def sampler_weights(self, state: PPOState) -> roles.SyncedWeights:
        """`state`'s policy on the sampler's mesh: synced once per train step (nothing is copied when
        the sampler shares the trainer's mesh; with LoRA only the adapters travel)."""
        step = int(state.step)
        if self.synced is not None and self.synced.step == step:
            return self.synced
        self.synced = None  # the older copy goes before the new one arrives (an in-flight sample keeps its own)
        where = self.steps.sampler_shardings
        if self.lora is not None:  # the trainable tree is the adapters, on the base copied there once
            adapters, seconds, nbytes = roles.sync_to(state.policy, where.synced_adapters)
            params = self.sampler_base
            if where.merged:  # folded into the decoding copy on the sampler's devices (the base stays)
                params, adapters = self._merge_adapters(params, adapters), None
        else:
            (params, seconds, nbytes), adapters = roles.sync_to(state.policy, where.params), None
        self.sync_log.append((seconds, nbytes))
        self.synced = roles.SyncedWeights(step, params, adapters)
        return self.synced

    def sample(self, state: PPOState, prompt_tokens, prompt_mask, key) -> sampling.SampleOutput:
        """Responses of `state`'s policy to prompts [B, Lq] batch-sharded on the sampler's mesh."""
        weights = self.sampler_weights(state)
        return self.steps.sampler(weights.params, prompt_tokens, prompt_mask, key, adapters=weights.adapters)

    def start(self, state: PPOState, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key) -> StartedRollout:
        """Dispatches the sampling of this process's prompt rows (host arrays), and with
        roles.scoring="sampler" its scoring, and returns at once."""
        mesh = self.meshes.sampler
        toks, mask = sharding.put_local_batch((prompt_tokens, prompt_mask), mesh)
        return self._scored(self.sample(state, toks, mask, sharding.replicate(key, mesh)))

    def _scored(self, out: sampling.SampleOutput) -> StartedRollout:
        if self.scorer is None:
            return StartedRollout(out)
        with sharding.mesh_context(self.meshes.sampler):
            ref_logprobs, model_scores = self.steps.scoring_jit(self.scorer, out.prompt_tokens, out.prompt_mask,
                                                                out.tokens, out.mask)
        return StartedRollout(out, ref_logprobs, model_scores)

    def finish(self, started: StartedRollout) -> Rollout:
        """A sample scored by the Python reward functions (on the host; this waits for it) and moved to
        the trainer's mesh."""
        out = started.sample
        if self.reward_functions:
            host = sharding.to_host({"pt": out.prompt_tokens, "pm": out.prompt_mask, "t": out.tokens, "m": out.mask})
            prompts_text, responses_text = self.texts.decode(host["pt"], host["pm"], host["t"], host["m"])
            host_scores = reward_functions.combined_scores(self.reward_functions, prompts_text, responses_text)
            reward_functions.warn_once_if_meaningless(host_scores, run=self)
        else:
            host_scores = np.zeros(out.tokens.shape[0], np.float32)
        fields = dict(prompt_tokens=out.prompt_tokens, prompt_mask=out.prompt_mask, tokens=out.tokens,
                      mask=out.mask, sampler_logprobs=out.logprobs, behaviour_logprobs=out.sampling_logprobs,
                      stopped=out.stopped)
        if started.ref_logprobs is not None:
            fields.update(ref_logprobs=started.ref_logprobs, model_scores=started.model_scores)
        trainer_mesh = self.meshes.trainer
        data = sharding.data_sharding(trainer_mesh)  # a no-op when the sampler shares the trainer's mesh
        fields = sharding.reshard(fields, {k: data for k in fields})
        return Rollout(**fields, host_scores=sharding.put_batch(host_scores, trainer_mesh))

    def rollout(self, state: PPOState, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
                key) -> tuple[Rollout, sampling.SampleOutput]:
        """Samples responses with `state`'s policy and scores them with the Python reward functions."""
        started = self.start(state, prompt_tokens, prompt_mask, key)
        return self.finish(started), started.sample

    def iteration_key(self, iteration: int):
        return jax.random.fold_in(self.sample_key, iteration)

    def next(self, state: PPOState) -> tuple[Rollout, sampling.SampleOutput]:
        """The rollout of iteration `state.step`. On-policy: sampled now. One-step off-policy: the one
        started in the previous iteration (or now, in a run's first), after starting the next one
        with the current weights (the last iteration starts none). Same prompts and keys either way."""
        iteration = int(state.step)
        if not self.off_policy:
            return self.rollout(state, *self.prompts.next_batch(), self.iteration_key(iteration))
        current = self.in_flight
        if current is None:
            current = self.start(state, *self.prompts.next_batch(), self.iteration_key(iteration))
        self.in_flight = None
        if iteration + 1 < self.settings.train.iterations:
            self.in_flight = self.start(state, *self.prompts.next_batch(), self.iteration_key(iteration + 1))
        return self.finish(current), current.sample

    def pop_sync_metrics(self) -> dict[str, float]:
        seconds = sum(s for s, _ in self.sync_log)
        nbytes = sum(b for _, b in self.sync_log)
        self.sync_log = []
        return {"time/weight_sync": seconds, "perf/weight_sync_bytes": float(nbytes)}

    # ------------------------------------------------------------------ the sample in flight, in checkpoints

    def in_flight_record(self) -> dict | None:
        """The sample in flight as JSON values (waits for it), or None."""
        if self.in_flight is None:
            return None
        out = self.in_flight.sample  # its scores are recomputed on restore: the same program on the same inputs
        host = sharding.to_host({f.name: getattr(out, f.name) for f in dataclasses.fields(out)})
        return encode_arrays({k: np.asarray(v) for k, v in host.items()})

    def restore_in_flight(self, record: dict | None) -> None:
        """The sample a checkpoint saved in flight, back on the sampler's mesh (and scored there with
        roles.scoring="sampler")."""
        self.in_flight = None
        if record is None:
            return
        if not self.off_policy:
            metrics_lib.warn("the checkpoint holds a rollout sampled ahead (rollout.off_policy_steps=1), but this run "
                             "is on-policy: that batch of prompts is skipped")
            return
        arrays = decode_arrays(record)
        self.in_flight = self._scored(sampling.SampleOutput(**sharding.put_batch(arrays, self.meshes.sampler)))
