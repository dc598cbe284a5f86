"""A lost process of a multi-process run: every other process ends with exit status 1 and one
`error:` line naming it and the last complete checkpoint, and the same command resumes.

The first test is the real thing: a 2-process CPU job (gloo) through the command line, process 1
SIGKILLed while a checkpoint save is in flight. The others check the watch (ppo_jax/peer_watch.py)
on a fake key-value store, and the save error's advice, in this process.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import pytest
from test_multihost import _free_port

from ppo_jax import peer_watch
from ppo_jax.checkpoint import CheckpointManager, CheckpointSaveError, committed_steps

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TIMEOUT = 5  # distributed.lost_process_timeout of the real run, in seconds
ITERATIONS = 8

CONFIG = f"""
import sys
sys.path.insert(0, {HERE!r})
from tiny_configs import tiny_config

def get_config():
    return tiny_config(**{{"train.iterations": {ITERATIONS}, "train.checkpoint_every": 1,
                          "rollout.batch_size": 8, "rollout.forward_microbatch": 0, "ppo.epochs": 1,
                          "ppo.num_minibatches": 1, "ppo.num_microbatches": 1,
                          "distributed.lost_process_timeout": {TIMEOUT}}})
"""


def _start(config, workdir, port, process_id, log):
    """One process of the job: the same command line on both, the process index in the environment."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu", "PPO_JAX_COORDINATOR": f"127.0.0.1:{port}", "PPO_JAX_NUM_PROCESSES": "2",
           "PPO_JAX_PROCESS_ID": str(process_id)}
    return subprocess.Popen([sys.executable, "-m", "ppo_jax.cli.train", f"--config={config}", f"--workdir={workdir}"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _saving(checkpoints) -> int | None:
    """The step of a save in flight (its tmp directory) once an earlier step has committed."""
    try:
        names = os.listdir(checkpoints)
    except FileNotFoundError:
        return None
    tmp = [int(n.split(".")[0]) for n in names if ".orbax-checkpoint-tmp" in n and n.split(".")[0].isdigit()]
    done = [int(n) for n in names if n.isdigit()]
    return max(tmp) if tmp and done and max(tmp) > min(done) else None


def test_a_lost_process_ends_the_other_with_exit_1_one_line_and_the_same_command_resumes(tmp_path):
    config, workdir, port = tmp_path / "config.py", tmp_path / "run", _free_port()
    config.write_text(CONFIG)
    checkpoints = workdir / "checkpoints"
    logs = [open(tmp_path / f"process{i}.log", "w+") for i in range(2)]
    procs = [_start(config, workdir, port, i, logs[i]) for i in range(2)]
    try:
        deadline = time.time() + 600
        while (step := _saving(checkpoints)) is None:
            assert all(p.poll() is None for p in procs), (tmp_path / "process0.log").read_text()[-3000:]
            assert time.time() < deadline, "no checkpoint save was seen in flight"
            time.sleep(0.005)
        procs[1].send_signal(signal.SIGKILL)  # only the processes this test started
        killed = time.time()
        rc = procs[0].wait(timeout=TIMEOUT + 60)
        took = time.time() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    output = (tmp_path / "process0.log").read_text()
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    kept = committed_steps(checkpoints)
    print(f"save of step {step} in flight; process 0 ended {took:.1f} s after the kill; kept {kept}")
    assert rc == 1, output[-3000:]
    assert took < TIMEOUT + 30, output[-3000:]
    assert len(errors) == 1, output[-3000:]
    assert "writable" not in output and "free space" not in output, output[-3000:]
    match = re.fullmatch(r"error: process 1 of 2 was lost \(no heartbeat for \d+ s\): it was killed, crashed, or its "
                         r"host or network went down; this is process 0\. The last complete checkpoint is step "
                         r"(\d+) in (.+); run the same command again on every process to resume from it\.", errors[0])
    assert match, errors[0]
    assert int(match.group(1)) == kept[-1] and match.group(2) == str(checkpoints)
    assert step not in kept  # the interrupted save never committed

    # The same command on both processes resumes from that step and finishes; each step logged once.
    logs = [open(tmp_path / f"resume{i}.log", "w+") for i in range(2)]
    procs = [_start(config, workdir, port, i, logs[i]) for i in range(2)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    resumed = [(tmp_path / f"resume{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], resumed[0][-3000:] + resumed[1][-3000:]
    assert f"done: {ITERATIONS - kept[-1]} iterations" in resumed[0]
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, ITERATIONS + 1))
    assert committed_steps(checkpoints)[-1] == ITERATIONS


# Both directions on the bare runtime (no training, seconds): the coordinator's loss makes JAX abort
# the other process at once (its error-polling call fails); the watch turns that abort into the line.
BARE = """
import sys, time
from ppo_jax import distributed
distributed.initialize(distributed.DistributedSettings(coordinator_address=sys.argv[1], num_processes=2,
                                                       process_id=int(sys.argv[2]), lost_process_timeout=3))
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("victim", [0, 1], ids=["coordinator", "process1"])
def test_every_survivor_names_the_lost_process_on_the_bare_runtime(victim):
    address = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", BARE, address, str(i)], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.time()
        survivor = procs[1 - victim]
        output = survivor.communicate(timeout=30)[0]
        took = time.time() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert survivor.returncode == 1 and len(errors) == 1, output[-3000:]
    assert errors[0].endswith(f"this is process {1 - victim}. Run the same command again on every process to "
                              "resume from the last checkpoint."), errors[0]
    if victim == 0:
        assert errors[0].startswith(f"error: process 0 (the coordinator) of 2 was lost (the coordinator at {address} "
                                    "does not accept connections"), errors[0]
        assert took < 10
    else:
        assert errors[0].startswith("error: process 1 of 2 was lost (no heartbeat for 3 s)"), errors[0]
        assert 2 < took < 15


# ---------------------------------------------------------------------------------------------
# The watch on a fake key-value store (JAX's client has the same two calls).


class FakeStore:
    def __init__(self):
        self.items, self.lock, self.down = {}, threading.Lock(), False

    def client(self, process_id):
        store = self

        class Client:
            def key_value_set(self, key, value, allow_overwrite=False):
                with store.lock:
                    if store.down:
                        raise RuntimeError("UNAVAILABLE: coordinator gone")
                    store.items[key] = value

            def key_value_dir_get(self, prefix):
                with store.lock:
                    if store.down:
                        raise RuntimeError("UNAVAILABLE: coordinator gone")
                    return [(k, v) for k, v in store.items.items() if k.startswith(prefix)]

        return Client()


def _watch(store, me, n=2, timeout=0.6):
    lines = []
    watch = peer_watch.PeerWatch(store.client(me), me, n, timeout, coordinator="10.0.0.1:1234",
                                 on_lost=lines.append)
    watch.resume_hint = lambda: "The last complete checkpoint is step 3 in /w; run the same command again."
    return watch, lines


def _until(condition, seconds=5.0):
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_silent_peer_is_named_once_with_the_resume_hint():
    store = FakeStore()
    (a, lines_a), (b, lines_b) = _watch(store, 0), _watch(store, 1)
    a.start(at_exit=False), b.start(at_exit=False)
    time.sleep(1.0)  # longer than the timeout: both beat, nobody is lost
    assert lines_a == [] == lines_b
    t = time.time()
    b._stop.set()  # process 1 stops beating without saying it ends (a SIGKILL)
    assert _until(lambda: lines_a)
    assert 0.2 < time.time() - t < 4.0  # the timeout after the last beat read (0.2 s apart), not JAX's
    # the seconds are as the judge measured them: 1 s, more on a loaded machine (CI)
    assert re.fullmatch(r"process 1 of 2 was lost \(no heartbeat for \d+ s\): it was killed, crashed, or its host "
                        r"or network went down; this is process 0\. The last complete checkpoint is step 3 in /w; "
                        r"run the same command again\.", lines_a[0]), lines_a
    assert store.items["ppo_jax/peer_watch/lost/1"].startswith("process 1 of 2 was lost")
    time.sleep(0.5)
    assert len(lines_a) == 1
    a._stop.set()


def test_the_coordinator_gone_is_process_0_and_a_lost_key_names_the_same_process():
    # Process 0 (holding the store) found process 2 lost and said so before it went: process 1 names 2 too.
    store = FakeStore()
    store.items.update({"ppo_jax/peer_watch/beat/0": "1", "ppo_jax/peer_watch/beat/2": "1",
                        "ppo_jax/peer_watch/lost/2": "process 2 of 3 was lost (no heartbeat for 31 s): ..."})
    b, lines_b = _watch(store, 1, n=3)
    b.start(at_exit=False)
    assert _until(lambda: lines_b)
    assert lines_b == ["process 2 of 3 was lost (no heartbeat for 31 s): ...; this is process 1. The last complete "
                       "checkpoint is step 3 in /w; run the same command again."]
    b._stop.set()

    # Process 0 and its store gone: every key-value call of process 1 fails.
    store = FakeStore()
    (a, _), (b, lines_b) = _watch(store, 0), _watch(store, 1)
    a.start(at_exit=False), b.start(at_exit=False)
    time.sleep(0.3)
    a._stop.set()
    store.down = True
    assert _until(lambda: lines_b)
    assert re.match(r"process 0 \(the coordinator\) of 2 was lost \(the coordinator at 10\.0\.0\.1:1234 has not "
                    r"answered for \d+ s\)", lines_b[0]), lines_b
    b._stop.set()


def test_with_the_store_down_the_coordinator_is_named_not_a_peer_whose_last_beat_came_a_read_earlier():
    # Process 1's reads at t0 and t0 + 0.2 s both succeed; process 0's counter moved only in the first
    # (its last beat fell between them), then the store goes down. Staleness over reads that never
    # came is no evidence about process 0's beat: the coordinator's silence is what is said.
    watch, lines = _watch(FakeStore(), 1)
    t0 = time.monotonic()
    watch._read([("ppo_jax/peer_watch/beat/0", "7")], t0)
    watch._read([("ppo_jax/peer_watch/beat/0", "7")], t0 + 0.2)
    assert watch.verdict(t0 + 0.7) is None  # 0.7 s since the beat moved, 0.5 s since the store answered
    who, line = watch.verdict(t0 + 0.9)
    assert who == 0 and line.startswith("process 0 (the coordinator) of 2 was lost (the coordinator at "
                                        "10.0.0.1:1234 has not answered for 1 s)"), line
    # with the store answering, the same silence is a lost heartbeat
    watch._read([("ppo_jax/peer_watch/beat/0", "7")], t0 + 0.8)
    assert watch.verdict(t0 + 0.85)[1].startswith("process 0 (the coordinator) of 2 was lost (no heartbeat for 1 s)")
    assert lines == []


def test_a_peer_ending_on_purpose_is_not_lost_and_settle_waits_for_a_sign_of_life():
    store = FakeStore()
    (a, lines_a), (b, lines_b) = _watch(store, 0, timeout=2.0), _watch(store, 1, timeout=2.0)
    for w in (a, b):
        w.start(at_exit=False)
    t = time.time()
    a.settle()  # process 1 beats: returns within a beat or two, not at its deadline (2.6 s)
    assert time.time() - t < 2.2
    b.stop()  # says it ends, sees process 0 alive after that, stops beating
    time.sleep(0.5)
    assert lines_a == [] == lines_b
    a.stop()  # ending too: a peer that ended is no news
    time.sleep(0.5)
    assert lines_a == []


def test_settle_waits_for_a_slow_verdict_so_the_main_threads_error_never_comes_first():
    # The judge finds the silent peer but takes long to say it (its key-value write and the
    # checkpoint listing, under load): settle must not return before the line is out.
    store = FakeStore()
    (a, lines_a), (b, _) = _watch(store, 0), _watch(store, 1)
    hint = a.resume_hint
    a.resume_hint = lambda: (time.sleep(2.0), hint())[1]
    a.start(at_exit=False), b.start(at_exit=False)
    time.sleep(0.5)
    b._stop.set()  # process 1 stops beating (a SIGKILL)
    time.sleep(0.3)  # its last beat read (0.2 s apart): no sign of life comes after this
    t = time.time()
    a.settle()  # the main thread, about to print an error of its own
    assert lines_a, f"settle returned after {time.time() - t:.1f} s with the peer's loss still unsaid"
    assert lines_a[0].startswith("process 1 of 2 was lost")
    a._stop.set()


def test_a_beat_written_before_settle_but_read_after_it_is_no_sign_of_life():
    # A peer killed mid-collective fails this process's collective at once; its last beat, written
    # just before, reaches this process only after the main thread asked (CI, 2026-11-29). That
    # beat must not let settle return with the loss unsaid.
    store = FakeStore()
    a, lines_a = _watch(store, 0)
    set_beat = store.client(1).key_value_set
    a.start(at_exit=False)
    for counter in range(1, 4):  # process 1 alive, then killed after its beat 4
        set_beat(f"{peer_watch.KEYS}beat/1", str(counter))
        time.sleep(0.25)
    store.lock.acquire()  # process 0's next read waits (a slow key-value call)...
    store.items[f"{peer_watch.KEYS}beat/1"] = "4"
    threading.Timer(0.3, store.lock.release).start()  # ...and sees beat 4 after settle began
    t = time.time()
    a.settle()
    assert lines_a, f"settle returned after {time.time() - t:.1f} s on a beat written before it was called"
    assert lines_a[0].startswith("process 1 of 2 was lost")
    a._stop.set()


def test_a_peer_that_ended_while_this_one_runs_is_named_after_the_timeout():
    store = FakeStore()
    (a, lines_a), (b, _) = _watch(store, 0), _watch(store, 1)
    for w in (a, b):
        w.start(at_exit=False)
    b.stop()
    assert _until(lambda: lines_a)
    assert re.match(r"process 1 of 2 ended \d+ s ago while the others still needed it \(its own output says "
                    r"why\); this is process 0\.", lines_a[0]), lines_a
    a._stop.set()


def test_jax_heartbeat_timeout_stays_above_the_watch():
    assert peer_watch.jax_heartbeat_timeout(30) == 120 and peer_watch.jax_heartbeat_timeout(1) == 10


# ---------------------------------------------------------------------------------------------
# A save that fails in the JAX runtime (a collective with a process that is gone) blames the runtime.


@pytest.mark.parametrize("cause, advice", [
    (jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: Read error: Connection reset by peer"),
     "The JAX runtime failed, not the disk"),
    (OSError(27, "File too large"), "Check that the directory is writable and the disk has free space"),
], ids=["collective", "disk"])
def test_a_save_error_names_the_runtime_or_the_disk(tmp_path, monkeypatch, cause, advice):
    state = {"w": jax.numpy.arange(4.0)}
    with CheckpointManager(tmp_path / "run", async_save=False) as manager:
        manager.save(1, state, extra={})

        def fail(*args, **kwargs):
            raise cause

        monkeypatch.setattr(manager._manager, "save", fail)
        with pytest.raises(CheckpointSaveError) as err:
            manager.save(2, state, extra={})
        monkeypatch.undo()
    assert advice in str(err.value) and "resume uses step 1" in str(err.value)
    assert committed_steps(tmp_path / "run") == [1] and committed_steps(tmp_path / "nothing") == []
