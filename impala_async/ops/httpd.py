"""A tiny, bounded HTTP/1.0 server for ``/metrics`` and ``/healthz``, on threads of its own, and its client.

No asyncio (ops/ sits beside the pure core): the learner's event loop and training thread never run a line of it, so
a scrape cannot stall them, and a stalled event loop cannot stall ``/healthz`` (which is how it gets reported). One
thread accepts; each connection gets a short-lived thread of its own, at most ``max_connections`` at once (more are
answered 503 and closed at once). A request (reading the request head, computing and sending the answer) must be
done within ``request_timeout_s`` in total, or the connection is closed; a request head over ``max_request_bytes`` is
refused. One request per connection (``Connection: close``), GET and HEAD only.

Plain HTTP without authentication: what protects the port is where it is bound (loopback by default) and the network
around it (README, Operations).
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

log = logging.getLogger("impala_async.ops.httpd")

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class Response(NamedTuple):
    status: int
    content_type: str
    body: bytes


Route = Callable[[], Response]


def text(status: int, body: str) -> Response:
    return Response(status, "text/plain; charset=utf-8", body.encode() + b"\n")


def metrics_route(registry) -> Route:
    """``/metrics`` of a prometheus_client registry (the text exposition format, collected at each request)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return lambda: Response(200, CONTENT_TYPE_LATEST, generate_latest(registry))


class HttpServer:
    """Serves ``routes`` (path -> function returning a :class:`Response`, called on the connection's thread)."""

    def __init__(
        self,
        host: str,
        port: int,
        routes: dict[str, Route],
        *,
        max_connections: int,
        request_timeout_s: float,
        max_request_bytes: int = 8192,
        name: str = "metrics",
    ):
        self.host, self.port, self.routes, self.name = host, port, dict(routes), name
        self.request_timeout_s = request_timeout_s
        self.max_request_bytes = max_request_bytes  # a longer request head (request line and headers) is refused
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self.requests = 0  # answered
        self.refused_busy = 0  # connections over max_connections, answered 503 at once
        self.timed_out = 0  # connections closed for exceeding request_timeout_s
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1

    def start(self) -> tuple[str, int]:
        """Bind and listen (OSError if the address is taken or not local), then accept on a daemon thread.
        Returns the bound address."""
        family, _, _, _, address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._accept_loop, name=f"{self.name}-http", daemon=True)
        self._thread.start()
        bound = sock.getsockname()
        if not is_loopback(bound[0]):
            log.warning(
                "%s: http://%s is plain HTTP without authentication, reachable from other machines: anyone "
                "who reaches it reads the metrics; keep it behind a firewall or NetworkPolicy (README, "
                "Operations)",
                self.name,
                _join_host_port(bound[0], bound[1]),
            )
        log.info(
            "%s: serving %s on http://%s",
            self.name,
            ", ".join(sorted(self.routes)),
            _join_host_port(bound[0], bound[1]),
        )
        return bound[0], bound[1]

    @property
    def connections_open(self) -> int:
        """Connections being answered now (each holds one of max_connections slots)."""
        return self.max_connections - self._slots._value

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop accepting and close the listening socket. Connections being answered finish by themselves within
        request_timeout_s (their threads are daemons and are not waited for)."""
        if self._sock is None:
            return
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._sock = None

    # --------------------------------------------------------------------------------------------------- serving
    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                events = sel.select()
                if any(key.fd == self._wake_r for key, _ in events):
                    return
                try:
                    conn, _ = self._sock.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:  # out of file descriptors, say: wait a little, keep serving
                    log.warning("%s: accept failed: %s", self.name, e)
                    time.sleep(0.1)
                    continue
                if not self._slots.acquire(blocking=False):
                    self.refused_busy += 1
                    _answer_quietly(conn, text(503, "busy: over max_connections"))
                    continue
                try:
                    threading.Thread(target=self._serve, args=(conn,), name=f"{self.name}-conn", daemon=True).start()
                except RuntimeError:  # no thread to be had (a process limit): this one goes unanswered
                    self._slots.release()
                    conn.close()
        finally:
            sel.close()

    def _serve(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.request_timeout_s
        try:
            try:
                method, path = _read_request(conn, deadline, self.max_request_bytes)
            except TimeoutError:
                self.timed_out += 1
                return
            except _BadRequest as e:
                _send(conn, text(e.status, str(e)), False, deadline)
                return
            if method not in ("GET", "HEAD"):
                response = text(405, f"{method} not allowed: GET or HEAD")
            elif path.split("?", 1)[0] not in self.routes:
                response = text(404, f"not found: try {', '.join(sorted(self.routes))}")
            else:
                try:
                    response = self.routes[path.split("?", 1)[0]]()
                except Exception as e:  # a bug in a route must not take the server down
                    log.exception("%s: %s failed", self.name, path)
                    response = text(500, f"internal error: {type(e).__name__}")
            try:
                _send(conn, response, method == "HEAD", deadline)
            except TimeoutError:
                self.timed_out += 1
                return
            self.requests += 1
        except OSError:
            pass  # the client went away
        finally:
            conn.close()
            self._slots.release()


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _read_request(conn: socket.socket, deadline: float, max_bytes: int) -> tuple[str, str]:
    """(method, path) of the request head, read within ``deadline`` (TimeoutError) and ``max_bytes``."""
    head = b""
    while b"\r\n\r\n" not in head and b"\n\n" not in head:
        if len(head) > max_bytes:
            raise _BadRequest(431, f"request head over {max_bytes} bytes")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        conn.settimeout(left)
        chunk = conn.recv(4096)  # TimeoutError (socket.timeout) when left runs out
        if not chunk:
            raise OSError("closed before the request was complete")
        head += chunk
    parts = head.split(b"\n", 1)[0].strip().split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        raise _BadRequest(400, "not an HTTP request line")
    return parts[0].decode("ascii", "replace"), parts[1].decode("ascii", "replace")


def _encode(r: Response, head_only: bool) -> bytes:
    header = (
        f"HTTP/1.0 {r.status} {_REASONS.get(r.status, '')}\r\nContent-Type: {r.content_type}\r\n"
        f"Content-Length: {len(r.body)}\r\nConnection: close\r\nCache-Control: no-store\r\n\r\n"
    ).encode()
    return header if head_only else header + r.body


def _send(conn: socket.socket, r: Response, head_only: bool, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    conn.settimeout(left)  # since Python 3.5 this bounds the whole sendall, not each send
    conn.sendall(_encode(r, head_only))


def _answer_quietly(conn: socket.socket, r: Response) -> None:
    """A short answer without waiting (the accept thread must not): what the kernel takes at once, then close."""
    try:
        conn.setblocking(False)
        conn.send(_encode(r, False))
    except OSError:
        pass
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------------------- client
def connect_host(host: str) -> str:
    """The address a local client reaches a server bound to ``host`` at: a wildcard bind means loopback."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def probe(host: str, port: int, path: str = "/healthz", timeout_s: float = 5.0) -> tuple[int, str]:
    """GET ``path`` from the server at ``host:port``: (status, body). OSError if it cannot be reached in time."""
    conn = http.client.HTTPConnection(connect_host(host), port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read(1 << 20).decode("utf-8", "replace")
    finally:
        conn.close()


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
