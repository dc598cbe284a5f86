"""The named containers one PPO iteration passes between its phases.

Shapes: B rollout rows (prompts x samples), Lq prompt length, Lr response length. Trainable state is
donated to the update; frozen parameters (reference, reward, a LoRA policy's base) never are.

With LoRA (policy.lora.rank > 0) `PPOState.policy` holds only the adapters (the "lora" collection)
and `FrozenParams.policy` the base they apply to; the reference is that same base with the adapters
off, so `FrozenParams.reference` is None and no copy of the policy exists. With policy.lora.init_from
the reference is that base + the imported adapters: `FrozenParams.reference` is then an adapters-only
tree (the frozen starting adapters).

With value LoRA (value.lora.rank > 0) `PPOState.value` holds {"lora": adapters, "score": head} and
`FrozenParams.value` the transformer they apply to: a subtree of a frozen tree the run holds anyway
(the policy's base, the reference, or the reward model), the very same arrays, never a copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax

from ppo_jax import ppo
from ppo_jax.models.lora import trained_variables
from ppo_jax.models.packing import PackedRows
from ppo_jax.models.transformer import CausalLM, ScalarModel

Array = jax.Array
Params = Any


@dataclasses.dataclass(frozen=True)
class Modules:
    """The Flax modules of the four trees (definitions only, no parameters; static in every step)."""

    policy: CausalLM
    value: ScalarModel | None  # None for critic-free estimators
    reward: ScalarModel | None  # None when only Python reward functions score
    teacher: CausalLM | None = None  # on-policy distillation's frozen teacher (distill.teacher_path); None: off

@flax.struct.dataclass
class PPOState:
    """Everything the PPO update changes (policy and value with their optimizer states, the KL
    controller, the key); donated to the update step. Named apart from the supervised trainers'
    `TrainState` (one model and its optimizer state)."""

    step: Array  # [] int32, PPO iterations done
    policy: Params  # the policy's params; with LoRA, its adapters only
    policy_opt: Any
    value: Params | None  # None for critic-free estimators (grpo, rloo, reinforce_pp); with value LoRA {"lora", "score"}
    value_opt: Any
    kl: ppo.KLControllerState
    key: Array  # base PRNG key; per-iteration keys are fold_in(key, step)
    entropy: ppo.EntropyControllerState | None = None  # the adaptive entropy coefficient (ppo.entropy_target); None: off


@flax.struct.dataclass
class Trainable:
    """The trees the update differentiates (their gradients come back as a `Trainable` too)."""

    policy: Params  # the policy's params; with LoRA its adapters (the base: `FrozenParams.policy`)
    value: Params | None  # None without a critic; with value LoRA {"lora": adapters, "score": head}


@flax.struct.dataclass
class FrozenParams:
    """Never donated, never optimised."""

    reference: Params | None  # the initial policy's copy; None with LoRA (the base is the reference)
    reward: Params | None  # None when only Python reward functions score
    policy: Params | None = None  # a LoRA policy's frozen base; None for full fine-tuning
    # A LoRA value model's frozen transformer: the same arrays as policy["transformer"],
    # reference["transformer"] or reward["transformer"] (held once); None for a full value model.
    value: Params | None = None
    teacher: Params | None = None  # on-policy distillation's teacher (distill.teacher_path); None: off


def policy_variables(trainable: Params, base: Params | None) -> tuple[Params, Params | None]:
    """(params, adapters) of a policy forward: (trainable, None) for full fine-tuning, (base, trainable)
    with LoRA, where the trainable tree is the adapters."""
    return (trainable, None) if base is None else (base, trainable)


def reference_variables(frozen: FrozenParams) -> tuple[Params, Params | None]:
    """(params, adapters) of the reference forward: (its own copy, None) for full fine-tuning; with
    LoRA (the base, None), the base with adapters off; with imported adapters (policy.lora.init_from)
    (the base, the frozen copy of the imported adapters)."""
    if frozen.policy is None:
        return frozen.reference, None
    return frozen.policy, frozen.reference


def value_variables(trainable: Params | None, base: Params | None) -> tuple[Params | None, Params | None]:
    """(params, adapters) of a value forward: (trainable, None) for a full value model; with value
    LoRA, trainable = {"lora": adapters, "score": head} on the frozen transformer `base`, so
    ({"transformer": base, "score": head}, adapters)."""
    return trained_variables(trainable, None if base is None else {"transformer": base})


@flax.struct.dataclass
class FrozenOutputs:
    """roles.scoring="sampler": the frozen models' outputs, computed on the sampler's mesh."""

    ref_logprobs: Array  # [B, Lr]
    model_scores: Array  # [B] the reward model's, before gain and bias


@flax.struct.dataclass
class EpisodeTurns:
    """Multi-turn episodes (environment.name, rl/episodes.py)."""

    # [B, Lr] int32, 1 on the policy's tokens (`Rollout.mask` also covers the observations, which the
    # forwards read as context)
    action_mask: Array
    rewards: Array  # [B, M] float32, each turn's environment reward
    ends: Array  # [B, M] int32, the column of each turn's last action token (-1: no such turn)


@flax.struct.dataclass
class Rollout:
    """Sampled responses (from the sampler) plus host-side scores; each mode's fields in a part of
    their own, None when the mode is off."""

    prompt_tokens: Array  # [B, Lq]
    prompt_mask: Array  # [B, Lq]
    tokens: Array  # [B, Lr]
    mask: Array  # [B, Lr], 1 up to and including the first stop token
    sampler_logprobs: Array  # [B, Lr], the sampler's log-probs under the full tempered distribution (the mismatch metric)
    # [B, Lr] the sampled tokens' log-probs under the distribution they were drawn from (top-k / top-p /
    # min_new_tokens truncated and renormalised; equal to sampler_logprobs without truncation): the
    # behaviour policy of the off-policy correction.
    behaviour_logprobs: Array
    stopped: Array  # [B] bool
    host_scores: Array  # [B] float32, weighted Python reward functions (0 when none)
    # [B] int32 the policy version (train step) of the weights that sampled each row: the policy lag is
    # the step being updated minus it (rollout.off_policy_steps = k: k once the pipeline is full). None:
    # not stamped (rollouts made outside the trainer), no lag metrics.
    policy_version: Array | None = None
    # [B, Lr] int32 (rollout.partial_rollouts, else None): the policy version of the weights that chose
    # each token (-1 off the mask): a row's tokens may come from several; the policy lag is per token.
    token_policy_version: Array | None = None
    # [B, Lq + Lr, Lm, k] int8/int16 (moe.router_replay, else None): the experts the sampler routed each
    # prompt and response token to in each MoE layer, -1 where nothing was recorded (rl/router_replay.py).
    routed_experts: Array | None = None
    # roles.scoring="sampler" (else None: the experience step computes them).
    frozen_outputs: FrozenOutputs | None = None
    turns: EpisodeTurns | None = None  # multi-turn episodes (else None)

    @property
    def action_mask(self) -> Array | None:
        """[B, Lr] the policy's tokens of multi-turn rows (None: every response token is one)."""
        return None if self.turns is None else self.turns.action_mask


