#!/usr/bin/env bash
# Delete a TPU VM or pod slice, or the queued resource that holds it.
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$SCRIPT_DIR/common.sh"

usage() {
  cat <<EOF
Usage: $SCRIPT_NAME [flags]

Delete the TPU --name in --zone without asking (gcloud --quiet). Everything on
its disks (the checkout, the virtualenv, local logs) goes with it; checkpoints
and metrics in a gs:// workdir stay.

Flags:
  --queued   the TPU was made with create.sh --queued: delete the queued
             resource and, with it (--force), its TPU [\$PPO_JAX_TPU_QUEUED=1]
  --async    return without waiting for the deletion to finish
             [\$PPO_JAX_TPU_ASYNC=1]

$COMMON_FLAGS_HELP

Example:
  $SCRIPT_NAME --name=ppo-v5p --zone=us-east5-a --queued
EOF
}

QUEUED=$(bool_default QUEUED)
ASYNC=$(bool_default ASYNC)

while (($#)); do
  if parse_common_flag "$@"; then shift "$OPT_SHIFT"; continue; fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --queued) QUEUED=1; shift ;;
    --async) ASYNC=1; shift ;;
    --queued=* | --async=*) die "${1%%=*} takes no value (got '$1')" ;;
    *) unknown_flag "$1" ;;
  esac
done
validate_common

gcloud_project_flag
ASYNC_FLAG=()
((!ASYNC)) || ASYNC_FLAG=(--async)
if ((QUEUED)); then
  note "deleting queued resource $TPU_NAME and its TPU in $TPU_ZONE"
  run gcloud compute tpus queued-resources delete "$TPU_NAME" --zone="$TPU_ZONE" --force --quiet \
    "${ASYNC_FLAG[@]}" "${PROJECT_FLAG[@]}"
else
  note "deleting TPU $TPU_NAME in $TPU_ZONE"
  run gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone="$TPU_ZONE" --quiet \
    "${ASYNC_FLAG[@]}" "${PROJECT_FLAG[@]}"
fi
