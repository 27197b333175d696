"""What a peer reads, and what it leaves untaken (issue 15, classes 3 and 4): the connection guard's credit per message
and its outbound watch of the weights socket, in process over real ZeroMQ sockets on loopback (tests/loopback.py's
helpers; tests/test_outbound_attacks.py drives the same through a real learner)."""

from __future__ import annotations

import zmq
from loopback import (
    DEADLINE_S,
    checked,
    joined,
    publisher,
    pull_with_guard,
    pusher,
    receive,
    subscriber,
    wait_until,
)

from impala_async.learner.transport.guard import (
    HEARTBEAT_ALLOWANCE_BYTES_PER_S,
    PER_CONNECTION_OVERHEAD_BYTES,
    guard_source,
    unread_bytes,
)
from impala_async.learner.transport.publisher import WeightsPublisher


def test_the_guard_credits_a_message_with_what_it_took_on_the_wire(ctx):
    """Each message read is credited with its ZMTP frame (2 bytes of header up to 255 bytes of body, 9 above), no more:
    after 3,000 messages of 0, 200 and 300 bytes, what the connection received less what was credited is only its
    greeting and handshake. Guards against the unread-bytes bypass: a flat 64 bytes a message credited each empty
    message with 62 bytes it never sent, and enough of them let a connection hold that much beyond its bound."""
    pull, address, guard = pull_with_guard(
        ctx, max_connections=4, max_unread_bytes=64 << 20, max_unread_bytes_total=128 << 20
    )
    try:
        s = pusher(ctx, address)
        sizes = [0, 200, 300] * 1000
        for n in sizes:
            s.send(b"\7" * n)
        for n in sizes:
            frame = receive_frame(pull)
            assert len(frame) == n
            guard.delivered(guard_source(frame), len(frame))
        (conn,) = guard.conns.values()
        wait_until(lambda: tcp_received(conn.fd) >= 1000 * (2 + 202 + 309), "every message's bytes received")
        handshake = tcp_received(conn.fd) - conn.delivered_bytes
        assert 64 <= handshake <= 256, f"{handshake} bytes beyond the messages: credit is not what the wire took"
        assert conn.delivered_bytes == 1000 * (2 + 202 + 309)
    finally:
        guard.close(pull)
    from impala_async.learner.transport.guard import wire_bytes

    assert wire_bytes(0, True) == 35 and wire_bytes(223, True) == 265, "CURVE: a MESSAGE command of 33 + n per frame"


def tcp_received(fd: int) -> int:
    """``TCP_INFO.tcpi_bytes_received`` of connection ``fd`` (Linux >= 4.1)."""
    import socket
    import struct

    s = socket.socket(fileno=fd)
    try:
        return struct.unpack_from("<Q", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136), 128)[0]
    finally:
        s.detach()


def receive_frame(sock: zmq.Socket) -> zmq.Frame:
    assert sock.poll(int(DEADLINE_S * 1000)), "nothing received"
    return sock.recv(zmq.NOBLOCK, copy=False)


def idle_subscriber(pub: WeightsPublisher, address: str):
    """A subscriber to everything that reads nothing (a 4 KiB receive buffer; ZMTP by hand, tests/attacks_outbound),
    once its subscription is applied; and its connection's descriptor in the learner."""
    from attacks_outbound import SUBSCRIBE_ALL, zmtp_peer

    before = set(pub.guard.conns)
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    s = zmtp_peer(host, int(port), b"SUB", rcvbuf_bytes=4096)
    s.sendall(SUBSCRIBE_ALL)
    joined(pub, pub.subscriptions + 1)
    (fd,) = set(pub.guard.conns) - before
    return s, fd


