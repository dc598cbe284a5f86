# shellcheck shell=bash disable=SC2034
# (SC2034: the globals set here are read by the scripts that source this file.)
# Shared helpers for the tpu_scripts, sourced (never executed) by each of them:
# error reporting, shell quoting, the dry-run aware `run`, flag parsing with
# environment fallbacks, validation of TPU names/zones/types, and the gcloud
# command prefixes every script builds on.
#
# Conventions every script follows:
#   * every setting is a flag; `--some-flag` falls back to $PPO_JAX_TPU_SOME_FLAG,
#     then to a default (see each script's --help);
#   * `--dry-run` prints each command, shell-quoted, one per line on stdout,
#     instead of running it; progress notes go to stderr in both modes;
#   * bad or missing flags exit with status 2 and an "error: <script>: ..." line
#     before anything runs.

if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 4))); then
  # Empty "${array[@]}" under `set -u` is an error before bash 4.4.
  printf 'error: these scripts need bash >= 4.4 (this is %s); on macOS: brew install bash\n' \
    "$BASH_VERSION" >&2
  exit 2
fi

SCRIPT_NAME=${0##*/}
DRY_RUN=0

# The layout on every worker, relative to the remote user's home directory:
#   <remote-dir>/src   the package source (replaced by each setup.sh)
#   <remote-dir>/venv  the virtualenv (kept across setups)
#   <remote-dir>/logs  train.log, train.pid, train.exit (written by launch.sh)
DEFAULT_REMOTE_DIR=ppo_jax

# die MESSAGE: a usage error (bad or missing flag): exit status 2.
die() {
  printf 'error: %s: %s\n' "$SCRIPT_NAME" "$*" >&2
  exit 2
}

# fail MESSAGE: a runtime failure (not a usage error): exit status 1.
fail() {
  printf 'error: %s: %s\n' "$SCRIPT_NAME" "$*" >&2
  exit 1
}

note() {
  printf '[%s] %s\n' "$SCRIPT_NAME" "$*" >&2
}

# quote WORD: WORD in a form any POSIX shell reads back as exactly WORD.
# Plain words stay bare; anything else is single-quoted with ' written as '\''.
# (Unlike printf %q this never emits bash-only $'...', so the remote commands
# below work whatever the login shell on the TPU VM is, and stay readable.)
quote() {
  local word=$1 escaped_quote="'\\''"
  if [[ -n $word && $word =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$word"
  else
    printf "'%s'" "${word//\'/"$escaped_quote"}"
  fi
}

# quote_cmd WORD...: the words quoted and joined by single spaces.
quote_cmd() {
  local word line=""
  for word in "$@"; do
    line+="${line:+ }$(quote "$word")"
  done
  printf '%s' "$line"
}

# run CMD ARG...: print the command (dry run) or run it.
run() {
  if ((DRY_RUN)); then
    printf '%s\n' "$(quote_cmd "$@")"
  else
    "$@"
  fi
}

# flag_default NAME DEFAULT: $PPO_JAX_TPU_<NAME> if set and non-empty, else DEFAULT.
flag_default() {
  local var="PPO_JAX_TPU_$1"
  printf '%s' "${!var:-$2}"
}

# bool_default NAME: 1 if $PPO_JAX_TPU_<NAME> is 1/true/yes, else 0.
bool_default() {
  local var="PPO_JAX_TPU_$1"
  case "${!var:-}" in
    1 | true | TRUE | True | yes | YES) printf 1 ;;
    '' | 0 | false | FALSE | False | no | NO) printf 0 ;;
    *) die "\$$var must be 1/true/yes or 0/false/no, got '${!var}'" ;;
  esac
}

# take_value "$@": read the value of the flag in $1, given as --flag=VALUE or
# --flag VALUE. Sets OPT_VALUE and OPT_SHIFT (how many words to shift).
take_value() {
  local flag=${1%%=*}
  if [[ $1 == *=* ]]; then
    OPT_VALUE=${1#*=}
    OPT_SHIFT=1
  elif (($# >= 2)) && [[ $2 != --* ]]; then
    OPT_VALUE=$2
    OPT_SHIFT=2
  else
    die "$flag needs a value: $flag=VALUE (see $SCRIPT_NAME --help)"
  fi
  [[ -n $OPT_VALUE ]] || die "$flag is empty: give it a value (see $SCRIPT_NAME --help)"
}

unknown_flag() {
  die "unknown flag '$1' (see $SCRIPT_NAME --help)"
}

# Settings shared by every script.
TPU_NAME=$(flag_default NAME ppo-jax)
TPU_ZONE=$(flag_default ZONE "")
TPU_PROJECT=$(flag_default PROJECT "")

COMMON_FLAGS_HELP="Common flags (every script):
  --name=NAME        TPU VM / pod slice name   [\$PPO_JAX_TPU_NAME, default ppo-jax]
  --zone=ZONE        e.g. us-central2-b (v4), us-west4-a (v5e), us-east5-a (v5p)
                     [\$PPO_JAX_TPU_ZONE, required]
  --project=PROJECT  GCP project  [\$PPO_JAX_TPU_PROJECT, default: gcloud's configured project]
  --dry-run          print the exact commands, one per line, instead of running them
  -h, --help         this help"

# parse_common_flag "$@": consume one common flag if $1 is one (return 0 and set
# OPT_SHIFT), else return 1. Callers print their own help for -h/--help.
parse_common_flag() {
  case "$1" in
    --name | --name=*) take_value "$@"; TPU_NAME=$OPT_VALUE ;;
    --zone | --zone=*) take_value "$@"; TPU_ZONE=$OPT_VALUE ;;
    --project | --project=*) take_value "$@"; TPU_PROJECT=$OPT_VALUE ;;
    --dry-run) DRY_RUN=1; OPT_SHIFT=1 ;;
    *) return 1 ;;
  esac
  return 0
}

