#!/usr/bin/env bash
# The checks of one device session (issue 49), prepared so that device minutes go to measurement:
#
#   bash bench/accel_session.sh OUT_DIR [PART] [SECONDS_PER_RUN]
#
# PART "main" (7.3 minutes on an H200 on 2026-11-27, the traced run cut at 200 s; run it first):
#   default     bench_accel.py at the defaults, TinyLlama-1.1B shape, 64 x (128 + 128), with the peers
#               (HF generate, PyTorch eager update) in the same process, one traced iteration
#               (`--profile`), and XLA's optimised HLO of every program dumped: the autotuned
#               programs the static profile (ppo_jax/accelerators/profile.py) is calibrated against
#   cached      the same run, no peers, twice against one compilation cache: the second process's
#               compile is what a rerun or a resume pays
# PART "ab" (about 5 minutes): A/B runs on a 4-layer slice of the same shape (a fifth of the compile),
#   no peers, one knob at a time against the slice's baseline; confirm a winner on the full shape:
#   steps_per_sync=1 (a host round trip per decode step, as before), command buffers that capture the
#   decode loop (+WHILE, the K-step inner loop as one CUDA graph), cuBLAS instead of Triton GEMMs,
#   cuBLASLt, remat full (the trainer's GPU default) and dots, fp32 master weights (bf16 compute) and
#   packing on
# ONLY="slice_base slice_graph_while" runs just the named runs of a part (a short device session).
# PART "next" (about 6 minutes): what the 2026-11-27 bf16 session left open: fp32 master weights cast once
#   per rollout, cuBLAS in bf16 decode, and the full shape at `--remat auto` (the trainer's memory choice).
# PART "all": main and ab, in one call (needs a limit of about 11 minutes: two device calls are safer).
# PART "compiled" (issue 63; fits one device call of 9 minutes: every run has its own limit and all of
#   them end by DEADLINE seconds, default 500, so that the tar at the end always runs; in order of
#   importance, a run with too little time left is skipped):
#   default_compiled  the full shape at the defaults with every peer: HF generate, the PyTorch eager
#                     update, the torch.compile update and experience forwards (a child process, at most
#                     140 s); the decode loop timed apart from the prefill; a fresh compilation cache
#   slice_gemm        4 layers, no peers: the sampler alone under rollout.gemm auto (the base), cublas
#                     and triton_exhaustive, each its own program in one process (bf16)
#   cached_warm       the full shape again, no peers, against default_compiled's cache: the warm compile
#   slice_xla_caches  4 layers, a fresh cache with jax_persistent_cache_enable_xla_caches=all (XLA's
#                     kernel cache and parallel LLVM compilation): its cold compile against slice_gemm's
# PART "gemm2" (issue 63; DEADLINE default 185 s, a run skipped when less than its RUN_MIN seconds are
#   left; every run a process of its own, so that no autotuning is reused; progress lines in each log):
#   gemm2_full_train_cublas      the full shape, no peers, ppo.gemm=cublas (--train-gemm): the experience
#                                and update programs without Triton GEMMs, the sampler at its default;
#                                its compile against part compiled's default_compiled (84.1 s). On a fresh
#                                H200 on 2026-11-28 it had not finished after 135 s; on 2026-11-30 it
#                                took 149 s (it has 190 s)
#   gemm2_slice_train_cublas     4 layers, no peers, ppo.gemm=cublas: against part compiled's slice_gemm,
#                                and against the next run (a slice run took 58-60 s on 2026-11-30; 85 s each)
#   gemm2_slice_default          4 layers, no peers, the defaults
#   gemm2_slice_sampler_exhaustive  4 layers, rollout.gemm=triton_exhaustive in a process of its own (2026-11-30:
#                                did not compile in about 110 s)
#   gemm2_full_default           the full shape at the defaults
#   The 2026-11-30 call ran DEADLINE=520 ONLY="gemm2_full_train_cublas gemm2_slice_train_cublas
#   gemm2_slice_default gemm2_slice_sampler_exhaustive", then part merge, in 374 s.
# PART "next63" (issue 63, DEADLINE default 520 s, one call of about 7 minutes; run it next): a 4-layer
#   slice of Llama-3-8B's shape with compute.decode_projections apart, then auto (one GEMM for gate/up
#   past XLA's dot-merger limit: decode_ms_per_step is the figure), then part merge.
# PART "compile4" (issue 63 item 4, one call of 9 minutes): the cold compile of the full TinyLlama
#   shape after a 1-layer warm-up process, each run a process of its own: the default (compute.precompile
#   auto: the three programs compiled side by side before the first iteration; the figure is the first
#   iteration's wall less a steady one's, and the JSON's precompile.wall_s), the default again on its
#   persistent cache (the warm start, target 10 s), then --precompile off (each at its first call, as
#   before), then, if time is left, --layer-loop scan (per-layer params trace one layer per kind too
#   since 2026-11-30, so its run time against the default's is the question).
# PART "merge" (issue 63 item 2, about 1 minute): bench_merged_gemm.py, decode-shaped projections (M = 64,
#   bf16) as two GEMMs or one: Llama-3-8B's gate/up, which XLA's dot merger leaves apart (117 MB each,
#   past its 32 MiB limit; compile-only for an H200: 2 GEMMs, merged by hand 1), and 8B q/k/v and
#   TinyLlama's, which it merges already (the control). Merging by hand is built only if it pays.
#
# Each run has its own time limit, so one slow run cannot eat the others. Everything lands in
# OUT_DIR/session-PART.tgz (each run's .json and .log, the trace, the HLO) plus OUT_DIR/summary-PART.txt,
# within the device tool's eight files: commit the JSONs under bench/results/ and the tables in
# docs/benchmarks.md. `BENCH_EXTRA=--tiny bash bench/accel_session.sh /tmp/out ab 120` runs the
# same at the tiny size on a CPU (a smoke test of this script, no figure to keep).
#
# On the workplace's device machine (jax, flax, optax, orbax, torch, transformers in its image): carry
# the wheels it lacks (ml-collections, tensorboardX) in .whl/ and install them first, e.g.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -uo pipefail
out=${1:?usage: accel_session.sh OUT_DIR [main|ab|next|all|compiled|gemm2|next63|compile4|merge] [SECONDS_PER_RUN]}
part=${2:-main}
limit=${3:-300}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d /tmp/accel_session.XXXX)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
# a tree exported without .git (git archive) names its commit here
PPO_JAX_COMMIT=${PPO_JAX_COMMIT:-$(git -C "$here" rev-parse HEAD 2>/dev/null || echo unknown)}
export PPO_JAX_COMMIT
summary="$out/summary-$part.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee "$summary"

