"""Local actor processes: start, watch, restart with backoff, stop. No asyncio, no learner code.

Each actor is a fresh interpreter (``python -m impala_async actor ...``), never a fork of the learner: it shares no
memory, no CUDA context and no locks with it, and it is the same program an actor machine runs.
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

log = logging.getLogger("impala_async.procs")


@dataclass
class _Child:
    index: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    restart_at: float = 0.0  # monotonic time of the next (re)start while proc is None
    started_at: float = 0.0
    exits: list = field(default_factory=list)


class ActorProcesses:
    """``count`` actor processes; ``argv(index)`` gives the command line of actor ``index``."""

    def __init__(self, argv: Callable[[int], list[str]], count: int, *, max_restarts: int = 10,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0):
        self._argv = argv
        self._children = [_Child(i) for i in range(count)]
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.restarts_total = 0
        self.gave_up: list[int] = []

    def __len__(self):
        return len(self._children)

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self._children if c.proc is not None]

    def start(self) -> None:
        for c in self._children:
            self._spawn(c)

    def _spawn(self, c: _Child) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Own session: a Ctrl-C in the terminal reaches only the learner, which then stops actors in order.
        c.proc = subprocess.Popen(self._argv(c.index), env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        c.started_at = time.monotonic()

    def alive(self) -> int:
        return sum(1 for c in self._children if c.proc is not None and c.proc.poll() is None)

    def check(self) -> None:
        """Reap exited actors and restart them with exponential backoff, up to max_restarts each."""
        now = time.monotonic()
        for c in self._children:
            if c.proc is not None:
                code = c.proc.poll()
                if code is None:
                    continue
                c.exits.append(code)
                c.proc = None
                if c.restarts >= self.max_restarts:
                    log.error("actor %d exited with code %s; restarted %d times already, giving up",
                              c.index, code, c.restarts)
                    self.gave_up.append(c.index)
                    c.restart_at = float("inf")
                    continue
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** c.restarts)
                log.warning("actor %d exited with code %s; restarting in %.1f s", c.index, code, delay)
                c.restart_at = now + delay
            elif now >= c.restart_at:
                c.restarts += 1
                self.restarts_total += 1
                self._spawn(c)

    def replace(self, index: int, why: str) -> None:
        """Kill actor ``index`` (hung or stopped); check() restarts it."""
        c = self._children[index]
        if c.proc is not None and c.proc.poll() is None:
            log.warning("actor %d (pid %d) %s: killing it", index, c.proc.pid, why)
            c.proc.kill()

    def stop(self, timeout_s: float) -> None:
        """SIGTERM every actor, wait up to timeout_s, SIGKILL what is left, reap everything."""
        procs = [c.proc for c in self._children if c.proc is not None]
        for c in self._children:
            c.proc, c.restart_at = None, float("inf")
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


def actor_argv(learner: str, weights: str, index: int, *, seed: int, envs_per_actor: int, extra=()) -> list[str]:
    return [sys.executable, "-m", "impala_async", "actor", "--learner", learner, "--weights", weights,
            "--index", str(index), "--seed", str(seed), "--envs-per-actor", str(envs_per_actor),
            "--parent-pid", str(os.getpid()), *extra]
