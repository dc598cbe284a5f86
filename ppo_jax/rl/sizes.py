"""The batch sizes of a PPO run on a mesh (`derive_sizes`): rollout rows, minibatches, microbatches,
forward chunks, packed rows and the continuous engine's decode slots, each checked against the
settings, the mesh and the model before anything compiles (a ConfigError naming the fields)."""

from __future__ import annotations

import jax

from ppo_jax.config import check, check_positions
from ppo_jax.rl.hyper import DerivedSizes
from ppo_jax.rl.settings import RolloutSettings, Settings, stop_token_ids


def packing_on(packing: str, platform: str | None) -> bool:
    """ppo.packing resolved for the devices' platform (None: this process's backend). "auto" packs on
    a CPU only: there it was measured 1.7x faster at long-tailed lengths and 5% slower without padding;
    on an H200 (TinyLlama shape, no padding) the packed experience and update were 1.44x and 1.52x
    slower than padded, their eight small microbatches a minibatch paying the per-microbatch costs
    eight times (docs/benchmarks.md, "The library on an H200"). GPU and TPU gains at long-tailed
    lengths are unmeasured: "on" packs anywhere."""
    if packing != "auto":
        return packing == "on"
    return (platform or jax.default_backend()) == "cpu"


def derive_sizes(s: Settings, *, batch_divisor: int = 1, max_positions: int | None = None,
                 vocab_size: int | None = None, platform: str | None = None,
                 sampler_divisor: int | None = None) -> DerivedSizes:
    """The batch sizes of a run on a mesh with `batch_divisor` data-parallel devices on `platform`
    ("cpu", "gpu", "tpu"; None: this process's backend), checked against the mesh and the model
    (before any compile). sampler_divisor: the sampler mesh's data-parallel devices when it has its
    own (`rl/roles.py`; None: the same mesh)."""
    r, p = s.rollout, s.ppo
    if sampler_divisor is not None and sampler_divisor != batch_divisor:
        check(r.batch_size % sampler_divisor == 0,
              f"rollout.batch_size={r.batch_size} is not a multiple of the sampler's {sampler_divisor} data-parallel "
              "devices (roles.sampler_mesh: data x fsdp x expert)")
    sampler_divisor = batch_divisor if sampler_divisor is None else sampler_divisor
    rows = r.batch_size * r.num_samples
    check(rows % p.num_minibatches == 0,
          f"rollout.batch_size * rollout.num_samples = {rows} is not divisible by ppo.num_minibatches="
          f"{p.num_minibatches}; change one of them")
    mini = rows // p.num_minibatches
    check(mini % p.num_microbatches == 0,
          f"a minibatch of {mini} rows is not divisible by ppo.num_microbatches={p.num_microbatches}")
    micro = mini // p.num_microbatches
    check(micro % batch_divisor == 0,
          f"a microbatch of {micro} rows does not split over the {batch_divisor} data-parallel devices "
          f"(mesh data x fsdp x expert); make rollout.batch_size * rollout.num_samples / (ppo.num_minibatches * "
          f"ppo.num_microbatches) a multiple of {batch_divisor}")
    check(r.batch_size % batch_divisor == 0,
          f"rollout.batch_size={r.batch_size} is not a multiple of the {batch_divisor} data-parallel devices")
    fwd = r.forward_microbatch or rows
    check(rows % fwd == 0 and fwd % batch_divisor == 0,
          f"rollout.forward_microbatch={r.forward_microbatch} must divide {rows} rows and be a multiple of "
          f"{batch_divisor}")
    if max_positions is not None:
        check_positions({"data.prompt_length": s.data.prompt_length, "rollout.response_length": r.response_length},
                        max_positions)
    if vocab_size is not None:
        for t in stop_token_ids(r, None):
            check(0 <= t < vocab_size, f"rollout.stop_token_ids: {t} is outside the vocabulary (size {vocab_size})")
    packed_rows, length = 0, s.data.prompt_length + r.response_length
    if packing_on(p.packing, platform):
        packed_rows = packed_rows_per_microbatch(p.max_tokens_per_microbatch, length, micro, batch_divisor)
    return DerivedSizes(rollout_rows=rows, minibatch_rows=mini, microbatch_rows=micro, forward_rows=fwd,
                        packed_rows=packed_rows, packed_length=length if packed_rows else 0,
                        decode_slots=decode_slots(r, sampler_divisor, s.environment.enabled),
                        dense_kl_stored=dense_kl_stored(s, rows // batch_divisor, vocab_size))


# ppo.dense_kl_reference="auto" keeps the reference's log-probs over the vocabulary from the experience
# step up to this many bytes per data-parallel device. The demo's are 1 MiB (64 rows x 16 x 262) and
# save a reference forward in each of an iteration's 8 update microbatches (update 3-4 % faster on 2
# cores, docs/benchmarks.md "The dense KL's reference kept"); an LLM's are gigabytes (8 rows x 512 x
# 151,936 = 2.3 GiB), where the forward is the cheaper way.
STORED_REFERENCE_BUDGET = 256 * 2**20


def dense_kl_stored(s: Settings, rows_per_device: int, vocab_size: int | None) -> bool:
    """Whether the update reads the dense KL's reference log-probs from the experience (True) or runs
    the reference forward per microbatch (False): ppo.dense_kl_reference resolved; "auto" needs the
    vocabulary size (None: recompute)."""
    p = s.ppo
    if not p.dense_kl_coef or p.dense_kl_reference == "recompute":
        return False
    if p.dense_kl_reference == "experience":
        return True
    if vocab_size is None:
        return False
    return rows_per_device * s.rollout.response_length * vocab_size * 4 <= STORED_REFERENCE_BUDGET


def decode_slots(r: RolloutSettings, batch_divisor: int, multi_turn: bool = False) -> int:
    """The continuous engine's decode slots (rollout.slots; 0: half the rows, rounded up to a
    multiple of the data-parallel devices, or every row for multi-turn episodes), checked against the
    rows and the mesh; 0 for the static engine."""
    if r.engine != "continuous":
        return 0
    rows = r.batch_size * r.num_samples
    half = -(-rows // 2 // batch_divisor) * batch_divisor
    slots = r.slots or (rows if multi_turn else half)
    check(slots % batch_divisor == 0,
          f"rollout.slots={slots} is not a multiple of the {batch_divisor} data-parallel devices (mesh data x fsdp "
          f"x expert): every device decodes the same number of slots")
    check(slots <= rows, f"rollout.slots={slots} is more than the {rows} rows of an iteration (rollout.batch_size * "
          f"rollout.num_samples): use at most {rows}")
    return slots


def packed_rows_per_microbatch(max_tokens: int, row_length: int, microbatch_rows: int, batch_divisor: int) -> int:
    """Packed rows per microbatch (M): ppo.max_tokens_per_microbatch // one row's slots, or (0) an eighth
    of a padded microbatch's rows; rounded down to a multiple of the data-parallel devices (each
    holds the same number of packed rows). Raises ConfigError for a budget below one row per device.

    The default's granularity: a packed minibatch computes whole microbatches, so on average half of
    its last one is empty. An eighth reached 0.90 token efficiency and 1.57x (experience + update)
    on CPU at uniform response lengths, where a quarter reached 0.75 and 1.45x; with no padding at
    all it costs 14% (smaller matmuls), a quarter 3% (docs/benchmarks.md, "Packing")."""
    if max_tokens == 0:
        return max(batch_divisor, microbatch_rows // 8 // batch_divisor * batch_divisor)
    check(max_tokens >= row_length * batch_divisor,
          f"ppo.max_tokens_per_microbatch={max_tokens} is smaller than one packed row per data-parallel device: "
          f"a row holds data.prompt_length + rollout.response_length = {row_length} tokens and {batch_divisor} "
          f"device(s) split each microbatch, so use at least {row_length * batch_divisor}")
    return max_tokens // row_length // batch_divisor * batch_divisor
