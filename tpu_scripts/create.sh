#!/usr/bin/env bash
# Create a TPU VM or pod slice with gcloud: directly (`tpu-vm create`) or as a
# queued resource (`queued-resources create`, then wait until it is ACTIVE).
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$SCRIPT_DIR/common.sh"

usage() {
  cat <<EOF
Usage: $SCRIPT_NAME [flags] [-- EXTRA_GCLOUD_FLAGS...]

Create a TPU VM (one host, e.g. v4-8, v5litepod-8) or a pod slice (several
hosts, e.g. v5p-32) named --name in --zone.

Flags:
  --accelerator-type=TYPE   v4-8, v5litepod-8, v5p-32, v6e-8, ...
                            [\$PPO_JAX_TPU_ACCELERATOR_TYPE, default v4-8]
  --runtime-version=VER     TPU software version [\$PPO_JAX_TPU_RUNTIME_VERSION,
                            default from the type: v2/v3/v4 tpu-ubuntu2204-base,
                            v5litepod v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5,
                            v6e v2-alpha-tpuv6e]
  --spot                    spot capacity: cheap, may be preempted at any time
                            [\$PPO_JAX_TPU_SPOT=1]
  --preemptible             legacy preemptible capacity (direct create only)
                            [\$PPO_JAX_TPU_PREEMPTIBLE=1]
  --queued                  request it as a queued resource (named like the TPU)
                            and wait until it is ACTIVE; the usual way to get
                            spot or large slices [\$PPO_JAX_TPU_QUEUED=1]
  --wait-minutes=N          queued: give up waiting after N minutes, 0 = do not
                            wait [\$PPO_JAX_TPU_WAIT_MINUTES, default 120]
  --poll-seconds=N          queued: seconds between state checks
                            [\$PPO_JAX_TPU_POLL_SECONDS, default 30]
  -- EXTRA_GCLOUD_FLAGS     appended to the create command as given, e.g.
                            -- --network=my-net --labels=team=rl

$COMMON_FLAGS_HELP

Examples:
  $SCRIPT_NAME --name=ppo-v4 --zone=us-central2-b --accelerator-type=v4-8
  $SCRIPT_NAME --name=ppo-v5p --zone=us-east5-a --accelerator-type=v5p-32 --spot --queued
EOF
}

# default_runtime_version TYPE: the TPU software version Google recommends for
# JAX on that TPU generation (docs: cloud.google.com/tpu/docs/runtimes).
default_runtime_version() {
  case "$1" in
    v2-* | v3-* | v4-*) printf tpu-ubuntu2204-base ;;
    v5litepod-* | v5e-*) printf v2-alpha-tpuv5-lite ;;
    v5p-*) printf v2-alpha-tpuv5 ;;
    v6e-*) printf v2-alpha-tpuv6e ;;
    *) return 1 ;;
  esac
}

ACCELERATOR_TYPE=$(flag_default ACCELERATOR_TYPE v4-8)
RUNTIME_VERSION=$(flag_default RUNTIME_VERSION "")
SPOT=$(bool_default SPOT)
PREEMPTIBLE=$(bool_default PREEMPTIBLE)
QUEUED=$(bool_default QUEUED)
WAIT_MINUTES=$(flag_default WAIT_MINUTES 120)
POLL_SECONDS=$(flag_default POLL_SECONDS 30)
EXTRA_GCLOUD_FLAGS=()

while (($#)); do
  if parse_common_flag "$@"; then shift "$OPT_SHIFT"; continue; fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --accelerator-type | --accelerator-type=*) take_value "$@"; ACCELERATOR_TYPE=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --runtime-version | --runtime-version=*) take_value "$@"; RUNTIME_VERSION=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --wait-minutes | --wait-minutes=*) take_value "$@"; WAIT_MINUTES=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --poll-seconds | --poll-seconds=*) take_value "$@"; POLL_SECONDS=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --spot) SPOT=1; shift ;;
    --preemptible) PREEMPTIBLE=1; shift ;;
    --queued) QUEUED=1; shift ;;
    --spot=* | --preemptible=* | --queued=*) die "${1%%=*} takes no value (got '$1')" ;;
    --) shift; EXTRA_GCLOUD_FLAGS=("$@"); break ;;
    *) unknown_flag "$1" ;;
  esac
