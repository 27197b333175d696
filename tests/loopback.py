"""Real ZeroMQ sockets on loopback for in-process tests of the learner's parts (tests/test_parts.py,
tests/test_outbound_parts.py): a weights publisher and its subscribers, a guarded PULL socket and its pushers, and a
poll that fails with what it waited for. The ``ctx`` fixture they take is conftest.py's."""

from __future__ import annotations

import time

import zmq

from impala_async.config import LearnerConfig
from impala_async.learner.transport.guard import ConnectionGuard
from impala_async.learner.transport.publisher import WeightsPublisher

DEADLINE_S = 5.0


def wait_until(condition, what: str, timeout_s: float = DEADLINE_S) -> None:
    """Poll ``condition()`` (which may do work, e.g. read a socket) until it is true; fail after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def publisher(ctx, **flags):
    cfg = LearnerConfig.of(**flags).check()
    pub = WeightsPublisher(ctx, cfg.network, cfg.limits)
    return pub, pub.bind("tcp://127.0.0.1:*")


def subscriber(ctx, address: str, *topics: bytes, reconnect: bool = True) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    if not reconnect:
        s.setsockopt(zmq.RECONNECT_IVL, -1)
    for topic in topics or (b"",):
        s.setsockopt(zmq.SUBSCRIBE, topic)
    s.connect(address)
    return s


def joined(pub: WeightsPublisher, n: int) -> None:
    """Read subscription messages until ``n`` subscriptions have been applied."""

    def applied():
        if pub.sock.poll(10):
            pub.read_subscriptions()
        return pub.subscriptions >= n

    wait_until(applied, f"{n} subscriptions")
    assert pub.subscriptions == n


def receive(sock: zmq.Socket) -> bytes:
    assert sock.poll(int(DEADLINE_S * 1000)), "nothing received"
    return sock.recv(zmq.NOBLOCK)


def pull_with_guard(ctx, **limits):
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind("tcp://127.0.0.1:*")
    guard = ConnectionGuard("trajectories", pull, **limits)
    return pull, pull.getsockopt_string(zmq.LAST_ENDPOINT), guard


def pusher(ctx, address: str) -> zmq.Socket:
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RECONNECT_IVL, -1)  # a cut connection stays cut: each cut is counted once
    s.connect(address)
    return s


def checked(guard: ConnectionGuard, condition) -> bool:
    guard.check()
    return condition()
