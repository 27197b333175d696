"""From received bytes to ring slots: validation, replay and staleness checks, counters and stage timings.

No sockets and no asyncio: the server's receive loop hands each message's bytes to :meth:`Ingest.handle`.

A message's ``n`` trajectories are decoded straight into the ring when they fit in the rows left in the batch slot
being filled (the common case, and always with one trajectory per message); otherwise into a preallocated scratch
area of ``max_trajectories_per_message`` trajectories, then copied into the ring as rows become free. A message is
accepted or rejected whole. If the ring has no room (``when_full = wait``) the decoded message stays *pending* and the
receive loop must call :meth:`Ingest.continue_pending` before reading anything else.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import numpy as np

from ...config.service import Limits
from ...core import wire
from ...core.decoder import TrajectoryDecoder
from ...core.ring import TrajectoryRing
from ...core.spec import TrajectorySpec
from ..reports.histograms import Histogram

log = logging.getLogger("impala_async.learner.ingest")
UNAUTHENTICATED = "unauthenticated"  # the key name trajectories_by_key counts under without CURVE


def wire_limits(limits: Limits) -> wire.WireLimits:
    """What the decoder enforces of a learner's limits."""
    return wire.WireLimits(
        max_message_bytes=limits.max_message_bytes,
        max_trajectories_per_message=limits.max_trajectories_per_message,
        max_episodes_per_message=limits.max_episodes_per_message,
        max_actor_id_bytes=limits.max_actor_id_bytes,
        max_abs_episode_return=limits.max_abs_episode_return,
        max_episode_length_steps=limits.max_episode_length_steps,
    )


