"""The weights socket: an XPUB that hears subscriptions, sends weights, and lets no peer multiply what it sends.

No asyncio: the server calls these methods from its event loop. Design:

- ``ZMQ_XPUB_MANUAL``: a subscription is stored only when the learner applies it, and it applies exactly one, to
  everything (``""``, the only topic it publishes). Other topics are counted and dropped, so no number of
  subscriptions grows the learner's memory (400K distinct topics held 1.3 GiB in automatic mode).
- ``ZMQ_MAXMSGSIZE = max_subscription_bytes`` on the socket: a subscription is a few bytes, a CurveZMQ handshake
  frame about 300; a larger frame closes the connection before it is buffered (also before authentication).
- A :class:`~impala_async.learner.guard.ConnectionGuard` caps connections, unread bytes and subscription messages per
  connection.
- Re-sends are rate-limited: weights go out after updates (at most every ``publish_interval_s``), again every
  ``republish_interval_s``, and once more for subscribers that joined since the last send, at most every
  ``min_resend_interval_s`` (joins meanwhile share it). A peer that subscribes over and over gets an honest subscriber
  no more copies than that.
"""

from __future__ import annotations

import time

import zmq

from ..config.service import Limits, Network
from ..ops import zmtp
from .guard import ConnectionGuard, guard_source

SNDHWM_MESSAGES = 2  # weights queued per subscriber (only the newest matter; actors CONFLATE)
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
        if secure is not None:
            secure(s)
        per_connection = max(64 << 10, (RCVHWM_MESSAGES + 2) * limits.max_subscription_bytes)
        self.guard = ConnectionGuard(
            "weights",
            s,
            max_connections=limits.max_connections,
            max_unread_bytes=per_connection,
            max_unread_bytes_total=per_connection * limits.max_connections,
            max_messages=limits.max_subscriptions_per_connection,
        )
        self.latest: bytes | None = None
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
        try:
            self.sock.send(data, zmq.NOBLOCK)
            self.sends += 1
        except zmq.Again:
            pass

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
        self._send(self.latest)
        self.resends += 1
        self._last_resend = now
        self._join_pending = False
        self._next_periodic = now + self.republish_interval_s
