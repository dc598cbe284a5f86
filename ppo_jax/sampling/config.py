"""What to sample and what comes out: `SamplingConfig`, its checks against a model and prompt shapes
(`validate_inputs`), `SampleOutput`, and `truncation_metrics`.

Log-probs. `logprobs` are log-probs of the sampled tokens under the full tempered distribution
`log_softmax(logits / temperature)`: exactly what the training forward computes for the same tokens,
so the PPO ratio of the first minibatch is 1. When the sampler does not sample from that distribution
(top-k, top-p, or stop tokens suppressed before `min_new_tokens`), the behaviour policy is the
truncated, renormalised distribution; its log-probs are in `sampling_logprobs`. The difference
`logprobs - sampling_logprobs = log(kept mass) <= 0` is what truncation does to the PPO ratio: with
old log-probs taken from `logprobs`, the true importance ratio pi_new/pi_behaviour is off by the factor
exp(sampling_logprobs - logprobs) >= 1 per token. `truncation_metrics` summarises it for logging.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from ppo_jax.models.config import to_dtype
from ppo_jax.models.transformer import CausalLM

Array = jax.Array


ENGINES = ("static", "continuous")
# A GEMM choice -> XLA:GPU options of one program (jax.jit's compiler_options): SamplingConfig.gemm
# (rollout.gemm) the sampler's, ppo.gemm the experience and update programs'. Decode's GEMMs are
# M = rows skinny and bandwidth-bound, the update's are not, so one process-wide XLA_FLAGS choice
# cannot suit both.
GEMM_OPTIONS: dict[str, dict[str, bool]] = {
    "auto": {},  # XLA's default: Triton GEMM fusions, autotuned, cuBLAS as a fallback candidate
    "cublas": {"xla_gpu_enable_triton_gemm": False},  # every dot a cuBLAS (nvjet) call; compiles faster
    "triton_exhaustive": {"xla_gpu_exhaustive_tiling_search": True},  # Triton, all tilings autotuned
}
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def gemm_compiler_options(gemm: str, platform: str | None) -> dict[str, bool] | None:
    """jax.jit's compiler_options for a program under GEMM choice `gemm` (`GEMM_OPTIONS`) on devices
    of `platform` (None: XLA's defaults, so programs elsewhere, and with gemm "auto", compile and
    cache exactly as before)."""
    options = GEMM_OPTIONS[gemm]
    return dict(options) if options and platform in GPU_PLATFORMS else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to sample responses (static: hashable, part of the compiled program).

    max_new_tokens: response length N (the buffers are always this long).
    min_new_tokens: stop tokens are suppressed while fewer than this many tokens were generated.
    temperature:    logits are divided by it, for sampling and for the returned log-probs.
    top_k:          keep only the k most likely tokens (0, or >= the vocabulary size: off).
    top_p:          keep the smallest set of most likely tokens whose mass reaches top_p (1.0: off);
                    applied after top_k, on the top-k-renormalised distribution (as transformers does).
    greedy:         take the argmax instead of sampling (log-probs still use the temperature;
                    sampling_logprobs are 0, the log-prob of a point mass).
    stop_token_ids: any of these ends a row; the stop token itself is part of the response (mask 1).
    pad_token_id:   written after a row has stopped.
    num_samples:    responses per prompt (GRPO/RLOO); the rows of one prompt are consecutive.
    cache_dtype:    KV cache dtype name ("bfloat16" halves its memory); None: the model compute dtype.
    engine:         "static": one batch of R rows decoded until its longest row stops (`loop.sample`);
                    "continuous": `slots` decode rows fed from a queue of the R rows, a finished row's
                    slot taking the next prompt's prefill (`continuous.sample_continuous`). The same
                    key gives both the same tokens and log-probs (token_choice: a row's draws depend
                    on its row index and step only).
    slots:          decode rows the continuous engine holds at once (its KV cache is slots x
                    (Lq + N - 1) instead of R x that); 0 with the static engine.
    prefill_prompts: prompts the continuous engine prefills together, when a slot is free and no
                    prefilled row is left waiting (each of their n samples then takes the next free
                    slot); 0: a quarter of the slots' worth, at least one.
    tail_halvings:  how many times the continuous engine may move its busy rows into half as many
                    slots once no prompt is left to insert (each a decode program of its own). None:
                    2 with the unrolled decode, 0 with the scanned one, whose stage caches XLA:TPU
                    kept side by side (compile-only Llama-3-8B on v5p-8, 256 rows x 2560: 27.5
                    instead of 10.4 GiB of temps).
    steps_per_sync: decode steps one iteration of the static engine's loop runs (a loop of known trip
                    count inside it) before it tests whether every row has stopped. XLA:GPU reads a
                    loop condition that depends on device data on the host, and waits for it, after
                    every iteration; K steps per test make that 1/K of the steps, at the price of up to
                    K - 1 steps past the last row's stop (masked: the same tokens and log-probs for any K).
    unroll_layers:  decode layer by layer on per-layer weights and caches instead of scanning the
                    stacked layers (`Transformer.unrolled`): this saves a copy of every layer's
                    weights and cache slab per token (GPT-2-small on CPU: 1.5x faster; TinyLlama on an
                    H100: 2.3x) at the price, for scanned params, of one copy of the layer weights
                    while sampling (none for unscanned params) and a decode program that grows with
                    depth; a bf16 cache saves less on CPU, as XLA:CPU converts each layer's slab to
                    f32 for its dots. None: on except on TPU (not measured there).
    record_experts: an MoE model's routing of every prompt and response token is returned
                    (`SampleOutput.routed_experts`), for routing replay in training.
    gemm:           the GEMM kernels of the sampler's program on a GPU (`GEMM_OPTIONS`): "auto"
                    (XLA's choice), "cublas" or "triton_exhaustive"; other platforms ignore it. The
                    samples are the same up to the kernels' summation order.
    """

    max_new_tokens: int
    pad_token_id: int
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    num_samples: int = 1
    cache_dtype: str | None = None
    engine: str = "static"
    slots: int = 0
    prefill_prompts: int = 0
    tail_halvings: int | None = None
    steps_per_sync: int = 1
    unroll_layers: bool | None = None
    record_experts: bool = False
    gemm: str = "auto"

    def __post_init__(self):
        # Accept any sequence of ids but store a tuple so the config stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"sampling.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(
                f"sampling.temperature must be > 0, got {self.temperature}; for argmax decoding set "
                f"sampling.greedy=True (the temperature then only scales the returned log-probs)")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1] (1.0 turns it off), got {self.top_p}")
        if self.num_samples < 1:
            raise ValueError(f"sampling.num_samples must be >= 1, got {self.num_samples}")
        if self.pad_token_id < 0:
            raise ValueError(f"sampling.pad_token_id must be a token id >= 0, got {self.pad_token_id}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"sampling.stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        if self.cache_dtype is not None:
            to_dtype(self.cache_dtype)
        if self.engine not in ENGINES:
            raise ValueError(f"sampling.engine={self.engine!r}: use one of {', '.join(ENGINES)}")
        if self.engine == "continuous" and self.slots < 1:
            raise ValueError(f"sampling.slots must be >= 1 with the continuous engine, got {self.slots}")
        if self.engine == "static" and self.slots:
            raise ValueError(f"sampling.slots={self.slots} is for the continuous engine (engine='static' "
                             f"decodes every row at once)")
        if self.steps_per_sync < 1:
            raise ValueError(f"sampling.steps_per_sync must be >= 1, got {self.steps_per_sync}")
        if self.tail_halvings is not None and self.tail_halvings < 0:
            raise ValueError(f"sampling.tail_halvings must be >= 0, got {self.tail_halvings}")
        if self.gemm not in GEMM_OPTIONS:
            raise ValueError(f"sampling.gemm={self.gemm!r}: use one of {', '.join(GEMM_OPTIONS)}")
        if self.prefill_prompts < 0:
            raise ValueError(f"sampling.prefill_prompts must be >= 0 (0: a quarter of the slots), got "
                             f"{self.prefill_prompts}")

    def compiler_options(self, platform: str) -> dict[str, bool] | None:
        """jax.jit's compiler_options for the sampler's program on devices of `platform`
        (`gemm_compiler_options`)."""
        return gemm_compiler_options(self.gemm, platform)

    def prefill_batch(self, prompts: int) -> int:
        """Prompts the continuous engine prefills at once, for a call of `prompts` prompts (never more
        than the call has)."""
        chunk = self.prefill_prompts or max(1, self.slots // (4 * self.num_samples))
        return min(chunk, prompts)

    @property
    def truncates(self) -> bool:
        """Whether tokens may be drawn from something other than the full tempered distribution."""
        suppresses_stop = self.min_new_tokens > 0 and bool(self.stop_token_ids)
        return self.greedy or self.top_k > 0 or self.top_p < 1.0 or suppresses_stop


@flax.struct.dataclass
class SampleOutput:
    """Sampled responses; R = B * num_samples rows, the rows of one prompt consecutive.

    prompt_tokens, prompt_mask [R, Lq]: the prompts, repeated num_samples times.
    tokens [R, N] int32: response tokens, pad_token_id after the first stop token.
    logprobs [R, N] float32: log_softmax(logits / T) of each sampled token (0 where mask is 0).
    sampling_logprobs [R, N] float32: log-prob under the distribution actually sampled from (after
        top-k / top-p / min_new_tokens suppression; 0 under greedy decoding, a point mass); equal to
        `logprobs` when nothing truncates. 0 where mask is 0.
    mask [R, N] int32: 1 up to and including the first stop token.
    lengths [R] int32: response lengths (sum of mask).
    stopped [R] bool: the row produced a stop token (False: it ran to max_new_tokens).
    slot_steps_at_finish [R] int32: slot-steps (one row's token position computed by a decode step)
        the engine had decoded when the row's last token was chosen (its first token comes from its
        prefill); the static engine's is (length - 1) * R. `slot_occupancy` reads the work done from
        it: its maximum is every slot-step of the call.
    routed_experts [R, Lq + N, Lm, k] int8/int16 (`SamplingConfig.record_experts`, else None): the
        experts each prompt and response token went to in each of the Lm MoE layers, aligned with the
        prompt + response; -1 on padding and on a row's last token (never fed back: no routing).
    token_policy_version [R, N] int32 (a segmented run, `segments.py`; else None): the policy version
        whose weights chose each token, -1 where mask is 0. With partial rollouts a row's tokens may
        come from several versions, each token's log-probs from the weights that chose it.
    """

    prompt_tokens: Array
    prompt_mask: Array
    tokens: Array
    logprobs: Array
    sampling_logprobs: Array
    mask: Array
    lengths: Array
    stopped: Array
    slot_steps_at_finish: Array
    routed_experts: Array | None = None
    token_policy_version: Array | None = None


def truncation_metrics(logprobs: Array, sampling_logprobs: Array, mask: Array) -> dict[str, Array]:
    """What truncated sampling does to the PPO ratio, averaged over response tokens: a SampleOutput's
    (or a rollout's) `logprobs`, `sampling_logprobs` and `mask`, each [R, N].

    kept_mass: probability mass of the tempered distribution that top-k/top-p/min-tokens kept
        (1.0 when nothing truncates); the initial ratio of the full-distribution policy to the
        behaviour policy is kept_mass per token, not 1.
    log_ratio: mean of logprobs - sampling_logprobs = log kept_mass (<= 0).
    """
    mask = mask.astype(jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0)
    log_ratio = (logprobs - sampling_logprobs) * mask
    return {
        "sampling/kept_mass": (jnp.exp(log_ratio) * mask).sum() / count,
        "sampling/log_ratio": log_ratio.sum() / count,
    }


def slot_occupancy(output: SampleOutput, config: SamplingConfig, prompts: int) -> Array:
    """Tokens generated / token choices computed (a float []), for a call on `prompts` prompts: the
    slot-steps decoded plus the first tokens, chosen from the prefills' logits (every row static;
    every prefilled chunk's rows continuous, padding rows of a last short chunk included)."""
    if config.engine == "static":
        first_tokens = prompts * config.num_samples
    else:
        chunk = config.prefill_batch(prompts)
        first_tokens = -(-prompts // chunk) * chunk * config.num_samples
    return output.lengths.sum() / (first_tokens + output.slot_steps_at_finish.max())


def validate_inputs(model: CausalLM, config: SamplingConfig, prompt_shape: tuple[int, ...],
                    mask_shape: tuple[int, ...]) -> None:
    """Shape and id checks that need no device data (run before anything compiles)."""
    mc = model.config
    if len(prompt_shape) != 2:
        raise ValueError(f"prompt_tokens must be [batch, prompt_length], got shape {tuple(prompt_shape)}")
    if tuple(mask_shape) != tuple(prompt_shape):
        raise ValueError(
            f"prompt_mask shape {tuple(mask_shape)} must equal prompt_tokens shape {tuple(prompt_shape)}")
    if prompt_shape[1] < 1:
        raise ValueError("prompt_tokens has length 0: every row needs at least one real prompt token")
    for name, ids in (("pad_token_id", (config.pad_token_id,)), ("stop_token_ids", config.stop_token_ids)):
        bad = [t for t in ids if t >= mc.vocab_size]
        if bad:
            raise ValueError(f"sampling.{name} {bad} outside the model vocabulary (vocab_size={mc.vocab_size})")
    if len(set(config.stop_token_ids)) >= mc.vocab_size:
        raise ValueError("sampling.stop_token_ids covers the whole vocabulary: nothing else can be sampled")
    total = prompt_shape[1] + config.max_new_tokens
    if mc.family == "gpt2" and total > mc.max_position_embeddings:
        raise ValueError(
            f"prompt length {prompt_shape[1]} + sampling.max_new_tokens {config.max_new_tokens} = {total} "
            f"exceeds model.max_position_embeddings={mc.max_position_embeddings} (learned positions); "
            f"shorten the prompts or the responses")
