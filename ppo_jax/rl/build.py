"""Everything a PPO run is built from, as small functions of its settings: the model configs, the Flax
modules of the four trees, the optimizers, the abstract train state and its shardings, and the three
compiled phases (a fresh run's weights are `rl/initial_weights.py`'s). The trainer, the memory planner and the exporter build with these, so
they all see the same programs and the same state layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from ppo_jax import ppo, sampling, sharding
from ppo_jax.config import ComputeSettings, ConfigError, override_dtypes, with_lora
from ppo_jax.models import lora as lora_lib
from ppo_jax.models import rope
from ppo_jax.models import CausalLM, LoraConfig, ModelConfig, ScalarModel, boxed_params, hf
from ppo_jax.models.transformer import check_context_rows
from ppo_jax.optim import make_optimizer
from ppo_jax.rl import remat_choice, roles
from ppo_jax.rl.experience import make_experience_fn, make_scoring_fn
from ppo_jax.rl.hyper import DerivedSizes, PPOHyper
from ppo_jax.rl.sampler_settings import sampling_config
from ppo_jax.rl.distill_settings import DistillSettings
from ppo_jax.rl.settings import (DECODE_LOOPS, PolicyLoraSettings, PolicySettings, PPOLossSettings, RewardSettings,
                                 RolloutSettings, Settings, ValueSettings)
from ppo_jax.rl.state import EpisodeTurns, Experience, FrozenOutputs, FrozenParams, Modules, Rollout, PPOState
from ppo_jax.rl.update import make_update_fn
from ppo_jax.sampling.config import gemm_compiler_options


@dataclasses.dataclass(frozen=True)
class RunKeys:
    """The keys a run derives from its seed (the exporter re-derives `init` to rebuild a base)."""

    init: jax.Array  # the policy's random init (when no policy.path), then the LoRA adapters'
    sample: jax.Array  # rollout sampling, folded with the iteration
    state: jax.Array  # PPOState.key (minibatch shuffles)


def run_keys(seed: int) -> RunKeys:
    return RunKeys(*jax.random.split(jax.random.key(seed), 3))


def imported_lora_config(settings: PolicyLoraSettings, base: ModelConfig) -> LoraConfig:
    """The LoraConfig of the PEFT adapter directory `policy.lora.init_from` (its adapter_config.json
    only; no tensor is read). rank/alpha/targets come from it; when policy.lora.rank is set too, all
    three must agree with it, else a ConfigError names both values."""
    where = f"policy.lora.init_from={settings.init_from!r}"
    try:
        imported = hf.adapter_lora_config(settings.init_from, base)
    except hf.HFModelError as err:
        raise ConfigError(f"{where}: {err}") from None
    stated = settings.lora_config()
    if stated is not None:
        for field, ours, theirs, json_key in (("rank", stated.rank, imported.rank, "r"),
                                              ("alpha", stated.alpha, imported.alpha, "lora_alpha"),
                                              ("targets", sorted(stated.targets), sorted(imported.targets),
                                               "target_modules")):
            if ours != theirs:
                raise ConfigError(
                    f"policy.lora.{field}={ours} disagrees with the adapter of {where} ({json_key} in its "
                    f"adapter_config.json gives {theirs}); set policy.lora.rank=0 to take the adapter's "
                    "rank, alpha and targets, or state the same ones")
    return imported


def mesh_platform(mesh) -> tuple[str | None, int]:
    """(platform of the mesh's devices, the ways its fsdp, expert and context axes shard the dense
    weights: the `embed` rule); (None, 1) without a mesh: what "auto" execution choices resolve for
    (`ComputeSettings.execution`)."""
    if mesh is None:
        return None, 1
    shards = int(mesh.shape["fsdp"]) * sharding.expert_axis_size(mesh) * sharding.context_axis_size(mesh)
    return mesh.devices.flat[0].platform, shards


def decode_unrolled(rollout: RolloutSettings, mesh) -> bool | None:
    """rollout.decode resolved for `mesh`: "auto" decodes per-layer copies except on a TPU and except
    where FSDP shards a GPU run's (scanned) layers; None leaves it to the sampler (no mesh)."""
    explicit = DECODE_LOOPS[rollout.decode]
    if explicit is not None or mesh is None:
        return explicit
    platform, fsdp = mesh_platform(mesh)
    return platform != "tpu" and not (platform == "gpu" and fsdp > 1)


