"""The accelerator programs, compiled for GPUs and TPUs this machine does not have (ppo_jax.accelerators).

What XLA:GPU compiles for an H100 is what an H100 runs: its kernels, loops, copies and buffer
assignment. So these tests check, on a CPU-only machine, what only a real accelerator would otherwise
show: the experience and update programs call cuDNN flash attention, the per-layer loop stacks no
layers, the update's temps hold no second copy of the train state, and the same programs compile
for TPU slices. Every figure is the compiler's own (`memory_analysis()`, the optimised HLO).

They need the CUDA plugin and libtpu, which the `test` extra installs (Linux); each skips, saying
so, where its plugin is absent.
"""

import math
import re

import jax
import pytest

from ppo_jax import accelerators, sharding
from ppo_jax.accelerators.hlo import ProgramStructure, result_shapes
from ppo_jax.accelerators.hlo_module import Module
from ppo_jax.accelerators.profile import profile_program
from ppo_jax.plan import profiles as profiles_lib
from ppo_jax.plan.memory import planned_settings
from ppo_jax.config import ConfigError, model_config_dict
from ppo_jax import plan as plan_lib
from ppo_jax.plan import format_plan
from ppo_jax.rl.settings import ppo_config

needs_cuda = pytest.mark.skipif(not accelerators.cuda_plugin_installed(),
                                reason="the CUDA plugin is not installed (pip install -e '.[cuda12]')")
