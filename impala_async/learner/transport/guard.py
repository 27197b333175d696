"""Bounds on what the peers of one ZeroMQ socket can make the learner hold: connections, unread bytes, untaken ones.

No asyncio: the server feeds this from its event loop. ZeroMQ bounds each queue in *messages*
(``ZMQ_RCVHWM``) and each frame in bytes (``ZMQ_MAXMSGSIZE``), but not a multipart message that never ends: its frames
stay in the connection's pipe until the last one arrives, so a peer can make the learner hold gigabytes. ZeroMQ also
accepts every TCP connection, authenticated or not. The guard closes the gap from outside libzmq:

- it follows the socket's connections through a socket monitor (``ZMQ_EVENT_ACCEPTED`` carries the connection's file
  descriptor, ``ZMQ_EVENT_DISCONNECTED`` its end);
- it refuses connections beyond ``max_connections`` (shut down as soon as they are seen, before any handshake);
- every ``check()`` (of the connections whose turn it is: at most ``max_checks_per_s`` a second, so that cheap
  connections by the thousand cannot make the guard take the event loop) it compares, per connection, the bytes TCP has
  received (``TCP_INFO.tcpi_bytes_received``) with the bytes of the complete messages the learner has read from it (each
  message names its connection's descriptor in its ``__fd`` property): the difference is what libzmq holds for that peer
  (queued messages, a partial message or an unfinished handshake). A connection holding more than ``max_unread_bytes``
  is shut down, and while all of them together hold more than ``max_unread_bytes_total`` the one holding most is shut
  down;
- ``delivered()`` credits each message read with the bytes it took on the wire (:func:`wire_bytes`: its ZMTP frame
  header, and under CURVE its MESSAGE box), no more: a guard that credited more (64 bytes whatever the size) let 4M
  empty messages (2 bytes each) buy a connection 320 MiB of unread bytes beyond its bound. It also counts messages
  per connection; more than ``max_messages`` (the weights socket's subscriptions: an honest subscriber sends one)
  closes the connection;
- with :class:`Outbound` (the weights socket) it also watches what each connection has not taken: the kernel's send
  queue (``SIOCOUTQ``) and the bytes the peer acknowledged (``TCP_INFO.tcpi_bytes_acked``). A connection that has had
  bytes waiting for ``max_stall_s`` without taking one whole weights message is cut (``stalled``): a subscriber that
  reads nothing, or a trickle, while sending ZMTP PINGs, is never closed by the heartbeats, and libzmq holds for it
  its queued weights and the one it was writing, old versions the learner cannot free. While the weights held for
  subscribers (:meth:`Outbound.held_bytes`) exceed ``max_held_bytes``, the connection stalled longest is cut
  (``held_weights``).

Shutting a connection down (``shutdown(2)`` on its descriptor) makes libzmq close it and free its pipe, partial
messages included (and for an outbound cut, ``SO_LINGER`` 0 first: the kernel drops the send queue at once instead of
probing a closed window for minutes). Every cut is counted by reason in ``cut``.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import math
import socket
import struct
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("impala_async.learner.guard")

_TCPI_BYTES_ACKED = 120  # offset of tcpi_bytes_acked (u64) in Linux's struct tcp_info (since Linux 4.1)
_TCPI_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received (u64)
_TCP_INFO_LEN = 136
_OUTQ = struct.pack("i", 0)
CURVE_MESSAGE_OVERHEAD_BYTES = 33  # a CurveZMQ MESSAGE command: "\x07MESSAGE", 8-byte nonce, flags byte, 16-byte MAC
PER_CONNECTION_OVERHEAD_BYTES = 64 << 10  # greeting and handshake
# Outbound (the weights socket): bytes per second of a connection's age never counted as unread. Its peer sends
# ZMTP PINGs and PONGs, which libzmq reads itself and never hands over, so they are never credited: 16 bytes per
# heartbeat plain, 82 under CURVE, which at 10 s heartbeats cut an honest subscriber for unread_bytes after about
# 23 h (4.4 h under CURVE). 64 bytes/s covers CURVE heartbeats every 1.3 s; nothing an attacker could hold grows by
# it, since the weights socket's frames are bounded by max_subscription_bytes and read as they come.
HEARTBEAT_ALLOWANCE_BYTES_PER_S = 64
EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
# A cut for held weights counts as freeing what its subscriber may hold for this long: libzmq frees a cut subscriber's
# queue once its socket has processed the closing (the server's republish task makes it do so when woken), and pyzmq's
# garbage thread releases the messages then. Checks meanwhile would otherwise still see the bytes held and cut more.
HELD_CUT_FREEING_S = 0.2
# Outbound cuts (a guard with Outbound: the weights socket): a subscriber taking nothing (or a trickle) for
# max_stall_s; the one stalled longest while the weights held for subscribers exceed max_held_bytes.
OUTBOUND_CUT_REASONS = ("stalled", "held_weights")
CUT_REASONS = ("max_connections", "unread_bytes", "unread_bytes_total", "max_messages", *OUTBOUND_CUT_REASONS)


def wire_bytes(nbytes: int, curve: bool) -> int:
    """The bytes a ZMTP 3 frame of ``nbytes`` takes on the wire: a 2-byte header up to 255 bytes of body, 9 above;
    under CURVE the frame travels as a MESSAGE command of ``nbytes + 33`` bytes. The guard credits a message read
    with exactly this: crediting more lets a peer hold the surplus unread (see the module docstring)."""
    if curve:
        nbytes += CURVE_MESSAGE_OVERHEAD_BYTES
    return nbytes + (2 if nbytes <= 255 else 9)


def unread_bytes(received: int, delivered: int, allowance: int) -> int:
    """What libzmq holds unread for a connection: the bytes TCP received beyond those credited to the messages read
    and the ``allowance`` (handshake, heartbeats)."""
    return max(0, received - delivered - allowance)


def guard_source(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection a received frame came from (libzmq's ``__fd`` property), or None."""
    try:
        return int(frame.get("__fd"))
    except (zmq.ZMQError, ValueError, TypeError):
        return None


