"""Flow control by pace: the learner tells actors how fast to act, so that they slow down instead of being dropped.

No sockets, no asyncio; thread-safe (the receive loop reports arrivals, the training thread consumption and asks for
the pace when it encodes weights).

When the learner trains more slowly than its actors act, something must give. ``--when-full drop_oldest`` throws the
surplus away after the actors spent their CPU on it; ``--when-full wait`` stops reading, so the surplus queues in
socket buffers and the policy lag grows with every queued message. Pacing instead asks each actor to leave at least
``pace_s_per_trajectory x n`` seconds between the starts of two unrolls of ``n`` trajectories (the weights message's
``pace_s_per_trajectory``, docs/protocol.md). The learner sets it from what it measures over the last ``window_s``:

    pace = 1 / level,   factor = clip(1 + gain * (target - waiting) / target, lo, hi)
    level: slow senders keep their rate, the others share equally what training consumes, times factor

``consumed_per_s``: trajectories a second the trainer can take: those it took over the window's batches (or the last two
where the window holds fewer), over the time it did not spend waiting for them. What it could take, not what it took:
consumption is bounded by supply, so a pace set from it can only tighten once supply falls, and a spell in which the
learner was slowed (CPU taken by a burst of connections) left an honest actor held to 1/20 of its rate for good
(simulated in tests/test_pacing.py; CI's 1,000-connection test measured 0.497 of its rate). The senders: connections
whose messages were accepted in the window (or within four of their own intervals, for one that sends less often), each
with its rate over that span (a sender of one message over the whole span: one message says nothing of how often it
sends); a sender is *slow* while its rate is under half of what it was allowed: an equal share of ``consumed_per_s``
among the senders not slow (water-filling: the slowest first), times the lowest ``factor`` (at most 1) advertised over
that span. Without the factor, an actor the pace held to a quarter of its share while a backlog drained looked slow, got
no pace at all, and filled the ring (Pong: a policy lag of 36 updates).
``waiting``: trajectories accepted and not yet taken; ``target``: how many the learner wants waiting, so it never waits
for data (``pace_target_batches`` batches). Every actor that keeps the pace then produces ``level`` trajectories a
second, whatever its number of environments, and all of them together produce what training consumes, a little more
while fewer than ``target`` wait and less while more do. Slow senders take no share: a peer that opens a thousand
connections and sends a trajectory on each now and then leaves the honest actors what training consumes, where an
equal share per connection gave it a thousand shares (and the honest actor a thousandth). Where every sender is slow
the actors are the bottleneck and the pace is 0, so a learner that is not the bottleneck costs nothing. Before
anything was consumed (the first seconds) the pace is 0: no pacing. A rate, not a grant: no actor waits for a reply to
its own messages, so there is no deadlock, no per-actor state in the weights message (whose size stays independent
of the fleet), and actors that ignore the field (older or foreign ones) are held back only by ``when_full``.

With ``ranks`` learner ranks (learner/ranks/) rank 0 alone computes the pace, from its own figures: the ranks train
in lock step, one batch each per update, and actors spread their messages over the ranks round-robin, so the whole
learner consumes ``ranks`` times what rank 0 does, and each rank holds about as many waiting as rank 0. So the rate
and each sender's rate are multiplied by ``ranks`` (an actor's messages reach rank 0 only every ``ranks``-th time,
so it also counts as a sender ``ranks`` times as long) while ``factor`` compares rank 0's waiting with rank 0's target
(both would be ``ranks`` times larger over the whole learner: the ratio is the same).
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
import time
from collections.abc import Callable

FACTOR_LO, FACTOR_HI, GAIN = 0.25, 3.0, 2.0
STARVED_S = 0.001  # a trainer that waited longer than this for a batch was starved of data
SENDER_HORIZON_S = 60.0  # the longest a sender counts after its last message, and its rate's longest span


class _Sender:
    """One sender's recent messages: enough to say how fast it sends and how often."""

    __slots__ = ("first_at", "last_at", "interval", "last_n", "recent")

    def __init__(self, first_at: float):
        self.first_at = self.last_at = first_at
        self.interval = 0.0  # between its last two messages (0 after one)
        self.last_n = 0
        self.recent: collections.deque[tuple[float, int]] = collections.deque()  # (accepted at, trajectories)

    def add(self, now: float, trajectories: int) -> None:
        if self.recent:
            self.interval = now - self.last_at
        self.last_at, self.last_n = now, trajectories
        self.recent.append((now, trajectories))

    def rate(self, now: float, horizon_s: float) -> float:
        """Trajectories a second over the last ``horizon_s`` (or its life, if shorter, but at least a second; a sender
        of one message: over ``horizon_s``)."""
        while self.recent and self.recent[0][0] < now - horizon_s:
            self.recent.popleft()
        # One message says nothing of how often a sender sends: it counts over the whole horizon (a thousand
        # connections that each sent once must not count as a thousand senders of a trajectory a second).
        age = now - self.first_at if len(self.recent) > 1 else horizon_s
        span = max(1.0, min(horizon_s, age))
        return sum(n for _, n in self.recent) / span


