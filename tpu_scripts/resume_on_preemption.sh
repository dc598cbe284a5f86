#!/usr/bin/env bash
# Keep a training alive across preemptions: watch the TPU's state and, when it
# has been preempted (or is gone), delete it, create it again, set it up and
# relaunch the same command. The trainer resumes from the last checkpoint in
# its gs:// workdir by itself, so relaunching is all a resume takes.
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$SCRIPT_DIR/common.sh"

usage() {
  cat <<EOF
Usage: $SCRIPT_NAME [flags] -- TRAIN_ARGS...

Every --poll-seconds, read the TPU's state with
  gcloud compute tpus tpu-vm describe NAME --zone=ZONE --format='value(state)'
and act on it:
  READY                        ask worker 0 how the training is doing: still
                               running -> nothing; ended with status 0 -> done
                               (exit 0); ended with 143 (stopped by SIGTERM or a
                               preemption notice, after a save) -> relaunch;
                               ended with another status (130: Ctrl-C) -> stop
                               (exit 1) or relaunch (--on-failure=relaunch);
                               not running at all -> relaunch (launch.sh --replace)
  PREEMPTED, TERMINATED, gone  delete.sh, create.sh, setup.sh, launch.sh
  anything else (CREATING...)  wait
Each relaunch or re-creation counts against --max-restarts. With --queued, a
TPU that is gone while its queued resource still waits for capacity is waited
for, not re-created. Run it after (or instead of) create/setup/launch, e.g. in
tmux or with nohup; stop it (Ctrl-C) before deleting the TPU by hand.

Flags of this script:
  --poll-seconds=N       seconds between checks [\$PPO_JAX_TPU_POLL_SECONDS, default 60]
  --max-restarts=N       give up (exit 1) after N relaunches/re-creations
                         [\$PPO_JAX_TPU_MAX_RESTARTS, default 10]
  --on-failure=ACTION    when the training exits non-zero: stop or relaunch
                         [\$PPO_JAX_TPU_ON_FAILURE, default stop]
  --delete-when-done     delete the TPU once the training has ended with status 0
                         [\$PPO_JAX_TPU_DELETE_WHEN_DONE=1]
  --simulate-state=S     with --dry-run: pretend describe said S (READY,
                         PREEMPTED, TERMINATED, MISSING, ...) and print what one
                         check would run [default PREEMPTED]
Passed on to create.sh: --accelerator-type, --runtime-version, --spot,
  --preemptible, --queued (also to delete.sh), --wait-minutes
Passed on to setup.sh: --src-dir, --ref, --git-url, --python-version, --extras,
  --pip-packages. When copying a local checkout, --ref is resolved to a commit
  once, at start, so every re-creation installs the same code.
Passed on to launch.sh: --module, --env (repeatable), and TRAIN_ARGS after '--',
  which must include --workdir=gs://... (where the checkpoints survive).
Passed on to all: --remote-dir and the common flags.

$COMMON_FLAGS_HELP

Example:
  $SCRIPT_NAME --name=ppo-v5p --zone=us-east5-a --accelerator-type=v5p-32 \\
      --spot --queued -- --config=configs/ppo_toy.py --workdir=gs://my-bucket/runs/toy
EOF
}

POLL_SECONDS=$(flag_default POLL_SECONDS 60)
MAX_RESTARTS=$(flag_default MAX_RESTARTS 10)
ON_FAILURE=$(flag_default ON_FAILURE stop)
DELETE_WHEN_DONE=$(bool_default DELETE_WHEN_DONE)
SIMULATE_STATE=""
QUEUED=$(bool_default QUEUED)
REMOTE_DIR=$(flag_default REMOTE_DIR "$DEFAULT_REMOTE_DIR")
SRC_DIR=$(flag_default SRC_DIR "$(dirname "$SCRIPT_DIR")")
REF=$(flag_default REF HEAD)
GIT_URL=$(flag_default GIT_URL "")
CREATE_ARGS=()
SETUP_ARGS=()
LAUNCH_ARGS=()
TRAIN_ARGS=()
SAW_SEPARATOR=0

while (($#)); do
  if parse_common_flag "$@"; then shift "$OPT_SHIFT"; continue; fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --poll-seconds | --poll-seconds=*) take_value "$@"; POLL_SECONDS=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --max-restarts | --max-restarts=*) take_value "$@"; MAX_RESTARTS=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --on-failure | --on-failure=*) take_value "$@"; ON_FAILURE=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --simulate-state | --simulate-state=*) take_value "$@"; SIMULATE_STATE=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --delete-when-done) DELETE_WHEN_DONE=1; shift ;;
    --queued) QUEUED=1; shift ;;
    --spot | --preemptible) CREATE_ARGS+=("$1"); shift ;;
    --accelerator-type | --accelerator-type=* | --runtime-version | --runtime-version=* | --wait-minutes | --wait-minutes=*)
      take_value "$@"; CREATE_ARGS+=("${1%%=*}=$OPT_VALUE"); shift "$OPT_SHIFT" ;;
    --src-dir | --src-dir=*) take_value "$@"; SRC_DIR=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --ref | --ref=*) take_value "$@"; REF=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --git-url | --git-url=*) take_value "$@"; GIT_URL=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --python-version | --python-version=* | --extras | --extras=* | --pip-packages | --pip-packages=*)
      take_value "$@"; SETUP_ARGS+=("${1%%=*}=$OPT_VALUE"); shift "$OPT_SHIFT" ;;
    --module | --module=* | --env | --env=*)
      take_value "$@"; LAUNCH_ARGS+=("${1%%=*}=$OPT_VALUE"); shift "$OPT_SHIFT" ;;
    --remote-dir | --remote-dir=*) take_value "$@"; REMOTE_DIR=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --delete-when-done=* | --queued=* | --spot=* | --preemptible=*) die "${1%%=*} takes no value (got '$1')" ;;
    --) shift; TRAIN_ARGS=("$@"); SAW_SEPARATOR=1; break ;;
    *) unknown_flag "$1" ;;
  esac
