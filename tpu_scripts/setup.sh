#!/usr/bin/env bash
# Install ppo_jax on every worker of a TPU VM or pod slice: copy (or git-clone)
# the source, make a Python virtualenv with uv, pip install -e the package and
# jax[tpu], and check that it imports.
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$SCRIPT_DIR/common.sh"

usage() {
  cat <<EOF
Usage: $SCRIPT_NAME [flags]

Install ppo_jax on the workers (all of them by default) of the TPU --name.
The source is either a commit of a local git checkout, archived and copied to
every worker (default), or a git clone made on every worker (--git-url).
On each worker, under ~/<remote-dir>: src/ (replaced), venv/ (kept across
setups), logs/ (used by launch.sh).

Flags:
  --src-dir=DIR          local git checkout to copy [\$PPO_JAX_TPU_SRC_DIR,
                         default: the repository these scripts are in]
  --ref=REF              commit/branch/tag to install [\$PPO_JAX_TPU_REF, default
                         HEAD]; copying takes the committed tree of REF, so
                         uncommitted edits are not copied
  --git-url=URL          clone URL on the workers instead of copying
                         [\$PPO_JAX_TPU_GIT_URL]
  --remote-dir=DIR       directory under the remote home
                         [\$PPO_JAX_TPU_REMOTE_DIR, default $DEFAULT_REMOTE_DIR]
  --python-version=VER   Python for the virtualenv, given to 'uv venv --python'
                         (a version or a path; ppo_jax needs >= 3.11, the TPU
                         images ship 3.10) [\$PPO_JAX_TPU_PYTHON_VERSION, default 3.12]
  --extras=LIST          ppo_jax extras, e.g. tfds,hf-datasets [\$PPO_JAX_TPU_EXTRAS]
  --pip-packages=SPECS   space-separated extra requirements installed with it
                         [\$PPO_JAX_TPU_PIP_PACKAGES, default "jax[tpu] gcsfs";
                         gcsfs lets checkpoints and metrics go to gs:// workdirs]
  --worker=W             all (default), one index (0), a list (1,3) or a range
                         (0-3), e.g. to redo one worker; no environment
                         fallback, so \$PPO_JAX_TPU_WORKER (for logs.sh) never
                         narrows a setup by accident

$COMMON_FLAGS_HELP

Examples:
  $SCRIPT_NAME --name=ppo-v4 --zone=us-central2-b
  $SCRIPT_NAME --name=ppo-v5p --zone=us-east5-a --git-url=https://github.com/me/ppo_jax --ref=v0.1.0
EOF
}

SRC_DIR=$(flag_default SRC_DIR "$(dirname "$SCRIPT_DIR")")
REF=$(flag_default REF HEAD)
GIT_URL=$(flag_default GIT_URL "")
REMOTE_DIR=$(flag_default REMOTE_DIR "$DEFAULT_REMOTE_DIR")
PYTHON_VERSION=$(flag_default PYTHON_VERSION 3.12)
EXTRAS=$(flag_default EXTRAS "")
PIP_PACKAGES=$(flag_default PIP_PACKAGES "jax[tpu] gcsfs")
WORKER=all

while (($#)); do
  if parse_common_flag "$@"; then shift "$OPT_SHIFT"; continue; fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --src-dir | --src-dir=*) take_value "$@"; SRC_DIR=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --ref | --ref=*) take_value "$@"; REF=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --git-url | --git-url=*) take_value "$@"; GIT_URL=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --remote-dir | --remote-dir=*) take_value "$@"; REMOTE_DIR=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --python-version | --python-version=*) take_value "$@"; PYTHON_VERSION=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --extras | --extras=*) take_value "$@"; EXTRAS=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --pip-packages | --pip-packages=*) take_value "$@"; PIP_PACKAGES=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    --worker | --worker=*) take_value "$@"; WORKER=$OPT_VALUE; shift "$OPT_SHIFT" ;;
    *) unknown_flag "$1" ;;
  esac
done

validate_common
validate_remote_dir "$REMOTE_DIR"
validate_worker "$WORKER"
[[ -z $EXTRAS || $EXTRAS =~ ^[A-Za-z0-9_-]+(,[A-Za-z0-9_-]+)*$ ]] ||
  die "--extras '$EXTRAS' should be a comma-separated list like tfds,hf-datasets"