def tcp_bytes(fd: int) -> tuple[int, int] | None:
    """``(received, acked)``: the bytes the kernel has received on TCP socket ``fd`` and the bytes it sent that the
    peer acknowledged (None if it is not a TCP socket or has no such counts)."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    finally:
        s.detach()  # the descriptor belongs to libzmq
    if len(info) < _TCP_INFO_LEN:
        return None
    return struct.unpack_from("<Q", info, _TCPI_BYTES_RECEIVED)[0], struct.unpack_from("<Q", info, _TCPI_BYTES_ACKED)[0]


def tcp_bytes_queued(fd: int) -> int:
    """Bytes in socket ``fd``'s send queue: not yet sent, or sent and not yet acknowledged (``SIOCOUTQ``); 0 if that
    cannot be read."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, _OUTQ))[0]
    except OSError:
        return 0


def _libc_malloc_trim():
    try:
        import ctypes
        import ctypes.util

        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc


_MALLOC_TRIM = _libc_malloc_trim()


def release_memory() -> None:
    """Give freed heap memory back to the system (glibc's ``malloc_trim``). After a connection holding hundreds of
    MiB is cut, its buffers are free but glibc keeps them mapped: the resident size would ratchet up attack by
    attack though nothing is in use."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def shut_down(fd: int, *, drop_send_queue: bool = False) -> None:
    """Make libzmq drop connection ``fd``: its next read sees the end of the stream. ``drop_send_queue``: ``SO_LINGER``
    0 first, so that libzmq's close resets the connection and frees the kernel's send queue at once (a peer that
    reads nothing would otherwise keep it through minutes of zero-window probes)."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        if drop_send_queue:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already gone
    finally:
        s.detach()


@dataclass(frozen=True)
class Outbound:
    """What a socket's peers may make the learner hold of what it sends them (the weights socket; publisher.py).

    ``max_stall_s``: a connection with bytes waiting must take ``message_bytes()`` (the latest weights message's size)
    within this. ``max_held_bytes``: bound on ``held_bytes()``, the bytes of messages libzmq holds for subscribers (one
    copy per version, however many subscribers share it); it never cuts below ``messages_per_subscriber`` messages,
    what one subscriber's queue and the message being written hold."""

    max_stall_s: float
    max_held_bytes: int
    messages_per_subscriber: int
    message_bytes: Callable[[], int]
    held_bytes: Callable[[], int]


@dataclass
class _Conn:
    fd: int
    peer: str
    accepted_at: float = 0.0
    delivered_bytes: int = 0
    messages: int = 0
    unread_bytes: int = 0
    # Outbound: when it last had nothing waiting or had taken a whole message since the mark before, and the peer's
    # acknowledged bytes then; ``stalled_s`` is the time since (while bytes wait).
    mark_at: float = 0.0
    mark_acked: int = 0
    stalled_s: float = 0.0
    taken_bytes: int = 0  # acknowledged since the mark (for the log)