done

validate_common
validate_remote_dir "$REMOTE_DIR"
check_int --poll-seconds "$POLL_SECONDS" 1
check_int --max-restarts "$MAX_RESTARTS" 0
[[ $ON_FAILURE == stop || $ON_FAILURE == relaunch ]] || die "--on-failure must be stop or relaunch, got '$ON_FAILURE'"
if [[ -n $SIMULATE_STATE ]]; then
  ((DRY_RUN)) || die "--simulate-state only makes sense with --dry-run"
  [[ $SIMULATE_STATE =~ ^[A-Z_]+$ ]] || die "--simulate-state '$SIMULATE_STATE' should be a TPU state in capitals, like PREEMPTED or READY"
fi
((SAW_SEPARATOR)) ||
  die "no training command: put its arguments after '--', e.g. -- --config=configs/ppo_toy.py --workdir=gs://BUCKET/run"
find_workdir "${TRAIN_ARGS[@]}"
[[ $WORKDIR == gs://* ]] ||
  die "the training needs --workdir=gs://BUCKET/PATH after '--' (got '${WORKDIR:-none}'): a re-created TPU resumes only from checkpoints kept off the TPU"

if [[ -z $GIT_URL ]]; then
  git -C "$SRC_DIR" rev-parse --is-inside-work-tree >/dev/null 2>&1 ||
    die "--src-dir '$SRC_DIR' is not a git checkout: point --src-dir at one, or use --git-url=URL"
  COMMIT=$(git -C "$SRC_DIR" rev-parse --verify --quiet "$REF^{commit}") ||
    die "--ref '$REF' is not a commit in $SRC_DIR"
  SETUP_ARGS+=(--src-dir="$SRC_DIR" --ref="$COMMIT")
else
  SETUP_ARGS+=(--git-url="$GIT_URL" --ref="$REF")
fi
((!QUEUED)) || CREATE_ARGS+=(--queued)
DELETE_ARGS=()
((!QUEUED)) || DELETE_ARGS+=(--queued)

common_args
CREATE=("$SCRIPT_DIR/create.sh" "${COMMON_ARGS[@]}" "${CREATE_ARGS[@]}")
SETUP=("$SCRIPT_DIR/setup.sh" "${COMMON_ARGS[@]}" --remote-dir="$REMOTE_DIR" "${SETUP_ARGS[@]}")
LAUNCH=("$SCRIPT_DIR/launch.sh" "${COMMON_ARGS[@]}" --remote-dir="$REMOTE_DIR" --replace --follow=none
  "${LAUNCH_ARGS[@]}" -- "${TRAIN_ARGS[@]}")
DELETE=("$SCRIPT_DIR/delete.sh" "${COMMON_ARGS[@]}" "${DELETE_ARGS[@]}")

# Check every flag the steps will get now, not at the first preemption hours
# later: each script's dry run validates its flags and runs nothing.
for step in create setup launch delete; do
  case $step in
    create) step_cmd=("${CREATE[@]}") ;;
    setup) step_cmd=("${SETUP[@]}") ;;
    launch) step_cmd=("${LAUNCH[@]}") ;;
    delete) step_cmd=("${DELETE[@]}") ;;
  esac
  # (--dry-run first: launch.sh's command ends with "-- TRAIN_ARGS".)
  if ! step_errors=$("${step_cmd[0]}" --dry-run "${step_cmd[@]:1}" 2>&1 >/dev/null); then
    printf '%s\n' "$step_errors" >&2
    die "the flags for $step.sh are not valid (see above)"
  fi
done

gcloud_project_flag
DESCRIBE=(gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone="$TPU_ZONE" --format='value(state)'
  "${PROJECT_FLAG[@]}")
DESCRIBE_QUEUED=(gcloud compute tpus queued-resources describe "$TPU_NAME" --zone="$TPU_ZONE"
  --format='value(state.state)' "${PROJECT_FLAG[@]}")