@flax.struct.dataclass
class Experience:
    """What the update trains on; every [B, Lr] array is 0 on masked positions."""

    prompt_tokens: Array  # [B, Lq]
    prompt_mask: Array  # [B, Lq]
    tokens: Array  # [B, Lr]
    mask: Array  # [B, Lr]
    old_logprobs: Array  # [B, Lr]
    ref_logprobs: Array  # [B, Lr]
    values: Array  # [B, Lr] (zeros for critic-free estimators)
    advantages: Array  # [B, Lr]
    returns: Array  # [B, Lr]
    scores: Array  # [B]
    # [B] each response's summed KL estimate of the policy about to be updated against the reference
    # (not of a stale sampler's: off-policy, old_logprobs may be the sampler's): what the adaptive KL
    # controller steps on.
    sequence_kl: Array
    routed_experts: Array | None = None  # [B, Lq + Lr, Lm, k]: the rollout's, the update replays it (moe.router_replay)
    action_mask: Array | None = None  # [B, Lr] multi-turn rows: the policy's tokens (None: every response token)
    # [B] each response's summed token entropy over `loss_mask` under the policy about to be updated:
    # what the adaptive entropy coefficient steps on (None: not computed, e.g. a hand-made batch).
    sequence_entropy: Array | None = None
    # [B, Lr, V] the reference's log-probs over the vocabulary at each response position, temperature
    # applied: the dense KL's reference when the experience step keeps it (PPOHyper.dense_kl_stored);
    # None: the update recomputes it.
    ref_vocab_logprobs: Array | None = None

    @property
    def loss_mask(self) -> Array:
        """[B, Lr] the tokens trained on (log-probs, KL, advantages, losses): the actions of
        multi-turn rows, else every response token. `mask` stays the forwards' context."""
        return self.mask if self.action_mask is None else self.action_mask

    @property
    def segment_ids(self) -> None:
        """Each row is one sequence (`ppo/sequences.py`)."""
        return None



@flax.struct.dataclass
class PackedExperience:
    """A minibatch of `Experience` on packed rows (`models/packing.py`): [..., M, T] arrays whose
    per-token fields sit at the slot that predicts the token (0 elsewhere, mask 0 there)."""

    rows: PackedRows  # the model inputs: tokens, positions, segment ids
    mask: Array  # 1 at the prediction slot of each response token trained on (`Experience.loss_mask`)
    old_logprobs: Array
    ref_logprobs: Array
    values: Array
    advantages: Array
    returns: Array
    ref_vocab_logprobs: Array | None = None  # [..., M, T, V] (Experience.ref_vocab_logprobs at the slots)

    @property
    def loss_mask(self) -> Array:
        return self.mask  # packed from `Experience.loss_mask`: the rows' context is in `rows`

    @property
    def segment_ids(self) -> Array:
        """[..., M, T] the sequence of each slot (`ppo/sequences.py`): runs of one id."""
        return self.rows.segment_ids
