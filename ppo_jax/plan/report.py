"""The memory planner's report: a plan (`ppo_jax.plan.memory.MemoryPlan`) as the table `ppo-jax-plan` prints
(GiB = 2^30 bytes per device)."""

from __future__ import annotations

from ppo_jax import sharding
from ppo_jax.plan.memory import GB, GIB, MemoryPlan, ModelSummary
from ppo_jax.plan.role_memory import RoleMemory, RolesPlan


def _gib(n: float) -> str:
    return f"{n / GIB:10.3f}"


def _model_line(label: str, m: ModelSummary) -> str:
    return (f"{label:<8}{m.arch} {m.num_params / 1e9:.2f}B params, {m.param_dtype} params, "
            f"{m.dtype} compute{', remat' if m.remat else ''}")


def _reference_note(reference: str) -> str:
    return {"copy": "  (reference: same)",
            "lora base": "  (LoRA: adapters on a frozen base; the base is the reference)",
            "lora base + imported": "  (LoRA: adapters on a frozen base; the base is the reference, with a frozen "
                                    "copy of the imported adapters)",
            }.get(reference, f"  (reference: a {reference})")


def _role_line(r: RoleMemory) -> str:
    def cell(n: int) -> str:
        return _gib(n) if n else f"{'-':>10}"

    return (f"  {r.role:<9}{str(r.mesh_shape):>14}{r.num_devices:>5} {cell(r.train_state_bytes)} "
            f"{cell(r.frozen_bytes)} {cell(r.policy_copy_bytes)} {cell(r.kv_cache_bytes)} {_gib(r.temp_bytes)} "
            f"{_gib(r.peak_bytes)}   "
            + (r.peak_phase or "(no phase compiled)"))


def _layout_note(roles: RolesPlan) -> str:
    scoring = roles.scoring == "sampler"
    if roles.layout != "disaggregated":
        return ("  Colocated: the same devices hold the trainer's trees and the sampler's copy"
                + (" and frozen trees" if scoring else "") + ", so both roles' peak is the devices' one peak.")
    return ("  Disaggregated: each role's peak is over its own devices' phases (sampler: the sampler"
            + (" and scoring phases" if scoring else " phase") + "; trainer: experience, update).")


def _scoring_note(roles: RolesPlan) -> list[str]:
    if roles.scoring != "sampler":
        return []
    kept = (f"keeps {roles.trainer.frozen_bytes / GIB:.3f} GiB of frozen trees (the LoRA base)"
            if roles.trainer.frozen_bytes else "keeps no frozen tree")
    where = "on the sampler's devices" if roles.layout == "disaggregated" else "in the sampler's layout"
    return [f"  Scoring (roles.scoring=sampler): the reference and reward model "
            f"({roles.sampler.frozen_bytes / GIB:.3f} GiB) score each sample {where} (the scoring phase); "
            f"the trainer {kept}."]


def format_roles(roles: RolesPlan) -> list[str]:
    """The per-role table of a plan whose sampler has its own mesh."""
    lines = [
        "",
        f"Roles ({roles.layout}): {roles.description}",
        "Per device of each role (GiB)          trees: shape arithmetic; temps: the role's own programs' largest",
        f"  {'role':<9}{'mesh':>14}{'devs':>5} {'train state':>10} {'frozen':>10} {'policy cp.':>10} "
        f"{'KV cache':>10} {'temps':>10} {'peak':>10}   (phase)",
        _role_line(roles.trainer),
        _role_line(roles.sampler),
        _layout_note(roles),
        *_scoring_note(roles),
        f"  Weight sync: {roles.sync_bytes / GIB:.3f} GiB per train step (all devices: the trainable policy"
        + (f"; the LoRA base, {roles.base_sync_bytes / GIB:.3f} GiB, once)" if roles.base_sync_bytes else ")"),
    ]
    return lines


