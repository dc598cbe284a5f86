"""A PPO run's rollouts: the policy synced to the sampler's mesh (`rl/roles.py`), sampling, host
rewards, the hand-over to the trainer's mesh, and the k-step off-policy pipeline
(rollout.off_policy_steps=k: the sampler runs k batches ahead of the trainer, batch i+k sampled with
the weights before update i while the trainer updates on batch i).

`Rollouts` holds the sampler's side of a run: the policy's copy on the sampler's mesh (synced once
per train step; with LoRA the frozen base, copied there once), the log of the syncs since the last
iteration, with roles.scoring="sampler" the scorer (the reference and reward model on the sampler's
mesh), and the samples in flight, each stamped with the policy version (train step) that sampled it.
It reads the trainer's state only as the argument of each call.

The pipelined iteration i (θ_i: the weights before update i; k = 1 shown, k > 1 the same with
batches i+1 .. i+k in flight):

    sync θ_i -> sampler;  start sample i+k (θ_i)   ─┐ sampler devices, asynchronous
    wait for sample i (θ_{i-k}); host rewards        │
    experience i; update i -> θ_{i+1}               ─┘ trainer devices, meanwhile

The first iteration starts batches 0 .. k with θ_0 (batch j's lag is j until the pipeline is full,
then k); the last k iterations start none. The samples in flight at a checkpoint are saved with it
(their arrays and versions, in the step's JSON item), so a resumed run continues with the very
rollouts the uninterrupted one would have used.

Partial rollouts (rollout.partial_rollouts, the continuous engine): a rollout in flight is decoded in
segments (`sampling/segments.py`), one per iteration, each under the weights synced that iteration:

    sync θ_i -> sampler;  finish batch i (θ_i);  one segment of batches i+1 .. i+k-1 (θ_i);
    begin batch i+k (θ_i);  host rewards of batch i;  experience i; update i

so the weights change between two decode steps of a rollout in flight; each token records the version
that chose it (`Rollout.token_policy_version`). The engine states in flight are saved in checkpoints
(every array of each, KV caches included) and resumed bit for bit.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ppo_jax import metrics as metrics_lib
from ppo_jax import reward_functions, sampling, sharding
from ppo_jax.checkpoint import trees
from ppo_jax.config import ConfigError
from ppo_jax.data.prompt_stream import PromptStream
from ppo_jax.models import LoraConfig
from ppo_jax.models import lora as lora_lib
from ppo_jax.rl import roles
from ppo_jax.rl.build import Steps
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.state import FrozenParams, Rollout, PPOState
from ppo_jax.sampling import segments

IN_FLIGHT_ITEM = "in_flight_rollout"


@dataclasses.dataclass
class InFlightRecord:
    """The samples in flight as a checkpoint holds them: `records` (JSON, oldest first: each its version
    and, per array, its name in `arrays`) and `arrays` (saved in Orbax's binary item, not as JSON)."""

    records: list[dict]
    arrays: dict[str, np.ndarray]

    def refer(self, arrays: dict[str, np.ndarray]) -> dict[str, dict]:
        """`arrays` added under names of their own; what a record keeps of them."""
        refs = {}
        for name, a in arrays.items():
            key = f"in_flight_{len(self.arrays)}"
            self.arrays[key] = a
            refs[name] = {"array": key}
        return refs


def resolve_arrays(record: dict[str, dict], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A record's arrays: from the checkpoint's binary item, or (checkpoints before it) base64 JSON."""
    return {name: arrays[v["array"]] if "array" in v else
            np.frombuffer(base64.b64decode(v["data"]), dtype=np.dtype(v["dtype"])).reshape(v["shape"])
            for name, v in record.items()}


def _size(nbytes: int) -> str:
    """Bytes in the largest binary unit (KiB, MiB, GiB) that leaves at least 1 of it."""
    power, unit = next(((p, u) for p, u in ((30, "GiB"), (20, "MiB")) if nbytes >= 2 ** p), (10, "KiB"))
    return f"{nbytes / 2 ** power:.2f} {unit}"


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
    """A rollout dispatched to the sampler's mesh: its sample, the policy version (train step) whose
    weights sampled it and, with roles.scoring="sampler", the frozen models' outputs there (reference
    log-probs [B, Lr], raw model scores [B])."""

    sample: sampling.SampleOutput | None
    version: int
    ref_logprobs: jax.Array | None = None
    model_scores: jax.Array | None = None
    # Partial rollouts: the engine state between segments (`sample` None until the last one), or, just
    # restored from a checkpoint, its arrays by tree path until the first segment rebuilds it.
    segment: segments.Segment | dict[str, np.ndarray] | None = None


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
        # Off-policy: the next iterations' samples, oldest first (batches step, step + 1, ... at the
        # start of `next`; at most rollout.off_policy_steps between iterations).
        self.in_flight: collections.deque[StartedRollout] = collections.deque()
        self.merge_jit = None
        self.sampler_base = None  # LoRA: the frozen base on the sampler's mesh (copied once: it never changes)
        if lora is not None:
            where = steps.sampler_shardings
            self.sampler_base, seconds, nbytes = roles.sync_to(frozen.policy, where.params, where.dtype)
            if nbytes:
                metrics_lib.warn(f"copied the frozen LoRA base to the sampler's mesh once ({nbytes / 2**30:.3f} GiB, "
                                 f"{seconds:.2f} s); each iteration syncs only the adapters")
        # rollout.partial_rollouts: the continuous engine in segments, `segment_steps` decode steps each (a
        # rollout whose rows all run to rollout.response_length takes k + 1, one per iteration in flight).
        # (Multi-turn episodes are segmented by turns instead: rl/partial_episodes.py.)
        one_turn_partial = settings.rollout.partial_rollouts and not settings.environment.enabled
        self.segmented = segments.SegmentedSampler(steps.sampler) if one_turn_partial else None
        self.segment_steps = segments.segment_budget(
            settings.rollout.batch_size * settings.rollout.num_samples, steps.sampling_config,
            settings.rollout.off_policy_steps + 1) if self.segmented else 0
        self.warned_segment_bytes = False  # said once: a checkpoint saves the partial rollouts in flight whole
        self.scorer: FrozenParams | None = None  # roles.scoring="sampler": the frozen models on the sampler's mesh
        if settings.roles.scoring == "sampler":
            where = steps.scorer_shardings
            self.scorer = FrozenParams(
                reference=None if frozen.reference is None else sharding.reshard(frozen.reference, where.reference),
                reward=None if frozen.reward is None else sharding.reshard(frozen.reward, where.reward),
                policy=self.sampler_base)

    @property
    def steps_ahead(self) -> int:
        """rollout.off_policy_steps: batches the sampler runs ahead of the trainer (0: on-policy)."""
        return self.settings.rollout.off_policy_steps

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
            adapters, seconds, nbytes = roles.sync_to(state.policy, where.synced_adapters, where.dtype)
            params = self.sampler_base
            if where.merged:  # folded into the decoding copy on the sampler's devices (the base stays)
                params, adapters = self._merge_adapters(params, adapters), None
        else:
            (params, seconds, nbytes), adapters = roles.sync_to(state.policy, where.params, where.dtype), None
        self.sync_log.append((seconds, nbytes))
        self.synced = roles.SyncedWeights(step, params, adapters)
        return self.synced

    def sample(self, state: PPOState, prompt_tokens, prompt_mask, key) -> sampling.SampleOutput:
        """Responses of `state`'s policy to prompts [B, Lq] batch-sharded on the sampler's mesh."""
        weights = self.sampler_weights(state)
        return self.steps.sampler(weights.params, prompt_tokens, prompt_mask, key, adapters=weights.adapters)

    def start(self, state: PPOState, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, key) -> StartedRollout:
        """Dispatches the sampling of this process's prompt rows (host arrays), whole, and with
        roles.scoring="sampler" its scoring, and returns at once. Whatever the training source: an
        evaluation's rollout is a whole one of the current weights."""
        mesh = self.meshes.sampler
        toks, mask = sharding.put_local_batch((prompt_tokens, prompt_mask), mesh)
        return self._scored(self.sample(state, toks, mask, sharding.replicate(key, mesh)), int(state.step))

    def _begin_partial(self, state: PPOState, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
                       key) -> StartedRollout:
        """Partial rollouts: dispatches the first segment of a batch (finished by `_next_partial`)."""
        mesh = self.meshes.sampler
        toks, mask = sharding.put_local_batch((prompt_tokens, prompt_mask), mesh)
        weights = self.sampler_weights(state)
        segment = self.segmented.begin(weights.params, toks, mask, sharding.replicate(key, mesh), int(state.step),
                                       self.segment_steps, adapters=weights.adapters)
        return StartedRollout(None, int(state.step), segment=segment)

    def _scored(self, out: sampling.SampleOutput, version: int) -> StartedRollout:
        if self.scorer is None:
            return StartedRollout(out, version)
        with sharding.mesh_context(self.meshes.sampler):
            ref_logprobs, model_scores = self.steps.scoring_jit(self.scorer, out.prompt_tokens, out.prompt_mask,
                                                                out.tokens, out.mask)
        return StartedRollout(out, version, ref_logprobs, model_scores)

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
        if out.routed_experts is not None:  # moe.router_replay
            fields.update(routed_experts=out.routed_experts)
        if out.token_policy_version is not None:  # partial rollouts: each token's version
            fields.update(token_policy_version=out.token_policy_version)
        trainer_mesh = self.meshes.trainer
        data = sharding.data_sharding(trainer_mesh)  # a no-op when the sampler shares the trainer's mesh
        fields = sharding.reshard(fields, {k: data for k in fields})
        # The version that started the batch (partial rollouts: its oldest tokens'; each token's is above).
        version = np.full(host_scores.shape, started.version, np.int32)
        return Rollout(**fields, host_scores=sharding.put_batch(host_scores, trainer_mesh),
                       policy_version=sharding.put_batch(version, trainer_mesh))

    def rollout(self, state: PPOState, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
                key) -> tuple[Rollout, sampling.SampleOutput]:
        """Samples responses with `state`'s policy and scores them with the Python reward functions."""
        started = self.start(state, prompt_tokens, prompt_mask, key)
        return self.finish(started), started.sample

    def iteration_key(self, iteration: int):
        return jax.random.fold_in(self.sample_key, iteration)

    def next(self, state: PPOState) -> tuple[Rollout, sampling.SampleOutput]:
        """The rollout of iteration `state.step`. On-policy: sampled now. k-step off-policy: first the
        batches up to iteration step + k not in flight yet are started with the current weights (all
        k + 1 in a run's first iteration; none past its last), then the oldest in flight is finished:
        the one started k iterations ago (in the first k iterations, in the first). Same prompts and
        keys, in the same order, for every k."""
        iteration = int(state.step)
        if not self.steps_ahead:
            return self.rollout(state, *self.prompts.next_batch(), self.iteration_key(iteration))
        last = min(iteration + self.steps_ahead, self.settings.train.iterations - 1)
        if self.settings.rollout.partial_rollouts:
            return self._next_partial(state, last)
        while iteration + len(self.in_flight) <= last:  # in flight: batches iteration, iteration + 1, ...
            batch = iteration + len(self.in_flight)
            self.in_flight.append(self.start(state, *self.prompts.next_batch(), self.iteration_key(batch)))
            self._check_room(more=last - batch)
        current = self.in_flight.popleft()
        return self.finish(current), current.sample

    def _next_partial(self, state: PPOState, last: int) -> tuple[Rollout, sampling.SampleOutput]:
        """`next` with partial rollouts: the oldest batch in flight finished under the current weights
        (dispatched first: the trainer waits for it), every other one a segment further under them,
        then the batches up to `last` begun."""
        iteration, weights = int(state.step), self.sampler_weights(state)
        if not self.in_flight:  # a run's first iteration: batch `iteration` begins now
            self.in_flight.append(self._begin_partial(state, *self.prompts.next_batch(),
                                                      self.iteration_key(iteration)))
            self._check_room(more=last - iteration)
        for started in self.in_flight:
            if isinstance(started.segment, dict):  # restored from a checkpoint: rebuilt on the sampler's mesh
                started.segment = self._rebuild_segment(started.segment, weights)
        current = self.in_flight.popleft()
        if current.sample is None:
            out = self.segmented.finish(weights.params, current.segment, iteration, adapters=weights.adapters)
            current = self._scored(out, current.version)
        for started in self.in_flight:
            if started.sample is not None:  # sampled whole (restored from a run without partial rollouts)
                continue
            started.segment = self.segmented.advance(weights.params, started.segment, iteration, self.segment_steps,
                                                     adapters=weights.adapters)
        while iteration + 1 + len(self.in_flight) <= last:
            batch = iteration + 1 + len(self.in_flight)
            self.in_flight.append(self._begin_partial(state, *self.prompts.next_batch(), self.iteration_key(batch)))
        return self.finish(current), current.sample

    def _check_room(self, more: int) -> None:
        """With the first batch of a fresh run in flight and `more` to join it (k-step off-policy):
        each will hold what the first holds on the sampler's devices (measured: its sample and scores,
        with partial rollouts its engine state and KV cache), so refuse in one line, before the others
        are dispatched, when that does not fit their free memory. Devices that report none (a CPU)
        are not checked."""
        if len(self.in_flight) != 1 or more < 1:  # only a fresh run's first batch is ever alone here
            return
        free = sharding.free_device_bytes(self.meshes.sampler.devices.flat)
        if free is None:
            return
        first = self.in_flight[0]
        each = sharding.device_bytes(self._held_on_sampler(first))
        if more * each <= free:
            return
        partial = self.settings.rollout.partial_rollouts
        held = "its engine state and KV cache" if partial else "its sample and scores"
        raise ConfigError(f"rollout.off_policy_steps={self.steps_ahead}: a batch in flight holds {_size(each)} per "
                          f"sampler device ({held}, measured on the first), so the {more} that join it need "
                          f"{_size(more * each)}, but {_size(free)} are free there; use "
                          f"rollout.off_policy_steps={free // each if each else 0} or less"
                          + (" or fewer rollout.slots" if partial else ""))

    @staticmethod
    def _held_on_sampler(started: StartedRollout) -> Any:
        """The arrays a batch in flight holds on the sampler's devices."""
        return started.sample, started.ref_logprobs, started.model_scores, started.segment

    def _rebuild_segment(self, arrays: dict[str, np.ndarray], weights: roles.SyncedWeights) -> segments.Segment:
        """A Segment saved as host arrays by tree path, back on the sampler's mesh (replicated; the
        engine's own constraints split its rows again in the next segment)."""
        mesh = self.meshes.sampler
        tokens = jax.ShapeDtypeStruct(arrays[".prompt_tokens"].shape, np.int32)
        key = sharding.replicate(self.iteration_key(0), mesh)
        abstract = self.segmented.abstract_segment(weights.params, tokens, tokens, key, adapters=weights.adapters)
        return trees.tree_from_host_arrays(arrays, abstract, lambda a: sharding.replicate(a, mesh),
                                           what="the checkpoint's partial rollout in flight")

    def close(self) -> None:
        """Ends what runs beside the trainer (the one-turn sampler's work is all dispatched: nothing)."""

    def pop_generate_metrics(self) -> dict[str, float]:
        """What ran inside the generate phase since the last call, apart from sampling: the weight
        syncs (`time/weight_sync`, `perf/weight_sync_bytes`); episode rollouts add their own."""
        seconds = sum(s for s, _ in self.sync_log)
        nbytes = sum(b for _, b in self.sync_log)
        self.sync_log = []
        return {"time/weight_sync": seconds, "perf/weight_sync_bytes": float(nbytes)}

    # ------------------------------------------------------------------ the samples in flight, in checkpoints

    def in_flight_record(self) -> InFlightRecord:
        """The samples in flight, oldest first (waits for them): each its version and its arrays (its
        scores are recomputed on restore: the same program on the same inputs)."""
        record = InFlightRecord([], {})
        for started in self.in_flight:
            record.records.append({"version": started.version, **self._in_flight_entry(started, record)})
        return record

    def _in_flight_entry(self, started: StartedRollout, record: InFlightRecord) -> dict:
        """What a checkpoint keeps of one batch in flight besides its version (its arrays added to `record`)."""
        if started.sample is None:  # partial rollouts: the engine state between two segments
            return {"segment": record.refer(self._segment_arrays(started))}
        out = started.sample
        host = sharding.to_host({f.name: getattr(out, f.name) for f in dataclasses.fields(out)
                                 if getattr(out, f.name) is not None})
        return {"sample": record.refer({k: np.asarray(v) for k, v in host.items()})}

    def _segment_arrays(self, started: StartedRollout) -> dict[str, np.ndarray]:
        """A partial rollout's engine state as host arrays by tree path (waits for it). Its KV caches
        make it large for a large model: the size is said once it passes 256 MiB."""
        if isinstance(started.segment, dict):  # restored and not run since
            return started.segment
        return self._saved_whole(trees.host_arrays_by_path(started.segment))

    def _saved_whole(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`arrays`, a partial rollout's engine state; its size said once a run when it passes 256 MiB."""
        nbytes = sum(a.nbytes for a in arrays.values())
        if nbytes > 2**28 and not self.warned_segment_bytes:
            self.warned_segment_bytes = True
            metrics_lib.warn(f"each partial rollout in flight is saved whole with the checkpoint: "
                             f"{nbytes / 2**30:.2f} GiB (its KV cache)")
        return arrays

    def restore_in_flight(self, record: list[dict] | dict | None, step: int,
                          arrays: dict[str, np.ndarray] | None = None) -> None:
        """The samples a checkpoint of train step `step` saved in flight (`InFlightRecord.records`,
        their arrays in `arrays`), back on the sampler's mesh (and scored there with
        roles.scoring="sampler"). Reads the older formats too: the arrays as base64 JSON, and one
        step's (one sample's arrays, or None), whose sample the weights before the step's update drew."""
        arrays = arrays or {}
        self.in_flight = collections.deque()
        if isinstance(record, dict):
            record = [{"version": step - 1, "sample": record}]
        records = record or []
        if len(records) > self.steps_ahead:
            metrics_lib.warn(f"the checkpoint holds {len(records)} rollouts sampled ahead, but this run has "
                             f"rollout.off_policy_steps={self.steps_ahead}: the prompts of the last "
                             f"{len(records) - self.steps_ahead} are skipped")
            records = records[:self.steps_ahead]
        for r in records:
            self.in_flight.append(self._restored(r, arrays))

    def _restored(self, r: dict, arrays: dict[str, np.ndarray]) -> StartedRollout:
        """One batch in flight as `_in_flight_entry` saved it."""
        if "segment" in r:  # partial rollouts: rebuilt on the sampler's mesh by the next segment
            if self.segmented is None:
                raise ConfigError("the checkpoint holds partial rollouts in flight (mid-decode): resume with "
                                  "rollout.partial_rollouts=True")
            return StartedRollout(None, int(r["version"]), segment=resolve_arrays(r["segment"], arrays))
        sample = resolve_arrays(r["sample"], arrays)
        out = sampling.SampleOutput(**sharding.put_batch(sample, self.meshes.sampler))
        return self._scored(out, int(r["version"]))