class ConnectionGuard:
    def __init__(
        self,
        name: str,
        sock: zmq.Socket,
        *,
        max_connections: int,
        max_unread_bytes: int,
        max_unread_bytes_total: int,
        max_messages: int | None = None,
        outbound: Outbound | None = None,
        max_checks_per_s: float = math.inf,
    ):
        """Create it after the socket's security is set: under CURVE (``ZMQ_CURVE_SERVER``) a message read is credited
        with its CURVE box too."""
        self.name = name
        self.max_connections = max_connections
        self.max_unread_bytes = max_unread_bytes
        self.max_unread_bytes_total = max_unread_bytes_total
        self.max_messages = max_messages
        self.outbound = outbound
        self.max_checks_per_s = max_checks_per_s
        self._checked_at: float | None = None  # when check() last ran
        self._quota = 0.0  # checks owed (a fraction of one carried over)
        self._cursor = 0  # where in the connections the next turn begins
        self.curve = bool(sock.getsockopt(zmq.CURVE_SERVER))
        self.monitor = sock.get_monitor_socket(EVENTS)
        self.conns: dict[int, _Conn] = {}
        self.cut: collections.Counter = collections.Counter()
        self.accepted = 0
        self.unread_bytes_total = 0
        self.max_unread_bytes_seen = 0
        self._freeing: collections.deque[float] = collections.deque()  # when each recent cut for held weights came

    def counters(self) -> dict:
        """Connections open now and cut by reason, per socket (``cut_<socket>_<reason>``); unread bytes held."""
        out = {
            f"connections_{self.name}": len(self.conns),
            **{f"cut_{self.name}_{reason}": self.cut[reason] for reason in CUT_REASONS},
        }
        if self.name == "trajectories":
            out["unread_bytes"] = self.unread_bytes_total
        return out

    def close(self, sock: zmq.Socket) -> None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)

    # -------------------------------------------------------------------------------------------- monitor events
    def drain_events(self) -> None:
        """Read every pending monitor event (non-blocking)."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            kind, fd = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted(fd, event["endpoint"])
            elif kind == zmq.EVENT_DISCONNECTED:
                self.conns.pop(fd, None)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                pass  # the value is not a descriptor here

    def _accepted(self, fd: int, endpoint: bytes) -> None:
        self.accepted += 1
        self.conns.pop(fd, None)  # a descriptor number reused: the old connection is gone
        if len(self.conns) >= self.max_connections:
            self._cut(_Conn(fd, ""), "max_connections")
            return
        now = time.monotonic()
        self.conns[fd] = _Conn(fd, endpoint.decode("ascii", "replace"), accepted_at=now, mark_at=now)

    # ---------------------------------------------------------------------------------------------- accounting
    def delivered(self, fd: int, nbytes: int) -> None:
        """A complete message (or frame) of ``nbytes`` was read from connection ``fd``: credited with what it took on
        the wire (:func:`wire_bytes`)."""
        conn = self.conns.get(fd)
        if conn is None:
            self.drain_events()  # its ACCEPTED event may not have been read yet
            conn = self.conns.get(fd)
            if conn is None:
                return  # a connection already cut
        conn.delivered_bytes += wire_bytes(nbytes, self.curve)
        conn.messages += 1
        if self.max_messages is not None and conn.messages > self.max_messages:
            self._cut(conn, "max_messages")

    def check(self) -> None:
        """Cut the connections that hold too much unread data, and with :class:`Outbound` those that take nothing (see
        the module docstring). Those checked are :meth:`_due`; the totals count every connection's latest figures."""
        self.drain_events()
        now = time.monotonic()
        for conn in self._due(now):
            counts = tcp_bytes(conn.fd)
            if counts is None:
                continue  # ipc:// or already closed
            conn.unread_bytes = unread_bytes(counts[0], conn.delivered_bytes, self._allowance_bytes(conn, now))
            if conn.unread_bytes > self.max_unread_bytes:
                self._cut(conn, "unread_bytes")
            elif self.outbound is not None:
                self._taking(conn, counts[1], now)
        live = list(self.conns.values())  # those cut are gone
        self._check_total(live)
        if self.outbound is not None:
            self._check_held(live, now)

    def _due(self, now: float) -> list[_Conn]:
        """The connections to check now: every one while there are few, else the next ``max_checks_per_s`` x the time
        since the last check, in turn. A check is a system call or two (5-9 us), and connections are free to open:
        1,000 idle ones checked every 50 ms took 13% of the learner's core, and beside a training thread on two
        cores an honest actor kept under half its throughput (CI). So the guard's cost is bounded, not the peers',
        and a connection's figures are at most ``connections / max_checks_per_s`` seconds old."""
        conns = list(self.conns.values())
        elapsed = math.inf if self._checked_at is None else now - self._checked_at
        self._checked_at = now
        if math.isinf(elapsed) or math.isinf(self.max_checks_per_s):
            return conns
        quota = min(len(conns), self._quota + self.max_checks_per_s * elapsed)
        if quota >= len(conns):
            self._quota = 0.0
            return conns
        n = int(quota)
        self._quota = quota - n
        start = self._cursor % len(conns)
        self._cursor = end = start + n
        return conns[start:end] + conns[: max(0, end - len(conns))]

    def _allowance_bytes(self, conn: _Conn, now: float) -> int:
        """Bytes of ``conn`` never counted as unread: its handshake, and on the weights socket its heartbeats."""
        heartbeats = 0 if self.outbound is None else HEARTBEAT_ALLOWANCE_BYTES_PER_S * (now - conn.accepted_at)
        return PER_CONNECTION_OVERHEAD_BYTES + int(heartbeats)

    def _check_total(self, live: list[_Conn]) -> None:
        total = sum(c.unread_bytes for c in live)
        self.max_unread_bytes_seen = max(self.max_unread_bytes_seen, total)
        if total > self.max_unread_bytes_total:
            for conn in sorted(live, key=lambda c: c.unread_bytes, reverse=True):
                self._cut(conn, "unread_bytes_total")
                total -= conn.unread_bytes
                if total <= self.max_unread_bytes_total:
                    break
        self.unread_bytes_total = total

    def _taking(self, conn: _Conn, acked: int, now: float) -> bool:
        """Whether connection ``conn`` (``acked`` bytes acknowledged by its peer) takes what is sent to it: it had
        nothing waiting, or took a whole message, within the last ``max_stall_s``. If not, it is cut (``stalled``).
        Bounds how long a subscriber can pin old weights, which the heartbeats do not (its PINGs keep arriving)."""
        out = self.outbound
        assert out is not None  # only the weights socket's guard (with an Outbound) checks what subscribers take
        need = max(1, out.message_bytes())
        if acked - conn.mark_acked >= need or tcp_bytes_queued(conn.fd) == 0:
            conn.mark_at, conn.mark_acked, conn.stalled_s = now, acked, 0.0
            return True
        conn.stalled_s = now - conn.mark_at
        if conn.stalled_s < out.max_stall_s:
            return True
        conn.taken_bytes = acked - conn.mark_acked
        self._cut(conn, "stalled")
        return False

    def _check_held(self, live: list[_Conn], now: float) -> None:
        """While the weights held for subscribers exceed the bound, cut the connections stalled longest (those holding
        the oldest versions): as many as would free the excess if each held its own ``messages_per_subscriber``
        messages, counting those cut in the last ``HELD_CUT_FREEING_S`` as freed already; versions they share with
        others may need more cuts later."""
        out, freeing = self.outbound, self._freeing
        assert out is not None  # only the weights socket's guard (with an Outbound) bounds held weights
        while freeing and now - freeing[0] > HELD_CUT_FREEING_S:
            freeing.popleft()
        per_subscriber = out.messages_per_subscriber * max(1, out.message_bytes())
        excess = out.held_bytes() - max(out.max_held_bytes, per_subscriber) - len(freeing) * per_subscriber
        if excess <= 0:
            return
        for conn in sorted((c for c in live if c.stalled_s > 0), key=lambda c: c.stalled_s, reverse=True):
            self._cut(conn, "held_weights")
            freeing.append(now)
            excess -= per_subscriber
            if excess <= 0:
                break

    def _cut(self, conn: _Conn, reason: str) -> None:
        n = self.cut[reason]
        self.cut[reason] = n + 1
        self.conns.pop(conn.fd, None)
        shut_down(conn.fd, drop_send_queue=reason in OUTBOUND_CUT_REASONS)
        if n < 10 or (n & (n - 1)) == 0:  # rate-limited: the first ten, then at powers of two
            log.warning(
                "%s socket: closed connection %s (%s; %d so far): %s",
                self.name,
                conn.peer or f"fd {conn.fd}",
                reason,
                n + 1,
                _explain(reason, conn, self),
            )


def _explain(reason: str, conn: _Conn, g: ConnectionGuard) -> str:
    if reason == "max_connections":
        return f"already {g.max_connections} connections (max_connections)"
    if reason == "unread_bytes":
        return f"it made the learner hold {conn.unread_bytes} unread bytes > {g.max_unread_bytes}"
    if reason == "unread_bytes_total":
        return (
            f"all connections held more than {g.max_unread_bytes_total} unread bytes; this one the most "
            f"({conn.unread_bytes})"
        )
    out = g.outbound  # the weights socket's guard: the two reasons below are its own
    if reason == "stalled" and out is not None:
        return (
            f"it took {conn.taken_bytes} bytes in {conn.stalled_s:.1f} s with weights waiting, less than one weights "
            f"message ({out.message_bytes()} bytes) in {out.max_stall_s:g} s (max_subscriber_stall_s)"
        )
    if reason == "held_weights" and out is not None:
        return (
            f"the weights held for subscribers exceed {out.max_held_bytes} bytes (max_weights_held_bytes); "
            f"this one had taken no whole weights message for the longest ({conn.stalled_s:.1f} s)"
        )
    return f"{conn.messages} messages on a connection that may send {g.max_messages}"
