#!/usr/bin/env bash
# Launch the same training command on every worker of a TPU VM or pod slice, in
# the background (setsid + nohup: an ssh drop does not stop it), each worker
# logging to its own disk; then stream worker 0's log.
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$SCRIPT_DIR/common.sh"

usage() {
  cat <<EOF
Usage: $SCRIPT_NAME [flags] -- TRAIN_ARGS...

Run 'python -m <module> TRAIN_ARGS...' from ~/<remote-dir>/src with the
virtualenv made by setup.sh, on all workers at once (multi-host JAX: the same
program on every host). It runs with PYTHONUNBUFFERED=1 and
PPO_JAX_DISTRIBUTED=auto, so the trainer calls jax.distributed.initialize()
without arguments, which on TPU VMs finds the other workers itself. Each worker writes ~/<remote-dir>/logs/$LOG_FILE (an older one is renamed
with a timestamp), $PID_FILE, and $EXIT_FILE when the program ends by itself.

Flags:
  --module=MODULE     Python module to run [\$PPO_JAX_TPU_MODULE, default ppo_jax.cli.train]
  --env=KEY=VALUE     environment variable for the program; repeatable
                      [\$PPO_JAX_TPU_ENV: space-separated KEY=VALUE words]
  --replace           stop a training that is still running on a worker (its
                      whole process group, TERM then KILL after 60 s) instead
                      of refusing to start [\$PPO_JAX_TPU_REPLACE=1]
  --follow=W          after launching, stream the log of worker W (0, 1, ...),
                      of all workers (all, each line prefixed), or none
                      [\$PPO_JAX_TPU_FOLLOW, default 0]; Ctrl-C stops only the stream
  --remote-dir=DIR    [\$PPO_JAX_TPU_REMOTE_DIR, default $DEFAULT_REMOTE_DIR]
  -- TRAIN_ARGS       the program's arguments, passed as given; for ppo_jax.cli.train
                      --config and --workdir are required, and the workdir should
                      be gs://... so checkpoints outlive the TPU

$COMMON_FLAGS_HELP

Example:
  $SCRIPT_NAME --name=ppo-v5p --zone=us-east5-a -- \\
      --config=configs/ppo_toy.py --workdir=gs://my-bucket/runs/toy --config.seed=1
EOF
}

MODULE=$(flag_default MODULE ppo_jax.cli.train)
ENV_ASSIGNMENTS=()
read -r -a ENV_ASSIGNMENTS <<<"$(flag_default ENV "")"
REPLACE=$(bool_default REPLACE)
FOLLOW=$(flag_default FOLLOW 0)
REMOTE_DIR=$(flag_default REMOTE_DIR "$DEFAULT_REMOTE_DIR")
TRAIN_ARGS=()
SAW_SEPARATOR=0

while (($#)); do
  if parse_common_flag "$@"; then shift "$OPT_SHIFT"; continue; fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --module | --module=*) take_value "$@"; MODULE=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --env | --env=*) take_value "$@"; ENV_ASSIGNMENTS+=("$OPT_VALUE"); shift "$OPT_SHIFT" ;;
    --follow | --follow=*) take_value "$@"; FOLLOW=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --remote-dir | --remote-dir=*) take_value "$@"; REMOTE_DIR=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --replace) REPLACE=1; shift ;;
    --replace=*) die "--replace takes no value (got '$1')" ;;
    --) shift; TRAIN_ARGS=("$@"); SAW_SEPARATOR=1; break ;;
    *) unknown_flag "$1" ;;
  esac
done

validate_common
validate_remote_dir "$REMOTE_DIR"
[[ $MODULE =~ ^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$ ]] ||
  die "--module '$MODULE' is not a Python module name (like ppo_jax.cli.train)"
