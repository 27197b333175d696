"""Attacks on a running learner, shared by tests/test_robustness.py, tools/attack_figures.py and tools/soak.py.

Every attack talks to a real learner process over real sockets. The ones that need what libzmq will not send (an
unfinished multipart message, a frame larger than the peer's limit) speak ZMTP 3.0 over a plain TCP socket with the
NULL mechanism (no CURVE: libzmq's own sockets flush a multipart message only once it is complete). Messages are
built for the protocol version the learner speaks (read from its weights message), so the same attacks measure the
code before and after a fix.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgpack
import numpy as np
import psutil
import zmq
from helpers import random_arrays

from impala_async.core.spec import TrajectorySpec


# ------------------------------------------------------------------------------------------------- ZMTP by hand
def zmtp_frame_header(size: int, more: bool = False, command: bool = False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if size > 255:
        return bytes([flags | 2]) + struct.pack(">Q", size)
    return bytes([flags, size])


def zmtp_frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    return zmtp_frame_header(len(body), more, command) + body


def zmtp_connect(host: str, port: int, socket_type: bytes = b"PUSH", timeout_s: float = 5.0) -> socket.socket:
    """A TCP connection that has done ZMTP 3.0's greeting and NULL handshake as ``socket_type``."""
    s = socket.create_connection((host, port), timeout=timeout_s)
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31)
    got = b""
    while len(got) < 64:
        chunk = s.recv(64 - len(got))
        if not chunk:
            raise ConnectionError("the learner closed the connection during the greeting")
        got += chunk
    name = b"Socket-Type"
    s.sendall(
        zmtp_frame(
            b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(socket_type)) + socket_type, command=True
        )
    )
    return s


def pump(sock: socket.socket, chunk: bytes, total_bytes: int, deadline_s: float = 30.0) -> int:
    """Send ``chunk`` until ``total_bytes`` went out or the learner closed the connection; returns bytes sent."""
    sent = 0
    end = time.monotonic() + deadline_s
    try:
        while sent < total_bytes and time.monotonic() < end:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass  # closed by the learner: what this attack should come to
    return sent


def unfinished_multipart(host: str, port: int, total_bytes: int, frame_bytes: int = (1 << 20) - 64) -> int:
    """One connection sending frames that all say 'more follows', never the last: returns the bytes it got out."""
    s = zmtp_connect(host, port)
    try:
        return pump(s, zmtp_frame(b"\0" * frame_bytes, more=True), total_bytes)
    finally:
        s.close()


def oversized_frame(
    host: str,
    port: int,
    claimed_bytes: int,
    total_bytes: int,
    socket_type: bytes = b"SUB",
    mechanism_greeting_only: bool = False,
) -> int:
    """A frame header claiming ``claimed_bytes``, then ``total_bytes`` of it. With ``mechanism_greeting_only`` the
    frame follows the greeting directly, as a CURVE client's HELLO would (before any authentication)."""
    if mechanism_greeting_only:
        s = socket.create_connection((host, port), timeout=5.0)
        s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\0" + b"\0" * 31)
        s.recv(64)
        header = zmtp_frame_header(claimed_bytes, command=True)
    else:
        s = zmtp_connect(host, port, socket_type)
        header = zmtp_frame_header(claimed_bytes)
    try:
        s.sendall(header)
        return pump(s, b"\0" * (1 << 20), total_bytes)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # closed before it took the header (a connection over the cap, cut): none of the frame got in
    finally:
        s.close()