default_deadline=1000000
[ "$part" = compiled ] && default_deadline=500  # one 9-minute device call: the tar must still run
[ "$part" = gemm2 ] && default_deadline=185  # one device call of about 200 s
[[ " next63 compile4 " == *" $part "* ]] && default_deadline=520  # one device call of 9 minutes, the tar included
deadline=$((SECONDS + ${DEADLINE:-$default_deadline}))  # every run ends by then

run() {  # [RUN_LIMIT=S] [RUN_MIN=S] run NAME [VAR=VALUE ...] -- BENCH_ARGS...: one bench_accel.py run, its table, its figures in NAME.json
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi  # ONLY="a b": just these runs
  local env=()
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do env+=("$1"); shift; done
  shift
  local secs=${RUN_LIMIT:-$limit} left=$((deadline - SECONDS))
  if [ "$left" -lt "${RUN_MIN:-45}" ]; then echo "== $name: skipped, ${left} s left before the deadline" | tee -a "$summary"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  local start=$SECONDS
  # shellcheck disable=SC2086  # BENCH_EXTRA is a list of flags
  env "${env[@]}" timeout "$secs" python3 "$here/bench_accel.py" --json "$work/$name.json" "$@" ${BENCH_EXTRA:-} \
    >"$work/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - start)) s of $secs (${env[*]} $*)" | tee -a "$summary"
  cp "$work/$name.json" "$out/" 2>/dev/null  # each run's figures reach OUT at once: a cut call keeps them
  grep -v -e "Loading weights" -e "UserWarning" -e "warnings.warn" "$work/$name.log" | tail -n 30 | tee -a "$summary"
}