for assignment in "${ENV_ASSIGNMENTS[@]}"; do
  [[ $assignment =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] ||
    die "--env '$assignment' should be KEY=VALUE with KEY a variable name"
done
[[ $FOLLOW == none ]] || validate_worker "$FOLLOW"
((SAW_SEPARATOR)) ||
  die "no training command: put the program's arguments after '--', e.g. -- --config=configs/ppo_toy.py --workdir=gs://BUCKET/run"
find_workdir "${TRAIN_ARGS[@]}"
has_flag() {  # has_flag FLAG ARGS...: one of ARGS is FLAG or FLAG=VALUE (a loop: `printf | grep -q` under
  # pipefail failed now and then, when grep exited on its match before printf had written everything)
  local flag=$1 arg
  shift
  for arg in "$@"; do
    [[ $arg == "$flag" || $arg == "$flag="* ]] && return 0
  done
  return 1
}
if [[ $MODULE == ppo_jax.cli.train ]]; then
  for required in --config --workdir; do
    has_flag "$required" "${TRAIN_ARGS[@]}" ||
      die "ppo_jax.cli.train needs $required: add it after '--' (e.g. -- --config=configs/ppo_toy.py --workdir=gs://BUCKET/run)"
  done
fi
if [[ -n $WORKDIR && $WORKDIR != gs://* ]]; then
  note "warning: --workdir=$WORKDIR is on each worker's own disk: it is lost with the TPU, and a pod slice needs one shared (gs://) directory for its checkpoints"
fi

REMOTE=$(remote_path "$REMOTE_DIR")
LOGS="$REMOTE/logs"
PID="$LOGS/$PID_FILE"
# The wrapper, run by a fresh session leader (setsid, so an ssh drop cannot
# signal it), records its pid (also the process group to stop with --replace),
# runs the program given as its arguments with output to the log, and records
# the exit status when the program ends by itself. Its logs directory is $0.
# shellcheck disable=SC2016  # the wrapper's $ are for the worker's shell
WRAPPER='echo $$ > "$0"/'"$PID_FILE"'; "$@" > "$0"/'"$LOG_FILE"' 2>&1; echo $? > "$0"/'"$EXIT_FILE"
# PPO_JAX_DISTRIBUTED=auto: the trainer calls jax.distributed.initialize() with
# no arguments, which on TPU VMs finds the other workers by itself (--env after
# it can override it: with env, the last assignment wins).
PROGRAM="$(quote_cmd env PYTHONUNBUFFERED=1 PPO_JAX_DISTRIBUTED=auto "${ENV_ASSIGNMENTS[@]}")"
PROGRAM+=" $REMOTE/venv/bin/python"
PROGRAM+=" $(quote_cmd -m "$MODULE" "${TRAIN_ARGS[@]}")"
RUNNING="[ -f $PID ] && alive \"\$(cat $PID)\""

STEPS=("set -e" "$REMOTE_ALIVE_FN" "[ -x $REMOTE/venv/bin/python ] || { echo \"error: no ppo_jax virtualenv on \$(hostname): run setup.sh first\" >&2; exit 1; }"
  "mkdir -p $LOGS" "cd $REMOTE/src")
if ((REPLACE)); then
  STEPS+=("if $RUNNING; then pid=\$(cat $PID); echo \"stopping pid \$pid on \$(hostname)\"; kill -TERM -\"\$pid\" 2>/dev/null || true; i=0; while alive \"\$pid\" && [ \$i -lt 60 ]; do sleep 1; i=\$((i+1)); done; kill -KILL -\"\$pid\" 2>/dev/null || true; fi")
else
  STEPS+=("if $RUNNING; then echo \"error: a training already runs on \$(hostname) (pid \$(cat $PID)): pass --replace to stop it first\" >&2; exit 1; fi")
fi
STEPS+=("rm -f $PID $LOGS/$EXIT_FILE"
  "if [ -f $LOGS/$LOG_FILE ]; then mv $LOGS/$LOG_FILE $LOGS/train.\$(date +%Y%m%d-%H%M%S).log; fi"
  "nohup setsid bash -c $(quote "$WRAPPER") $LOGS $PROGRAM > /dev/null 2>&1 < /dev/null &"
  "echo \"launched on \$(hostname); log: ~/$REMOTE_DIR/logs/$LOG_FILE\"")

join_steps "${STEPS[@]}"
note "launching '$(quote_cmd python -m "$MODULE" "${TRAIN_ARGS[@]}")' on all workers of $TPU_NAME"
ssh_cmd all "$REMOTE_COMMAND"
run "${SSH_CMD[@]}"

if [[ $FOLLOW != none ]]; then
  common_args
  exec "$SCRIPT_DIR/logs.sh" "${COMMON_ARGS[@]}" --worker="$FOLLOW" --remote-dir="$REMOTE_DIR"
fi
