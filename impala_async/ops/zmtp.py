"""ZeroMQ connection liveness, written once: ZMTP heartbeats on a socket (the learner's trajectory and weights sockets,
an actor's two sockets)."""

from __future__ import annotations

import zmq


def heartbeats(sock: zmq.Socket, timeout_s: float, *, connecting: bool = False) -> None:
    """A connection whose peer answers no ZMTP PING for ``timeout_s`` is closed (a machine gone, or a link down,
    without the connection being closed); PINGs go every third of it. ``connecting`` (an actor's sockets): the
    connection is then remade, and a connection attempt gives up after half of ``timeout_s``, so that a link that comes
    back is used within about ``timeout_s`` instead of after TCP's retransmission backoff (minutes after long
    outages). 0: nothing set (TCP's own timeouts)."""
    if timeout_s <= 0:
        return
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(timeout_s * 1000 / 3)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout_s * 1000))
    if connecting:
        sock.setsockopt(zmq.CONNECT_TIMEOUT, max(1, int(timeout_s * 500)))