main_part() {
  # The defaults with the peers, traced, and XLA's optimised HLO of the three programs.
  run default XLA_FLAGS="--xla_dump_to=$work/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_(run|experience|update)" \
    -- --profile "$work/trace"
  find "$work/hlo" -type f ! -name "*after_optimizations.txt" -delete 2>/dev/null
  find "$work/hlo" -type d -empty -delete 2>/dev/null
  # Compile time of a second process: the same run twice against one persistent cache.
  run cached_cold -- --no-peers --iterations 1 --compilation-cache "$work/xla_cache"
  run cached_warm -- --no-peers --iterations 1 --compilation-cache "$work/xla_cache"
  rm -rf "$work/xla_cache"
}

ab_part() {
  local slice=(--no-peers --layers 4)
  run slice_base -- "${slice[@]}"
  run slice_sync_every_step -- "${slice[@]}" --steps-per-sync 1
  run slice_graph_while XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_graph_min_graph_size=1" \
    -- "${slice[@]}"
  run slice_cublas XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" -- "${slice[@]}"
  run slice_cublaslt XLA_FLAGS="--xla_gpu_enable_cublaslt=true" -- "${slice[@]}"
  run slice_remat_full -- "${slice[@]}" --remat full
  run slice_remat_dots -- "${slice[@]}" --remat dots
  run slice_fp32_master -- "${slice[@]}" --param-dtype float32  # fp32 weights and Adam moments, bf16 compute
  run slice_packed -- "${slice[@]}" --packing on
}

next_part() {
  # What the third session (2026-11-27, bf16) left to measure: the once-per-rollout cast of fp32
  # master weights (expect slice_base's 0.48 ms/step), cuBLAS's GEMMs in bf16 decode, and the
  # trainer's own remat choice on the full shape (its log names the program it kept and why).
  local slice=(--no-peers --layers 4)
  run slice_base -- "${slice[@]}"
  run slice_fp32_master -- "${slice[@]}" --param-dtype float32
  run slice_cublas XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" -- "${slice[@]}"
  run remat_auto -- --no-peers --remat auto
}

compiled_part() {
  # Issue 63: what a user would compare against (torch.compile), the decode loop apart from its
  # prefill, the sampler's GEMM choice, the warm compile. The most important run first.
  RUN_LIMIT=360 run default_compiled -- --torch-compile-timeout 140 --compilation-cache "$work/xla_cache"
  RUN_LIMIT=110 run slice_gemm -- --no-peers --layers 4 --gemm-ab cublas,triton_exhaustive
  RUN_LIMIT=100 run cached_warm -- --no-peers --iterations 1 --no-decode-split --compilation-cache "$work/xla_cache"
  rm -rf "$work/xla_cache"
  RUN_LIMIT=80 run slice_xla_caches JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=all -- \
    --no-peers --layers 4 --no-decode-split --compilation-cache "$work/xla_cache_all"
  rm -rf "$work/xla_cache_all"
}