def policy_model_config(s: Settings, mesh=None) -> ModelConfig:
    """The policy architecture, read without loading weights (config.json or policy.model), with
    policy.lora's adapters (ModelConfig.lora; None when off, whatever the model config said; those of
    the adapter directory policy.lora.init_from when set), executed as on `mesh` (its platform and
    fsdp size; None: this process's backend, no fsdp; the planner's mesh may be compile-only GPUs)."""
    cfg = hf.load_config(s.policy.path)[0] if s.policy.path else s.policy.model
    lora = imported_lora_config(s.policy.lora, cfg) if s.policy.lora.init_from else s.policy.lora.lora_config()
    cfg = with_lora(cfg, lora, "policy")
    _check_cached_rope(cfg, s.data.prompt_length + s.rollout.response_length)
    sharding.check_experts_split(cfg.num_experts, mesh, "policy", ConfigError)
    check_context_rows(cfg, s.data.prompt_length + s.rollout.response_length, mesh, ConfigError,
                       "data.prompt_length + rollout.response_length", s.compute.attention)
    s.moe.check_model(cfg)
    if not cfg.num_experts and (s.ppo.router_aux_coef or s.ppo.router_z_coef):
        raise ConfigError(f"ppo.router_aux_coef={s.ppo.router_aux_coef}, ppo.router_z_coef={s.ppo.router_z_coef}: "
                          f"router losses need a mixture-of-experts policy, and this {cfg.arch} policy has no experts")
    return s.compute.apply(override_dtypes(cfg, s.policy.param_dtype, s.policy.dtype), *mesh_platform(mesh))


def fp32_compute_warning(cfg: ModelConfig, platform: str) -> str | None:
    """A line for a run whose policy computes in fp32 on a GPU or TPU (a Hugging Face checkpoint loads
    in fp32 unless policy.dtype says otherwise), None elsewhere."""
    if platform not in ("gpu", "tpu") or cfg.dtype != "float32":
        return None
    return (f"the policy computes in float32 on a {platform}: every matmul runs in fp32 (TF32 on a GPU, half "
            "the bf16 rate) and fused attention is off; policy.dtype=bfloat16 computes in bf16 and keeps the "
            f"{cfg.param_dtype} weights (docs/benchmarks.md, the H200 runs)")


def _check_cached_rope(cfg: ModelConfig, length: int) -> None:
    """The sampler decodes through a KV cache and the update reads one forward: their log-probs must
    be the same numbers, which a rope scaling that switches with the length breaks past its limit."""
    limit = rope.cached_decode_limit(cfg)
    if limit is not None and length > limit:
        kind = cfg.rope_scaling_dict["rope_type"]
        raise ConfigError(
            f"data.prompt_length + rollout.response_length = {length} passes {limit}, where the policy's "
            f"{kind} rope scaling switches its frequencies: the sampler's cached keys would keep the "
            f"frequencies they were written with while the training forward rotates every position with "
            f"the new ones, so rollout log-probs would not be training log-probs. Keep the sum <= {limit}")


def reward_model_config(reward: RewardSettings, compute: ComputeSettings, policy_cfg: ModelConfig,
                        mesh=None) -> ModelConfig | None:
    """The frozen reward model's architecture (its config.json, no weights read), held and run in
    reward.param_dtype / reward.dtype, each "" meaning the policy's (`policy_cfg`): a bf16 policy
    scores with a bf16 reward model rather than an fp32 one at half the GPU's matmul rate."""
    if not reward.path:
        return None
    cfg, kind = hf.load_config(reward.path)
    if kind != "reward":
        raise ConfigError(
            f"reward.path={reward.path!r} holds a {kind} checkpoint; the reward model must be a "
            "sequence classifier with one label (ForSequenceClassification, num_labels=1)")
    sharding.check_experts_split(cfg.num_experts, mesh, "reward", ConfigError)
    return compute.apply(in_reward_dtypes(reward, cfg, policy_cfg), *mesh_platform(mesh))