done

validate_common
[[ $ACCELERATOR_TYPE =~ ^[a-z][a-z0-9]*-[0-9]+$ ]] ||
  die "--accelerator-type '$ACCELERATOR_TYPE' should look like v4-8, v5litepod-8 or v5p-32 (list them: gcloud compute tpus accelerator-types list --zone=$TPU_ZONE)"
if [[ -z $RUNTIME_VERSION ]]; then
  RUNTIME_VERSION=$(default_runtime_version "$ACCELERATOR_TYPE") ||
    die "no default runtime version for '$ACCELERATOR_TYPE': pass --runtime-version (list them: gcloud compute tpus versions list --zone=$TPU_ZONE)"
fi
((!(SPOT && PREEMPTIBLE))) || die "--spot and --preemptible are exclusive: pick one (spot is the newer of the two)"
((!(QUEUED && PREEMPTIBLE))) || die "--preemptible does not exist for queued resources: use --spot --queued"
check_int --wait-minutes "$WAIT_MINUTES" 0
check_int --poll-seconds "$POLL_SECONDS" 1

gcloud_project_flag
CAPACITY=()
((!SPOT)) || CAPACITY=(--spot)
((!PREEMPTIBLE)) || CAPACITY=(--preemptible)

if ((!QUEUED)); then
  # Blocks until the TPU is READY (or fails).
  note "creating TPU $TPU_NAME ($ACCELERATOR_TYPE, $RUNTIME_VERSION) in $TPU_ZONE"
  run gcloud compute tpus tpu-vm create "$TPU_NAME" --zone="$TPU_ZONE" \
    --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" \
    "${CAPACITY[@]}" "${PROJECT_FLAG[@]}" "${EXTRA_GCLOUD_FLAGS[@]}"
  exit 0
fi

# Queued: the request returns at once; the node (named like the request) exists
# only once the request is ACTIVE.
note "requesting queued resource $TPU_NAME ($ACCELERATOR_TYPE, $RUNTIME_VERSION) in $TPU_ZONE"
run gcloud compute tpus queued-resources create "$TPU_NAME" --zone="$TPU_ZONE" \
  --node-id="$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" \
  "${CAPACITY[@]}" "${PROJECT_FLAG[@]}" "${EXTRA_GCLOUD_FLAGS[@]}"

if ((WAIT_MINUTES == 0)); then
  note "not waiting (--wait-minutes=0); the TPU is usable once its queued resource is ACTIVE"
  exit 0
fi
DESCRIBE=(gcloud compute tpus queued-resources describe "$TPU_NAME" --zone="$TPU_ZONE"
  --format='value(state.state)' "${PROJECT_FLAG[@]}")
if ((DRY_RUN)); then
  # The real run repeats this until the state is ACTIVE.
  run "${DESCRIBE[@]}"
  exit 0
fi
deadline=$((SECONDS + 60 * 10#$WAIT_MINUTES))
while :; do
  state=$("${DESCRIBE[@]}") || fail "could not read the state of queued resource $TPU_NAME"
  case "$state" in
    ACTIVE) note "queued resource $TPU_NAME is ACTIVE"; exit 0 ;;
    FAILED | SUSPENDING | SUSPENDED | DELETING)
      fail "queued resource $TPU_NAME is $state; see: $(quote_cmd gcloud compute tpus queued-resources describe "$TPU_NAME" --zone="$TPU_ZONE" "${PROJECT_FLAG[@]}")" ;;
  esac
  ((SECONDS < deadline)) ||
    fail "queued resource $TPU_NAME is still ${state:-not ready} after $WAIT_MINUTES minutes and stays queued; check it with: $(quote_cmd "${DESCRIBE[@]}") (or remove it: delete.sh --queued)"
  note "queued resource $TPU_NAME is ${state:-not yet visible}; checking again in ${POLL_SECONDS}s"
  sleep "$POLL_SECONDS"
done
