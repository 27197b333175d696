"""The learner's periodic tasks, run by its event loop beside the receive loop. Each is a function of the parts it
works on, handed to it by the server: weight re-sends, the connection guards, supervision (local actors, data
timeouts), the event-loop lag probe, and the SIGUSR1 state dump.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable

import zmq

from ..actors.procs import ActorProcesses
from ..ops import exitcodes
from .transport.guard import ConnectionGuard, release_memory
from .transport.ingest import Histogram, Ingest
from .transport.intake import wait_event
from .transport.publisher import WeightsPublisher

log = logging.getLogger("impala_async.learner.tasks")

LOOP_LAG_PROBE_S = 0.01
StopRequest = Callable[[str, int], None]  # (reason, exit code)


async def republish(publisher: WeightsPublisher) -> None:
    """Apply subscriptions and send the latest weights again when actors have subscribed (they would otherwise wait
    for the next update) and every republish_interval_s, at the rates transport/publisher.py allows."""
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()
    fd = publisher.sock.getsockopt(zmq.FD)
    loop.add_reader(fd, woken.set)
    try:
        while True:
            publisher.read_subscriptions()
            wait_s = publisher.resend_due(time.monotonic())
            woken.clear()
            if not publisher.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await wait_event(woken, wait_s)
    finally:
        loop.remove_reader(fd)


async def guard_connections(guards: list[ConnectionGuard], interval_s: float) -> None:
    """Connections over the limits are closed (transport/guard.py): peers cannot make the learner hold unbounded memory.
    After a cut, the memory it freed goes back to the system (at most once a second)."""
    cuts, trim_at, trimmed_at = 0, None, 0.0
    while True:
        for guard in guards:
            guard.check()
        now = time.monotonic()
        total = sum(sum(g.cut.values()) for g in guards)
        if total != cuts:
            cuts = total
            trim_at = max(now + 0.2, trimmed_at + 1.0)  # libzmq closes the connection and frees it meanwhile
        if trim_at is not None and now >= trim_at:
            release_memory()
            trim_at, trimmed_at = None, time.monotonic()
        await asyncio.sleep(interval_s)


async def supervise(
    actors: ActorProcesses | None,
    ingest: Ingest,
    *,
    started_at: float,
    start_timeout_s: float,
    no_data_timeout_s: float,
    listen: str,
    stop: StopRequest,
) -> None:
    """Restart local actors that exit or hang; stop the learner when every one has been given up, or when no
    trajectory arrives within ``start_timeout_s`` of ``started_at`` or for ``no_data_timeout_s`` once data flowed."""
    while True:
        await asyncio.sleep(0.25)
        if actors is not None:
            actors.check()
            if actors.all_given_up():
                stop(
                    f"every local actor failed {actors.max_restarts + 1} times; see the actor errors above",
                    exitcodes.ACTORS_FAILED,
                )
        now, last = time.monotonic(), ingest.last_data_at
        if last is None and now - started_at > start_timeout_s:
            stop(
                f"no trajectory arrived within actor_start_timeout_s={start_timeout_s:g} s of start: are actors "
                f"running and pointed at {listen}?",
                exitcodes.NO_DATA,
            )
        elif last is not None and now - last > no_data_timeout_s:
            stop(
                f"no trajectory arrived for no_data_timeout_s={no_data_timeout_s:g} s: every actor is gone or stuck",
                exitcodes.NO_DATA,
            )


async def probe_loop_lag(histogram: Histogram) -> None:
    """Event-loop responsiveness: how late a short sleep wakes up."""
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(LOOP_LAG_PROBE_S)
        histogram.add(max(0.0, time.monotonic() - t0 - LOOP_LAG_PROBE_S))


async def every(interval_s: float, call: Callable[[], object]) -> None:
    while True:
        await asyncio.sleep(interval_s)
        call()


def dump_state(loop: asyncio.AbstractEventLoop, summary: Callable[[], str]) -> None:
    """SIGUSR1: write every thread's stack, every asyncio task's state and ``summary()`` to stderr (a stuck learner)."""
    import faulthandler

    faulthandler.dump_traceback(all_threads=True)
    for task in asyncio.all_tasks(loop):
        task.print_stack(file=sys.stderr)
    print(summary(), file=sys.stderr, flush=True)
