"""What a PPO run derives from its settings before any weights load or anything compiles, each part
checked: the model configs, the tokenizer, the reward functions, the batch sizes, the stop and
turn-stop tokens (`checked_inputs`). Every refusal is one `ConfigError` line."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ppo_jax import metrics as metrics_lib
from ppo_jax import sharding
from ppo_jax.config import ConfigError
from ppo_jax.data import toy
from ppo_jax.models import ModelConfig, hf
from ppo_jax.reward_functions import parse as parse_reward_functions
from ppo_jax.rl import build, roles
from ppo_jax.rl.hyper import PPOHyper
from ppo_jax.rl.settings import Settings, stop_token_ids
from ppo_jax.rl.hyper import DerivedSizes
from ppo_jax.rl.sizes import derive_sizes


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """A run's inputs as derived and checked (see the module docstring)."""

    policy_config: ModelConfig
    reward_config: ModelConfig | None
    teacher_config: ModelConfig | None  # on-policy distillation's teacher (None: off)
    tokenizer: Any
    reward_functions: list[tuple[Callable, float]]
    sizes: DerivedSizes
    hp: PPOHyper
    stop_ids: list[int]
    turn_stops: tuple[tuple[int, ...], ...]  # multi-turn: the turn-stop markers as ids (() without an environment)


def checked_inputs(s: Settings, meshes: roles.RoleMeshes, tokenizer=None,
                   reward_functions: Sequence[tuple[Callable, float]] | None = None) -> RunInputs:
    """The run's inputs; tokenizer and reward_functions: objects passed in code instead of the paths
    and names the settings give."""
    mesh = meshes.trainer
    platform = build.mesh_platform(mesh)[0]
    policy_config = build.policy_model_config(s, mesh)
    reward_config = build.reward_model_config(s.reward, s.compute, policy_config, mesh)
    teacher_config = build.teacher_model_config(s.distill, s.compute, policy_config, mesh)
    if warning := build.fp32_compute_warning(policy_config, platform):
        metrics_lib.warn(warning)
    if tokenizer is None:
        tokenizer = hf.load_tokenizer(s.policy.path) if s.policy.path else toy.tokenizer(policy_config.vocab_size)
    reward_functions = (list(reward_functions) if reward_functions is not None else
                        parse_reward_functions(s.reward.functions, s.reward.function_weights))
    sizes = derive_sizes(s, batch_divisor=sharding.batch_divisor(mesh),
                         max_positions=policy_config.max_position_embeddings, vocab_size=policy_config.vocab_size,
                         platform=platform, sampler_divisor=sharding.batch_divisor(meshes.sampler))
    check_tokenizers(tokenizer, policy_config.vocab_size, s.reward.path)
    check_teacher(tokenizer, teacher_config, s.distill.teacher_path)
    hp = PPOHyper.from_settings(s, sizes)
    eos = getattr(tokenizer, "eos_token_id", None)
    stop_ids = stop_token_ids(s.rollout, eos if eos is not None else policy_config.eos_token_id)
    if not stop_ids:
        raise ConfigError("rollout.stop_token_ids is empty and the tokenizer has no EOS token; "
                          "set rollout.stop_token_ids")
    # Multi-turn: the turn-stop markers as ids, refused now if the tokenizer cannot encode them.
    turn_stops = s.environment.turn_stops(tokenizer) if s.environment.enabled else ()
    return RunInputs(policy_config, reward_config, teacher_config, tokenizer, reward_functions, sizes, hp, stop_ids, turn_stops)


def check_teacher(tokenizer, teacher_config: ModelConfig | None, teacher_path: str) -> None:
    """The teacher reads the student's token ids: its tokenizer is the policy's, its vocabulary holds them."""
    if teacher_config is None:
        return
    where = f"distill.teacher_path={teacher_path!r}"
    if hf.load_tokenizer(teacher_path).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"{where}: the teacher's tokenizer differs from the policy's; the teacher would read "
                          "different token ids (distill from a teacher with the student's tokenizer)")
    if len(tokenizer) > teacher_config.vocab_size:
        raise ConfigError(f"{where}: the teacher's vocabulary has {teacher_config.vocab_size} tokens, the "
                          f"tokenizer {len(tokenizer)}")


def check_tokenizers(tokenizer, vocab_size: int, reward_path: str) -> None:
    """The policy's tokenizer has a pad token and fits its vocabulary; a reward model's is the same."""
    if tokenizer.pad_token_id is None:
        raise ConfigError("the policy tokenizer has no pad token; set tokenizer.pad_token "
                          "(a token distinct from EOS) before training")
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the policy's vocabulary has {vocab_size}")
    if reward_path and hf.load_tokenizer(reward_path).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            "the policy and reward-model tokenizers differ (reward.path vs policy.path): the reward "
            "model would read different token ids; use a reward model trained with the policy's tokenizer")