read -r -a PIP_SPECS <<<"$PIP_PACKAGES"

gcloud_project_flag
REMOTE=$(remote_path "$REMOTE_DIR")
REMOTE_TARBALL_NAME="$REMOTE_DIR.src.tar.gz"
STEPS=("set -e" "mkdir -p $REMOTE" "rm -rf $REMOTE/src")

if [[ -z $GIT_URL ]]; then
  # Copy: archive one commit of the local checkout (resolved now, so the dry run
  # shows exactly what would be copied).
  git -C "$SRC_DIR" rev-parse --is-inside-work-tree >/dev/null 2>&1 ||
    die "--src-dir '$SRC_DIR' is not a git checkout: point --src-dir at one, or install from a clone with --git-url=URL"
  COMMIT=$(git -C "$SRC_DIR" rev-parse --verify --quiet "$REF^{commit}") ||
    die "--ref '$REF' is not a commit in $SRC_DIR"
  if [[ -n $(git -C "$SRC_DIR" status --porcelain --untracked-files=no) ]]; then
    note "warning: $SRC_DIR has uncommitted changes; they are NOT copied (installing commit ${COMMIT:0:12})"
  fi
  TARBALL="${TMPDIR:-/tmp}/ppo_jax-src-$COMMIT.tar.gz"
  # shellcheck disable=SC2064  # the path is fixed now
  ((DRY_RUN)) || trap "rm -f $(quote "$TARBALL")" EXIT  # also when a step below fails
  note "copying commit ${COMMIT:0:12} of $SRC_DIR to worker(s) $WORKER of $TPU_NAME"
  run git -C "$SRC_DIR" archive --format=tar.gz --output="$TARBALL" "$COMMIT"
  run gcloud compute tpus tpu-vm scp "$TARBALL" "$TPU_NAME:$REMOTE_TARBALL_NAME" --zone="$TPU_ZONE" \
    --worker="$WORKER" "${PROJECT_FLAG[@]}"
  run rm -f "$TARBALL"
  REMOTE_TARBALL=$(remote_path "$REMOTE_TARBALL_NAME")
  STEPS+=("mkdir $REMOTE/src" "tar -xzf $REMOTE_TARBALL -C $REMOTE/src" "rm -f $REMOTE_TARBALL")
else
  note "cloning $GIT_URL ($REF) on worker(s) $WORKER of $TPU_NAME"
  STEPS+=("git clone --quiet $(quote "$GIT_URL") $REMOTE/src"
    "git -C $REMOTE/src checkout --quiet $(quote "$REF")")
fi

# uv: a Python >= 3.11 (the TPU images have 3.10) and a fast resolver. It lands
# in ~/.local/bin; newer images refuse a plain `pip install --user`, hence the
# --break-system-packages fallback (it only adds the uv binary).
PACKAGE="$REMOTE/src"
[[ -z $EXTRAS ]] || PACKAGE+=$(quote "[$EXTRAS]")
PIP_ARGS=""
for spec in "${PIP_SPECS[@]}"; do PIP_ARGS+=" $(quote "$spec")"; done
# shellcheck disable=SC2016  # $HOME, $PATH and the python snippet are for the worker's shell
STEPS+=('export PATH="$HOME/.local/bin:$PATH"'
  'command -v uv >/dev/null 2>&1 || python3 -m pip install --user --quiet uv || python3 -m pip install --user --quiet --break-system-packages uv'
  "[ -x $REMOTE/venv/bin/python ] || uv venv --quiet --python $(quote "$PYTHON_VERSION") $REMOTE/venv"
  "uv pip install --quiet --python $REMOTE/venv/bin/python -e $PACKAGE$PIP_ARGS"
  "$REMOTE/venv/bin/python -c 'import socket, jax, ppo_jax; print(\"ppo_jax ready on\", socket.gethostname(), \"with jax\", jax.__version__)'")

join_steps "${STEPS[@]}"
ssh_cmd "$WORKER" "$REMOTE_COMMAND"
run "${SSH_CMD[@]}"
