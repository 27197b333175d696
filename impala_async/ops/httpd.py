"""A small, bounded HTTP/1.0 server for ``/metrics`` and ``/healthz``, on threads of its own, and its client.

No asyncio (ops/ sits beside the pure core): the learner's event loop and training thread never run a line of it, so
a scrape cannot stall them, and a stalled event loop cannot stall ``/healthz`` (which is how it gets reported).

One I/O thread reads the request heads of all connections in one selector loop (no thread per connection: an idle or
slow client costs a descriptor and a few hundred bytes, not a thread). Requests for the ``inline_routes``
(``/healthz``: a few reads) are answered on that thread at once; the others (``/metrics``: a collection) by ``threads``
worker threads, at most ``max_queued_requests`` waiting (one more is answered 503). What keeps the probe answered,
whatever other clients hold:

- the kernel hands a connection over only once its first bytes have arrived (``TCP_DEFER_ACCEPT``, Linux; after about
  ``head_timeout_s`` it hands it over anyway): connections that send nothing cost no descriptor and no room here;
- a request that arrives complete with its connection (a probe's does: a client sends it as soon as the connection is
  up, and it waits in the kernel until accepted) is answered on the spot, before any cap is looked at;
- a connection must have delivered its whole request head within ``head_timeout_s``, and have been answered within
  ``request_timeout_s``, or it is closed;
- at most ``max_connections_per_address`` connections per source address and ``max_connections`` in all (and at most
  a quarter of the process's descriptor limit, which ZeroMQ needs too): at a cap, the oldest connection still sending
  its head (of that address, or of all) is closed for the newest, so connections held open cannot lock newcomers
  out; only when none is left to close is the newest answered 503.

A request: GET or HEAD, one per connection (``Connection: close``), a head (request line, headers, blank line) of at
most ``max_request_bytes`` (431 as soon as a read shows it longer, whatever chunks it came in), and a ``Host`` header,
if any, naming an IP address, ``localhost``, the bound host or one of ``allowed_hosts`` (``.example.org``: every name
under it). A DNS-rebinding web page sends its own domain: refused with 421, so a browser on this machine cannot be
made to read /metrics. Every refusal and every connection closed unanswered is counted by reason (:data:`REFUSALS`).

Plain HTTP without authentication: what protects the port is where it is bound (loopback by default) and the network
around it (README, Operations; deploy/k8s's NetworkPolicy).
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import os
import queue
import resource
import selectors
import socket
import threading
import time

from .httpparts import (  # noqa: F401 (Response, text, metrics_route, probe, ...: what users of the server take from here)
    REFUSALS,
    BadRequest,
    Collector,
    Response,
    Route,
    connect_host,
    defer_accept,
    drain,
    encode,
    host_allowed,
    is_ip,
    is_loopback,
    join_host_port,
    metrics_route,
    parse_head,
    probe,
    text,
)

log = logging.getLogger("impala_async.ops.httpd")

_ACCEPTS_PER_WAKE = 16  # then the heads that arrived are read: a flood of connections cannot starve them
_ACCEPT_RETRY_S = 0.1  # accepting pauses this long when accept() fails with nothing to close
_DESCRIPTOR_SHARE = 4  # at most 1/4 of RLIMIT_NOFILE for HTTP connections: ZeroMQ and the run need the rest
_READING, _WAITING, _WRITING, _CLOSED = range(4)  # a connection's state
_LISTEN, _WAKE = object(), object()  # selector data of the listening socket and the wake-up pipe


class _Conn:
    """One client connection: its head so far, then the answer left to send. Owned by the I/O thread."""

    __slots__ = ("sock", "fd", "address", "accepted_at", "deadline", "head", "out", "state", "events", "tracked")

    def __init__(self, sock: socket.socket, address: str, now: float, head_deadline: float):
        self.sock, self.fd, self.address = sock, sock.fileno(), address
        self.accepted_at, self.deadline = now, head_deadline
        self.head, self.out = b"", b""
        self.state, self.events, self.tracked = _READING, 0, False


class HttpServer:
    """Serves ``routes`` (path -> function returning a :class:`Response`): the ``inline_routes`` on the I/O thread
    (they must be cheap and never block), the others on ``threads`` worker threads."""

    def __init__(
        self,
        host: str,
        port: int,
        routes: dict[str, Route],
        *,
        max_connections: int,
        request_timeout_s: float,
        max_request_bytes: int = 8192,
        max_connections_per_address: int = 32,
        head_timeout_s: float = 2.0,
        threads: int = 2,
        max_queued_requests: int = 16,
        allowed_hosts: tuple[str, ...] = (),
        inline_routes: tuple[str, ...] = ("/healthz",),
        name: str = "metrics",
    ):
        self.host, self.port, self.routes, self.name = host, port, dict(routes), name
        self.inline_routes = frozenset(inline_routes)
        self.request_timeout_s, self.head_timeout_s = request_timeout_s, min(head_timeout_s, request_timeout_s)
        self.max_request_bytes = max_request_bytes  # a longer request head (request line and headers) is refused
        self.max_connections, self.max_connections_per_address = max_connections, max_connections_per_address
        self.connection_cap = max_connections  # lowered at start() to a share of the descriptor limit
        self.threads, self.max_queued_requests = threads, max_queued_requests
        own = () if is_ip(host) or not host else (host.lower().rstrip("."),)
        self.allowed_hosts = tuple(h.lower().rstrip(".") for h in allowed_hosts) + own
        self.refusals = dict.fromkeys(REFUSALS, 0)  # written by the I/O thread only
        self.answered = 0  # answers sent whole (any status)
        self.client_closed = 0  # connections the client closed before its request head was whole
        self._conns: dict[int, _Conn] = {}  # fd -> connection held, oldest first
        self._by_address: dict[str, dict[int, _Conn]] = {}
        self._jobs: queue.Queue = queue.Queue()  # (connection, route, HEAD?) for the workers; None stops one
        self._answers: collections.deque = collections.deque()  # (connection, bytes) from the workers
        self._jobs_out = 0  # jobs given to the workers and not answered yet (the I/O thread's count)
        self._next_sweep, self._resume_accept_at = math.inf, math.inf
        self._stopping = False
        self._sock: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._wake_r, self._wake_w = -1, -1

    def start(self) -> tuple[str, int]:
        """Bind and listen (OSError if the address is taken or not local), then serve on daemon threads.
        Returns the bound address."""
        family, _, _, _, address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            defer_accept(sock, self.head_timeout_s)
            sock.listen(socket.SOMAXCONN)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._set_connection_cap()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ, _LISTEN)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-http", daemon=True)
        self._thread.start()
        for i in range(self.threads):
            worker = threading.Thread(target=self._work, name=f"{self.name}-http-{i}", daemon=True)
            worker.start()
            self._workers.append(worker)
        self._log_start(sock.getsockname())
        return sock.getsockname()[0], sock.getsockname()[1]

    def _set_connection_cap(self) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        share = self.max_connections if soft == resource.RLIM_INFINITY else max(1, soft // _DESCRIPTOR_SHARE)
        self.connection_cap = min(self.max_connections, share)
        if self.connection_cap < self.max_connections:
            log.info(
                "%s: at most %d HTTP connections (1/%d of the descriptor limit %d), not %d",
                self.name,
                self.connection_cap,
                _DESCRIPTOR_SHARE,
                soft,
                self.max_connections,
            )

    def _log_start(self, bound) -> None:
        if not is_loopback(bound[0]):
            log.warning(
                "%s: http://%s is plain HTTP without authentication, reachable from other machines: anyone "
                "who reaches it reads the metrics; keep it behind a firewall or NetworkPolicy (README, "
                "Operations)",
                self.name,
                join_host_port(bound[0], bound[1]),
            )
        log.info(
            "%s: serving %s on http://%s",
            self.name,
            ", ".join(sorted(self.routes)),
            join_host_port(bound[0], bound[1]),
        )

    @property
    def connections_open(self) -> int:
        """Connections held now (reading a head, waiting for a worker, or sending an answer)."""
        return len(self._conns)

    @property
    def timed_out(self) -> int:
        return self.refusals["head_timeout"] + self.refusals["timeout"]

    def counters(self) -> dict[str, int]:
        """This server's counts: answered, client_closed, connections (held now), refused_<reason> (REFUSALS)."""
        out = {"answered": self.answered, "client_closed": self.client_closed, "connections": len(self._conns)}
        return out | {f"refused_{reason}": n for reason, n in dict(self.refusals).items()}

    def collector(self, prefix: str = "impala_async_"):
        """A prometheus_client collector of :meth:`counters`: ``<prefix>http_refused_total{reason}``,
        ``<prefix>http_answered_total`` and the gauge ``<prefix>http_connections``."""
        return Collector(self, prefix)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop serving: the listening socket and every connection are closed; worker threads busy with a route
        finish it (they are daemons, waited for at most ``timeout_s`` in all)."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the pipe is full: the loop is being woken anyway
            pass
        deadline = time.monotonic() + timeout_s
        self._thread.join(timeout_s)
        for _ in self._workers:
            self._jobs.put(None)
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive() and not any(w.is_alive() for w in self._workers):
            os.close(self._wake_r)  # else a thread may still use the pipe: its two descriptors are left open
            os.close(self._wake_w)

    # ----------------------------------------------------------------------------------------------- the I/O loop
    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._sel.select(self._select_timeout_s()):
                    try:
                        self._on_event(key.data, mask)
                    except Exception:  # a bug must cost one connection, never the server
                        log.exception("%s: serving a connection failed", self.name)
                        if isinstance(key.data, _Conn):
                            self._close(key.data)
                self._take_answers()
                self._sweep(time.monotonic())
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            self._sel.close()
            self._sock.close()

    def _select_timeout_s(self) -> float | None:
        soonest = min(self._next_sweep, self._resume_accept_at)
        return None if soonest == math.inf else max(0.0, soonest - time.monotonic())

    def _on_event(self, data, mask: int) -> None:
        if data is _LISTEN:
            self._accept_some()
        elif data is _WAKE:
            drain(self._wake_r)
        elif mask & selectors.EVENT_WRITE:
            self._send(data)
        else:
            self._advance(data)

    def _accept_some(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._accept_failed(e)
                return
            self._admit(sock, peer[0])

    def _accept_failed(self, e: OSError) -> None:
        """Out of descriptors, say: close the oldest connection still sending its head to make one free, or, with
        none, stop accepting for a moment (the listening socket would otherwise wake the loop without end)."""
        if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):  # that one connection's trouble
            return
        self.refusals["accept_failed"] += 1
        if self._evict(self._conns, "evicted"):
            return
        log.warning("%s: accept failed (%s): not accepting for %g s", self.name, e, _ACCEPT_RETRY_S)
        self._sel.unregister(self._sock)
        self._resume_accept_at = time.monotonic() + _ACCEPT_RETRY_S

    def _admit(self, sock: socket.socket, address: str) -> None:
        sock.setblocking(False)
        now = time.monotonic()
        conn = _Conn(sock, address, now, now + self.head_timeout_s)
        self._advance(conn)  # a request that came with its connection: answered now, whatever the caps
        if conn.state == _READING and not self._make_room(address):
            self._refuse(conn, "busy", text(503, "busy: connections at their cap, none idle"))
        if conn.state == _CLOSED:
            return
        self._track(conn)
        if conn.state == _READING:
            self._watch(conn, selectors.EVENT_READ)

    def _make_room(self, address: str) -> bool:
        """Room for one more connection from ``address``: at a cap, the oldest still sending its head is closed."""
        mine = self._by_address.get(address)
        if mine and len(mine) >= self.max_connections_per_address and not self._evict(mine, "evicted_address"):
            return False
        return len(self._conns) < self.connection_cap or self._evict(self._conns, "evicted")

    def _evict(self, conns: dict[int, _Conn], reason: str) -> bool:
        """Make room among ``conns``: close the oldest connection still sending its head. Each one is read first: a
        head that has arrived whole since (a probe whose bytes came after its connection) is answered instead, which
        makes room as well unless it waits for a worker thread (then the next oldest is tried)."""
        for _ in range(len(conns)):
            victim = next((c for c in conns.values() if c.state == _READING), None)
            if victim is None:
                return False
            self._advance(victim)
            if victim.state == _READING:
                self._close(victim, reason)
            if victim.state == _CLOSED:
                return True
        return False

    def _advance(self, conn: _Conn) -> None:
        """Read what the connection has sent; once its head is whole, answer it or hand it to a worker."""
        try:
            chunk = conn.sock.recv(max(1, self.max_request_bytes + 1 - len(conn.head)))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.client_closed += 1
            self._close(conn)
            return
        conn.head += chunk
        try:
            request = parse_head(conn.head, self.max_request_bytes)
        except BadRequest as e:
            self._refuse(conn, e.reason, text(e.status, str(e)))
            return
        if request is not None:
            conn.deadline = conn.accepted_at + self.request_timeout_s
            self._watch(conn, 0)  # nothing more is read
            self._dispatch(conn, *request)

    def _dispatch(self, conn: _Conn, method: str, target: str, host: str | None) -> None:
        if not host_allowed(host, self.allowed_hosts):
            return self._refuse(
                conn, "host", text(421, f"Host {host!r} not served here: an IP address, localhost or an allowed host")
            )
        if method not in ("GET", "HEAD"):
            return self._refuse(conn, "method", text(405, f"{method} not allowed: GET or HEAD"))
        path = target.split("?", 1)[0]
        route = self.routes.get(path)
        if route is None:
            return self._refuse(conn, "not_found", text(404, f"not found: try {', '.join(sorted(self.routes))}"))
        if path in self.inline_routes:
            return self._respond(conn, encode(self._call(route, path), method == "HEAD"))
        if self._jobs_out >= self.threads + self.max_queued_requests:
            return self._refuse(conn, "overloaded", text(503, "busy: too many requests waiting"))
        conn.state = _WAITING
        self._jobs_out += 1
        self._jobs.put((conn, route, path, method == "HEAD"))

    def _call(self, route: Route, path: str) -> Response:
        try:
            return route()
        except Exception as e:  # a bug in a route must not take the server down
            log.exception("%s: %s failed", self.name, path)
            return text(500, f"internal error: {type(e).__name__}")

    def _refuse(self, conn: _Conn, reason: str, response: Response) -> None:
        self.refusals[reason] += 1
        self._respond(conn, encode(response, False))

    def _respond(self, conn: _Conn, data: bytes) -> None:
        conn.out, conn.state = memoryview(data), _WRITING
        self._send(conn)

    def _send(self, conn: _Conn) -> None:
        """Send what the socket takes without waiting; what is left waits for it to be writable."""
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self.answered += 1
            self._close(conn)
            return
        self._track(conn)  # over the caps if need be: an answer on its way is never dropped for room
        self._watch(conn, selectors.EVENT_WRITE)

    def _take_answers(self) -> None:
        while self._answers:
            conn, data = self._answers.popleft()
            self._jobs_out -= 1
            if conn.state == _WAITING:  # else closed meanwhile (request_timeout_s)
                self._respond(conn, data)

    def _sweep(self, now: float) -> None:
        """Close the connections past their deadline; resume accepting after a pause."""
        if now >= self._resume_accept_at:
            self._resume_accept_at = math.inf
            self._sel.register(self._sock, selectors.EVENT_READ, _LISTEN)
        if now < self._next_sweep:
            return
        soonest = math.inf
        for conn in list(self._conns.values()):
            if conn.deadline <= now:
                self._close(conn, "head_timeout" if conn.state == _READING else "timeout")
            else:
                soonest = min(soonest, conn.deadline)
        self._next_sweep = soonest

    # ------------------------------------------------------------------------------------------ connections held
    def _track(self, conn: _Conn) -> None:
        if conn.tracked:
            return
        conn.tracked = True
        self._conns[conn.fd] = conn
        self._by_address.setdefault(conn.address, {})[conn.fd] = conn
        self._next_sweep = min(self._next_sweep, conn.deadline)

    def _watch(self, conn: _Conn, events: int) -> None:
        if events == conn.events:
            return
        if not conn.events:
            self._sel.register(conn.sock, events, conn)
        elif not events:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def _close(self, conn: _Conn, reason: str = "") -> None:
        if conn.state == _CLOSED:
            return
        if reason:
            self.refusals[reason] += 1
        self._watch(conn, 0)
        if conn.tracked:
            del self._conns[conn.fd]
            mine = self._by_address[conn.address]
            del mine[conn.fd]
            if not mine:
                del self._by_address[conn.address]
        conn.state = _CLOSED
        conn.sock.close()

    # --------------------------------------------------------------------------------------------- the workers
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            conn, route, path, head_only = job
            self._answers.append((conn, encode(self._call(route, path), head_only)))
            self._wake()

    def _wake(self) -> None:
        if self._stopping:  # the loop is gone, or going, and close() may be closing the pipe
            return
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full: the loop is being woken anyway
            pass
