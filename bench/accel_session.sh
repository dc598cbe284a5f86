#!/usr/bin/env bash
# The accelerator checks of one device session, in one call that fits its lease (docs/benchmarks.md,
# "The library on an H200"): bench_accel.py at the profile's shape with the peers, traced; the static
# and continuous rollout engines at long-tailed lengths (bench_sampler.py --engines); then the PPO
# iteration packed and with full remat; each run under its own time limit, so one slow run cannot eat
# the others (about 10 minutes at 200 s each: two calls of the device tool, or fewer runs).
#
#   bash bench/accel_session.sh OUT_DIR [SECONDS_PER_RUN]
#   BENCH_EXTRA=--tiny bash bench/accel_session.sh /tmp/out 120     # the same runs at the tiny size, on a CPU
#
# On the workplace's device machine (jax, flax, optax, orbax, torch, transformers in its image): carry
# the wheels it lacks (ml-collections, tensorboardX) in .whl/ and install them first, e.g.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# Writes OUT_DIR/<run>.log and .json per run and OUT_DIR/trace.tgz (one traced iteration, for
# `python bench/profile_summary.py`); prints each run's table.
set -uo pipefail
out=${1:?usage: accel_session.sh OUT_DIR [SECONDS_PER_RUN]}
limit=${2:-200}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"

run() {  # run NAME ARGS...: one bench_accel.py run, its table printed, its figures in NAME.json
  local name=$1; shift
  local start=$SECONDS
  # shellcheck disable=SC2086  # BENCH_EXTRA is a list of flags
  timeout "$limit" python3 "$here/bench_accel.py" --json "$out/$name.json" "$@" ${BENCH_EXTRA:-} >"$out/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - start)) s ($*)"
  grep -v -e "Loading weights" -e "UserWarning" -e "warnings.warn" "$out/$name.log" | tail -n 70
}

run default --profile /tmp/accel_trace                    # the defaults (padded rows on a GPU), the peers, a trace
tar -czf "$out/trace.tgz" -C /tmp accel_trace 2>/dev/null || true
engines() {  # the rollout engines on TinyLlama at forced long-tailed and equal lengths (bench_sampler.py)
  local start=$SECONDS
  timeout "$limit" python3 "$here/bench_sampler.py" --engines --shapes tinyllama --dtype bfloat16 --batch 64 \
    --prompt 128 --new 256 --repeats 3 --lengths long-tailed equal --slots 16 32 64 >"$out/engines.log" 2>&1
  echo "== engines: exit $? after $((SECONDS - start)) s"
  tail -n 12 "$out/engines.log"
}
engines
run packed --no-peers --packing on                        # what packing costs with no padding to remove
run remat_full --no-peers --remat full                    # the trainer's own remat default on a GPU
