"""The compiled entry point: `Sampler` is `sample` jitted over a mesh (batch-major inputs and outputs
split over the data-parallel axes, params as given, the key replicated), with the input checks that
run before anything compiles (shapes and ids, and a batch the mesh can split).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ppo_jax import sharding
from ppo_jax.models.transformer import CausalLM
from ppo_jax.sampling.config import SampleOutput, SamplingConfig, validate_inputs
from ppo_jax.sampling.continuous import sample_continuous
from ppo_jax.sampling.loop import sample
from ppo_jax.sampling.weights import weights_in_compute_dtype


class Sampler:
    """`sample` jitted over a mesh: call as sampler(params, prompt_tokens, prompt_mask, key, adapters=None).

    Batch-major inputs and outputs are split over the batch mesh axes, params follow
    `param_shardings`, LoRA adapters (the "lora" tree, None for the base) `adapter_shardings`, the key
    is replicated. One trace per input shape: `trace_count` counts them. On a GPU the program
    compiles with `config.compiler_options` (its GEMM choice), no other program does.
    """

    def __init__(self, model: CausalLM, config: SamplingConfig, mesh: Mesh, param_shardings: Any,
                 adapter_shardings: Any = None):
        self.model, self.config, self.mesh = model, config, mesh
        self.param_shardings, self.adapter_shardings = param_shardings, adapter_shardings
        self.trace_count = 0
        batch = sharding.data_sharding(mesh)
        out_shardings = SampleOutput(**{f.name: batch for f in dataclasses.fields(SampleOutput)})
        if not config.record_experts:
            out_shardings = out_shardings.replace(routed_experts=None)

        self.takes_adapters = adapter_shardings is not None
        engine = sample_continuous if config.engine == "continuous" else sample

        def run(params, prompt_tokens, prompt_mask, key, adapters=None):
            self.trace_count += 1  # Python side effect: runs once per trace, never per call
            return engine(weights_in_compute_dtype(params, model), prompt_tokens, prompt_mask, key,
                          model=model, config=config, adapters=adapters)

        # Adapters go last and only when the sampler takes them, so the lowered / compiled program of
        # a base sampler keeps its (params, prompt_tokens, prompt_mask, key) signature.
        in_shardings = (param_shardings, batch, batch, sharding.replicated(mesh))
        in_shardings += (adapter_shardings,) if self.takes_adapters else ()
        self.jitted = jax.jit(run, in_shardings=in_shardings, out_shardings=out_shardings,
                              compiler_options=config.compiler_options(mesh.devices.flat[0].platform))

    def with_config(self, **changes) -> Sampler:
        """A sampler of the same model, mesh and shardings whose SamplingConfig differs by `changes`
        (e.g. `max_new_tokens=1`: the prefill alone; `gemm="cublas"`): a program of its own."""
        return Sampler(self.model, dataclasses.replace(self.config, **changes), self.mesh, self.param_shardings,
                       self.adapter_shardings)

    @property
    def batch_multiple(self) -> int:
        """The prompt batch must be a multiple of this: the ways the mesh splits the batch (data x fsdp x expert)."""
        return sharding.batch_divisor(self.mesh)

    def _args(self, params, prompt_tokens, prompt_mask, key, adapters) -> tuple:
        if (adapters is not None) != self.takes_adapters:
            raise ValueError("this sampler was made with adapter_shardings and must be given adapters" if
                             self.takes_adapters else "this sampler decodes the base: make it with "
                             "adapter_shardings to pass adapters")
        return (params, prompt_tokens, prompt_mask, key) + ((adapters,) if self.takes_adapters else ())

    def _check(self, prompt_tokens, prompt_mask) -> None:
        validate_inputs(self.model, self.config, np.shape(prompt_tokens), np.shape(prompt_mask))
        divisor = self.batch_multiple
        if self.config.slots % divisor:
            raise ValueError(f"sampling.slots={self.config.slots} is not a multiple of {divisor}, the number of "
                             f"ways the mesh splits the batch ({sharding.batch_axes_text(self.mesh)})")
        if np.shape(prompt_tokens)[0] % divisor:
            raise ValueError(
                f"prompt batch {np.shape(prompt_tokens)[0]} is not a multiple of {divisor}, the number of "
                f"ways the mesh splits the batch ({sharding.batch_axes_text(self.mesh)}); pad the batch "
                f"or change the mesh")

    def __call__(self, params, prompt_tokens, prompt_mask, key, adapters=None) -> SampleOutput:
        self._check(prompt_tokens, prompt_mask)
        with sharding.mesh_context(self.mesh):
            return self.jitted(*self._args(params, prompt_tokens, prompt_mask, key, adapters))

    def lower(self, params, prompt_tokens, prompt_mask, key, adapters=None):
        """The lowered program (for `.compile().memory_analysis()` and cost reports)."""
        self._check(prompt_tokens, prompt_mask)
        with sharding.mesh_context(self.mesh):
            return self.jitted.lower(*self._args(params, prompt_tokens, prompt_mask, key, adapters))


def make_sampler(model: CausalLM, config: SamplingConfig, mesh: Mesh, param_shardings: Any,
                 adapter_shardings: Any = None) -> Sampler:
    """A compiled sampler for `model` on `mesh` (see `Sampler`); adapter_shardings: those of the LoRA
    adapters it will be called with (None: it decodes the base)."""
    return Sampler(model, config, mesh, param_shardings, adapter_shardings)