needs_libtpu = pytest.mark.skipif(not accelerators.libtpu_installed(),
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")

LAYERS = 3  # no other dimension of the model or batch is 3: a leading [3, ...] axis is a layer stack
HIDDEN, MLP = 128, 384


def tiny_config(**compute):
    """A bf16 Llama-shaped PPO run whose trainable state outweighs its activations (few, short rows),
    so a second copy of the state in the update's temps cannot hide among them."""
    config = ppo_config()
    config.mesh.shape = (1, 1, 1)
    config.policy.model = model_config_dict(
        arch="llama", vocab_size=512, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4, num_kv_heads=2,
        intermediate_size=MLP, max_position_embeddings=64, tie_word_embeddings=False,
        param_dtype="bfloat16", dtype="bfloat16")
    config.reward.functions = "toy_target_count"
    config.data.prompt_length = 16
    config.rollout.batch_size = 4
    config.rollout.response_length = 16
    config.ppo.epochs = 1
    config.ppo.num_minibatches = 1
    for field, value in compute.items():
        setattr(config.compute, field, value)
    return config


def compile_plan(config, devices, phases=("experience", "update")):
    """(plan, {phase: optimised HLO text}) of `config` on `devices`. At the default matmul precision,
    as a run has it: the suite's "highest" (conftest) would ask Mosaic for fp32 dots on the bf16
    operands of the TPU's splash kernel, which it refuses."""
    texts = {}
    mesh = sharding.make_mesh(tuple(config.mesh.shape), devices)
    with jax.default_matmul_precision("default"):
        plan = plan_lib.plan_memory(config, mesh, phases, inspect=lambda name, c: texts.update({name: c.as_text()}))
    return plan, texts


def trainable_bytes(plan):
    """Per-device bytes of the donated train state: policy and value params + their optimizer states."""
    return plan.params["policy"] + plan.params["value"] + sum(plan.optimizer.values())


def layer_stacks(text):
    """Array results in `text` with a leading layer axis ([LAYERS, ...], rank >= 2), by shape."""
    return {shape: n for shape, n in result_shapes(text).items() if len(shape[1]) >= 2 and shape[1][0] == LAYERS}


def collective_shapes(text, op):
    """Array dims in the results of `op` ("all-gather", "reduce-scatter"; XLA:GPU's async -start form
    too, whose result holds the operands and the results)."""
    lines = [line for line in text.splitlines() if f" {op}(" in line or f" {op}-start(" in line]
    return {tuple(int(d) for d in dims.split(",") if d)
            for line in lines for dims in re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", line.split(f" {op}")[0])}


@pytest.fixture(scope="module")
def h100():
    return accelerators.gpu_devices("h100", 1)


@pytest.fixture(scope="module")
def gpu_auto(h100):
    """The programs `auto` builds for a GPU: per-layer loop, cuDNN attention, padded rows."""
    return compile_plan(tiny_config(), h100)


@pytest.fixture(scope="module")
def gpu_packed_update(h100):
    """The update with ppo.packing=on: its microbatches run in a while loop that carries a gradient
    accumulator, the program where a second copy of the train state once hid (a lax.cond per
    microbatch)."""
    config = tiny_config()
    config.ppo.packing = "on"
    return compile_plan(config, h100, phases=("update",))


@needs_cuda
def test_gpu_targets_are_the_vendors_devices(h100):
    assert h100[0].platform == "gpu" and h100[0].device_kind == "NVIDIA H100 80GB HBM3"
    assert accelerators.gpu_devices("a100", 2)[1].device_kind == "NVIDIA A100-SXM4-80GB"
    # The cuDNN version XLA is told is the installed wheel's: it decides which fused kernels exist.
    assert "dnn_version_info { major: 9" in accelerators.gpu_target_config("h200")
    with pytest.raises(ConfigError, match="h100, h200, a100"):
        accelerators.gpu_target_config("v100")


@needs_cuda
def test_gpu_auto_resolves_for_the_planned_platform_not_the_host(gpu_auto):
    plan, _ = gpu_auto
    assert plan.platform == "gpu" and plan.device_kind.startswith("NVIDIA H100")
    assert plan.batch["packed_rows"] == 0  # packing "auto" pads on a GPU (measured faster on an H200)
    # The planner's report names the device and reads the compiled programs.
    report = format_plan(plan, 80e9)
    assert "XLA:GPU for NVIDIA H100" in report and "fused attention calls" in report


@needs_cuda
def test_gpu_experience_and_update_call_cudnn_flash_attention(gpu_auto):
    plan, texts = gpu_auto
    for phase in plan.phases:
        # Experience: policy, reference, value and reward forwards, one call per layer each; the update
        # adds the backward kernels.
        assert phase.structure.fused_attention_calls >= 4 * LAYERS, phase
        assert "__cudnn$fmha" in texts[phase.name]
        # Right-aligned rows with their lengths (padding-causal flash attention): no [B, 1, T, T] bias
        # built from a mask, nor its gradient computed in the backward.
        targets = set(re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', texts[phase.name]))
        assert not [target for target in targets if "Bias" in target], targets


@needs_cuda
def test_gpu_decode_tests_for_stopped_rows_once_per_eight_steps(h100):
    """XLA:GPU waits on the host for a loop condition that reads device data: the decode loop's
    "every row stopped" test. The sampler decodes 8 steps per test (rollout.steps_per_sync = auto on a
    GPU) in an inner loop whose trip count XLA proves, so 15 decode steps cost 2 round trips, not 15."""
    config = tiny_config()
    response = config.rollout.response_length
    _, texts = compile_plan(config, h100, phases=("sampler",))
    groups = math.ceil((response - 1) / 8)  # the first token comes from the prefill
    sampler = profile_program("sampler", texts["sampler"], unknown_trip_count=groups)
    decode = sampler.outer_unknown_loop()
    (steps,) = [loop for loop in sampler.loops if loop.parent == decode.name]
    assert steps.known and steps.trip_count == 8
    assert sampler.host_syncs == groups == 2
    assert [loop for loop in sampler.loops if not loop.known] == [decode]


def gemm_kernels(text):
    """(Triton GEMM fusions, cuBLAS / cuBLASLt calls) in an optimised XLA:GPU program."""
    triton = len(re.findall(r'"kind":"__triton(?:_nested)?_gemm(?:_fusion)?"', text))
    cublas = len(re.findall(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)"', text))
    return triton, cublas


@needs_cuda
def test_gpu_gemm_choice_is_the_samplers_alone(h100):
    """rollout.gemm=cublas compiles the sampler's dots as cuBLAS calls (XLA's default there: Triton
    GEMM fusions) and leaves the update's GEMMs to XLA's default: a compiler option of one program."""
    config = tiny_config()
    _, auto = compile_plan(config, h100, phases=("sampler",))
    config.rollout.gemm = "cublas"
    _, cublas = compile_plan(config, h100, phases=("sampler", "update"))
    assert gemm_kernels(auto["sampler"])[0] > 0
    triton, calls = gemm_kernels(cublas["sampler"])
    assert triton == 0 and calls >= 3 * LAYERS  # q/k/v (merged or not), o, MLP, per layer, and the head
    assert gemm_kernels(cublas["update"])[0] > 0


@needs_cuda
def test_gpu_trainer_gemm_choice_is_the_experience_and_updates_alone(h100, gpu_auto):
    """ppo.gemm=cublas compiles the experience's and the update's dots as cuBLAS calls (no Triton GEMM
    fusion left to autotune) and leaves the sampler's to rollout.gemm (here XLA's default, Triton)."""
    _, auto = gpu_auto
    config = tiny_config()
    config.ppo.gemm = "cublas"
    _, cublas = compile_plan(config, h100, phases=("sampler", "experience", "update"))
    for phase in ("experience", "update"):
        assert gemm_kernels(auto[phase])[0] > 0, phase
        triton, calls = gemm_kernels(cublas[phase])
        assert triton == 0 and calls >= 3 * LAYERS, phase  # per layer at least q/k/v, o and the MLP's
    assert gemm_kernels(cublas["sampler"])[0] > 0
    config.ppo.gemm = "triton"
    with pytest.raises(ConfigError, match="ppo.gemm='triton': use one of auto, cublas, triton_exhaustive"):
        planned_settings(config)


def concatenation_homes(text, result_type):
    """Names of the computations of an optimised HLO text holding a concatenate whose result is `result_type`."""
    module = Module.from_text(text)
    return [c.name for c in module.computations.values()
            for i in c.instructions if i.opcode == "concatenate" and i.type.startswith(result_type)]


@needs_cuda
def test_gpu_decode_reads_gate_and_up_past_the_dot_mergers_limit_in_one_gemm(h100):
    """Llama-3-8B's gate and up kernels (117 MB each) are past XLA's 32 MiB dot-merger limit, so alone
    XLA:GPU would stream them in two GEMMs a decode step. compute.decode_projections=auto joins them:
    their concatenation lives only inside Triton GEMM fusions, which read both kernels where they lie,
    so no merged copy of the weights is made in the decode loop. q/k/v (q at exactly 32 MiB) is left
    to XLA, and "apart" builds no such concatenation at all."""
    config = tiny_config()
    config.policy.model = model_config_dict(
        arch="llama", vocab_size=512, hidden_size=4096, num_layers=1, num_heads=32, num_kv_heads=8,
        intermediate_size=14336, max_position_embeddings=64, tie_word_embeddings=False,
        param_dtype="bfloat16", dtype="bfloat16")
    gate_up = "bf16[4096,28672]"
    _, auto = compile_plan(config, h100, phases=("sampler",))
    homes = concatenation_homes(auto["sampler"], gate_up)
    assert homes and all(name.startswith("gemm_fusion") for name in homes), homes
    config.compute.decode_projections = "apart"
    _, apart = compile_plan(config, h100, phases=("sampler",))
    assert concatenation_homes(apart["sampler"], gate_up) == []
    assert gemm_kernels(auto["sampler"])[0] < gemm_kernels(apart["sampler"])[0]


@needs_cuda
def test_gpu_static_profile_counts_the_matmuls_of_the_four_forwards(gpu_auto):
    """The static profile's GEMM FLOPs are the models' matmuls (counted from the shapes here): the
    experience runs policy, reference, value and reward transformers over every token, the LM head
    over the response positions only, scalar heads over every token; the update at least forward
    plus the backward's two matmuls per forward matmul for policy and value."""
    _, texts = gpu_auto
    config = tiny_config()
    profiles = profiles_lib.static_profiles(texts, planned_settings(config))
    rows, tokens = config.rollout.batch_size, config.data.prompt_length + config.rollout.response_length
    model = config.policy.model
    kv = model.num_kv_heads * HIDDEN // model.num_heads
    per_layer = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv + 3 * HIDDEN * MLP  # q, o; k, v; gate, up, down
    transformer = 2 * rows * tokens * LAYERS * per_layer  # one forward's matmul FLOPs
    lm_head = 2 * rows * config.rollout.response_length * HIDDEN * model.vocab_size
    scalar_head = 2 * rows * tokens * HIDDEN

    def gemm_flops(profile):
        return sum(k.flops * k.executions for k in profile.kernels if k.category == "gemm")

    experience = 4 * transformer + 2 * lm_head + 2 * scalar_head
    assert gemm_flops(profiles["experience"]) == pytest.approx(experience, rel=2e-3)
    assert gemm_flops(profiles["update"]) >= 3 * (2 * transformer + lm_head + scalar_head)
    assert profiles["experience"].host_syncs == profiles["update"].host_syncs == 0
    with pytest.raises(ConfigError, match="--profile needs --platform=gpu"):
        profiles_lib.device_model("")


@needs_cuda
def test_gpu_per_layer_loop_stacks_no_layers(gpu_auto):
    _, texts = gpu_auto
    for name, text in texts.items():
        assert layer_stacks(text) == {}, name


@needs_cuda
@pytest.mark.parametrize("program", ["gpu_auto", "gpu_packed_update"])
def test_gpu_update_temps_hold_no_second_copy_of_the_train_state(program, request):
    plan, texts = request.getfixturevalue(program)
    update = next(p for p in plan.phases if p.name == "update")
    state = trainable_bytes(plan)
    # Gradients (one params-sized buffer) and activations live in the temps; a copy of params + Adam
    # moments would not fit under the state's own size.
    assert update.temp_bytes < state, (update.temp_bytes, state)
    # Nor is any MLP weight or moment copied (a lax.cond over the state copies every leaf). Copies of
    # a broadcast are not: they zero-fill the packed update's gradient accumulator (its while loop
    # carries one buffer per leaf).
    mlp = re.compile(rf"= bf16\[({HIDDEN},{MLP}|{MLP},{HIDDEN})\]\S* copy\(%(?!broadcast)")
    assert not mlp.findall(texts["update"]), result_shapes(texts["update"], "copy")
    assert update.alias_bytes >= state  # and the state itself is updated in place (donated)


@needs_cuda
def test_gpu_expert_parallel_update_never_gathers_the_experts():
    """8 H100s with the experts split over an expert axis: the update's program moves tokens (an
    all-gather of the expert group's activations, a reduce-scatter of the sums), never a layer's
    experts. (With the same 8 GPUs on fsdp alone, XLA all-reduces buffers of all E x D x F expert
    weights, 98304 and 147456 elements: every GPU holds every expert at some point.)"""
    experts, expert_mlp = 8, 96
    config = tiny_config()
    config.mesh.shape = (1, 1, 1, experts)
    config.rollout.batch_size = 8
    config.policy.model.update(arch="qwen3_moe", qk_norm=True, num_experts=experts, experts_per_token=2,
                               moe_intermediate_size=expert_mlp)
    plan, texts = compile_plan(config, accelerators.gpu_devices("h100", experts), phases=("update",))
    moved = {op: collective_shapes(texts["update"], op)
             for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")}
    largest = max(math.prod(dims) for shapes in moved.values() for dims in shapes)
    assert largest < experts * HIDDEN * expert_mlp, moved
    assert (8 * 32, HIDDEN) in moved["all-gather"]  # tokens: the expert group's 8 x 32 rows of [D]
    assert (8 * 32, HIDDEN) in moved["reduce-scatter"]  # the experts' sums back to their tokens
    assert plan.phases[0].alias_bytes >= trainable_bytes(plan)


@needs_libtpu
def test_the_same_programs_compile_for_a_data_parallel_tpu_slice():
    config = tiny_config()
    config.mesh.shape = (4, 1, 1)  # v5e-4: every chip holds the whole train state and one row of the batch
    plan, texts = compile_plan(config, accelerators.tpu_devices("v5e:2x2"))
    assert plan.platform == "tpu" and plan.device_kind.startswith("TPU v5")
    update = next(p for p in plan.phases if p.name == "update")
    assert trainable_bytes(plan) <= update.alias_bytes  # the train state is updated in place
    # ... and no stacked MLP weight or moment ([L, D, F], scanned layers: auto on TPU) is copied.
    copies = result_shapes(texts["update"], "copy")
    assert not [shape for shape in copies if shape[1] in ((LAYERS, HIDDEN, MLP), (LAYERS, MLP, HIDDEN))], copies
    experience = ProgramStructure.from_hlo(texts["experience"])
    assert experience.while_loops >= 1  # scanned layers (auto on TPU)
    assert experience.fused_attention_calls >= 1  # splash (a Pallas custom call; once per scanned body)


@needs_libtpu
def test_the_update_compiles_for_an_fsdp_sharded_tpu_slice():
    config = tiny_config()
    config.mesh.shape = (1, 4, 1)  # v5p-8: 4 chips
    plan, _ = compile_plan(config, accelerators.tpu_devices("v5p:2x2x1"), phases=("update",))
    assert plan.device_kind.startswith("TPU v5") and plan.num_devices == 4
    assert plan.phases[0].alias_bytes >= trainable_bytes(plan)  # each chip's shard updated in place


def test_structure_counts_read_the_hlo():
    text = """
ENTRY %main (p: f32[3,4]) -> f32[4,3] {
  %p = f32[3,4]{1,0} parameter(0)
  %copy.1 = f32[3,4]{1,0} copy(%p)
  %transpose.2 = f32[4,3]{0,1} transpose(%copy.1), dimensions={1,0}
  %cc = (bf16[2,8,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%p), custom_call_target="__cudnn$fmhaSoftmax"
  %w = (s32[], f32[3,4]{1,0}) while(%t), condition=%c, body=%b
  ROOT %r = f32[4,3]{1,0} copy(%transpose.2)
}"""
    assert ProgramStructure.from_hlo(text) == ProgramStructure(fused_attention_calls=1, transposes=1, copies=2,
                                                               while_loops=1)
    assert result_shapes(text, "copy") == {("f32", (3, 4)): 1, ("f32", (4, 3)): 1}
    assert result_shapes(text)["bf16", (2, 8, 4, 16)] == 1
    # A scanned layer loop's stacked weights ([L, D, F]) are what layer_stacks finds.
    stacked = text.replace("%p = f32[3,4]{1,0} parameter(0)", f"%p = bf16[{LAYERS},{HIDDEN},{MLP}]{{2,1,0}} parameter(0)")
    assert layer_stacks(stacked)["bf16", (LAYERS, HIDDEN, MLP)] == 1
    assert ("bf16", (LAYERS, HIDDEN, MLP)) not in layer_stacks(text)


def test_planning_devices_refuse_mismatched_flags():
    with pytest.raises(ConfigError, match="--gpu needs --platform=gpu"):
        accelerators.planning_devices("cpu", 1, gpu="h100")
    with pytest.raises(ConfigError, match="--tpu_topology needs --platform=tpu"):
        accelerators.planning_devices("gpu", 1, tpu_topology="v5e:1x1")