def format_plan(plan: MemoryPlan, device_memory_bytes: float | None = None) -> str:
    """A human-readable table (GiB = 2^30 bytes per device)."""
    b = plan.batch
    axes = ", ".join(f"{name}={n}" for name, n in zip(sharding.MESH_AXES, plan.mesh_shape))
    lines = [
        f"Memory plan: mesh ({axes}) = {plan.num_devices} devices; "
        f"compiled by XLA:{plan.platform.upper()} for {plan.device_kind}"
        + (" (the trainer's; the sampler's: see Roles)" if plan.roles is not None else ""),
        _model_line("policy", plan.policy_model) + _reference_note(plan.reference),
        _model_line("reward", plan.reward_model) + f"  ({plan.reward_source})",
        (_model_line("value", plan.value_model) + f"  (from the {plan.value_init}"
         + ("; LoRA: adapters + head on its frozen base, shared, not counted again)" if plan.value_lora else ")"))
        if plan.value_model
        else "value   none (critic-free estimator)",
        f"batch   {b['prompts']} prompts x {b['samples_per_prompt']} samples = {b['rows']} rows, prompt "
        f"{b['prompt_length']} + response {b['response_length']} tokens; {b['epochs']} epochs of minibatches "
        f"of {b['minibatch_rows']} rows, " + (
            f"packed: microbatches and forward chunks of {b['packed_rows']} packed rows (only those holding "
            "tokens computed; memory is planned for the worst case)" if b.get("packed_rows") else
            f"microbatches of {b['microbatch_rows']}, forward chunks of {b['forward_rows']}"),
        "",
        "Per device (GiB)                       bytes are exact shape arithmetic on the shardings",
    ]
    for name in ("policy", "reference", "reward", "value") + (("teacher",) if plan.params.get("teacher") else ()):
        elsewhere = plan.scored_by_sampler and name in ("reference", "reward")
        lines.append(f"  params     {name:<12}{_gib(plan.params[name])}"
                     + ("   on the sampler's devices (roles.scoring=sampler): see Roles" if elsewhere else ""))
    for name in ("policy", "value"):
        lines.append(f"  optimizer  {name:<12}{_gib(plan.optimizer[name])}")
    lines += [
        f"  total      params+opt  {_gib(plan.resident_bytes)}",
        f"  KV cache   (sampler)   {_gib(plan.kv_cache_bytes)}   part of the sampler's temps; "
        + (f"continuous engine: {b['decode_slots']} decode slots" if b.get("decode_slots")
           else f"static engine: all {b['rows']} rows"),
        f"  batch      rollout     {_gib(plan.batch_arrays['rollout'])}",
        f"  batch      experience  {_gib(plan.batch_arrays['experience'])}",
        "",
        "Phases (GiB per device)                live: shape arithmetic; the rest: compiled.memory_analysis()",
        f"  {'phase':<11}{'live':>10} {'outputs':>10} {'aliased':>10} {'temps':>10} {'peak':>10}   "
        f"{'(arguments':>10}  compile s)",
    ]
    for p in plan.phases:
        lines.append(f"  {p.name:<11}{_gib(p.live_bytes)} {_gib(p.output_bytes)} {_gib(p.alias_bytes)} "
                     f"{_gib(p.temp_bytes)} {_gib(p.peak_bytes)}   {_gib(p.argument_bytes)} {p.compile_seconds:9.1f}")
    if plan.roles is not None:
        lines += format_roles(plan.roles)
    lines += ["", "Programs (optimised HLO)   fused attention calls  transposes    copies  while loops"]
    for p in plan.phases:
        st = p.structure
        lines.append(f"  {p.name:<11}{st.fused_attention_calls:>28} {st.transposes:>11} {st.copies:>9} {st.while_loops:>12}")
    peak = plan.peak_phase
    lines.append("")
    if len(plan.phases) < len(plan.run_phases):
        lines.append(f"Only {', '.join(p.name for p in plan.phases)} compiled (--phases): the peak is over those.")
    summary = (f"Peak {plan.peak_bytes / GIB:.3f} GiB ({plan.peak_bytes / GB:.2f} GB) per device, "
               f"in the {peak.name} phase")
    if device_memory_bytes is None:
        lines.append(summary + "; pass --device_memory_gb or --device_memory_gib for a verdict.")
    else:
        verdict = "FITS" if plan.fits(device_memory_bytes) else "DOES NOT FIT"
        spare = device_memory_bytes - plan.peak_bytes
        lines.append(f"{summary}; device memory {device_memory_bytes / GIB:.3f} GiB "
                     f"({device_memory_bytes / GB:.2f} GB): {verdict} "
                     f"({'spare' if spare >= 0 else 'short by'} {abs(spare) / GIB:.3f} GiB)")
    if plan.platform == "gpu" and plan.device_kind.startswith("NVIDIA"):
        lines.append("Temps are XLA:GPU's own buffer assignment: what a GPU run of these programs allocates (compiled "
                     "without a GPU, GEMM tiles are untuned: speed is not planned).")
    if plan.platform == "cpu":
        lines.append("Temps are XLA:CPU's estimate of an accelerator's (see ppo_jax/rl/plan.py); parameter, optimizer, "
                     "KV-cache and batch bytes are exact.")
    return "\n".join(lines)
