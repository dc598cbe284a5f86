#!/usr/bin/env bash
# Stream (or print) the training log that launch.sh writes on each worker.
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$SCRIPT_DIR/common.sh"

usage() {
  cat <<EOF
Usage: $SCRIPT_NAME [flags]

Show ~/<remote-dir>/logs/$LOG_FILE of worker 0 (or others) of the TPU --name,
following it as it grows until Ctrl-C (which stops only the stream, never the
training). With several workers every line is prefixed "[worker N] ".

Flags:
  --worker=W        0 (default), another index, a list (0,3), a range (0-3) or all
                    [\$PPO_JAX_TPU_WORKER, default 0]
  --lines=N         start with the last N lines [\$PPO_JAX_TPU_LINES, default 100]
  --no-follow       print the last lines and return [\$PPO_JAX_TPU_NO_FOLLOW=1]
  --file=NAME       another file in the logs directory, e.g. an older
                    train.20250101-120000.log [\$PPO_JAX_TPU_FILE, default $LOG_FILE]
  --remote-dir=DIR  [\$PPO_JAX_TPU_REMOTE_DIR, default $DEFAULT_REMOTE_DIR]

$COMMON_FLAGS_HELP

Example:
  $SCRIPT_NAME --name=ppo-v5p --zone=us-east5-a --worker=all
EOF
}

WORKER=$(flag_default WORKER 0)
LINES_SHOWN=$(flag_default LINES 100)
NO_FOLLOW=$(bool_default NO_FOLLOW)
FILE=$(flag_default FILE "$LOG_FILE")
REMOTE_DIR=$(flag_default REMOTE_DIR "$DEFAULT_REMOTE_DIR")

while (($#)); do
  if parse_common_flag "$@"; then shift "$OPT_SHIFT"; continue; fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --worker | --worker=*) take_value "$@"; WORKER=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --lines | --lines=*) take_value "$@"; LINES_SHOWN=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --file | --file=*) take_value "$@"; FILE=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --remote-dir | --remote-dir=*) take_value "$@"; REMOTE_DIR=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --no-follow) NO_FOLLOW=1; shift ;;
    --no-follow=*) die "--no-follow takes no value (got '$1')" ;;
    *) unknown_flag "$1" ;;
  esac
done

validate_common
validate_worker "$WORKER"
validate_remote_dir "$REMOTE_DIR"
check_int --lines "$LINES_SHOWN" 0
[[ $FILE =~ ^[A-Za-z0-9_][A-Za-z0-9._-]*$ ]] || die "--file '$FILE' must be a file name in the logs directory"

TAIL="tail -n $((10#$LINES_SHOWN))"
((NO_FOLLOW)) || TAIL+=" -F"
TAIL+=" $(remote_path "$REMOTE_DIR")/logs/$(quote "$FILE")"
if [[ $WORKER =~ ^[0-9]+$ ]]; then
  REMOTE_COMMAND=$TAIL
else
  # TPU worker host names end in -w-<index>; fall back to the whole host name.
  # shellcheck disable=SC2016  # evaluated by the worker's shell
  REMOTE_COMMAND='w=$(hostname); w=${w##*-w-}; '"$TAIL"' 2>&1 | awk -v p="[worker $w] " '\''{ print p $0; fflush() }'\'
fi
ssh_cmd "$WORKER" "$REMOTE_COMMAND"
run "${SSH_CMD[@]}"
