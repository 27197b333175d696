"""The weights socket: an XPUB that hears subscriptions, sends weights, and lets no peer multiply what it sends.

No asyncio: the server calls these methods from its event loop. Design:

- ``ZMQ_XPUB_MANUAL``: a subscription is stored only when the learner applies it, and it applies exactly one, to
  everything (``""``, the only topic it publishes). Other topics are counted and dropped, so no number of
  subscriptions grows the learner's memory (400K distinct topics held 1.3 GiB in automatic mode).
- ``ZMQ_MAXMSGSIZE = max_subscription_bytes`` on the socket: a subscription is a few bytes, a CurveZMQ handshake
  frame about 300; a larger frame closes the connection before it is buffered (also before authentication).
- A :class:`~.guard.ConnectionGuard` caps connections, unread bytes and subscription messages per
  connection, and with :class:`~.guard.Outbound` what subscribers leave untaken.
- What a subscriber can make the learner hold is bounded three ways. In the kernel: ``ZMQ_SNDBUF =
  max_send_buffer_bytes_per_subscriber``. In libzmq: ``SNDHWM`` messages queued, and the one being written, per
  subscriber; each weights message is sent without a copy (``copy=False``) and tracked, so :meth:`held_bytes` knows
  the bytes of every version libzmq still holds (one copy per version, shared by its subscribers). In time: the guard
  cuts a subscriber that has taken no whole weights message for ``max_subscriber_stall_s`` while weights waited for
  it, and, while :meth:`held_bytes` exceeds ``max_weights_held_bytes``, the one stalled longest. 1,000 subscribers
  that read nothing (sending ZMTP PINGs, so that the heartbeats never closed them) pinned 2,940 MiB of old versions
  for good before these bounds.
- Re-sends are rate-limited: weights go out after updates (at most every ``publish_interval_s``), again every
  ``republish_interval_s``, and once more for subscribers that joined since the last send, at most every
  ``min_resend_interval_s`` (joins meanwhile share it). A peer that subscribes over and over gets an honest subscriber
  no more copies than that.
"""

from __future__ import annotations

import collections
import time

import zmq

from ...config.service import Limits, Network
from ...ops import zmtp
from .guard import ConnectionGuard, Outbound, guard_source

SNDHWM_MESSAGES = 2  # weights queued per subscriber (only the newest matter; actors CONFLATE)
HELD_PER_SUBSCRIBER_MESSAGES = SNDHWM_MESSAGES + 1  # and the one its connection is writing
RCVHWM_MESSAGES = 16  # subscription messages queued per subscriber
_SUBSCRIBE_ALL, _UNSUBSCRIBE_ALL = b"\x01", b"\x00"