def in_reward_dtypes(reward: RewardSettings, cfg: ModelConfig, policy_cfg: ModelConfig) -> ModelConfig:
    """`cfg` held in reward.param_dtype and run in reward.dtype, each "" meaning the policy's."""
    return cfg.replace(param_dtype=reward.param_dtype or policy_cfg.param_dtype,
                       dtype=reward.dtype or policy_cfg.dtype)


def load_reward_params(reward: RewardSettings, cfg: ModelConfig, mesh):
    """The frozen reward model's weights from reward.path, in the dtypes of `cfg` (reward_model_config)."""
    return hf.load_model(reward.path, mesh, kind="reward", param_dtype=cfg.param_dtype, dtype=cfg.dtype,
                         execution=cfg.execution()).params


def value_model_config(value: ValueSettings, policy_cfg: ModelConfig, reward_cfg: ModelConfig | None) -> ModelConfig:
    """The value model: the reward model's architecture or the policy's (value.init), trained like the
    policy, in its parameter and compute dtypes. A LoRA value model keeps its frozen base's parameter
    dtype (the base is that tree's arrays, not a copy)."""
    cfg = reward_cfg if value.init == "reward" else policy_cfg
    cfg = value.lora.apply(cfg, "value")
    if cfg.lora is None:
        cfg = cfg.replace(param_dtype=policy_cfg.param_dtype)
    return cfg.replace(dtype=policy_cfg.dtype)


def teacher_model_config(distill: DistillSettings, compute: ComputeSettings, policy_cfg: ModelConfig,
                         mesh=None) -> ModelConfig | None:
    """On-policy distillation's teacher architecture (its config.json, no weights read), held and run in
    distill.param_dtype / distill.dtype, each "" meaning the policy's; None without a teacher."""
    if not distill.enabled:
        return None
    cfg, kind = hf.load_config(distill.teacher_path)
    if kind != "causal_lm":
        raise ConfigError(f"distill.teacher_path={distill.teacher_path!r} holds a {kind} checkpoint; the teacher "
                          "must be a causal language model (ForCausalLM)")
    sharding.check_experts_split(cfg.num_experts, mesh, "teacher", ConfigError)
    cfg = cfg.replace(lora=None, param_dtype=distill.param_dtype or policy_cfg.param_dtype,
                      dtype=distill.dtype or policy_cfg.dtype)
    return compute.apply(cfg, *mesh_platform(mesh))


def load_teacher_params(distill: DistillSettings, cfg: ModelConfig, mesh):
    """The frozen teacher's weights from distill.teacher_path, in the dtypes of `cfg` (teacher_model_config)."""
    return hf.load_model(distill.teacher_path, mesh, kind="causal_lm", param_dtype=cfg.param_dtype, dtype=cfg.dtype,
                         execution=cfg.execution()).params


def make_modules(ppo_settings: PPOLossSettings, value_settings: ValueSettings, policy_cfg: ModelConfig,
                 reward_cfg: ModelConfig | None, teacher_cfg: ModelConfig | None = None) -> Modules:
    value = None
    if ppo_settings.uses_critic:  # value.lora's adapters (a full model when off, whatever the policy is)
        value = ScalarModel(value_model_config(value_settings, policy_cfg, reward_cfg),
                            head_init="reward" if value_settings.init == "reward" else "zero")
    reward = ScalarModel(reward_cfg, head_init="reward") if reward_cfg is not None else None
    return Modules(policy=CausalLM(policy_cfg), value=value, reward=reward,
                   teacher=CausalLM(teacher_cfg) if teacher_cfg is not None else None)


def optimizer_steps(s: Settings) -> int:
    """The run's optimizer steps: what a decaying learning-rate schedule spans."""
    return s.train.iterations * s.ppo.epochs * s.ppo.num_minibatches


def make_optimizers(s: Settings):
    """(policy optimizer, value optimizer or None); schedules span the run's optimizer steps."""
    opt_steps = optimizer_steps(s)
    policy_tx = make_optimizer(s.optim, s.optim.policy_lr, opt_steps)
    value_tx = make_optimizer(s.optim, s.optim.value_lr, opt_steps) if s.uses_critic else None
    return policy_tx, value_tx