def closed_by_learner(s) -> bool:
    """Whether the learner closed (reset) the connection of ``s``: a PING on it then fails, or poll says so."""
    import select
    import socket

    try:
        s.send(ZMTP_PING, socket.MSG_DONTWAIT)
    except BlockingIOError:
        pass
    except OSError:
        return True
    poller = select.poll()
    poller.register(s, select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


ZMTP_PING = b"\x04\x07\x04PING\x00\x00"  # a ZMTP PING command (TTL 0)


def publish_while_stalled(pub: WeightsPublisher, fd: int, versions: list[bytes]) -> None:
    """Publish ``versions`` to a subscriber that reads nothing (descriptor ``fd``): the rest once the first is being
    written into its connection (the kernel's send queue is not empty) and the socket has learnt, from its commands,
    that the queue has room again; so that whatever the I/O thread's timing the connection holds the first and the
    queue the next SNDHWM (2)."""
    from impala_async.learner.transport.guard import tcp_bytes_queued

    pub.publish(versions[0])
    wait_until(lambda: tcp_bytes_queued(fd) > 0, "the first version being written")
    pub.read_subscriptions()
    for data in versions[1:]:
        pub.publish(data)


def held_bytes(pub: WeightsPublisher) -> int:
    """``pub.held_bytes()`` once the socket has processed its commands (as the server's republish task makes it do
    when the socket's descriptor wakes it): libzmq frees a closed connection's queue only then."""
    pub.read_subscriptions()
    return pub.held_bytes()


def weights_versions(n: int, nbytes: int) -> list[bytes]:
    """``n`` distinct weights messages (distinct objects: each is a version the learner may hold)."""
    return [bytes([i]) * nbytes for i in range(n)]


def test_a_subscriber_that_takes_nothing_is_cut_and_its_versions_freed(ctx):
    """A subscriber that subscribed and then reads nothing keeps the weights queued for it (SNDHWM, and the message
    its connection was writing) alive: held_bytes() counts them, once per version. Once it has taken no whole message
    for max_subscriber_stall_s (0.5 s) with weights waiting, check() cuts it (``cut_weights_stalled``) and every
    version is freed; an honest subscriber, which took each message, is never cut and gets the next weights. The
    kernel's send buffer per subscriber is max_send_buffer_bytes_per_subscriber (Linux doubles it). Guards against
    subscribers pinning old versions for good (ZMTP PINGs keep them clear of the peer timeout)."""
    size = 4 << 20
    pub, address = publisher(ctx, max_subscriber_stall_s=0.5, max_send_buffer_bytes_per_subscriber=64 << 10)
    import socket

    try:
        honest = subscriber(ctx, address)
        joined(pub, 1)
        idle, idle_fd = idle_subscriber(pub, address)
        kernel = socket.socket(fileno=idle_fd)
        assert kernel.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * (64 << 10)
        kernel.detach()
        versions = weights_versions(4, size)
        publish_while_stalled(pub, idle_fd, versions)
        assert receive(honest) == versions[0]
        wait_until(lambda: held_bytes(pub) == 3 * size, "versions 0-2 held for the idle one, each counted once")
        wait_until(lambda: checked(pub.guard, lambda: pub.guard.cut["stalled"] == 1), "the idle subscriber cut")
        assert pub.counters()["cut_weights_stalled"] == 1 and pub.guard.cut["held_weights"] == 0
        assert len(pub.guard.conns) == 1, "the honest subscriber was cut too"
        wait_until(lambda: held_bytes(pub) == 0, "every version freed")
        wait_until(lambda: closed_by_learner(idle), "the idle subscriber's connection closed")
        pub.publish(b"next")
        while (got := receive(honest)) != b"next":
            assert got in versions[1:], "the honest subscriber missed weights"
    finally:
        pub.close()


def test_while_held_weights_exceed_the_bound_the_longest_stalled_subscriber_is_cut(ctx):
    """Two subscribers that read nothing, the first idle since versions 0-2, the second since 3-5 (4 MiB each):
    the learner holds six versions, 24 MiB, over max_weights_held_bytes (1 MiB; never less than the 3 messages one
    subscriber holds, 12 MiB). check() cuts the one stalled longest (``cut_weights_held_weights``), long before
    max_subscriber_stall_s (100 s), which frees its versions, and then no other. Guards against the number of versions
    alive growing with the number of subscribers that read nothing."""
    size = 4 << 20
    pub, address = publisher(ctx, max_subscriber_stall_s=100.0, max_weights_held_bytes=1 << 20)
    try:
        versions = weights_versions(6, size)
        first, first_fd = idle_subscriber(pub, address)
        publish_while_stalled(pub, first_fd, versions[:3])
        wait_until(lambda: checked(pub.guard, lambda: pub.guard.conns[first_fd].stalled_s > 0), "the first stalled")
        assert pub.held_bytes() == 3 * size and pub.guard.cut["held_weights"] == 0, "within what one may hold"
        second, second_fd = idle_subscriber(pub, address)
        publish_while_stalled(pub, second_fd, versions[3:])
        assert pub.held_bytes() == 6 * size
        wait_until(lambda: checked(pub.guard, lambda: pub.guard.cut["held_weights"] == 1), "a cut for held weights")
        assert first_fd not in pub.guard.conns and second_fd in pub.guard.conns, "not the one stalled longest"
        wait_until(lambda: closed_by_learner(first), "the first one's connection closed")
        wait_until(lambda: checked(pub.guard, lambda: held_bytes(pub) == 3 * size), "versions 0-2 freed")
        for _ in range(5):
            pub.guard.check()
        assert pub.guard.cut["held_weights"] == 1 and not closed_by_learner(second), "the second one stays"
        assert pub.counters()["cut_weights_held_weights"] == 1 and pub.guard.cut["stalled"] == 0
    finally:
        pub.close()


def test_an_honest_subscribers_heartbeats_never_become_unread_bytes(ctx):
    """libzmq reads a peer's ZMTP PINGs and PONGs itself, so nothing credits them: on the weights socket a connection's
    age buys HEARTBEAT_ALLOWANCE_BYTES_PER_S. An honest subscriber under CURVE (82 bytes every 10 s) is not cut after a
    week; before, it was cut for unread_bytes (128 KiB) after about 4.4 h. The trajectory socket buys nothing by age:
    a message that never ends must stay within max_unread_bytes however old its connection."""
    from impala_async.learner.transport.guard import _Conn

    pub, _ = publisher(ctx)
    try:  # a connection's record built by hand: its age is all that matters here
        week_s = 7 * 24 * 3600
        old = _Conn(fd=-1, peer="", accepted_at=0.0)
        heartbeats = PER_CONNECTION_OVERHEAD_BYTES + 82 * week_s // 10
        assert unread_bytes(heartbeats, 0, pub.guard._allowance_bytes(old, week_s)) == 0
        assert HEARTBEAT_ALLOWANCE_BYTES_PER_S * 10 >= 82
    finally:
        pub.close()
    pull, _, guard = pull_with_guard(ctx, max_connections=4, max_unread_bytes=1 << 20, max_unread_bytes_total=2 << 20)
    try:
        assert guard._allowance_bytes(_Conn(fd=-1, peer="", accepted_at=0.0), 1e9) == PER_CONNECTION_OVERHEAD_BYTES
    finally:
        guard.close(pull)
