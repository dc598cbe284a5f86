"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning system
at scale", §3.2): a group of responses to one prompt whose rewards are all equal has a zero
group-relative advantage (GRPO, RLOO, Dr. GRPO), so it adds no policy gradient while it still takes
its share of the batch. Such groups are dropped and the batch is refilled with the groups of more
prompts, sampled with the current weights, until it holds rollout.batch_size groups that vary or
`dynamic_sampling.max_extra_batches` more batches were sampled. A batch still short then is filled
with the dropped groups, oldest first (static shapes: every batch has B rows), and says so in its
metrics.

The rewards that decide are those known when the batch is sampled: the Python reward functions'
weighted sum and, with roles.scoring="sampler", the reward model's score times reward.model_weight
(a reward model scored in the trainer's experience step is refused in one line). They are compared
before the experience step's score processing (missing-stop penalty, clip, DAPO's overlong
penalty), as DAPO's filter reads the accuracy.

Order and randomness are fixed: extra batch j of iteration i takes the prompt stream's next batch
and the key fold_in(fold_in(sample_key, EXTRA_KEYS + i), j); so a resumed run draws the very same.
One-turn rollouts, both engines, off-policy or not; extra rows are stamped with the iteration's
version (their tokens, with partial rollouts, too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from ppo_jax import sampling, sharding
from ppo_jax.data.prompt_stream import PromptStream
from ppo_jax.rl import roles
from ppo_jax.rl.dynamic_sampling_settings import DynamicSamplingSettings
from ppo_jax.rl.rollout_source import RolloutSource, Sampled
from ppo_jax.rl.state import FrozenOutputs

EXTRA_KEYS = 1 << 29  # extra batches' keys live apart from the pipeline's (fold_in(sample_key, batch))


def varying_groups(scores: np.ndarray, group: int) -> np.ndarray:
    """[R] rewards, groups of `group` consecutive rows -> [R / group] bool: the group's rewards differ."""
    grouped = scores.reshape(-1, group)
    return grouped.max(axis=1) != grouped.min(axis=1)


@dataclasses.dataclass(frozen=True)
class GroupChoice:
    """Which groups fill the batch: `groups` [G] (part, group index) pairs in order, and the counts the
    metrics report."""

    groups: list[tuple[int, int]]
    sampled_groups: int  # groups sampled this iteration, the first batch's included
    dropped_groups: int  # of them, with all rewards equal
    refilled_with_dropped: int  # dropped groups put back because too few varied


def choose_groups(varying: list[np.ndarray], batch_groups: int) -> GroupChoice:
    """varying: per sampled part (the batch, then each extra one), [G] bool. The first `batch_groups`
    varying groups in sampling order; short of that, the first batch's dropped groups in order."""
    kept = [(p, g) for p, part in enumerate(varying) for g in np.flatnonzero(part)][:batch_groups]
    short = batch_groups - len(kept)
    dropped_first = [(0, g) for g in np.flatnonzero(~varying[0])][:short]
    sampled = sum(len(part) for part in varying)
    dropped = sampled - sum(int(part.sum()) for part in varying)
    return GroupChoice(kept + dropped_first, sampled, dropped, len(dropped_first))


def _host_rows(sampled: Sampled) -> dict[str, np.ndarray]:
    """A one-turn batch's per-row arrays on the host: the sample's fields, the frozen models' outputs
    and each row's version."""
    out = sampled.sample
    rows = {f.name: getattr(out, f.name) for f in dataclasses.fields(out) if getattr(out, f.name) is not None}
    if sampled.frozen_outputs is not None:
        rows.update(frozen_ref_logprobs=sampled.frozen_outputs.ref_logprobs,
                    frozen_model_scores=sampled.frozen_outputs.model_scores)
    host = {k: np.asarray(v) for k, v in sharding.to_host(rows).items()}
    host["version"] = np.broadcast_to(np.asarray(sampled.version, np.int32), out.tokens.shape[:1]).copy()
    return host


def _with_token_versions(host: dict[str, np.ndarray], version: int) -> dict[str, np.ndarray]:
    """A whole sample's rows beside a segmented batch's: each token stamped with `version`."""
    if "token_policy_version" not in host:
        host["token_policy_version"] = np.where(host["mask"] > 0, version, -1).astype(np.int32)
    return host


class DynamicSampling:
    """Refills a one-turn batch as the module docstring says."""

    def __init__(self, settings: DynamicSamplingSettings, group: int, source: RolloutSource, prompts: PromptStream,
                 sample_key: jax.Array, mesh, model_weight: float):
        """source: the whole samples' source the extra batches come from; mesh: the sampler's."""
        self.max_extra, self.group, self.source, self.prompts = settings.max_extra_batches, group, source, prompts
        self.sample_key, self.mesh, self.model_weight = sample_key, mesh, model_weight

    def rewards(self, sampled: Sampled, host_scores: np.ndarray) -> np.ndarray:
        """[R] what decides: the reward functions' scores plus the weighted reward model's (sampler-scored)."""
        if sampled.frozen_outputs is None:
            return host_scores
        model = np.asarray(sharding.to_host(sampled.frozen_outputs.model_scores))
        return host_scores + self.model_weight * model

    def refill(self, sampled: Sampled, host_scores: np.ndarray, weights: Callable[[], roles.SyncedWeights],
               iteration: int, score: Callable[[Sampled], np.ndarray]) -> tuple[Sampled, np.ndarray, dict[str, float]]:
        """(the batch to train on, its host scores [R], metrics). weights: the current weights on the
        sampler's mesh, asked for only when more is sampled; score: a batch's host scores."""
        parts, scores = [sampled], [host_scores]
        varying = [varying_groups(self.rewards(sampled, host_scores), self.group)]
        batch_groups = len(varying[0])
        while sum(int(v.sum()) for v in varying) < batch_groups and len(parts) - 1 < self.max_extra:
            key = jax.random.fold_in(jax.random.fold_in(self.sample_key, EXTRA_KEYS + iteration), len(parts) - 1)
            current = weights()
            more = self.source.begin(current, *self.prompts.next_batch(), key, iteration).complete(
                current, iteration).result()
            parts.append(more)
            scores.append(score(more))
            varying.append(varying_groups(self.rewards(more, scores[-1]), self.group))
        choice = choose_groups(varying, batch_groups)
        metrics = {"rollout/dynamic_dropped_share": choice.dropped_groups / choice.sampled_groups,
                   "rollout/dynamic_extra_rows": float((len(parts) - 1) * len(host_scores)),
                   "rollout/dynamic_refilled_with_dropped": float(choice.refilled_with_dropped)}
        if len(parts) == 1 and not choice.dropped_groups:
            return sampled, host_scores, metrics  # every group varied: the batch as it was
        hosts = [_host_rows(p) for p in parts]
        if "token_policy_version" in hosts[0]:  # partial rollouts: the extra rows' tokens are this iteration's
            hosts = hosts[:1] + [_with_token_versions(h, iteration) for h in hosts[1:]]
        rows = [np.arange(g * self.group, (g + 1) * self.group) for _, g in choice.groups]
        chosen = {k: np.concatenate([hosts[p][k][r] for (p, _), r in zip(choice.groups, rows)])
                  for k in hosts[0]}
        chosen_scores = np.concatenate([scores[p][r] for (p, _), r in zip(choice.groups, rows)])
        return self._placed(chosen), chosen_scores, metrics

    def _placed(self, chosen: dict[str, np.ndarray]) -> Sampled:
        """Chosen host rows back on the sampler's mesh as one batch."""
        version = chosen.pop("version")
        frozen = None
        if "frozen_ref_logprobs" in chosen:
            frozen = FrozenOutputs(*sharding.put_batch(
                (chosen.pop("frozen_ref_logprobs"), chosen.pop("frozen_model_scores")), self.mesh))
        return Sampled(sampling.SampleOutput(**sharding.put_batch(chosen, self.mesh)), version, frozen)