def init_kl(p: PPOLossSettings) -> ppo.KLControllerState:
    return ppo.init_kl_controller(p.kl_controller, p.kl_coef, target=p.kl_target, horizon=p.kl_horizon)


def init_entropy(p: PPOLossSettings) -> ppo.EntropyControllerState | None:
    """The adaptive entropy coefficient's starting state (ppo.entropy_target > 0), else None."""
    return ppo.init_entropy_controller(p.ent_coef, p.entropy_target, p.entropy_coef_step) if p.entropy_target else None


def abstract_train_state(p: PPOLossSettings, modules: Modules, policy_tx, value_tx, mesh):
    """(abstract PPOState of ShapeDtypeStructs carrying shardings, PPOState of shardings).

    Built once from `jax.eval_shape` and the logical axis rules: the shardings every step is
    jitted with, and the target a checkpoint restores onto (whatever mesh it was saved on). With LoRA
    the trainable policy is the adapters (the base: `roles.policy_shardings`).
    """
    lora = modules.policy.config.lora is not None
    policy = boxed_params(modules.policy, collection="lora" if lora else "params")
    value = boxed_value(modules)
    boxed = PPOState(
        step=jax.ShapeDtypeStruct((), jnp.int32), policy=policy,
        policy_opt=jax.eval_shape(policy_tx.init, policy),
        value=value, value_opt=jax.eval_shape(value_tx.init, value) if value is not None else None,
        kl=jax.eval_shape(lambda: init_kl(p)), key=jax.eval_shape(lambda: jax.random.key(0)),
        entropy=jax.eval_shape(lambda: init_entropy(p)))
    shardings = sharding.tree_shardings(boxed, mesh)
    abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                            nn.unbox(boxed), shardings)
    return abstract, shardings


def as_reference(policy: PolicySettings, tree):
    """`tree` (the policy's params, as arrays or ShapeDtypeStructs) in the dtype the frozen reference
    is held in (`policy.reference_dtype`; unchanged when ""). Only floating-point leaves change."""
    return cast_floating(tree, policy.reference_dtype) if policy.reference_dtype else tree


def cast_floating(tree, dtype):
    """`tree` (arrays or ShapeDtypeStructs) with its floating-point leaves in `dtype`."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(cast, tree)


def reference_copy(policy_settings: PolicySettings, policy, shardings):
    """The frozen reference: a real copy of the initial policy (not an alias: the policy is donated to
    the update) on `shardings`, in the reference dtype."""
    return jax.jit(lambda t: jax.tree.map(jnp.copy, as_reference(policy_settings, t)),
                   out_shardings=shardings)(policy)


def value_lora(modules: Modules) -> bool:
    """Whether the value model is LoRA (value.lora.rank > 0): adapters + head on a shared frozen base."""
    return modules.value is not None and modules.value.config.lora is not None


def trainable_value(adapters, head):
    """A LoRA value model's trainable tree: its adapters and its scalar head (the "score" params);
    its transformer is frozen and shared (`FrozenParams.value`). See `state.value_variables`."""
    return {lora_lib.COLLECTION: adapters, "score": head}


def boxed_value(modules: Modules):
    """The abstract (boxed) trainable value tree: the whole model, or with value LoRA its adapters +
    head; None for critic-free estimators."""
    if modules.value is None:
        return None
    if not value_lora(modules):
        return boxed_params(modules.value)
    return trainable_value(boxed_params(modules.value, collection="lora"), boxed_params(modules.value)["score"])


def shared_value_base(value: ValueSettings, modules: Modules, frozen: FrozenParams):
    """The frozen transformer a LoRA value model's adapters apply to, as a subtree of a frozen tree
    the run holds anyway (so it is in memory once): the reward model's with value.init="reward", else
    the policy's base (LoRA policy) or the reference (full fine-tuning: the initial policy, never the
    trainable, donated tree). None for a full value model. Works on arrays, shardings or abstract
    trees alike; with value.init="policy" the CausalLM's "transformer" subtree is exactly a
    ScalarModel's (the same Transformer module; the LM head sits outside it)."""
    if not value_lora(modules):
        return None
    if value.init == "reward":
        return frozen.reward["transformer"]
    return (frozen.policy if frozen.policy is not None else frozen.reference)["transformer"]


