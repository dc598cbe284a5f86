"""Small building blocks with logical axis names: projections, norms and the MLP.

Every parameter carries logical axis names (`nn.with_logical_partitioning`) that `ppo_jax.sharding`
maps onto the mesh. Norm statistics are float32 whatever the compute dtype.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ppo_jax import sharding
from ppo_jax.models import lora as lora_lib
from ppo_jax.models.config import LoraConfig, ModelConfig, to_dtype

Array = jax.Array


def _param(module: nn.Module, name: str, init, shape, axes, dtype):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class DenseGeneral(nn.Module):
    """x[..., *in] @ kernel[*in, *out] (+ bias[*out]) with named axes; computes in `dtype`.

    With `lora` (the model's LoraConfig when this projection is a target) and a "lora" collection
    given to `apply`, adds scale * (x @ A[*in, r]) @ B[r, *out] (models/lora.py); without that
    collection the projection is the base one, bit for bit.
    """

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical names of kernel axes (in + out)
    use_bias: bool
    dtype: Any
    param_dtype: Any
    kernel_init: Any = nn.initializers.normal(0.02)
    lora: LoraConfig | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        kernel = _param(self, "kernel", self.kernel_init, self.in_shape + self.out_shape, self.axes,
                        self.param_dtype)
        n_in = len(self.in_shape)
        y = _contract(x.astype(self.dtype), kernel.astype(self.dtype), n_in)
        if self.lora is not None and (self.is_initializing() or self.has_variable(lora_lib.COLLECTION, "a")):
            y = y + self._low_rank(x, n_in)
        if self.use_bias:
            bias = _param(self, "bias", nn.initializers.zeros, self.out_shape,
                          self.axes[n_in:], self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y

    def _low_rank(self, x: Array, n_in: int) -> Array:
        """scale * (x[..., *in] @ A[*in, r]) @ B[r, *out] -> [..., *out], in `dtype`."""
        cfg = self.lora
        dtype = to_dtype(cfg.param_dtype)
        a_init = nn.with_logical_partitioning(
            lambda key, shape, dt: lora_lib.kaiming_uniform_a_sqrt5(key, shape, dt, n_in),
            self.axes[:n_in] + ("lora_rank",))
        b_init = nn.with_logical_partitioning(nn.initializers.zeros, ("lora_rank",) + self.axes[n_in:])
        a = self.variable(lora_lib.COLLECTION, "a", lambda: a_init(self.make_rng("params"),
                                                                   self.in_shape + (cfg.rank,), dtype))
        b = self.variable(lora_lib.COLLECTION, "b", lambda: b_init(None, (cfg.rank,) + self.out_shape, dtype))
        low = _contract(x.astype(self.dtype), a.value.astype(self.dtype), n_in)  # [..., r]
        return _contract(low, b.value.astype(self.dtype), 1) * jnp.asarray(cfg.scale, self.dtype)


def _contract(x: Array, w: Array, n_in: int) -> Array:
    """x[..., *in] @ w[*in, *out] over the last `n_in` axes of x -> [..., *out]."""
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    return jax.lax.dot_general(x, w, (contract, ((), ())))


def project_shared_input(parent: nn.Module, x: Array, projections: Sequence[DenseGeneral],
                         merge_above: int | None) -> tuple[Array, ...]:
    """x [B, T, D] through the projections of `parent` that share it (q/k/v, gate/up) -> their outputs
    [B, T, *out], in order.

    XLA:GPU's dot merger joins such projections into one GEMM only while each kernel is at most 32 MiB.
    Past that (Llama-3-8B's gate and up, 117 MB each) a decode step streams each kernel in a GEMM of its
    own, and one GEMM over both streamed them 1.41x faster on an H200 (docs/benchmarks.md, 2026-11-30).
    So a decode step (T = 1) whose largest kernel holds more than `merge_above` bytes (0: any; None:
    never) runs one GEMM over the kernels concatenated inside the program. XLA:GPU fuses that
    concatenation into the GEMM's operand reads, so no merged copy of the weights is ever made
    (compile-only, tests/test_accelerators.py; the CPU checks are tests/test_merged_projections.py).
    Each projection stays apart on init, under LoRA adapters (their low-rank terms are each
    projection's own), and when the mesh's tensor axis splits the outputs (joining shards along a
    split axis would move weights between devices).
    """
    if not _merges(parent, x, projections, merge_above):
        return tuple(projection(x) for projection in projections)
    dtype = projections[0].dtype
    params = _params_of(parent, projections)
    kernels = [q["kernel"].reshape(q["kernel"].shape[0], -1).astype(dtype) for q in params]  # [D, N_i]
    y = _contract(x.astype(dtype), jnp.concatenate(kernels, axis=1), 1)  # [B, T, sum N_i]
    cuts = list(itertools.accumulate(k.shape[1] for k in kernels))[:-1]
    outs = []
    for p, q, part in zip(projections, params, jnp.split(y, cuts, axis=-1)):
        part = part.reshape(x.shape[:-1] + tuple(p.out_shape))
        outs.append(part + q["bias"].astype(dtype) if p.use_bias else part)
    return tuple(outs)


def _params_of(parent: nn.Module, projections: Sequence[DenseGeneral]) -> list[dict[str, Array]]:
    """Each projection's params ({"kernel", ["bias"]}), read through `parent` without calling it."""
    return [nn.meta.unbox(parent.variables["params"][p.name]) for p in projections]


def _merges(parent: nn.Module, x: Array, projections: Sequence[DenseGeneral], merge_above: int | None) -> bool:
    """Whether `project_shared_input` runs `projections` as one GEMM (see there)."""
    if merge_above is None or x.shape[-2] != 1 or parent.is_initializing():
        return False
    if sharding.axis_size("tensor") > 1 or any(len(p.in_shape) != 1 for p in projections):
        return False
    adapters = parent.variables.get(lora_lib.COLLECTION, {})
    if any(p.name in adapters for p in projections):
        return False
    return max(q["kernel"].size * q["kernel"].dtype.itemsize for q in _params_of(parent, projections)) > merge_above


class LayerNorm(nn.Module):
    """GPT-2 LayerNorm (scale and bias), statistics in float32."""

    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d = x.shape[-1]
        scale = _param(self, "scale", nn.initializers.ones, (d,), ("norm",), self.param_dtype)
        bias = _param(self, "bias", nn.initializers.zeros, (d,), ("norm",), self.param_dtype)
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, normalised in float32, in the Hugging Face order of each family.

    Llama: cast back to `dtype`, then times w. Gemma (`unit_offset`): times (1 + w) in float32, then
    cast back; w starts at 0. GPT-OSS (`scale_float32`): times w in float32, then cast back. (In
    float32 all orders agree; in bfloat16 they differ in the last bit.)
    """

    eps: float
    dtype: Any
    param_dtype: Any
    unit_offset: bool = False
    scale_float32: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d = x.shape[-1]
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = _param(self, "scale", init, (d,), ("norm",), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (y * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
        if self.scale_float32:
            return (y * scale.astype(jnp.float32)).astype(self.dtype)
        return y.astype(self.dtype) * scale.astype(self.dtype)


def norm(config: ModelConfig, name: str) -> nn.Module:
    if config.family == "gpt2":
        return LayerNorm(config.norm_eps, config.jnp_dtype, config.jnp_param_dtype, name=name)
    return RMSNorm(config.norm_eps, config.jnp_dtype, config.jnp_param_dtype, config.norm_unit_offset,
                   config.norm_scale_float32, name=name)


def softcap(x: Array, cap: float | None) -> Array:
    """cap * tanh(x / cap) (Gemma 2's soft-capping of scores and logits); x itself when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


_ACTIVATIONS = {"gelu_new": lambda y: jax.nn.gelu(y, approximate=True),
                "gelu": lambda y: jax.nn.gelu(y, approximate=False),
                "silu": jax.nn.silu, "relu": jax.nn.relu}


def activation(name: str):
    """The MLP nonlinearity by its ModelConfig.act name."""
    return _ACTIVATIONS[name]


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        d, f = cfg.hidden_size, cfg.mlp_dim
        common = dict(dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype)
        act = activation(cfg.act)
        if cfg.family == "gpt2":
            hidden = act(DenseGeneral((d,), (f,), ("embed", "mlp"), True, name="fc", lora=cfg.lora_for("fc"),
                                      **common)(x))
            return DenseGeneral((f,), (d,), ("mlp", "embed"), True, name="proj", lora=cfg.lora_for("proj"),
                                **common)(hidden)
        bias = cfg.mlp_bias
        gate, up = project_shared_input(self, x, [
            DenseGeneral((d,), (f,), ("embed", "mlp"), bias, name="gate", lora=cfg.lora_for("gate"), **common),
            DenseGeneral((d,), (f,), ("embed", "mlp"), bias, name="up", lora=cfg.lora_for("up"), **common),
        ], cfg.merge_decode_projections_above)
        return DenseGeneral((f,), (d,), ("mlp", "embed"), bias, name="down", lora=cfg.lora_for("down"),
                            **common)(act(gate) * up)
