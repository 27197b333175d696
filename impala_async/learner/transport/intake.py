"""The trajectory socket and its receive loop: a ZeroMQ PULL socket read by the event loop, guarded against peers
that would make the learner hold too much, each message handed to :class:`~.ingest.Ingest`.

The socket is a plain (synchronous) one: the event loop watches its file descriptor itself and only ever receives
non-blocking, so no pyzmq asyncio machinery shares that descriptor.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import zmq

from ...config.service import Limits, Network
from ...ops import zmtp
from .guard import ConnectionGuard, guard_source

MAX_DRAIN_MESSAGES = 256  # messages handled per wake-up before yielding to other tasks ...
MAX_DRAIN_S = 0.005  # ... or this much time


async def wait_event(event: asyncio.Event, timeout_s: float) -> None:
    """Wait until ``event`` is set or ``timeout_s`` passes (then it is set too; callers clear it before waiting).

    Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that races with the event (the receive task
    then never ended and shutdown hung; seen in tests/test_cli.py)."""
    timer = asyncio.get_running_loop().call_later(timeout_s, event.set)
    try:
        await event.wait()
    finally:
        timer.cancel()


class Takes(Protocol):
    """What the receive loop hands messages to: :class:`~.ingest.Ingest`, or :class:`~.lockstep.Ordered` in front of
    it (``--reproducible 1``)."""

    @property
    def pending(self) -> object | None: ...

    def handle(self, buf, user_id: str | None = None, source: int | None = None) -> None: ...

    def continue_pending(self) -> bool: ...

    def has_room(self) -> bool: ...

    def reject_reason(self, reason: str, detail: str) -> None: ...


class Room:
    """ "A ring slot was freed": said from any thread (the ring's ``on_release``, on the training thread), awaited by
    a receive loop that holds a message the ring had no room for (``when_full = wait``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.event = loop, asyncio.Event()

    def freed(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


class Intake:
    def __init__(self, ctx: zmq.Context, network: Network, limits: Limits, ingest: Takes, room: Room, secure=None):
        """``room``: told when the ring frees a slot; ``secure(socket)`` makes the socket a CURVE server
        (ops/auth.py). Call :meth:`bind` next."""
        self.ingest, self.room = ingest, room
        self.sock = ctx.socket(zmq.PULL)
        s = self.sock
        s.setsockopt(zmq.RCVHWM, network.receive_hwm_messages)
        if network.receive_buffer_bytes:
            s.setsockopt(zmq.RCVBUF, network.receive_buffer_bytes)
        s.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
        s.setsockopt(zmq.HANDSHAKE_IVL, int(network.handshake_timeout_s * 1000))
        zmtp.heartbeats(s, network.peer_timeout_s)  # a peer gone without closing stops counting against the limits
        s.setsockopt(zmq.LINGER, 0)
        if secure is not None:
            secure(s)
        self.user_ids = secure is not None  # CURVE: each message carries its key's name (ZAP User-Id)
        self.guard = ConnectionGuard(
            "trajectories",
            s,
            max_connections=limits.max_connections,
            max_unread_bytes=limits.max_unread_bytes_per_connection,
            max_unread_bytes_total=limits.max_unread_bytes_total,
            max_checks_per_s=limits.max_connection_checks_per_s,
        )
        self.receive_s = 0.0  # cumulative seconds in recv calls
        # Monotonic time the receive loop last went round (at least every 0.1 s unless the event loop is stalled):
        # /healthz tells a stalled loop from a quiet one by it. None until the loop starts.
        self.beat: float | None = None

    def bind(self, address: str) -> str:
        self.sock.bind(address)
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        self.guard.close(self.sock)
        self.sock.close(0)

    def counters(self) -> dict:
        return {"stage_receive_s": self.receive_s}

    async def run(self, until: asyncio.Event) -> None:
        """Drain the socket with non-blocking receives; sleep on its file descriptor only when it is empty, or on
        ring room while a decoded message waits for it (``when_full = wait``).

        ZeroMQ's FD is edge-triggered ("something may have changed"): the loop checks ZMQ_EVENTS before sleeping and
        after every wake-up, so it never sleeps with messages pending. No Future per message."""
        loop, room = asyncio.get_running_loop(), self.room.event
        readable = asyncio.Event()
        fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(fd, readable.set)
        try:
            while not until.is_set():
                self.beat = time.monotonic()
                if not self.ingest.continue_pending():
                    room.clear()
                    if not self.ingest.has_room():  # the trainer may have released a slot meanwhile
                        await wait_event(room, 0.1)
                    continue
                if not self._has_message():
                    readable.clear()
                    if not self._has_message():  # re-check: the edge may have come meanwhile
                        await wait_event(readable, 0.1)
                        continue
                self._drain()
                await asyncio.sleep(0)  # let the other tasks run between drains
        finally:
            loop.remove_reader(fd)

    def _has_message(self) -> bool:
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _drain(self) -> None:
        """Handle up to MAX_DRAIN_MESSAGES messages or MAX_DRAIN_S of them, stopping early when one waits for room."""
        sock, ingest, guard = self.sock, self.ingest, self.guard
        deadline = time.monotonic() + MAX_DRAIN_S
        for _ in range(MAX_DRAIN_MESSAGES):
            t0 = time.perf_counter()
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.receive_s += time.perf_counter() - t0
            source = guard_source(frame)  # the connection it came from: its bytes are no longer held unread
            if source is not None:
                guard.delivered(source, len(frame))
            if frame.more:
                self._discard_multipart()
                continue
            ingest.handle(frame.buffer, frame.get("User-Id") if self.user_ids else None, source)
            if ingest.pending is not None or time.monotonic() > deadline:
                return

    def _discard_multipart(self) -> None:
        """The protocol has one frame per message: drop the rest of a multipart message (already in memory)."""
        parts = 1
        while self.sock.getsockopt(zmq.RCVMORE):
            frame = self.sock.recv(copy=False)
            source = guard_source(frame)
            if source is not None:
                self.guard.delivered(source, len(frame))
            parts += 1
        self.ingest.reject_reason("multipart", f"a message of {parts} frames; the protocol allows 1")