class Ingest:
    def __init__(
        self,
        limits: Limits,
        max_policy_lag: int,
        spec: TrajectorySpec,
        ring: TrajectoryRing,
        policy_version: Callable[[], int],
        incarnation: int,
        *,
        key_names: list[str] | None = None,
        pacer=None,
        resumed: dict | None = None,
        accept_jpeg: bool = False,
    ):
        """``policy_version()``: the learner's version (messages from the future are rejected, from the far past
        dropped). ``key_names``: the names of the allowed CURVE keys (CURVE on: replay state is namespaced by the
        name of the client's key), None without CURVE. ``pacer``: learner/pacing.py's Pacer, told of every accepted
        message (flow control). ``resumed``: a checkpoint's state, whose counters continue here."""
        self.limits, self.max_policy_lag, self.spec, self.ring = limits, max_policy_lag, spec, ring
        self._policy_version = policy_version
        self.incarnation = incarnation  # this learner run's; messages acted under an earlier run's weights carry theirs
        self.identities = key_names is not None
        self.decoder = TrajectoryDecoder(spec, wire_limits(limits), incarnation, accept_jpeg=accept_jpeg)
        self.steps_per_trajectory = spec.unroll_length
        n = limits.max_trajectories_per_message
        self._scratch = {f.name: np.empty((n, *f.shape), f.dtype) for f in spec.fields}
        self.pending: tuple[wire.TrajectoryMessage, int] | None = None  # (message in scratch, next row)
        self._last_seq: collections.OrderedDict[str, int] = collections.OrderedDict()
        # Counters.
        self.env_steps = int(resumed["env_steps"]) if resumed else 0  # steps in accepted trajectories
        self.trajectories_received = 0
        self.trajectories_jpeg = 0  # of which the observations (obs or frames) came as JPEG
        # Trajectories of accepted messages by the name of the key they came with (the ZAP User-Id; without CURVE
        # one bucket, UNAUTHENTICATED): bounded by the keys in allowed/, as only those get a message accepted.
        self._key_names = key_names if key_names is not None else [UNAUTHENTICATED]
        self.trajectories_by_key: collections.Counter = collections.Counter()
        self._image_field = spec.fields[0].name  # obs or frames
        self.messages_received = 0
        self.bytes_received = 0
        self.decoded_bytes = 0
        self.rejected: collections.Counter = collections.Counter()  # messages, by reason
        self.trajectories_rejected = 0  # trajectories in rejected messages (1 for a message that did not parse)
        self.dropped_stale = 0
        self.dropped_incarnation = 0  # trajectories acted under another learner incarnation's weights
        self.latency_implausible = 0  # accepted messages whose sent_at_ns was too far from the learner's clock
        self.episodes = int(resumed["episodes"]) if resumed else 0
        self.returns: collections.deque = collections.deque(resumed["returns"] if resumed else (), maxlen=100)
        self.lengths: collections.deque = collections.deque(resumed["lengths"] if resumed else (), maxlen=100)
        self.last_data_at: float | None = None  # monotonic time of the last accepted trajectory
        self.stage_s = {"parse": 0.0, "decode": 0.0}  # cumulative seconds on this thread
        self.latency_s = Histogram()  # actor's sent_at_ns -> trajectory in its ring slot
        self.pacer = pacer

    def counters(self) -> dict:
        """Ingest's figures (reports/counters.py); containers the event loop changes are copied in one C call."""
        returns, lengths, rejected = self.returns.copy(), self.lengths.copy(), dict(self.rejected)
        return {
            "env_steps": self.env_steps,
            "episodes": self.episodes,
            "episode_return_mean": float(np.mean(returns)) if returns else None,
            "episode_length_mean": float(np.mean(lengths)) if lengths else None,
            "trajectories_received": self.trajectories_received,
            "trajectories_rejected": self.trajectories_rejected,
            "trajectories_jpeg": self.trajectories_jpeg,
            "trajectories_by_key": {**dict.fromkeys(self._key_names, 0), **dict(self.trajectories_by_key)},
            "messages_received": self.messages_received,
            "messages_rejected": sum(rejected.values()),
            **{f"rejected_{r}": rejected.get(r, 0) for r in wire.REJECT_REASONS},
            "bytes_received": self.bytes_received,
            "decoded_bytes": self.decoded_bytes,
            "ingest_dropped_stale": self.dropped_stale,
            "dropped_incarnation": self.dropped_incarnation,
            "latency_p50_ms": self.latency_s.quantile_ms(0.5),
            "latency_p99_ms": self.latency_s.quantile_ms(0.99),
            "latency_implausible": self.latency_implausible,
            "stage_parse_s": self.stage_s["parse"],
            "stage_decode_s": self.stage_s["decode"],
            "scratch_bytes": self.scratch_nbytes,
        }

    def has_room(self) -> bool:
        """Whether ring rows can be written now (a pending message can go on)."""
        return self.ring.writable()

    @property
    def scratch_nbytes(self) -> int:
        return sum(a.nbytes for a in self._scratch.values())

    # ------------------------------------------------------------------------------------------------- messages
    def handle(self, buf, user_id: str | None = None, source: int | None = None) -> None:
        """One received message (``user_id``: its CURVE key's name; ``source``: the descriptor of the connection it
        came on, if known). Never raises for anything the peer sent. Nothing of a message counts (its sequence
        number, its episodes, its trajectories) until all of it has been checked and accepted. Called only while no
        message is pending (the receive loop continues a pending one first)."""
        t0 = time.perf_counter()
        self.messages_received += 1
        self.bytes_received += len(buf)
        msg = self._parse(buf, user_id)
        self.stage_s["parse"] += time.perf_counter() - t0
        if msg is None:
            return
        if self._policy_version() - msg.policy_version > self.max_policy_lag:
            self._drop_stale(msg)
            return
        self._decode(msg, user_id, source)

    def _parse(self, buf, user_id: str | None) -> wire.TrajectoryMessage | None:
        """The message, header checked; None if it was rejected or dropped (counted)."""
        try:
            msg = self.decoder.parse(buf)
        except wire.OtherIncarnation:  # acted with an earlier learner run's weights (maybe another spec)
            self.dropped_incarnation += 1
            return None
        except wire.Rejected as e:
            self.reject(e)
            return None
        except Exception as e:  # a decoder bug must not let a peer stop the server: reject, and say so loudly
            log.exception("decoder bug on a received message; rejecting it as malformed")
            self.reject(wire.Rejected("malformed", f"unexpected {type(e).__name__}: {e}"))
            return None
        if msg.incarnation != self.incarnation:  # its keys in another order than the encoder's: the same drop
            self.dropped_incarnation += 1
            return None
        try:
            self._check_header(msg, user_id)
        except wire.Rejected as e:
            self.reject(e, msg.n)
            return None
        return msg

    def _drop_stale(self, msg: wire.TrajectoryMessage) -> None:
        """Acted with weights more than max_policy_lag versions old: dropped, and counted in trajectories only once
        decoded (into the scratch area, free while nothing is pending): a peer cannot inflate the count with claims."""
        t0 = time.perf_counter()
        n = msg.n
        try:
            self.decoder.decode_into(msg, {name: a[:n] for name, a in self._scratch.items()})
        except wire.Rejected as e:
            self.reject(e, n)
        except Exception as e:  # as in _parse(): never let a peer's bytes stop the server
            log.exception("decoder bug on a received message; rejecting it as malformed")
            self.reject(wire.Rejected("malformed", f"unexpected {type(e).__name__}: {e}"), n)
        else:
            self.dropped_stale += n
        self.stage_s["decode"] += time.perf_counter() - t0

    def _actor_key(self, msg: wire.TrajectoryMessage, user_id: str | None) -> str:
        """Replay state is per (key name, actor id) under CURVE: one client cannot touch another's sequence."""
        return f"{user_id}\0{msg.actor_id}" if self.identities else msg.actor_id

    def _check_header(self, msg: wire.TrajectoryMessage, user_id: str | None) -> None:
        version = self._policy_version()
        if msg.policy_version > version:
            raise wire.Rejected("future_version", f"policy version {msg.policy_version} > learner's {version}")
        if self.identities and not user_id:
            raise wire.Rejected("bad_identity", "no authenticated key name (ZAP User-Id) on the message")
        last = self._last_seq.get(self._actor_key(msg, user_id))
        if last is not None and msg.seq <= last:
            raise wire.Rejected("replay", f"actor {msg.actor_id!r} seq {msg.seq} <= {last}")

    def _decode(self, msg: wire.TrajectoryMessage, user_id: str | None, source: int | None) -> None:
        t0 = time.perf_counter()
        n, ring = msg.n, self.ring
        direct = ring.room() >= n
        dest = ring.rows(n) if direct else {name: a[:n] for name, a in self._scratch.items()}
        try:
            ends = self.decoder.decode_into(msg, dest)
        except wire.Rejected as e:
            self.reject(e, n)
        except Exception as e:  # as in _parse(): never let a peer's bytes stop the server
            log.exception("decoder bug on a received message; rejecting it as malformed")
            self.reject(wire.Rejected("malformed", f"unexpected {type(e).__name__}: {e}"), n)
        else:
            self._message_accepted(msg, user_id, source, ends)
            if direct:
                ring.commit(n, msg.policy_version)
                self._accepted(msg, n)
            else:
                self.pending = (msg, 0)
        self.stage_s["decode"] += time.perf_counter() - t0
        self.continue_pending()

    def _message_accepted(
        self, msg: wire.TrajectoryMessage, user_id: str | None, source: int | None, ends: int
    ) -> None:
        """The whole message passed every check: now its sequence number and episodes count. ``ends``: the episodes
        its steps ended (terminated or truncated flags, measured; its records are at most as many, the decoder
        checked): the episode count, and the curriculum that follows it, take the measured figure."""
        key = self._actor_key(msg, user_id)
        self._last_seq[key] = msg.seq
        self._last_seq.move_to_end(key)
        if len(self._last_seq) > self.limits.max_tracked_actors:
            self._last_seq.popitem(last=False)
        self.trajectories_by_key[user_id if self.identities else UNAUTHENTICATED] += msg.n
        for ret, length in msg.episodes:
            self.returns.append(ret)
            self.lengths.append(length)
        self.episodes += ends
        if self.pacer is not None:  # a sender is a connection (what the learner sees), not an id a peer declares
            self.pacer.accepted(f"connection {source}" if source is not None else key, msg.n)

    def continue_pending(self) -> bool:
        """Copy what fits of the pending (scratch-decoded) message into the ring. True when nothing is pending."""
        if self.pending is None:
            return True
        t0 = time.perf_counter()
        msg, i = self.pending
        ring = self.ring
        while i < msg.n:
            m = min(ring.room(), msg.n - i)
            if m == 0:
                break
            for name, rows in ring.rows(m).items():
                np.copyto(rows, self._scratch[name][i : i + m])
            ring.commit(m, msg.policy_version)
            i += m
            self._accepted(msg, m, whole=i >= msg.n)
        self.pending = None if i >= msg.n else (msg, i)
        self.stage_s["decode"] += time.perf_counter() - t0
        return self.pending is None

    def _accepted(self, msg: wire.TrajectoryMessage, m: int, whole: bool = True) -> None:
        """``m`` trajectories of ``msg`` are in the ring; ``whole``: its last ones (its latency counts once, then)."""
        self.trajectories_received += m
        if msg.fields[self._image_field][0] == wire.CODEC_JPEG:
            self.trajectories_jpeg += m
        self.env_steps += m * self.steps_per_trajectory
        self.decoded_bytes += m * self.spec.trajectory_nbytes
        self.last_data_at = time.monotonic()
        if whole and msg.sent_at_ns is not None:  # a peer's clock reading: counted only when plausible
            latency_s = (time.time_ns() - msg.sent_at_ns) * 1e-9
            if 0.0 <= latency_s <= self.limits.max_plausible_latency_s:
                self.latency_s.add(latency_s)
            else:
                self.latency_implausible += 1

    def reject(self, e: wire.Rejected, trajectories: int = 1) -> None:
        n = self.rejected[e.reason]
        self.rejected[e.reason] = n + 1
        self.trajectories_rejected += trajectories
        if n < 10 or (n & (n - 1)) == 0:  # rate-limited: the first ten, then at powers of two
            log.warning("rejected a message (%d so far for this reason): %s", n + 1, e)

    def reject_reason(self, reason: str, detail: str) -> None:
        self.reject(wire.Rejected(reason, detail))
