"""A lost process ends every other process of the run with exit status 1 and one `error:` line.

Without this, a process that is killed, crashes, or loses its host or network leaves the others
blocked in a collective (or a checkpoint save) until JAX's coordination service notices the missed
heartbeats and aborts them (SIGABRT, status 134, "Fatal Python error: Aborted"), a minute or more
later, with whatever the main thread printed last as the only explanation (a save's "check that the
directory is writable" advice, say).

JAX's own hook for this, the distributed client's `missed_heartbeat_callback`, does not take a
Python function in jaxlib 0.10 (the status it passes has no Python conversion: std::bad_cast, then
std::terminate). So every process keeps a heartbeat of its own in the coordinator's key-value store
(`KEYS`), with JAX's heartbeat timeout set well above this one (`jax_heartbeat_timeout`), so the
watch always speaks first:

  beat/<i>   process i's counter, rewritten every `interval` seconds; every process reads them all
  exit/<i>   process i is ending on purpose (finished, its own error, Ctrl-C): not lost (named only if
             the others still run `timeout` seconds later)
  lost/<k>   process k was found lost (by whom and why): the others name the same process

A process is lost when its counter has not moved for `timeout` seconds of reads that succeeded; the
coordinator (process 0) is lost to the others when none of their key-value calls has succeeded for
that long; and a process that ended on purpose while this one still runs is named after `timeout`
seconds (the run's collectives need every process). The process that finds one prints one `error:`
line and leaves with `os._exit(1)`: its main thread may be blocked in a collective that will never
return, and JAX's exit handlers would wait for the lost process. A save in flight is cut short; it
never committed, and a resume ignores (and removes) what it left.

One loss JAX reacts to at once: when the coordinator's process ends, the other processes' clients
abort within a second (their error-polling call to it fails). So the watch also catches SIGABRT
(`catch_abort`): when the coordinator no longer accepts connections, the abort is that loss and is
reported as one; any other abort goes on as before (status 134).

The command line asks the watch before printing an error of its own (`settle`): when a peer was
lost, the error the main thread saw (a collective's, a save's) is a consequence, and the lost
process is the line to print.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

KEYS = "ppo_jax/peer_watch/"
JAX_TIMEOUT_FACTOR = 4  # JAX's heartbeat timeout over the watch's (JAX declares a loss after 0.5-1x its own)
MIN_JAX_TIMEOUT = 10


def jax_heartbeat_timeout(timeout: float) -> int:
    """The heartbeat timeout to give `jax.distributed.initialize` when the watch uses `timeout`."""
    return max(MIN_JAX_TIMEOUT, int(JAX_TIMEOUT_FACTOR * timeout))


def default_resume_hint() -> str:
    return "Run the same command again on every process to resume from the last checkpoint."


def _exit_with(line: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 (a closed stream must not stop the exit)
            pass
    os.write(2, f"\nerror: {line}\n".encode())
    os._exit(1)


class PeerWatch:
    """Watches the other processes of a run through `client` (JAX's distributed runtime client, or
    anything with its key_value_set / key_value_dir_get). `on_lost(line)` is called once with the
    `error:` text when a process is lost (default: print it and `os._exit(1)`); `resume_hint()` says
    what was kept and how to resume (the command line sets it, see `set_resume_hint`)."""

    def __init__(self, client, process_id: int, num_processes: int, timeout: float, *,
                 coordinator: str = "", on_lost: Callable[[str], None] = _exit_with):
        self.client, self.me, self.n = client, int(process_id), int(num_processes)
        self.timeout = float(timeout)
        # A beat a second (a tenth of short timeouts); every process reads every beat, so large jobs
        # beat less often (1 s up to 64 processes), never less than 4 times per timeout.
        self.interval = max(min(min(self.timeout / 10, 1.0) * max(1.0, self.n / 64), self.timeout / 4), 0.2)
        self.coordinator = coordinator
        self.on_lost = on_lost
        self.resume_hint: Callable[[], str] = default_resume_hint
        self.peers = [p for p in range(self.n) if p != self.me]
        now = time.monotonic()
        self._cond = threading.Condition()
        self._counters: dict[int, str] = {}
        self._seen = {p: now for p in self.peers}  # when each peer's counter last moved
        # when each peer was last surely alive: a counter read as moved was written after the
        # previous read began (it may be older than the read that saw it: see settle)
        self._alive_after = {p: float("-inf") for p in self.peers}
        self._ended: dict[int, float] = {}  # peer -> when its exit/<i> was first read
        self._found: dict[int, str] = {}  # peer -> lost/<k> as another process wrote it
        self._last_ok = now  # the last key-value round trip that succeeded
        self._stop = threading.Event()
        self._exiting = False  # this process is ending on purpose: a peer ending is no news
        self._reported = False
        self._said = threading.Event()  # on_lost has returned (it ends the process unless a test's)
        self._threads = [threading.Thread(target=self._io_loop, name="ppo_jax peer watch io", daemon=True),
                         threading.Thread(target=self._judge_loop, name="ppo_jax peer watch", daemon=True)]

    # ------------------------------------------------------------------ lifecycle

    def start(self, *, at_exit: bool = True) -> PeerWatch:
        """Starts watching; at_exit: `stop` when the interpreter exits. Registered after JAX's own
        exit handler (JAX registers at import), it runs before jax.distributed.shutdown, while the
        key-value store still answers."""
        for t in self._threads:
            t.start()
        if at_exit:
            atexit.register(self.stop)
        return self

    def catch_abort(self) -> None:
        """Reports an abort of this process that the coordinator's loss caused (see the module
        docstring). The handler goes in C's signal table through ctypes: a Python handler would only
        run on the main thread, after abort() has ended the process. It runs on the aborting thread
        (JAX's), takes the GIL and either ends the process with the line, or dumps the Python threads
        (as faulthandler did) and returns, and abort() goes on."""
        if self.me == 0 or not self.coordinator:
            return  # the coordinator's own aborts come after the watch's verdict (JAX's timeout is longer)
        handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
        self._abort_handler = handler_type(self._on_abort)  # kept: C holds only a pointer to it
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, handler_type], ctypes.c_void_p
        libc.signal(signal.SIGABRT, self._abort_handler)

    def _on_abort(self, signum: int) -> None:
        del signum
        if self._reported:  # the judge is saying it already: let it finish (it ends the process)
            time.sleep(5)
        gone = self._coordinator_gone()
        if gone is not None:
            self._report(0, self._lost(0, f"the coordinator at {self.coordinator} {gone}"))
        faulthandler.dump_traceback(all_threads=True)

    def _coordinator_gone(self) -> str | None:
        """Why the coordinator counts as gone (it refuses or drops connections), or None if it answers."""
        host, _, port = self.coordinator.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(self.timeout, 5.0)):
                return None
        except (OSError, ValueError) as e:
            return f"does not accept connections ({e.strerror or e})" if isinstance(e, OSError) else None

    def stop(self) -> None:
        """Says this process ends on purpose, waits until every peer is seen alive after that (or
        ending too; a peer lost meanwhile still ends this process with its line), then stops."""
        if self._stop.is_set():
            return
        with self._cond:
            self._exiting = True
        try:
            self.client.key_value_set(f"{KEYS}exit/{self.me}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001 (the coordinator gone: the judge says so, or nothing is left to say)
            pass
        self.settle()
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2 * self.interval)

    # ------------------------------------------------------------------ the main thread's question

    def settle(self) -> None:
        """Returns once every peer has shown a sign of life after this call (or is ending on
        purpose). When one is lost instead, the watch ends the process first and this never
        returns; after `timeout` and a margin it returns anyway, unless a peer is lost by then.

        A sign of life is a beat written after the call, not one read after it: a peer killed
        mid-collective fails this process's collective at once, and its last beat, written just
        before, is often read only after the main thread asks (CI, 2026-11-29: the save's error line
        came first)."""
        if self._stop.is_set():
            return
        asked = time.monotonic()
        deadline = asked + self.timeout + 3 * self.interval
        with self._cond:
            while any(self._alive_after[p] <= asked and p not in self._ended for p in self.peers):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, self.interval))
        # A peer still silent at the deadline is lost by the judge's own rule, and the judge may be
        # saying so right now: under load its key-value write and the checkpoint listing took longer
        # than the margin, and the main thread's error line came first (CI, 2026-11-29). Say it from
        # here, or wait while the judge says it.
        verdict = self.verdict(time.monotonic())
        if verdict is not None:
            self._report(*verdict)  # returns at once when the judge is already reporting
        if self._reported:
            self._said.wait(self.timeout + 10 * self.interval)

    # ------------------------------------------------------------------ the threads

    def _io_loop(self) -> None:
        counter, last_read_began = 0, float("-inf")
        while not self._stop.is_set():
            counter += 1
            began = time.monotonic()
            try:
                self.client.key_value_set(f"{KEYS}beat/{self.me}", str(counter), allow_overwrite=True)
                entries = self.client.key_value_dir_get(KEYS)
            except Exception:  # noqa: BLE001 (the coordinator unreachable: judged by _last_ok)
                pass
            else:
                self._read(entries, time.monotonic(), alive_after=last_read_began)
                last_read_began = began
            self._stop.wait(self.interval)

    def _read(self, entries, now: float, alive_after: float = float("-inf")) -> None:
        """Takes in one read of the store, made at `now`; the previous successful read began at
        `alive_after`, so a counter that moved since was written after that."""
        with self._cond:
            self._last_ok = now
            for key, value in entries:
                kind, _, who = key[len(KEYS):].partition("/") if key.startswith(KEYS) else ("", "", "")
                if not who.isdigit() or int(who) == self.me:
                    continue
                who = int(who)
                if kind == "beat" and self._counters.get(who) != value:
                    self._counters[who] = value
                    self._seen[who] = now
                    self._alive_after[who] = alive_after
                elif kind == "exit":
                    self._ended.setdefault(who, now)
                elif kind == "lost":
                    self._found.setdefault(who, value)
            self._cond.notify_all()

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.interval / 2):
            verdict = self.verdict(time.monotonic())
            if verdict is not None:
                self._report(*verdict)
                return

    def verdict(self, now: float) -> tuple[int, str] | None:
        """(the process missing, what happened to it), or None while every process is accounted for."""
        with self._cond:
            for who, what in sorted(self._found.items()):
                return who, what
            if self.me != 0 and 0 not in self._ended and now - self._last_ok > self.timeout:
                where = f" at {self.coordinator}" if self.coordinator else ""
                return 0, self._lost(0, f"the coordinator{where} has not answered for {now - self._last_ok:.0f} s")
            # A beat is judged stale only over reads that succeeded: while the store does not answer,
            # nobody's counter can be seen to move, and the coordinator's silence is the news (its
            # own timeout above). Judged up to `now`, a peer whose last beat was read one interval
            # before the store went down was named in the coordinator's place (CI, 2026-11-29).
            for p in self.peers:
                if p not in self._ended and self._last_ok - self._seen[p] > self.timeout:
                    return p, self._lost(p, f"no heartbeat for {now - self._seen[p]:.0f} s")
            if not self._exiting:
                for p, when in sorted(self._ended.items()):
                    if now - when > self.timeout:
                        return p, (f"process {p}{_role(p)} of {self.n} ended {now - when:.0f} s ago while the "
                                   "others still needed it (its own output says why)")
        return None

    def _lost(self, who: int, seen: str) -> str:
        return (f"process {who}{_role(who)} of {self.n} was lost ({seen}): it was killed, crashed, or its "
                "host or network went down")

    def _report(self, who: int, what: str) -> None:
        with self._cond:
            if self._reported:
                return
            self._reported = True
        if who != 0:  # the others name the same process (the store is the coordinator's: not when it is lost)
            try:
                self.client.key_value_set(f"{KEYS}lost/{who}", what, allow_overwrite=True)
                if self.me == 0 and self.n > 2:  # the store ends with this process: let the others read it
                    time.sleep(2 * self.interval)
            except Exception:  # noqa: BLE001
                pass
        try:
            hint = self.resume_hint()
        except Exception as e:  # noqa: BLE001 (the line must still be printed)
            hint = f"{default_resume_hint()} (the checkpoints could not be listed: {type(e).__name__}: {e})"
        self.on_lost(f"{what}; this is process {self.me}. {hint}")
        self._said.set()


def _role(process: int) -> str:
    return " (the coordinator)" if process == 0 else ""