class WeightsPublisher:
    def __init__(self, ctx: zmq.Context, network: Network, limits: Limits, secure=None):
        """``secure(socket)`` makes the socket a CURVE server (see auth.make_curve_server); call :meth:`bind` next."""
        self.republish_interval_s = network.republish_interval_s
        self.min_resend_interval_s = network.min_resend_interval_s
        self.sock = ctx.socket(zmq.XPUB)
        s = self.sock
        s.setsockopt(zmq.XPUB_MANUAL, 1)
        s.setsockopt(zmq.MAXMSGSIZE, limits.max_subscription_bytes)
        s.setsockopt(zmq.SNDHWM, SNDHWM_MESSAGES)
        s.setsockopt(zmq.RCVHWM, RCVHWM_MESSAGES)
        s.setsockopt(zmq.HANDSHAKE_IVL, int(network.handshake_timeout_s * 1000))
        zmtp.heartbeats(s, network.peer_timeout_s)  # a peer gone without closing stops counting against the limits
        s.setsockopt(zmq.LINGER, 0)
        if limits.max_send_buffer_bytes_per_subscriber:
            s.setsockopt(zmq.SNDBUF, limits.max_send_buffer_bytes_per_subscriber)
        if secure is not None:
            secure(s)
        self.latest: bytes | None = None
        # (tracker, id of the bytes, size) per message sent, until libzmq has released it: what held_bytes() counts
        self._held: collections.deque[tuple[zmq.MessageTracker, int, int]] = collections.deque()
        per_connection = max(64 << 10, (RCVHWM_MESSAGES + 2) * limits.max_subscription_bytes)
        self.guard = ConnectionGuard(
            "weights",
            s,
            max_connections=limits.max_connections,
            max_unread_bytes=per_connection,
            max_unread_bytes_total=per_connection * limits.max_connections,
            max_messages=limits.max_subscriptions_per_connection,
            max_checks_per_s=limits.max_connection_checks_per_s,
            outbound=Outbound(
                max_stall_s=limits.max_subscriber_stall_s,
                max_held_bytes=limits.max_weights_held_bytes,
                messages_per_subscriber=HELD_PER_SUBSCRIBER_MESSAGES,
                message_bytes=lambda: len(self.latest) if self.latest is not None else 0,
                held_bytes=self.held_bytes,
            ),
        )
        self.sends = 0  # weights messages sent (each goes to every subscriber)
        self.resends = 0  # of which re-sends of the same weights (new subscribers, periodic)
        self.subscriptions = 0
        self.ignored_subscriptions = 0  # to topics the learner never publishes
        self._join_pending = False
        self._last_resend = -float("inf")
        self._next_periodic = time.monotonic() + self.republish_interval_s

    def counters(self) -> dict:
        return {
            "weights_sends": self.sends,
            "weights_resends": self.resends,
            "subscriptions": self.subscriptions,
            "subscriptions_ignored": self.ignored_subscriptions,
            "weights_held_bytes": self.held_bytes(),
            **self.guard.counters(),
        }

    def bind(self, address: str) -> str:
        self.sock.bind(address)
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        self.guard.close(self.sock)
        self.sock.close(0)

    def publish(self, data: bytes) -> None:
        """New weights: to every subscriber (those that joined before included)."""
        self.latest = data
        self._send(data)
        self._join_pending = False
        self._next_periodic = time.monotonic() + self.republish_interval_s

    def _send(self, data: bytes) -> None:
        """To every subscriber, without a copy: libzmq holds ``data`` itself until the last subscriber's connection
        has written it (or is closed); the tracker says when."""
        try:
            tracker = self.sock.send(data, zmq.NOBLOCK, copy=False, track=True)
        except zmq.Again:
            return
        self.sends += 1
        held = self._held
        while held and held[0][0].done:
            held.popleft()
        held.append((tracker, id(data), len(data)))

    def held_bytes(self) -> int:
        """Bytes of the weights messages libzmq holds now, each version counted once (a re-send shares the bytes of
        the message it repeats; ``id`` is unique among live objects, and a message not yet released is alive)."""
        self._held = collections.deque(entry for entry in self._held if not entry[0].done)
        return sum({key: n for _, key, n in self._held}.values())

    def read_subscriptions(self) -> None:
        """Apply the subscription messages waiting on the socket."""
        sock = self.sock
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            data = frame.bytes
            source = guard_source(frame)  # None for what libzmq itself queues (a closed subscriber's unsubscribe)
            if source is not None:
                self.guard.delivered(source, len(data))
            if data == _SUBSCRIBE_ALL:
                sock.setsockopt(zmq.SUBSCRIBE, b"")  # applies to the connection this message came from
                self.subscriptions += 1
                self._join_pending = True
            elif data == _UNSUBSCRIBE_ALL:
                sock.setsockopt(zmq.UNSUBSCRIBE, b"")
            else:
                self.ignored_subscriptions += 1

    def resend_due(self, now: float) -> float:
        """Re-send if due (see the module docstring); returns the seconds until something may next be due."""
        if self.latest is None:
            return self.republish_interval_s
        if self._join_pending and now - self._last_resend >= self.min_resend_interval_s:
            self._resend(now)
        elif now >= self._next_periodic:
            self._resend(now)
        wait = self._next_periodic - now
        if self._join_pending:
            wait = min(wait, self._last_resend + self.min_resend_interval_s - now)
        return max(0.001, wait)

    def _resend(self, now: float) -> None:
        assert self.latest is not None  # re-sends are due only once something was published
        self._send(self.latest)
        self.resends += 1
        self._last_resend = now
        self._join_pending = False
        self._next_periodic = now + self.republish_interval_s
