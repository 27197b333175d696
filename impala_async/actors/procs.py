"""Local actor processes: start, watch (exit and heartbeat), restart with backoff, stop. No asyncio, no learner code.

Each actor is the program an actor machine runs (``python -m impala_async actor ...``), never a fork of the running
learner: it shares no CUDA context, no thread and no lock with it. It is forked from the supervisor's zygote (a copy
of the supervisor made at its start, torch imported: actors/zygote.py) or, where that cannot be, a fresh
interpreter. Each one gets the
write end of a pipe and writes a byte to it every ``heartbeat_interval_s`` from its main loop; an actor that stays
silent for ``heartbeat_timeout_s`` (hung, or stopped with SIGSTOP) is killed and restarted like one that crashed.
Before a long step that cannot beat (building its environments: 32 ALE games take about 10 s here) it writes
:data:`GRACE` instead, which gives it :data:`STARTUP_GRACE_S` for its next beat, as at its start.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..ops import exitcodes

log = logging.getLogger("impala_async.actors.procs")

STARTUP_GRACE_S = 30.0  # the first beat (interpreter start, torch import) and the next after GRACE may take this long
BEAT, GRACE = b".", b"g"  # what an actor writes to its pipe: "alive", and "alive, about to be busy for a while"


def die_with_parent(parent_pid: int) -> None:
    """This process gets SIGTERM when ``parent_pid`` (its parent) dies, whatever the way (Linux PR_SET_PDEATHSIG);
    it exits at once if the parent is gone already. 0: nothing (a process started by hand)."""
    if not parent_pid:
        return
    set_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise SystemExit(0)


def set_death_signal(sig: int) -> None:
    """This process gets ``sig`` when its parent dies (Linux PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Heartbeat:
    """Writes a byte to the supervisor's pipe at most every interval_s; called from every loop of the actor, so that
    silence means the actor is stuck (or stopped), not merely that some helper thread is alive."""

    def __init__(self, fd: int, interval_s: float):
        self.fd, self.interval_s = fd, interval_s
        self.next_at = 0.0
        if fd >= 0:
            os.set_blocking(fd, False)

    def __call__(self) -> None:
        if self.fd < 0:
            return
        now = time.monotonic()
        if now >= self.next_at:
            self.next_at = now + self.interval_s
            self._write(BEAT)

    def grace(self) -> None:
        """Tell the supervisor that a long step without beats comes next (building the environments): it then waits
        up to procs.STARTUP_GRACE_S for the next beat instead of heartbeat_timeout_s."""
        if self.fd >= 0:
            self.next_at = 0.0  # the step's end beats at once
            self._write(GRACE)

    def _write(self, byte: bytes) -> None:
        try:
            os.write(self.fd, byte)
        except (BlockingIOError, BrokenPipeError):
            pass  # a full pipe means the supervisor is behind; a broken one, that it is gone


@dataclass
class _Child:
    index: int
    proc: subprocess.Popen | None = None  # or a zygote's Forked, with the same methods
    heartbeat_fd: int | None = None
    last_beat: float = 0.0
    beats: int = 0
    restarts: int = 0  # in all
    failures: int = 0  # restarts in a row, each after less than stable_after_s of running: the backoff's exponent
    started_at: float = 0.0  # monotonic time of the latest start
    restart_at: float = 0.0  # monotonic time of the next (re)start while proc is None
    exits: list = field(default_factory=list)


class Spawner(Protocol):
    """What forks actors instead of starting fresh interpreters: a Zygote (actors/zygote.py)."""

    pid: int

    def runs(self, argv: list[str]) -> bool: ...

    def spawn(self, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()): ...


class ActorProcesses:
    """``count`` actor processes; ``argv(index, heartbeat_fd, parent_pid)`` gives the command line of actor
    ``index``; ``zygote``, where given, forks those it can run (else each is a fresh interpreter)."""

    def __init__(
        self,
        argv: Callable[[int, int, int], list[str]],
        count: int,
        *,
        max_restarts: int = 10,
        heartbeat_timeout_s: float = 10.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stable_after_s: float = 30.0,
        zygote: Spawner | None = None,
    ):
        self._argv = argv
        self._zygote = zygote
        self._children = [_Child(i) for i in range(count)]
        self.max_restarts = max_restarts
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_after_s = stable_after_s
        self.restarts_total = 0
        self.replaced_silent = 0
        self.gave_up: list[int] = []

    @classmethod
    def with_options(
        cls, argv: Callable[[int, int, int], list[str]], count: int, options, zygote: Spawner | None = None
    ) -> ActorProcesses:
        """Supervise ``count`` actors as ``options`` (an ActorOptions) say: restarts, heartbeat timeout."""
        return cls(
            argv,
            count,
            max_restarts=options.max_actor_restarts,
            heartbeat_timeout_s=options.heartbeat_timeout_s,
            stable_after_s=options.actor_stable_after_s,
            zygote=zygote,
        )

    def start(self) -> None:
        for c in self._children:
            self._spawn(c)

    def _spawn(self, c: _Child) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        try:
            c.proc = self._start(c.index, write_fd)
        finally:
            os.close(write_fd)
        c.heartbeat_fd = read_fd
        c.started_at = time.monotonic()
        c.last_beat = c.started_at + STARTUP_GRACE_S  # the first beat may take a while
        c.beats = 0

    def _start(self, index: int, heartbeat_fd: int):
        """Actor ``index``'s process (a subprocess.Popen, or what the zygote forked), in a session of its own: a
        Ctrl-C in the terminal reaches only the supervisor, which then stops actors in order."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self._zygote is not None:
            argv = self._argv(index, heartbeat_fd, self._zygote.pid)
            if self._zygote.runs(argv):
                try:
                    return self._zygote.spawn(argv, env, (heartbeat_fd,))
                except OSError as e:
                    log.warning("the actors' zygote failed (%s): actors start as fresh interpreters from now", e)
                    self._zygote = None
        return subprocess.Popen(
            self._argv(index, heartbeat_fd, os.getpid()),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=(heartbeat_fd,),
        )

    def _read_beats(self, c: _Child, now: float) -> None:
        try:
            data = os.read(c.heartbeat_fd, 4096)
        except BlockingIOError:
            return
        if data:
            c.beats += len(data)
            c.last_beat = now + STARTUP_GRACE_S if data.endswith(GRACE) else now

    @property
    def count(self) -> int:
        return len(self._children)

    def alive(self) -> int:
        """Actor processes running now. Safe from another thread (a /metrics scrape): each child's process is read
        once, as check() may set it to None meanwhile."""
        return sum(1 for c in self._children if (p := c.proc) is not None and p.poll() is None)

    def heartbeating(self, now: float | None = None) -> int:
        """Actor processes running that have sent a heartbeat within heartbeat_timeout_s (as of the last check());
        one that has not sent its first yet does not count. Safe from another thread, as alive()."""
        now = time.monotonic() if now is None else now
        return sum(
            1
            for c in self._children
            if (p := c.proc) is not None
            and c.beats
            and now - c.last_beat <= self.heartbeat_timeout_s
            and p.poll() is None
        )

    def counters(self) -> dict:
        """The supervisor's figures (the learner's reports/counters.py, for train's local actors)."""
        return {
            "actors_alive": self.alive(),
            "actor_restarts": self.restarts_total,
            "actors_replaced_silent": self.replaced_silent,
        }

    def all_given_up(self) -> bool:
        return bool(self._children) and len(self.gave_up) == len(self._children)

    def check(self) -> None:
        """Reap exited actors, replace silent ones, restart with exponential backoff up to max_restarts each."""
        now = time.monotonic()
        for c in self._children:
            if c.proc is not None:
                self._read_beats(c, now)
                code = c.proc.poll()
                if code is None:
                    if now - c.last_beat > self.heartbeat_timeout_s:
                        log.warning(
                            "actor %d (pid %d) silent for %.1f s (hung or stopped): killing it",
                            c.index,
                            c.proc.pid,
                            now - c.last_beat,
                        )
                        self.replaced_silent += 1
                        c.proc.kill()
                        c.proc.wait()
                        code = c.proc.returncode
                    else:
                        continue
                self._reaped(c, code, now)
            elif now >= c.restart_at:
                c.restarts += 1
                c.failures += 1
                self.restarts_total += 1
                self._spawn(c)

    def _reaped(self, c: _Child, code: int, now: float) -> None:
        """An actor exited: restart it with exponential backoff, but at once after RUN_CHANGED (a fresh process
        builds the restarted learner's run from scratch), and never after USAGE (it cannot act in this run or
        lacks what it needs: restarting would fail the same way; it said why). The backoff and max_restarts count
        failures in a row: one that ran stable_after_s or longer starts the count over (a crash an hour is no crash
        loop, and a long run must not end up waiting max_backoff_s after every exit, or give its actors up)."""
        c.exits.append(code)
        if now - c.started_at >= self.stable_after_s:
            c.failures = 0
        c.proc = None
        os.close(c.heartbeat_fd)
        c.heartbeat_fd = None
        if code == exitcodes.USAGE:
            log.error(
                "actor %d exited with code %d (it cannot act in this run; see its error above): giving up",
                c.index,
                code,
            )
            self.gave_up.append(c.index)
            c.restart_at = float("inf")
            return
        if code == exitcodes.RUN_CHANGED and c.failures < self.max_restarts:
            log.warning("actor %d exited with code %d (the learner's run changed): restarting it now", c.index, code)
            c.restart_at = now
            return
        if c.failures >= self.max_restarts:
            log.error(
                "actor %d exited with code %s; restarted %d times in a row already (each ran under %.0f s), giving up",
                c.index,
                code,
                c.failures,
                self.stable_after_s,
            )
            self.gave_up.append(c.index)
            c.restart_at = float("inf")
            return
        delay = min(self.max_backoff_s, self.backoff_s * 2**c.failures)
        log.warning("actor %d exited with code %s; restarting in %.1f s", c.index, code, delay)
        c.restart_at = now + delay

    def stop(self, timeout_s: float) -> None:
        """SIGTERM every actor, wait up to timeout_s, SIGKILL what is left, reap everything."""
        procs = [c.proc for c in self._children if c.proc is not None]
        for c in self._children:
            if c.heartbeat_fd is not None:
                os.close(c.heartbeat_fd)
            c.proc, c.heartbeat_fd, c.restart_at = None, None, float("inf")
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                    p.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        for c in self._children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()


def actor_argv(
    learner: str,
    weights: str,
    index: int,
    heartbeat_fd: int,
    parent_pid: int,
    *,
    seed: int,
    options,
    curve_keys: str = "",
    env_backend: str = "",
) -> list[str]:
    """The command line of supervised actor ``index``: ``options`` (an ActorOptions, config/actors.py) spelled out in
    full, the supervisor's heartbeat pipe, the pid of the actor's parent (the supervisor, or its zygote), and never a
    metrics port (the supervisor serves /healthz; children must not take its port from the environment)."""
    return [
        sys.executable,
        "-m",
        "impala_async",
        "actor",
        "--learner",
        learner,
        "--weights",
        weights,
        "--index",
        str(index),
        "--seed",
        str(seed),
        *options.argv(),
        "--parent-pid",
        str(parent_pid),
        "--heartbeat-fd",
        str(heartbeat_fd),
        "--metrics-port",
        "0",
        *(["--curve-keys", curve_keys] if curve_keys else []),
        *(["--env-backend", env_backend] if env_backend else []),
    ]