@dataclasses.dataclass
class Steps:
    """The three compiled phases of a PPO iteration, with their shardings and donation.

    sampler: rollout sampling; experience_jit(state, frozen, rollout) -> (Experience, metrics);
    update_jit(state, frozen, experience) -> (state, metrics), the state donated
    (the frozen LoRA bases, None without LoRA, never). trace_counts counts the traces of the two
    jitted steps (the sampler counts its own).
    """

    sampling_config: sampling.SamplingConfig
    sampler: sampling.Sampler
    experience_jit: Callable
    update_jit: Callable
    trace_counts: dict[str, int]
    sampler_shardings: roles.SamplerShardings
    # roles.scoring="sampler": scoring_jit(scorer_frozen, prompt_tokens, prompt_mask, tokens, mask) ->
    # (reference log-probs [B, Lr], raw model scores [B]) on the sampler's mesh; the scorer's trees'
    # shardings. None when the experience step scores.
    scoring_jit: Callable | None = None
    scorer_shardings: FrozenParams | None = None


def rollout_shardings(batch, *, router_replay: bool, episodes: bool, scored_outside: bool) -> Rollout:
    """The experience step's `Rollout` shardings: every array batch-sharded, each mode's part present
    only when its mode is on (a None part is no input of the program)."""
    every = lambda cls: cls(*([batch] * len(dataclasses.fields(cls))))  # noqa: E731
    return every(Rollout).replace(routed_experts=batch if router_replay else None,
                                  frozen_outputs=every(FrozenOutputs) if scored_outside else None,
                                  turns=every(EpisodeTurns) if episodes else None)