# common_args: the common flags as given, to forward to another script.
common_args() {
  COMMON_ARGS=(--name="$TPU_NAME" --zone="$TPU_ZONE")
  [[ -z $TPU_PROJECT ]] || COMMON_ARGS+=(--project="$TPU_PROJECT")
  ((!DRY_RUN)) || COMMON_ARGS+=(--dry-run)
}

validate_common() {
  # TPU node ids: a lowercase letter, then lowercase letters, digits or hyphens,
  # at most 63 characters, not ending in a hyphen.
  [[ $TPU_NAME =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
    die "--name '$TPU_NAME' is not a valid TPU name: start with a lowercase letter, then lowercase letters, digits or '-', at most 63 characters, no trailing '-'"
  [[ -n $TPU_ZONE ]] ||
    die "no zone: pass --zone=ZONE (e.g. us-central2-b for v4, us-west4-a for v5e, us-east5-a for v5p) or set PPO_JAX_TPU_ZONE"
  [[ $TPU_ZONE =~ ^[a-z]+-[a-z]+[0-9]+-[a-z0-9]+$ ]] ||
    die "--zone '$TPU_ZONE' does not look like a zone (e.g. us-central2-b)"
  [[ -z $TPU_PROJECT || $TPU_PROJECT =~ ^[a-z][-a-z0-9.:]{4,61}[a-z0-9]$ ]] ||
    die "--project '$TPU_PROJECT' is not a valid project id"
}

validate_remote_dir() {
  [[ $1 =~ ^[A-Za-z0-9_][A-Za-z0-9._-]*$ ]] ||
    die "--remote-dir '$1' must be one directory name under the remote home (letters, digits, '.', '_', '-')"
}

# validate_worker W: what gcloud's --worker accepts with --command: all, an
# index, a comma-separated list or a range of indices.
validate_worker() {
  [[ $1 =~ ^(all|[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*)$ ]] ||
    die "--worker '$1' must be all, an index (0), a list (1,3) or a range (0-3)"
}

# check_int FLAG VALUE [MIN]: VALUE must be an integer >= MIN (default 1).
check_int() {
  local flag=$1 value=$2 min=${3:-1}
  if [[ ! $value =~ ^[0-9]+$ ]] || ((10#$value < min)); then
    die "$flag must be an integer >= $min, got '$value'"
  fi
}

# gcloud_project_flag: sets PROJECT_FLAG to (--project=P) when a project was
# given, else to () so gcloud uses its configured default project.
gcloud_project_flag() {
  PROJECT_FLAG=()
  [[ -z $TPU_PROJECT ]] || PROJECT_FLAG=(--project="$TPU_PROJECT")
}

# ssh_cmd WORKER REMOTE_COMMAND: sets SSH_CMD to the gcloud ssh command that
# runs REMOTE_COMMAND on WORKER (0, 1, ..., or all).
ssh_cmd() {
  gcloud_project_flag
  SSH_CMD=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$TPU_ZONE" --worker="$1"
    "${PROJECT_FLAG[@]}" --command="$2")
}

# remote_path DIR: shell text for $HOME/DIR on the worker. "$HOME" is left for
# the remote shell to expand; DIR is quoted here.
remote_path() {
  # shellcheck disable=SC2016  # $HOME must reach the remote shell unexpanded
  printf '"$HOME"/%s' "$(quote "$1")"
}

# find_workdir ARG...: sets WORKDIR to the value of --workdir=DIR / --workdir DIR
# among the training arguments ("" when absent).
find_workdir() {
  WORKDIR=""
  while (($#)); do
    case "$1" in
      --workdir=*) WORKDIR=${1#--workdir=} ;;
      --workdir) WORKDIR=${2:-} ;;
    esac
    shift
  done
}

# join_steps STEP...: sets REMOTE_COMMAND to the shell steps joined into one
# line: "; " between steps, but only a space after a step that ends in "&"
# ("cmd &; next" is a syntax error).
join_steps() {
  local step
  REMOTE_COMMAND=""
  for step in "$@"; do
    if [[ -z $REMOTE_COMMAND ]]; then
      REMOTE_COMMAND=$step
    elif [[ $REMOTE_COMMAND == *"&" ]]; then
      REMOTE_COMMAND+=" $step"
    else
      REMOTE_COMMAND+="; $step"
    fi
  done
}

# Shell text for the worker defining `alive SID`: true while a process of the
# session SID is alive (zombies do not count). launch.sh starts each training as
# a session of its own whose id is the recorded pid (and its process group id).
REMOTE_ALIVE_FN="alive() { ps -o stat= --sid \"\$1\" 2>/dev/null | grep -qv '^Z'; }"

# The files launch.sh keeps in <remote-dir>/logs on every worker.
LOG_FILE=train.log    # stdout and stderr of the training process
PID_FILE=train.pid    # its process (and process group) id
EXIT_FILE=train.exit  # its exit status, written when it ends by itself
