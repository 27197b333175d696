"""The trajectory addresses an actor pushes to: the one it was given, and those of the learner's other ranks.

A learner with several ranks lists every rank's trajectory address in its weights messages, ``run.trajectory_addresses``
(docs/protocol.md, Transport). The actor's PUSH socket connects to each of them once, and ZeroMQ's PUSH spreads the
messages round-robin over the ranks it is connected to. No zmq import here: the caller's socket is only asked to
``connect`` and ``disconnect``.

- An address whose host is a wildcard (a learner bound to every interface: ``0.0.0.0``, ``::``, ``*``) is reached at
  the host of the address the actor was given (``--learner``).
- The given address itself is never connected twice: a listed address is the same as it when the strings are equal,
  or, for tcp, when the ports are equal and the hosts resolve to a common address (``localhost`` and ``127.0.0.1``,
  a name and its IP).
- A learner without the key (an older one) changes nothing: the actor keeps sending to the address it was given.
- Addresses a newer weights message no longer lists (a learner restarted on other ports) are disconnected.
"""

from __future__ import annotations

import logging
import socket

from ..core.address import TcpAddress, parse_tcp

log = logging.getLogger("impala_async.actors.endpoints")

MAX_ADDRESSES = 256  # at most this many listed addresses are connected (a learner has as many ranks as GPUs)
_WILDCARDS = {"0.0.0.0", "::", "*", ""}


def _tcp(address: str) -> TcpAddress | None:
    """A tcp:// address parsed (core/address.py); None for other transports and for a tcp address it cannot parse
    (connecting to that fails, and is said, where it is tried)."""
    try:
        return parse_tcp(address)
    except ValueError:
        return None


def resolve(address: str, given: str) -> str:
    """``address`` as this actor connects to it: a wildcard host becomes the host of ``given`` (a tcp address)."""
    parsed, own = _tcp(address), _tcp(given)
    if parsed is None or own is None or parsed.host not in _WILDCARDS:
        return address
    return str(parsed.with_host(own.host))


class Endpoints:
    """Keeps a PUSH socket connected to the given address and to every other listed one, each once."""

    def __init__(self, sock, given: str):
        self.sock, self.given = sock, given
        self.extra: set[str] = set()  # connected besides ``given``
        self._listed: list | None = None  # the list the connections were made for
        self._hosts: dict[str, frozenset] = {}

    def _addresses(self, host: str) -> frozenset:
        if host not in self._hosts:
            try:
                found = {info[4][0] for info in socket.getaddrinfo(host, None)}
            except (OSError, UnicodeError):
                found = {host}
            # Every loopback address is this machine: 127.0.0.1 and ::1 (and localhost) are one host here.
            self._hosts[host] = frozenset("loopback" if TcpAddress(a, "*").loopback else a for a in found)
        return self._hosts[host]

    def same(self, a: str, b: str) -> bool:
        if a == b:
            return True
        ta, tb = _tcp(a), _tcp(b)
        if ta is None or tb is None or ta.port != tb.port:
            return False
        return bool(self._addresses(ta.host) & self._addresses(tb.host))

    def update(self, run_info: dict) -> None:
        """Connect to the addresses ``run_info`` lists that are not connected yet; disconnect those it dropped."""
        listed = run_info.get("trajectory_addresses")
        if type(listed) is not list or listed == self._listed:
            return  # a learner without the key (its one address is the one given), or nothing changed
        self._listed = list(listed)
        wanted: set[str] = set()
        for address in listed[:MAX_ADDRESSES]:
            if type(address) is not str:
                continue
            address = resolve(address, self.given)
            if not self.same(address, self.given) and not any(self.same(address, w) for w in wanted):
                wanted.add(address)
        for address in sorted(self.extra - wanted):
            try:
                self.sock.disconnect(address)
            except Exception as e:  # noqa: BLE001 (zmq.ZMQError; no zmq import here)
                log.warning("could not disconnect from %s: %s", address, e)
        for address in sorted(wanted - self.extra):
            try:
                self.sock.connect(address)
                log.info("pushing to learner rank address %s too", address)
            except Exception as e:  # noqa: BLE001 (an address this actor cannot connect to)
                log.warning("cannot connect to the learner's trajectory address %r: %s", address, e)
                wanted.discard(address)
        self.extra = wanted
