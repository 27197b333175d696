"""The learner server's periodic tasks, run by its event loop beside the receive loop: weight re-sends, the connection
guard, supervision (local actors, data timeouts; the SIGUSR1 state dump), the event-loop lag probe and the metrics
reports.

A mixin of :class:`~impala_async.learner.server.LearnerServer` (its attributes are the server's); kept apart so that
server.py reads as the server's life (startup, intake, training callbacks, shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq

from .guard import release_memory

log = logging.getLogger("impala_async.learner.server")

LOOP_LAG_PROBE_S = 0.01
EXIT_ACTORS_FAILED, EXIT_NO_DATA = 3, 4


class PeriodicTasks:
    async def _republish_loop(self) -> None:
        """Apply subscriptions and send the latest weights again when actors have subscribed (they would otherwise
        wait for the next update) and every republish_interval_s, at the rates publisher.py allows."""
        pub = self.publisher
        woken = asyncio.Event()
        fd = pub.sock.getsockopt(zmq.FD)
        self._loop.add_reader(fd, woken.set)
        try:
            while not self._stop.is_set():
                pub.read_subscriptions()
                wait_s = pub.resend_due(time.monotonic())
                woken.clear()
                if not pub.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    await _wait(woken, wait_s)
        finally:
            self._loop.remove_reader(fd)

    async def _guard_loop(self) -> None:
        """Connections over the limits are closed (guard.py): peers cannot make the learner hold unbounded memory.
        After a cut, the memory it freed goes back to the system (at most once a second)."""
        cuts, trim_at, trimmed_at = 0, None, 0.0
        while True:
            self.pull_guard.check()
            self.publisher.guard.check()
            now = time.monotonic()
            total = sum(self.pull_guard.cut.values()) + sum(self.publisher.guard.cut.values())
            if total != cuts:
                cuts = total
                trim_at = max(now + 0.2, trimmed_at + 1.0)  # libzmq closes the connection and frees it meanwhile
            if trim_at is not None and now >= trim_at:
                release_memory()
                trim_at, trimmed_at = None, time.monotonic()
            await asyncio.sleep(self.cfg.network.connection_check_interval_s)

    # -------------------------------------------------------------------------------------------- supervision
    def _dump_state(self) -> None:
        """SIGUSR1: write every thread's stack and every asyncio task's state to stderr (for a stuck learner)."""
        import faulthandler
        import sys

        faulthandler.dump_traceback(all_threads=True)
        for task in asyncio.all_tasks(self._loop):
            task.print_stack(file=sys.stderr)
        print(
            f"trainer alive={self.trainer.alive()} error={self.trainer.error!r} batches={self.trainer.batches} "
            f"ring ready={self.ring.ready_batches()} writable={self.ring.writable()} "
            f"pending={self.ingest.pending is not None} connections={len(self.pull_guard.conns)}+"
            f"{len(self.publisher.guard.conns)}",
            file=sys.stderr,
            flush=True,
        )

    async def _watch_loop(self) -> None:
        cfg = self.cfg
        while True:
            await asyncio.sleep(0.25)
            if self.actors is not None:
                self.actors.check()
                if self.actors.all_given_up():
                    self.request_stop(
                        f"every local actor failed {cfg.actors.max_actor_restarts + 1} times; "
                        f"see the actor errors above",
                        EXIT_ACTORS_FAILED,
                    )
            now = time.monotonic()
            last = self.ingest.last_data_at
            if last is None and now - self.t0 > cfg.run.actor_start_timeout_s:
                self.request_stop(
                    f"no trajectory arrived within actor_start_timeout_s={cfg.run.actor_start_timeout_s:g} s "
                    f"of start: are actors running and pointed at {self.listen_endpoint}?",
                    EXIT_NO_DATA,
                )
            elif last is not None and now - last > cfg.run.no_data_timeout_s:
                self.request_stop(
                    f"no trajectory arrived for no_data_timeout_s={cfg.run.no_data_timeout_s:g} s: "
                    f"every actor is gone or stuck",
                    EXIT_NO_DATA,
                )

    async def _loop_lag_loop(self) -> None:
        """Event-loop responsiveness: how late a short sleep wakes up."""
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(LOOP_LAG_PROBE_S)
            self.loop_lag_s.add(max(0.0, time.monotonic() - t0 - LOOP_LAG_PROBE_S))

    # ---------------------------------------------------------------------------------------------- reporting
    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.observe.report_interval_s)
            self._report()

    def _report(self) -> None:
        with self._stats_lock:
            stats, self._stats = self._stats, []
            lags, self._lags = self._lags, []
        rec = self.reporter.record(stats, lags)
        self.metrics.write(rec)
        self.last_record = rec
        if self.tboard is not None:
            self.tboard.write(rec)  # queued for its own thread
        for text in self.watch.feed(rec):  # policy-collapse warnings, rate-limited (watch.py)
            log.warning(text)
        self.progress.show(rec)


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    """Wait until ``event`` is set or ``timeout_s`` passes (then it is set too; callers clear it before waiting).

    Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that races with the event (the receive task
    then never ended and shutdown hung; seen in tests/test_cli.py)."""
    timer = asyncio.get_running_loop().call_later(timeout_s, event.set)
    try:
        await event.wait()
    finally:
        timer.cancel()