class Pacer:
    def __init__(
        self,
        target_trajectories: float,
        window_s: float,
        max_pace_s_per_trajectory: float,
        capacity_trajectories: int = 1 << 30,
        max_tracked_senders: int = 100_000,
        ranks: int = 1,
    ):
        """``target_trajectories`` > 0: the fewest trajectories the learner wants waiting; 0 turns pacing off (pace
        0). ``capacity_trajectories``: what the ring holds (the target stays a message and a batch below it).
        ``ranks``: learner ranks training in lock step (this pacer sees one rank's share of the data)."""
        self.ranks = max(1, int(ranks))
        self.base_target = self.target = float(target_trajectories)
        self.capacity = capacity_trajectories
        self.window_s = float(window_s)
        self.max_pace = float(max_pace_s_per_trajectory)
        self.max_senders = max_tracked_senders
        self._lock = threading.Lock()
        # by last message, oldest first
        self._senders: collections.OrderedDict[str, _Sender] = collections.OrderedDict()
        # (monotonic time, trajectories, seconds the trainer waited for them)
        self._consumed: collections.deque[tuple[float, int, float]] = collections.deque()
        # Trajectories of the messages accepted within the window (time, n): the largest recent message, not the
        # largest ever (one 256-trajectory message must not raise the target for the rest of the run).
        self._sizes: collections.deque[tuple[float, int]] = collections.deque()
        self._batch = 1  # trajectories of the last batch consumed
        self._reached_at = -math.inf  # when the backlog last came within a batch of the target
        self._starved_at = -math.inf  # when the trainer last took a batch it had waited for
        # The lowest factor advertised in each second, over the longest span a sender's rate is measured: [second,
        # factor] (a pace may be asked for after every update: hundreds a second).
        self._factors: collections.deque[list] = collections.deque()
        self.pace_s_per_trajectory = 0.0  # the latest value computed (metrics)
        self.senders = 0
        self.target_now = 0.0  # the target the latest pace was computed for (metrics)

    @classmethod
    def from_config(cls, cfg) -> Pacer:
        """The pacer a learner's configuration asks for (``flow_control none``: target 0, pace always 0)."""
        ring = cfg.ring
        target = ring.pace_target_batches * cfg.loss.batch_size if ring.flow_control == "pace" else 0
        return cls(
            target,
            ring.pace_window_s,
            ring.max_pace_s_per_trajectory,
            capacity_trajectories=ring.ring_batches * cfg.loss.batch_size,
            max_tracked_senders=cfg.limits.max_tracked_actors,
            ranks=cfg.ranks.learner_ranks,
        )

    def counters(self) -> dict:
        return {
            "pace_s_per_trajectory": round(self.pace_s_per_trajectory, 6),
            "pace_senders": self.senders,
            "pace_target_trajectories": round(self.target_now, 1),
        }

    def accepted(self, actor: str, trajectories: int, now: float | None = None) -> None:
        """A message of ``actor`` with ``trajectories`` was accepted (the receive loop)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._sizes.append((now, trajectories))
            sender = self._senders.get(actor)
            if sender is None:
                sender = self._senders[actor] = _Sender(first_at=now)
            sender.add(now, trajectories)
            self._senders.move_to_end(actor)
            if len(self._senders) > self.max_senders:
                self._senders.popitem(last=False)

    def consumed(self, trajectories: int, waited_s: float = 0.0, now: float | None = None) -> None:
        """The trainer took a batch of ``trajectories``, after waiting ``waited_s`` for it (the training thread).

        The target adapts: a batch the trainer had to wait for (more than ``STARVED_S``) after a backlog that had come
        within a batch of the target since the last such batch means the actors' next messages come too late for the
        backlog kept, so it grows by half a batch; a starved trainer whose backlog stayed far below the target is
        short of supply, which a larger target cannot mend, so it stays. Every batch taken without waiting shrinks
        it by a hundredth of its excess over the configured target (a hundredth of a batch at least), down to that
        target. So the backlog, and with it the policy lag, is the least that keeps training fed wherever the
        actors' latency lies, and a spell of starvation is forgotten within a few hundred batches. (Growing at every
        starved batch and shrinking by a fixed hundredth of a batch, a learner starved by an attack on its receive
        loop kept a target of 753 trajectories, 188 batches, after it: a policy lag of 107 updates; CI,
        tests/test_outbound_attacks.py.)"""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._consumed.append((now, trajectories, max(0.0, waited_s)))
            self._batch = trajectories
            self._forget(now)
            if self.base_target > 0:
                ceiling = max(self.base_target, self.capacity - self._largest() - trajectories)
                if waited_s <= STARVED_S:
                    step = -max(trajectories, self.target - self.base_target) / 100
                elif self._reached_at > self._starved_at:
                    step = trajectories / 2
                else:  # starved again, and the backlog never came near the target since: supply is short
                    step = 0.0
                if waited_s > STARVED_S:
                    self._starved_at = now
                self.target = min(ceiling, max(self.base_target, self.target + step))

    def _forget(self, now: float) -> None:
        horizon = now - self.window_s
        # The window's batches, but the last two always: a learner slower than a batch a window still has a rate
        # (which falls as the time since them grows, so a learner that stopped advertises a slower and slower one).
        while len(self._consumed) > 2 and self._consumed[0][0] < horizon:
            self._consumed.popleft()
        while self._sizes and self._sizes[0][0] < horizon:  # the window's messages only: none outlives it
            self._sizes.popleft()
        while self._factors and self._factors[0][0] < now - SENDER_HORIZON_S - 1:
            self._factors.popleft()
        # An actor keeping a slow pace sends less often than the window: it still counts for a few of its intervals,
        # reckoned from its own messages (an actor of 128 environments sends 128 trajectories at a time).
        while self._senders:
            actor, sender = next(iter(self._senders.items()))
            if sender.last_at >= now - self._horizon(sender):
                break
            del self._senders[actor]

    def _horizon(self, sender: _Sender) -> float:
        """How long a sender counts after its last message, and the span its rate is measured over: the window, or
        four of its own intervals (measured, or at the pace for its message size), at most SENDER_HORIZON_S."""
        paced = 4 * self.ranks * self.pace_s_per_trajectory * sender.last_n
        return min(SENDER_HORIZON_S, max(self.window_s, 4 * sender.interval, paced))

    def _advertised(self, factor: float, now: float) -> None:
        second = math.floor(now)
        if self._factors and self._factors[-1][0] == second:
            self._factors[-1][1] = min(self._factors[-1][1], factor)
        else:
            self._factors.append([second, factor])

    def _held_to(self) -> Callable[[float], float]:
        """``held_to(since)``: the lowest factor advertised since ``since`` (to the second), at most 1: the smallest
        share a sender whose rate is measured from then may have been held to."""
        seconds = [sec for sec, _ in self._factors]
        lowest = [1.0] * (len(seconds) + 1)  # lowest[i]: over the seconds from the i-th on
        for i in range(len(seconds) - 1, -1, -1):
            lowest[i] = min(lowest[i + 1], self._factors[i][1])
        return lambda since: lowest[bisect.bisect_left(seconds, math.floor(since))]

    def _level(self, consumed_per_s: float, factor: float, now: float) -> float:
        """Trajectories a second each sender may send (the whole learner's rates), water-filled: a sender that sends
        under half of what it was allowed keeps its own rate and leaves the rest to the others, which share it
        equally, times ``factor``; inf where every sender is that slow (no pacing: the actors are the bottleneck).
        What a sender was allowed is an equal share of the consumption times the lowest factor advertised over the
        span its rate is measured: an actor the pace holds back is not slow, and the factor's swings are not
        mistaken for one either."""
        held_to, senders = self._held_to(), []  # (rate over the factor it was held to; rate), slowest first
        for s in self._senders.values():
            horizon = self._horizon(s)
            rate = self.ranks * s.rate(now, horizon)
            senders.append((rate / held_to(now - horizon), rate))
        senders.sort()
        slow_total, k = 0.0, 0  # the slowest k senders
        while k < len(senders) and senders[k][0] < (consumed_per_s - slow_total) / (len(senders) - k) / 2:
            slow_total += senders[k][1]
            k += 1
        if k == len(senders):
            return math.inf
        return max(1e-9, (consumed_per_s * factor - slow_total) / (len(senders) - k))

    def _largest(self) -> int:
        """Most trajectories in one message accepted within the window (1 before any)."""
        return max((n for _, n in self._sizes), default=1)

    def pace(self, waiting_trajectories: int, now: float | None = None) -> float:
        """Seconds per trajectory each actor should keep between the starts of its unrolls (0: as fast as it can)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._forget(now)
            if waiting_trajectories >= self.target - self._batch:
                self._reached_at = now
            senders = len(self._senders)
            self.senders = senders
            if self.target <= 0 or senders == 0 or len(self._consumed) < 2:
                self.pace_s_per_trajectory = 0.0
                return 0.0
            # Trajectories taken after the window's first batch, over the time since it that the trainer did not wait
            # for them: up to now, so that a learner that stopped does not keep advertising its old rate.
            first_at = self._consumed[0][0]
            after_first = list(self._consumed)[1:]
            taken = sum(n for _, n, _ in after_first)
            working_s = now - first_at - sum(w for _, _, w in after_first)
            rate = self.ranks * taken / max(1e-6, working_s)  # the whole learner's
            # A message arrives whole: wanting fewer waiting than one message holds would swing the pace between
            # its extremes at every arrival.
            # Never more than the ring can hold while a batch is taken: above that the pace would ask for data the
            # ring must drop.
            target = min(max(self.target, self._largest()), max(1.0, self.capacity - self._batch))
            self.target_now = target
            factor = min(FACTOR_HI, max(FACTOR_LO, 1.0 + GAIN * (target - waiting_trajectories) / target))
            level = self._level(rate, factor, now)
            self._advertised(factor, now)
        pace = min(self.max_pace, 1.0 / level)
        self.pace_s_per_trajectory = pace
        return pace
