"""Bounds on what the peers of one ZeroMQ socket can make the learner hold: connections, and unread bytes.

No asyncio: the server feeds this from its event loop. ZeroMQ bounds each queue in *messages*
(``ZMQ_RCVHWM``) and each frame in bytes (``ZMQ_MAXMSGSIZE``), but not a multipart message that never ends: its frames
stay in the connection's pipe until the last one arrives, so a peer can make the learner hold gigabytes. ZeroMQ also
accepts every TCP connection, authenticated or not. The guard closes the gap from outside libzmq:

- it follows the socket's connections through a socket monitor (``ZMQ_EVENT_ACCEPTED`` carries the connection's file
  descriptor, ``ZMQ_EVENT_DISCONNECTED`` its end);
- it refuses connections beyond ``max_connections`` (shut down as soon as they are seen, before any handshake);
- every ``check()`` it compares, per connection, the bytes TCP has received (``TCP_INFO.tcpi_bytes_received``) with
  the bytes of the complete messages the learner has read from it (each message names its connection's descriptor
  in its ``__fd`` property): the difference is what libzmq holds for that peer (queued messages, a partial message
  or an unfinished handshake). A connection holding more than ``max_unread_bytes`` is shut down, and while all of them
  together hold more than ``max_unread_bytes_total`` the one holding most is shut down;
- ``delivered()`` counts messages per connection; more than ``max_messages`` (the weights socket's subscriptions:
  an honest subscriber sends one) closes the connection.

Shutting a connection down (``shutdown(2)`` on its descriptor) makes libzmq close it and free its pipe, partial
messages included. Every cut is counted by reason in ``cut``.
"""

from __future__ import annotations

import collections
import logging
import socket
import struct
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("impala_async.learner.guard")

_TCPI_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received (u64) in Linux's struct tcp_info (since Linux 4.1)
_TCP_INFO_LEN = 136
PER_MESSAGE_OVERHEAD_BYTES = 64  # ZMTP frame header and CURVE box, per message
PER_CONNECTION_OVERHEAD_BYTES = 64 << 10  # greeting and handshake
EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
CUT_REASONS = ("max_connections", "unread_bytes", "unread_bytes_total", "max_messages")


def guard_source(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection a received frame came from (libzmq's ``__fd`` property), or None."""
    try:
        return int(frame.get("__fd"))
    except (zmq.ZMQError, ValueError, TypeError):
        return None


def tcp_bytes_received(fd: int) -> int | None:
    """Bytes the kernel has received on TCP socket ``fd`` (None if it is not a TCP socket or has no such count)."""
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
    return struct.unpack_from("<Q", info, _TCPI_BYTES_RECEIVED)[0]


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


def shut_down(fd: int) -> None:
    """Make libzmq drop connection ``fd``: its next read sees the end of the stream."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already gone
    finally:
        s.detach()


@dataclass
class _Conn:
    fd: int
    peer: str
    delivered_bytes: int = 0
    messages: int = 0
    unread_bytes: int = 0


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
    ):
        self.name = name
        self.max_connections = max_connections
        self.max_unread_bytes = max_unread_bytes
        self.max_unread_bytes_total = max_unread_bytes_total
        self.max_messages = max_messages
        self.monitor = sock.get_monitor_socket(EVENTS)
        self.conns: dict[int, _Conn] = {}
        self.cut: collections.Counter = collections.Counter()
        self.accepted = 0
        self.unread_bytes_total = 0
        self.max_unread_bytes_seen = 0

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
        self.conns[fd] = _Conn(fd, endpoint.decode("ascii", "replace"))

    # ---------------------------------------------------------------------------------------------- accounting
    def delivered(self, fd: int, nbytes: int) -> None:
        """A complete message of ``nbytes`` was read from connection ``fd``."""
        conn = self.conns.get(fd)
        if conn is None:
            self.drain_events()  # its ACCEPTED event may not have been read yet
            conn = self.conns.get(fd)
            if conn is None:
                return  # a connection already cut
        conn.delivered_bytes += nbytes + PER_MESSAGE_OVERHEAD_BYTES
        conn.messages += 1
        if self.max_messages is not None and conn.messages > self.max_messages:
            self._cut(conn, "max_messages")

    def check(self) -> None:
        """Cut the connections that hold too much unread data (see the module docstring)."""
        self.drain_events()
        total, largest = 0, []
        for conn in list(self.conns.values()):
            received = tcp_bytes_received(conn.fd)
            if received is None:
                continue  # ipc:// or already closed
            conn.unread_bytes = max(0, received - conn.delivered_bytes - PER_CONNECTION_OVERHEAD_BYTES)
            if conn.unread_bytes > self.max_unread_bytes:
                self._cut(conn, "unread_bytes")
                continue
            total += conn.unread_bytes
            largest.append(conn)
        self.max_unread_bytes_seen = max(self.max_unread_bytes_seen, total)
        if total > self.max_unread_bytes_total:
            for conn in sorted(largest, key=lambda c: c.unread_bytes, reverse=True):
                self._cut(conn, "unread_bytes_total")
                total -= conn.unread_bytes
                if total <= self.max_unread_bytes_total:
                    break
        self.unread_bytes_total = total

    def _cut(self, conn: _Conn, reason: str) -> None:
        n = self.cut[reason]
        self.cut[reason] = n + 1
        self.conns.pop(conn.fd, None)
        shut_down(conn.fd)
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
    return f"{conn.messages} messages on a connection that may send {g.max_messages}"