LOGS="$(remote_path "$REMOTE_DIR")/logs"
# What worker 0 says about the training: running, exit:<status>, or not-running.
ssh_cmd 0 "$REMOTE_ALIVE_FN; if [ -f $LOGS/$EXIT_FILE ]; then echo exit:\$(cat $LOGS/$EXIT_FILE); elif [ -f $LOGS/$PID_FILE ] && alive \"\$(cat $LOGS/$PID_FILE)\"; then echo running; else echo not-running; fi"
TRAINING_STATUS=("${SSH_CMD[@]}")
RESTARTS=0

# describe_state CMD...: the state printed by a describe command; MISSING when
# gcloud says the resource does not exist; UNKNOWN when it failed otherwise
# (network, auth: nothing to act on, try again at the next check).
describe_state() {
  local out err_file
  err_file=$(mktemp)
  if out=$("$@" 2>"$err_file"); then
    rm -f "$err_file"
    printf '%s' "${out:-UNKNOWN}"
  elif grep -qiE 'not.?found' "$err_file"; then
    rm -f "$err_file"
    printf MISSING
  else
    note "could not read the state: $(tr '\n' ' ' <"$err_file")"
    rm -f "$err_file"
    printf UNKNOWN
  fi
}

count_restart() {
  RESTARTS=$((RESTARTS + 1))
  ((RESTARTS <= MAX_RESTARTS)) || fail "gave up after $MAX_RESTARTS restarts (--max-restarts)"
  note "restart $RESTARTS of at most $MAX_RESTARTS: $*"
}

# A step that fails is retried at the next check (it has used up a restart).
recreate() {
  count_restart "TPU $TPU_NAME is $1: re-creating it"
  if [[ $1 != MISSING ]] || ((QUEUED)); then
    # Queued: the queued resource outlives its preempted TPU and must go too.
    "${DELETE[@]}" || note "delete failed (maybe nothing was left to delete); creating anyway"
  fi
  "${CREATE[@]}" || { note "create failed; trying again at the next check"; return 0; }
  "${SETUP[@]}" || { note "setup failed; trying again at the next check"; return 0; }
  "${LAUNCH[@]}" || { note "launch failed; trying again at the next check"; return 0; }
  if ((DRY_RUN)); then
    note "dry run: the trainer would resume from the last checkpoint in $WORKDIR"
  else
    note "relaunched: the trainer resumes from the last checkpoint in $WORKDIR"
  fi
}

relaunch() {
  count_restart "$1: relaunching"
  "${LAUNCH[@]}" && return 0
  note "launch failed: setting the workers up again, then launching"
  if ! { "${SETUP[@]}" && "${LAUNCH[@]}"; }; then
    note "relaunch failed; trying again at the next check"
  fi
}

check_training() {
  local status
  if ((DRY_RUN)); then
    run "${TRAINING_STATUS[@]}"
    note "dry run: the real run acts on worker 0's answer (running / exit:N / not-running)"
    return 0
  fi
  status=$("${TRAINING_STATUS[@]}" 2>/dev/null | tail -n 1) || status=""
  case "$status" in
    running) ;;
    exit:0)
      note "training finished (exit status 0 on worker 0)"
      if ((DELETE_WHEN_DONE)); then "${DELETE[@]}"; fi
      exit 0 ;;
    exit:143) relaunch "training was stopped by SIGTERM or a preemption notice (exit status 143) after saving" ;;
    exit:*)
      [[ $ON_FAILURE == relaunch ]] ||
        fail "training exited with status ${status#exit:} on worker 0; see $(quote_cmd "$SCRIPT_DIR/logs.sh" --name="$TPU_NAME" --zone="$TPU_ZONE" --worker=all --no-follow)"
      relaunch "training exited with status ${status#exit:}" ;;
    not-running) relaunch "no training is running on worker 0" ;;
    *) note "could not ask worker 0 about the training; trying again at the next check" ;;
  esac
}

# handle STATE: one check's action.
handle() {
  case "$1" in
    READY) check_training ;;
    PREEMPTED | TERMINATED) recreate "$1" ;;
    MISSING)
      if ((QUEUED)); then
        local queued_state
        if ((DRY_RUN)); then
          run "${DESCRIBE_QUEUED[@]}"
          note "dry run: assuming no queued resource waits for capacity"
          queued_state=MISSING
        else
          queued_state=$(describe_state "${DESCRIBE_QUEUED[@]}")
        fi
        case "$queued_state" in
          CREATING | ACCEPTED | PROVISIONING | WAITING_FOR_RESOURCES)
            note "queued resource $TPU_NAME is $queued_state: waiting"
            return 0 ;;
        esac
      fi
      recreate MISSING ;;
    UNKNOWN) ;;
    *) note "TPU $TPU_NAME is $1: waiting" ;;
  esac
}

note "watching TPU $TPU_NAME in $TPU_ZONE every ${POLL_SECONDS}s (at most $MAX_RESTARTS restarts)"
if ((DRY_RUN)); then
  run "${DESCRIBE[@]}"
  state=${SIMULATE_STATE:-PREEMPTED}
  note "dry run: simulating state $state"
  handle "$state"
  exit 0
fi
while :; do
  handle "$(describe_state "${DESCRIBE[@]}")"
  sleep "$POLL_SECONDS"
done