gemm2_part() {
  # Issue 63, the compile of the trainer's programs: ppo.gemm=cublas takes the Triton GEMMs, and their
  # autotuning, out of the experience and update programs. Each run a process of its own, no decode
  # split (its prefill program is compile time of its own), no peers. The most important run first.
  local full=(--no-peers --iterations 3 --no-decode-split) slice=(--no-peers --layers 4 --iterations 3 --no-decode-split)
  RUN_LIMIT=190 run gemm2_full_train_cublas -- "${full[@]}" --train-gemm cublas
  RUN_LIMIT=85 RUN_MIN=70 run gemm2_slice_train_cublas -- "${slice[@]}" --train-gemm cublas
  RUN_LIMIT=85 RUN_MIN=70 run gemm2_slice_default -- "${slice[@]}"
  RUN_LIMIT=85 RUN_MIN=70 run gemm2_slice_sampler_exhaustive -- "${slice[@]}" --sampler-gemm triton_exhaustive
  RUN_LIMIT=175 RUN_MIN=170 run gemm2_full_default -- "${full[@]}"
}

merge_part() {
  # Issue 63 item 2: whether one wide GEMM at decode's M streams weights faster than two.
  local start=$SECONDS
  timeout "${RUN_LIMIT:-120}" python3 "$here/bench_merged_gemm.py" --json "$work/merged_gemm.json" >"$work/merged_gemm.log" 2>&1
  echo "== merged_gemm: exit $? after $((SECONDS - start)) s" | tee -a "$summary"
  cp "$work/merged_gemm.json" "$out/" 2>/dev/null
  tail -n 10 "$work/merged_gemm.log" | tee -a "$summary"
}

next63_part() {
  # Issue 63 after the 2026-11-30 session: compute.decode_projections on the model it is for, a 4-layer
  # slice of Llama-3-8B's shape (gate and up 117 MB each, past XLA's 32 MiB dot-merger limit), apart
  # (what XLA alone runs) against auto (one GEMM, the concatenation fused into its operand reads), each
  # a process of its own; the figure is decode_ms_per_step. Then part merge again (15 s).
  local slice8b=(--model llama3-8b --layers 4 --no-peers --iterations 3)
  RUN_LIMIT=180 RUN_MIN=120 run next63_8b_apart -- "${slice8b[@]}" --decode-projections apart
  RUN_LIMIT=180 RUN_MIN=120 run next63_8b_auto -- "${slice8b[@]}" --decode-projections auto
  RUN_LIMIT=60 merge_part
}

compile4_part() {
  # Issue 63 item 4: the programs compiled side by side (the GPU default now) against one after another,
  # and scanned layers beside it, on the full TinyLlama shape after a warm-up process (2026-11-30: a
  # machine's first process compiled the same sampler 48% slower). DEADLINE default 520 s.
  # The default runs twice against one persistent cache: cold, then warm (the warm start is tracing and
  # lowering, one layer per kind since 2026-11-30: 14.5-18.9 -> 5.6-8.2 s compile-only). Scan, last,
  # runs only if time is left.
  local full=(--no-peers --iterations 3 --no-decode-split)
  RUN_LIMIT=60 run compile4_warmup -- --no-peers --layers 1 --iterations 1 --no-decode-split
  RUN_LIMIT=140 RUN_MIN=110 run compile4_full_default -- "${full[@]}" --compilation-cache "$work/xla_cache"
  RUN_LIMIT=80 RUN_MIN=60 run compile4_full_warm -- --no-peers --iterations 1 --no-decode-split \
    --compilation-cache "$work/xla_cache"
  rm -rf "$work/xla_cache"
  RUN_LIMIT=140 RUN_MIN=110 run compile4_full_precompile_off -- "${full[@]}" --precompile off
  RUN_LIMIT=140 RUN_MIN=110 run compile4_full_scan -- "${full[@]}" --layer-loop scan
}

case "$part" in
  main) main_part ;;
  ab) ab_part ;;
  next) next_part ;;
  all) main_part; ab_part ;;
  compiled) compiled_part ;;
  gemm2) gemm2_part ;;
  merge) merge_part ;;
  next63) next63_part ;;
  compile4) compile4_part ;;
  *) echo "PART must be main, ab, next, all, compiled, gemm2, next63, compile4 or merge, got $part" >&2; exit 2 ;;
esac
tar -czf "$out/session-$part.tgz" -C "$work" . && rm -rf "$work"
ls -la "$out"