def connection_flood(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` TCP connections that never say anything (neither greeting nor handshake). The caller closes them."""
    held = []
    for _ in range(count):
        try:
            held.append(socket.create_connection((host, port), timeout=5.0))
        except OSError:
            break
    return held


# ---------------------------------------------------------------------------------------------- hostile bytes
def nested_tree(total_bytes: int) -> bytes:
    """MessagePack of 4096-element arrays of 4096 empty maps: one object per byte (16.7M in 16 MiB), each of which a
    decoder that builds the tree makes a dict of (about 1.1 GiB)."""
    row = b"\xdc\x10\x00" + b"\x80" * 4096
    rows = max(1, (total_bytes - 3) // len(row))
    return b"\xdc" + struct.pack(">H", rows) + row * rows


def tree_message(key: str, total_bytes: int) -> bytes:
    """A one-key map whose value, where the layout wants a scalar, is a tree of ``total_bytes``."""
    return b"\x81" + msgpack.packb(key) + nested_tree(total_bytes - 2 - len(key))


def push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A PUSH socket to ``endpoint`` that drops what it holds at close and gives up a send after 10 s."""
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 10_000)
    s.connect(endpoint)
    return s


class LearnerView:
    """The learner's spec, policy version and incarnation, from its weights socket."""

    def __init__(self, ctx: zmq.Context, weights: str):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.CONFLATE, 1)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(weights)
        self.protocol, self.version, self.incarnation, self.spec = 0, 0, 0, None
        self.tensors: dict = {}

    def refresh(self, timeout_s: float = 15.0) -> LearnerView:
        assert self.sub.poll(int(timeout_s * 1000), zmq.POLLIN), "no weights message from the learner"
        data = self.sub.recv()
        raw = msgpack.unpackb(data, raw=False)
        self.protocol = raw["v"]
        self.version = raw["version"]
        self.incarnation = raw.get("incarnation", 0)
        self.spec = TrajectorySpec.from_dict(raw["run"]["spec"])
        self.tensors = {k: np.frombuffer(t["data"], np.dtype(t["dtype"])) for k, t in raw["tensors"].items()}
        return self

    def weights_finite(self) -> bool:
        return all(np.isfinite(a).all() for a in self.tensors.values() if a.dtype.kind == "f")

    def close(self) -> None:
        self.sub.close(0)


def message(
    view: LearnerView,
    *,
    actor: str,
    seq: int,
    seed: int = 0,
    episodes=(),
    sent_at_ns: int | None = None,
    edit=None,
    raw_edit=None,
) -> bytes:
    """A valid one-trajectory message for the learner ``view`` describes (its protocol version), changed by
    ``edit(arrays)`` before encoding and ``raw_edit(map)`` after."""
    spec = view.spec
    arrays = random_arrays(spec, 1, seed=seed)
    if edit is not None:
        edit(arrays)
    fields = {
        f.name: {
            "dtype": f.wire_dtype,
            "shape": list(f.shape),
            "codec": "none",
            "data": np.ascontiguousarray(arrays[f.name], f.dtype).tobytes(),
        }
        for f in spec.fields
    }
    msg = {
        "v": view.protocol,
        "type": "trajectories",
        "actor": actor,
        "seq": seq,
        "policy_version": view.version,
        "n": 1,
        "episodes": [list(e) for e in episodes],
        "fields": fields,
    }
    if view.protocol >= 2:
        msg["incarnation"] = view.incarnation
    if sent_at_ns is not None:
        msg["sent_at_ns"] = sent_at_ns
    if raw_edit is not None:
        raw_edit(msg)
    return msgpack.packb(msg, use_bin_type=True)


def poisoned(view: LearnerView, *, actor: str, seq: int, value: float = 3e38, fields=("truncation_value",)) -> bytes:
    """A valid trajectory whose every step a time limit cut, with extreme, finite values in ``fields`` (of
    truncation_value, reward, behaviour_logits). Truncation values of 3e38 turned every weight into NaN before inputs
    were clipped (with a single one, the gradient's norm often overflowed to infinity instead, and clipping zeroed
    the update)."""

    def edit(a):  # every step cut by a time limit, each with the extreme value
        a["terminated"][:] = 0
        a["truncated"][:] = 1
        a["truncation_value"][:] = 0
        if "truncation_value" in fields:
            a["truncation_value"][:] = value
        if "reward" in fields:
            a["reward"][0, 0] = value
        if "behaviour_logits" in fields:
            a["behaviour_logits"][0, 0, 0] = value

    return message(view, actor=actor, seq=seq, edit=edit)


# ------------------------------------------------------------------------------------------------ subscribers
def subscription_flood(host: str, port: int, topics: int, batch: int = 10_000) -> int:
    """Subscribe to ``topics`` distinct topics on one connection, as fast as TCP takes them (a libzmq SUB socket
    would drop all but its send high-water mark's worth). Returns how many went out before the learner closed the
    connection."""
    s = zmtp_connect(host, port, b"SUB")
    sent = 0
    try:
        while sent < topics:
            n = min(batch, topics - sent)
            s.sendall(b"".join(zmtp_frame(b"\x01topic-%012d" % i) for i in range(sent, sent + n)))
            sent += n
    except OSError:
        pass  # closed by the learner
    finally:
        s.close()
    return sent


def resubscribe_flood(ctx: zmq.Context, weights: str, per_s: float, seconds: float) -> int:
    """A new SUB connection subscribing to everything ``per_s`` times a second (each asks for a re-send)."""
    made, end = 0, time.monotonic() + seconds
    live: list[zmq.Socket] = []
    while time.monotonic() < end:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(weights)
        live.append(sub)
        if len(live) > 20:
            live.pop(0).close(0)
        made += 1
        time.sleep(1.0 / per_s)
    for sub in live:
        sub.close(0)
    return made


class CopyCounter(threading.Thread):
    """An honest subscriber (no CONFLATE) counting the weights messages and bytes it receives."""

    def __init__(self, ctx: zmq.Context, weights: str):
        super().__init__(daemon=True)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(weights)
        self.copies = self.bytes = 0
        self.counting = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            if self.sub.poll(50, zmq.POLLIN):
                data = self.sub.recv()
                if self.counting.is_set():
                    self.copies += 1
                    self.bytes += len(data)
        self.sub.close(0)


# ---------------------------------------------------------------------------------------------------- watching
class PeakRss(threading.Thread):
    """Samples a process's resident memory every 10 ms: ``peak - base`` is what an attack made it hold."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.base = self.peak = self.proc.memory_info().rss
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.01):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    @property
    def grown_mib(self) -> float:
        return (self.peak - self.base) / 2**20

    def __enter__(self) -> PeakRss:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._halt.set()
        self.join(2)
