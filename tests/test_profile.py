"""The static profile of a GPU program (ppo_jax.accelerators.profile), on programs small enough to count
by hand: XLA:GPU compiles them for an H100 on this CPU machine, the profile walks the optimised HLO,
and its kernels, FLOPs, bytes, loops and host round trips must be the arithmetic of the program.

Needs the CUDA plugin (the `test` extra on Linux); skips where it is absent.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ppo_jax import accelerators
from ppo_jax.accelerators.hlo_module import Module, parse_instruction
from ppo_jax.accelerators.profile import DEVICE_MODELS, profile_program

pytestmark = pytest.mark.skipif(not accelerators.cuda_plugin_installed(),
                                reason="the CUDA plugin is not installed (pip install -e '.[cuda12]')")


@pytest.fixture(scope="module")
def replicated():
    mesh = Mesh(np.array(accelerators.gpu_devices("h100", 1)), ("x",))
    return NamedSharding(mesh, PartitionSpec())


def gpu_hlo(fn, *shapes, sharding) -> str:
    """The optimised HLO XLA:GPU compiles for `fn` on arrays of `shapes` ((shape, dtype) pairs)."""
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    return jax.jit(fn).lower(*args).compile().as_text()


def test_a_loop_with_a_static_trip_count_runs_its_matmul_that_many_times_without_host_syncs(replicated):
    m, k = 128, 256

    def fn(w, x):
        return jax.lax.fori_loop(0, 5, lambda i, c: jnp.tanh(c @ w), x)

    profile = profile_program("fori", gpu_hlo(fn, ((k, k), jnp.bfloat16), ((m, k), jnp.bfloat16), sharding=replicated))
    (loop,) = profile.loops
    assert loop.known and loop.trip_count == 5 and profile.host_syncs == 0
    gemms = [kernel for kernel in profile.kernels if kernel.category == "gemm"]
    assert [g.executions for g in gemms] == [5]
    assert gemms[0].flops == 2 * m * k * k  # one [m, k] @ [k, k] per iteration
    assert gemms[0].tensor_core
    # Reads at least both bf16 operands, writes at least the product.
    assert gemms[0].bytes >= 2 * (m * k + k * k) + 2 * m * k
    # Every kernel inside the loop runs once per iteration; launches add up.
    inside = [kernel for kernel in profile.kernels if kernel.loop == loop.name]
    assert loop.kernels_per_iteration == len(inside) and all(kernel.executions == 5 for kernel in inside)
    assert profile.launches == 5 * len(inside) + sum(1 for kernel in profile.kernels if not kernel.loop)


def test_a_loop_whose_condition_reads_device_data_costs_a_host_round_trip_per_iteration(replicated):
    def fn(x):
        return jax.lax.while_loop(lambda c: c.sum() < 100.0, lambda c: c * 1.5 + 1.0, x)

    profile = profile_program("while", gpu_hlo(fn, ((64,), jnp.float32), sharding=replicated), unknown_trip_count=7)
    (loop,) = profile.loops
    assert not loop.known and loop.trip_count == 7
    assert profile.host_syncs == 7
    device = DEVICE_MODELS["h100"]
    no_sync = sum(kernel.seconds(device) * kernel.executions for kernel in profile.kernels)
    assert profile.seconds(device) == pytest.approx(no_sync + 7 * device.host_sync_seconds)


def test_an_embedding_lookup_reads_the_rows_it_gathers_not_the_table(replicated):
    vocab, width, tokens = 32000, 512, 64

    def fn(table, ids):
        return table[ids].astype(jnp.float32) * 2.0

    text = gpu_hlo(fn, ((vocab, width), jnp.bfloat16), ((tokens,), jnp.int32), sharding=replicated)
    profile = profile_program("take", text)
    table_bytes = vocab * width * 2
    rows_bytes = tokens * width * 2
    assert profile.bytes < 0.05 * table_bytes
    assert profile.bytes >= rows_bytes + tokens * width * 4  # the rows read, the f32 result written


def test_cudnn_attention_flops_come_from_its_shapes(replicated):
    b, t, h, kv, d = 2, 256, 8, 2, 64

    def fn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    shapes = (((b, t, h, d), jnp.bfloat16), ((b, t, kv, d), jnp.bfloat16), ((b, t, kv, d), jnp.bfloat16))
    profile = profile_program("attention", gpu_hlo(fn, *shapes, sharding=replicated))
    (attention,) = [kernel for kernel in profile.kernels if kernel.category == "attention"]
    assert attention.flops == 4 * b * h * t * t * d
    assert attention.bytes >= 2 * (b * t * h * d * 2 + 2 * b * t * kv * d)  # q, o and k, v in bf16

    grad = jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    backward = profile_program("attention_grad", gpu_hlo(grad, *shapes, sharding=replicated))
    flops = sorted(kernel.flops for kernel in backward.kernels if kernel.category == "attention")
    assert flops == [4 * b * h * t * t * d, 2.5 * 4 * b * h * t * t * d]  # forward (recomputed), backward


def test_instructions_parse_with_tuple_types_comments_and_called_computations():
    line = ('ROOT %while.4 = (s32[], bf16[64,4,255,64]{3,2,1,0}, /*index=2*/f32[8]{0}) while(%tuple.1), '
            'condition=%cond.2, body=%body.3, metadata={op_name="jit(run)/while"}, '
            'backend_config={"known_trip_count":{"n":"12"}}')
    instruction = parse_instruction(line)
    assert instruction.opcode == "while" and instruction.operands == ("tuple.1",)
    assert instruction.called == ("cond.2", "body.3") and instruction.called_as("body") == "body.3"
    assert instruction.known_trip_count == 12 and instruction.op_name == "jit(run)/while"
    assert "metadata" not in instruction.without_metadata()
    text = ("HloModule m\n\n%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n"
            "  %b = f32[] parameter(1)\n  ROOT %s = f32[] add(%a, %b)\n}\n\n"
            "ENTRY %main (p: f32[8]) -> f32[] {\n  %p = f32[8]{0} parameter(0)\n  %c = f32[] constant(0)\n"
            "  ROOT %r = f32[] reduce(%p, %c), dimensions={0}, to_apply=%add\n}\n")
    module = Module.from_text(text)
    assert module.entry == "main" and set(module.computations) == {"add", "main"}
    assert module.reachable(["main"]) == ["add", "main"]