def build_steps(s: Settings, mesh, sizes: DerivedSizes, hp: PPOHyper, modules: Modules, policy_tx, value_tx,
                state_shardings, frozen_shardings, stop_ids: Sequence[int], pad_id: int,
                unroll_layers: bool | None = None, sampler_mesh=None) -> Steps:
    """The sampler and the jitted experience and update steps of a run (also what `ppo_jax.plan`
    lowers and measures, so the planner sees exactly the programs a run compiles). unroll_layers:
    overrides rollout.decode (see `sampler_settings.sampling_config`); sampler_mesh: the sampler's own mesh
    (`rl/roles.py`; None: `mesh`), `sizes.decode_slots` derived for it."""
    batch = sharding.data_sharding(mesh)
    replicated = sharding.replicated(mesh)
    sampler_mesh = mesh if sampler_mesh is None else sampler_mesh
    unroll_layers = decode_unrolled(s.rollout, sampler_mesh) if unroll_layers is None else unroll_layers
    sampler_settings = sampling_config(s, stop_ids, pad_id, unroll_layers, sizes.decode_slots,
                                       platform=mesh_platform(sampler_mesh)[0])
    # LoRA: the rollout decodes the frozen base with the trainable adapters (no merged copy).
    where = roles.sampler_shardings(modules, state_shardings, frozen_shardings, sampler_mesh, sampler_mesh is mesh,
                                    merged=s.roles.lora_sync == "merged")
    sampler = sampling.make_sampler(modules.policy, sampler_settings, sampler_mesh, where.params,
                                    adapter_shardings=where.adapters)
    experience = make_experience_fn(modules, hp, batch)
    update = make_update_fn(modules, policy_tx, value_tx, hp, sizes.rollout_rows, batch)
    rollout_sh = rollout_shardings(batch, router_replay=s.moe.router_replay, episodes=s.environment.enabled,
                                   scored_outside=hp.scored_outside)
    exp_sh = jax.tree.map(lambda _: batch, Experience(*([0] * len(dataclasses.fields(Experience)))))
    if not s.moe.router_replay:  # no routing record travels
        exp_sh = exp_sh.replace(routed_experts=None)
    if not s.environment.enabled:  # one-turn rows: no action mask (the same programs)
        exp_sh = exp_sh.replace(action_mask=None)
    if not hp.dense_kl_stored:  # the update recomputes the dense KL's reference (or has no dense KL)
        exp_sh = exp_sh.replace(ref_vocab_logprobs=None)
    scoring_jit, scorer_sh = None, None
    if hp.scored_outside:  # roles.scoring="sampler": the frozen models score on the sampler's mesh
        scorer_sh = roles.scorer_shardings(modules, frozen_shardings, where, sampler_mesh)
        frozen_shardings = roles.trainer_frozen(frozen_shardings)
        sampler_batch = sharding.data_sharding(sampler_mesh)
        scoring_jit = jax.jit(make_scoring_fn(modules, hp),
                              in_shardings=(scorer_sh,) + (sampler_batch,) * 4, out_shardings=(sampler_batch,) * 2,
                              compiler_options=gemm_compiler_options(s.ppo.gemm, mesh_platform(sampler_mesh)[0]))
    trace_counts = {"experience": 0, "update": 0}
    # ppo.gemm: the GEMM kernels of the trainer's programs on a GPU (the sampler's: rollout.gemm)
    trainer_options = gemm_compiler_options(s.ppo.gemm, mesh_platform(mesh)[0])

    def traced(name, fn):
        @functools.wraps(fn)  # the program keeps the step's name (jit_update, jit_experience) in HLO dumps
        def counted(*args):
            trace_counts[name] += 1  # runs once per trace, never per call
            return fn(*args)
        return counted

    experience_jit = jax.jit(traced("experience", experience),
                             in_shardings=(state_shardings, frozen_shardings, rollout_sh),
                             out_shardings=(exp_sh, replicated), compiler_options=trainer_options)

    def jit_update(fn):
        return jax.jit(traced("update", fn), in_shardings=(state_shardings, frozen_shardings, exp_sh),
                       out_shardings=(state_shardings, replicated), donate_argnums=(0,),
                       compiler_options=trainer_options)

    update_jit = jit_update(update)
    if chooses_remat(s, mesh):
        # compute.remat="auto" on a GPU: the update without remat where it fits (rl/remat_choice.py)
        lean = make_update_fn(remat_choice.without_remat(modules), policy_tx, value_tx, hp, sizes.rollout_rows, batch)
        update_jit = remat_choice.MemoryChosenUpdate(
            (("none", jit_update(lean)), ("full", update_jit)),
            free_bytes=functools.partial(sharding.free_device_bytes, list(mesh.devices.flat)))
    return Steps(sampler_settings, sampler, experience_jit, update_jit, trace_counts, where, scoring_jit, scorer_sh)


def chooses_remat(s: Settings, mesh) -> bool:
    """Whether the update chooses its remat by the memory free at its first call (rl/remat_choice.py)."""
    return remat_choice.applies(s.compute.remat, mesh_platform(mesh)[0],
                                model_sets_remat=bool(not s.policy.path and s.policy.model.remat))


def frozen_params(value: ValueSettings, modules: Modules, reference, reward, base, teacher=None) -> FrozenParams:
    """The frozen trees of a run (arrays, shardings or abstract), the LoRA value base filled in as a
    subtree of the others (`shared_value_base`)."""
    frozen = FrozenParams(reference=reference, reward=reward, policy=base, teacher=teacher)
    return frozen.replace(value=shared_value_base(value, modules, frozen))


def frozen_shardings(policy: PolicySettings, value: ValueSettings, modules: Modules, state_shardings: PPOState,
                     reward_params, lora_base_shardings=None, teacher_params=None) -> FrozenParams:
    """The reference lives on the policy's shardings (with LoRA there is none: the base, on
    `lora_base_shardings`, is the reference; with imported adapters it is their copy, on the
    adapters' shardings); the reward model and the teacher keep their own; a LoRA value base those of
    its tree."""
    imported = bool(policy.lora.init_from)
    own = lambda tree: jax.tree.map(lambda x: x.sharding, tree) if tree is not None else None  # noqa: E731
    return frozen_params(
        value, modules, reference=state_shardings.policy if lora_base_shardings is None or imported else None,
        reward=own(reward_params), base=lora_base_shardings, teacher=own(teacher_params))
