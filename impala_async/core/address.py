"""ZeroMQ tcp:// addresses, parsed once: host (an IPv6 host without its brackets), port (digits, or ``*`` for one the
system picks), and the arithmetic the learner's ports follow (weights on the trajectory port + 1, learner rank r on
port + 1 + r)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class TcpAddress:
    host: str  # "127.0.0.1", "::1" (no brackets), "*", "0.0.0.0", a name or an interface
    port: str  # "5555", or "*"

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def offset(self, n: int) -> TcpAddress:
        """The address ``n`` ports above this one (a wildcard port stays a wildcard); ValueError past 65535."""
        if self.port == "*":
            return self
        port = int(self.port) + n
        if port > 65535:
            raise ValueError(f"port {port} of {self} + {n} is beyond 65535")
        return TcpAddress(self.host, str(port))

    def with_host(self, host: str) -> TcpAddress:
        return TcpAddress(host, self.port)

    @property
    def loopback(self) -> bool:
        """True for localhost and loopback IPs (127.0.0.0/8, ::1)."""
        if self.host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.split("%")[0]).is_loopback
        except ValueError:
            return False  # '*', a hostname or an interface name: may be reachable from other machines


def parse_tcp(address: str) -> TcpAddress | None:
    """``tcp://HOST:PORT`` (HOST may be ``[v6]``) as a TcpAddress; None for other transports; ValueError for a tcp
    address without a valid port."""
    transport, sep, rest = address.partition("://")
    if not sep or transport.lower() != "tcp":
        return None
    host, sep, port = rest.rpartition(":")
    if not sep or not (port == "*" or (port.isdigit() and 0 < int(port) <= 65535)):
        raise ValueError(f"{address!r} is not tcp://HOST:PORT (PORT 1-65535, or * for any)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return TcpAddress(host, port)


def port_offset(address: str, n: int, what: str) -> str:
    """``address`` with its tcp port ``n`` higher (``what`` names the derived address in errors); ValueError for
    other transports."""
    try:
        parsed = parse_tcp(address)
        if parsed is None:
            raise ValueError("not a tcp:// address")
        return str(parsed.offset(n))
    except ValueError as e:
        raise ValueError(f"cannot derive {what} from {address!r} ({e})") from None


def is_local(address: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback host: nothing outside this machine can connect."""
    transport = address.partition("://")[0].lower()
    if transport in ("ipc", "inproc") and "://" in address:
        return True
    try:
        parsed = parse_tcp(address)
    except ValueError:
        return False
    return parsed is not None and parsed.loopback
