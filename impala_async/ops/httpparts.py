"""The parts of ops/httpd.py's server that hold no connection: responses, request heads (parsed with their limits and
the Host rule), the reasons a connection is refused and their Prometheus collector, socket helpers, and the client of
the probe (``impala-async healthcheck``).
"""

from __future__ import annotations

import http.client
import ipaddress
import math
import os
import re
import socket
from collections.abc import Callable
from typing import NamedTuple

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    421: "Misdirected Request",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


# Connections refused or closed unanswered, by reason (HttpServer.refusals; the counts a Prometheus collector exports).
REFUSALS = {
    "busy": "no room: connections at a cap, none of them still sending its head to close (503)",
    "overloaded": "a /metrics request with max_queued_requests already waiting for a worker thread (503)",
    "evicted": "closed while sending its head, for a newer connection, at max_connections",
    "evicted_address": "closed while sending its head, for a newer one from its address, at the per-address cap",
    "head_timeout": "no whole request head within head_timeout_s",
    "timeout": "not answered (computed and sent) within request_timeout_s",
    "too_large": "a request head over max_request_bytes (431)",
    "bad_request": "not an HTTP request line, or a Host header twice or malformed (400)",
    "host": "a Host header that names no address or name this server answers to (421)",
    "method": "a method other than GET and HEAD (405)",
    "not_found": "a path this server does not serve (404)",
    "accept_failed": "accept() failed (descriptors exhausted): an idle connection is closed, or accepting pauses",
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


def encode(r: Response, head_only: bool) -> bytes:
    header = (
        f"HTTP/1.0 {r.status} {_REASONS.get(r.status, '')}\r\nContent-Type: {r.content_type}\r\n"
        f"Content-Length: {len(r.body)}\r\nConnection: close\r\nCache-Control: no-store\r\n\r\n"
    ).encode()
    return header if head_only else header + r.body


class BadRequest(Exception):
    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason = status, reason


_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")


def parse_head(buf: bytes, max_bytes: int) -> tuple[str, str, str | None] | None:
    """(method, target, Host header or None) once ``buf`` holds a whole request head, None while it does not.
    BadRequest 431 as soon as the head (request line, headers and the blank line) is known to exceed ``max_bytes``,
    whatever chunks it came in (a complete head checked only by the reads before it could pass a limit by up to one
    read); 400 for a request line that is not HTTP's, or a Host header twice or with space before its colon (two
    servers reading different Hosts out of one request is how a Host check is got round)."""
    ends = [i + len(t) for t in _HEAD_ENDS if (i := buf.find(t)) >= 0]
    if not ends:
        if len(buf) >= max_bytes:
            raise BadRequest(431, "too_large", f"request head over {max_bytes} bytes")
        return None
    end = min(ends)
    if end > max_bytes:
        raise BadRequest(431, "too_large", f"request head of {end} bytes, over {max_bytes}")
    lines = re.split(rb"\r?\n", buf[:end])
    parts = lines[0].split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        raise BadRequest(400, "bad_request", "not an HTTP request line")
    hosts = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"host":
            if name != name.strip():
                raise BadRequest(400, "bad_request", "space before the colon of a Host header")
            hosts.append(value.strip().decode("latin-1"))
    if len(hosts) > 1:
        raise BadRequest(400, "bad_request", "more than one Host header")
    return parts[0].decode("latin-1"), parts[1].decode("latin-1"), hosts[0] if hosts else None


def host_allowed(host: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a request whose Host header is ``host`` (None: none sent, as HTTP/1.0 allows; no browser does that) is
    answered: an IP address, ``localhost``, a name in ``allowed`` or under an entry of it that starts with a dot.
    What this prevents: a web page whose domain was rebound to this machine's address reading /metrics through a
    browser on it (the browser sends the page's own domain as Host)."""
    if host is None:
        return True
    name = _host_name(host.strip()).lower().rstrip(".")
    if not name:
        return False
    if name == "localhost" or name in allowed or any(a.startswith(".") and name.endswith(a) for a in allowed):
        return True
    return is_ip(name)


def _host_name(host: str) -> str:
    """``host`` without its port: ``[::1]:9481`` -> ``::1``, ``name:9481`` -> ``name``."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class Collector:
    """prometheus_client collector of an ops.httpd.HttpServer's counts."""

    def __init__(self, server, prefix: str):
        self.server, self.prefix = server, prefix

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counts = self.server.counters()
        refused = CounterMetricFamily(
            self.prefix + "http_refused",
            "metrics HTTP connections refused or closed unanswered, by reason",
            labels=["reason"],
        )
        for reason in REFUSALS:
            refused.add_metric([reason], float(counts[f"refused_{reason}"]))
        yield refused
        yield CounterMetricFamily(
            self.prefix + "http_answered", "metrics HTTP answers sent whole", value=float(counts["answered"])
        )
        yield GaugeMetricFamily(
            self.prefix + "http_connections", "metrics HTTP connections held now", value=float(counts["connections"])
        )


def defer_accept(sock: socket.socket, timeout_s: float) -> None:
    """Linux's TCP_DEFER_ACCEPT: the kernel hands a connection over only once its first bytes have arrived (or after
    about ``timeout_s``), so a probe's connection comes with its request, answered at once, and connections that send
    nothing cost neither a descriptor nor room here for that long. Elsewhere: nothing."""
    option = getattr(socket, "TCP_DEFER_ACCEPT", None)
    if option is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, option, max(1, math.ceil(timeout_s)))
        except OSError:
            pass


def drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


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


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
