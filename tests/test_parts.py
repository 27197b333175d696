"""The learner's parts in process, without a learner process around them.

- Ingest (transport/ingest.py) with a real TrajectoryRing built as ``Parts.create_data_path`` builds it: accepted
  messages byte for byte in the ring rows, counters; reject-whole; replay; staleness; other incarnations; the pacer
  hand-off; a message pending while the ring is full (``when_full wait``). Socket-free: bytes in, ring rows out.
- WeightsPublisher (transport/publisher.py) on a real tcp loopback XPUB with real SUB sockets: what reaches a
  subscriber, the re-send rate limits (explicit ``now``), its counters, its guard on subscription messages.
- ConnectionGuard (transport/guard.py) on a real tcp loopback PULL: connections, the connection limit, unread bytes.
- Pacer (transport/pacing.py): only what tests/test_pacing.py leaves out (from_config, counters, the sender bound, a
  trainer that stopped consuming).
- counters.figures / counters.take / metrics.record against hand-computed values.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import zmq
from helpers import random_arrays
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

from impala_async.config import LearnerConfig
from impala_async.core import wire
from impala_async.core.ring import TrajectoryRing
from impala_async.core.spec import TrajectorySpec
from impala_async.learner.reports import counters, metrics
from impala_async.learner.reports.histograms import RHO_BIN_EDGES
from impala_async.learner.transport import guard as guard_module
from impala_async.learner.transport.guard import PER_CONNECTION_OVERHEAD_BYTES, guard_source
from impala_async.learner.transport.ingest import UNAUTHENTICATED, Ingest
from impala_async.learner.transport.pacing import Pacer

SPEC = TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=5)
INCARNATION = 7


# ------------------------------------------------------------------------------------------------------ helpers
class PacerStub:
    """Records what ingest tells the pacer."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def accepted(self, key: str, trajectories: int) -> None:
        self.calls.append((key, trajectories))


def data_path(*, batch_size=4, ring_batches=3, when_full="drop_oldest", max_policy_lag=3, key_names=None, **flags):
    """Ring and ingest as ``Parts.create_data_path`` makes them (CPU: no pinned memory), the learner at version 10."""
    cfg = LearnerConfig.of(
        batch_size=batch_size,
        ring_batches=ring_batches,
        when_full=when_full,
        max_policy_lag=max_policy_lag,
        max_trajectories_per_message=8,  # what config/resolve.py would resolve 0 (auto) to
        **flags,
    ).check()
    ring = TrajectoryRing(
        SPEC,
        cfg.loss.batch_size,
        cfg.ring.ring_batches,
        pin_memory=False,
        drop_when_full=cfg.ring.when_full == "drop_oldest",
    )
    version = [10]
    pacer = PacerStub()
    ingest = Ingest(
        cfg.limits,
        cfg.ring.max_policy_lag,
        SPEC,
        ring,
        lambda: version[0],
        INCARNATION,
        key_names=key_names,
        pacer=pacer,
    )
    return SimpleNamespace(cfg=cfg, ring=ring, ingest=ingest, pacer=pacer, version=version)


def with_ends(arrays: dict, records: int) -> dict:
    """``arrays`` with at least ``records`` episode ends (terminated set where a step ends none, in order), as a real
    actor's message has one per episode record it carries."""
    term, trunc = arrays["terminated"], arrays["truncated"]
    missing = records - int(term.sum() + trunc.sum())
    for i, j in np.argwhere((term == 0) & (trunc == 0))[: max(0, missing)]:
        term[i, j] = 1
    return arrays


def ends(arrays: dict) -> int:
    """The episodes the steps of ``arrays`` end: what the learner counts (not the records a message claims)."""
    return int(arrays["terminated"].sum() + arrays["truncated"].sum())


def encode(arrays, *, actor="a", seq=0, version=10, incarnation=INCARNATION, episodes=(), sent_at_ns=None) -> bytes:
    with_ends(arrays, len(episodes))
    return wire.encode_trajectories(
        SPEC,
        actor_id=actor,
        seq=seq,
        policy_version=version,
        incarnation=incarnation,
        arrays=arrays,
        episodes=episodes,
        sent_at_ns=sent_at_ns,
    )


def concat(*parts: dict) -> dict:
    return {f.name: np.concatenate([p[f.name] for p in parts]) for f in SPEC.fields}


def rows(arrays: dict, i: int, j: int) -> dict:
    return {name: a[i:j] for name, a in arrays.items()}


def assert_batch_holds(batch, arrays: dict) -> None:
    """Every field of ``batch`` is bit for bit ``arrays`` (floats compared as bytes: NaN payloads, -0.0 included)."""
    assert batch is not None, "no READY batch"
    for f in SPEC.fields:
        got = batch.tensors[f.name].numpy()
        want = np.ascontiguousarray(arrays[f.name], dtype=f.dtype)
        assert got.shape == want.shape, f.name
        assert got.tobytes() == want.tobytes(), f"field {f.name} differs from what was encoded"


def trajectory_nbytes(arrays: dict) -> int:
    """Decoded bytes of one trajectory, from the arrays themselves (not from the spec)."""
    return sum(a[0].nbytes for a in arrays.values())


def ring_state(ring: TrajectoryRing) -> tuple[int, int, int]:
    return ring.room(), ring.waiting_trajectories(), ring.ready_batches()


# ------------------------------------------------------------------------------------------------------ ingest
def test_accepted_messages_land_in_the_ring_byte_for_byte_and_count():
    """Trajectories go into the ring rows exactly as encoded, also when a message spans two batch slots (the scratch
    path), each row with its message's policy version; every counter moves by what the messages held. Guards against
    rows written at the wrong offset, a spanning message losing or duplicating rows, and counters off by a chunk."""
    p = data_path(batch_size=4, ring_batches=3)
    a, b, c = (random_arrays(SPEC, n, seed=s) for n, s in ((3, 1), (3, 2), (2, 3)))
    bufs = [
        encode(a, seq=0, version=8, episodes=[(1.5, 10)]),
        encode(b, seq=1, version=9),  # 1 row left in slot 0: 1 row there, 2 in slot 1
        encode(c, seq=2, version=10, episodes=[(2.5, 20), (-1.0, 3)]),
    ]
    p.ingest.handle(bufs[0])
    assert ring_state(p.ring) == (1, 3, 0)
    p.ingest.handle(bufs[1])
    assert p.ingest.pending is None and ring_state(p.ring) == (2, 6, 1)
    p.ingest.handle(bufs[2])
    assert ring_state(p.ring)[1:] == (8, 2)

    everything = concat(a, b, c)
    first, second = p.ring.get(0.0), p.ring.get(0.0)
    assert_batch_holds(first, rows(everything, 0, 4))
    assert_batch_holds(second, rows(everything, 4, 8))
    assert first.policy_versions.tolist() == [8, 8, 8, 9] and second.policy_versions.tolist() == [9, 9, 10, 10]

    got = p.ingest.counters()
    assert got["trajectories_received"] == 8
    assert got["env_steps"] == 8 * 5  # unroll_length 5
    assert got["episodes"] == ends(a) + ends(b) + ends(c)  # measured in the steps, not the records claimed
    assert got["episode_return_mean"] == pytest.approx((1.5 + 2.5 - 1.0) / 3)
    assert got["episode_length_mean"] == pytest.approx((10 + 20 + 3) / 3)
    assert got["messages_received"] == 3
    assert got["bytes_received"] == sum(len(x) for x in bufs)
    assert got["decoded_bytes"] == 8 * trajectory_nbytes(a)
    assert got["trajectories_by_key"] == {UNAUTHENTICATED: 8}
    assert got["messages_rejected"] == 0 and got["trajectories_rejected"] == 0
    assert all(got[f"rejected_{r}"] == 0 for r in wire.REJECT_REASONS)
    assert got["ingest_dropped_stale"] == 0 and got["dropped_incarnation"] == 0
    assert got["scratch_bytes"] == 8 * trajectory_nbytes(a), "scratch: max_trajectories_per_message trajectories"
    assert p.pacer.calls == [("a", 3), ("a", 3), ("a", 2)]


def test_latency_counts_each_message_once_however_it_is_split():
    """latency_implausible counts *messages* whose sent_at_ns is implausible (ingest.py's comment and
    docs/metrics.md), and a plausible one adds a latency sample. Guards against a message that spans two batch slots
    (copied into the ring in two chunks) being counted twice."""
    p = data_path(batch_size=4, ring_batches=3)
    p.ingest.handle(encode(random_arrays(SPEC, 3, seed=1), seq=0, sent_at_ns=time.time_ns()))
    assert p.ingest.counters()["latency_p50_ms"] is not None
    assert p.ingest.counters()["latency_implausible"] == 0
    # 1 ns after the epoch: decades away from the learner's clock. 1 row left in slot 0: this one spans two slots.
    p.ingest.handle(encode(random_arrays(SPEC, 3, seed=2), seq=1, sent_at_ns=1))
    assert p.ingest.counters()["trajectories_received"] == 6
    assert p.ingest.counters()["latency_implausible"] == 1, "one implausible message"


def _corrupt(reason: str, arrays: dict, buf_of) -> bytes:
    """A message that parses (or, for bad_size, whose header parses) but fails one check, at its last trajectory."""
    bad = {k: v.copy() for k, v in arrays.items()}
    if reason == "bad_action":
        bad["action"][-1, -1] = SPEC.num_actions
    elif reason == "nonfinite":
        bad["reward"][-1, 0] = np.nan
    elif reason == "bad_flag":
        bad["terminated"][-1, 1] = 2
    elif reason == "inconsistent":
        bad["terminated"][-1, 2], bad["truncated"][-1, 2] = 1, 1
    buf = buf_of(bad)
    if reason in ("bad_size", "bad_lz4"):
        msg = msgpack.unpackb(buf)
        entry = msg["fields"]["behaviour_logits"]  # the last field: every other one decodes first
        if reason == "bad_size":
            entry["codec"], entry["data"] = "none", arrays["behaviour_logits"].tobytes()[:-4]
        else:
            entry["data"] = entry["data"][:4] + b"\xff" * (len(entry["data"]) - 4)
        buf = msgpack.packb(msg, use_bin_type=True)
    return buf


@pytest.mark.parametrize("n", [2, 3], ids=["direct", "spanning"])
@pytest.mark.parametrize("reason", ["bad_action", "nonfinite", "bad_flag", "inconsistent", "bad_lz4", "bad_size"])
def test_a_message_is_rejected_whole(reason, n):
    """A message failing any check is rejected whole: nothing committed to the ring (room, waiting and READY batches
    unchanged, the rows already committed intact), counted under its reason, its episodes and its sequence number not
    counted (a retry with the same seq and good data is accepted, not a replay), the pacer not told. ``direct``: the
    message fits the slot and decodes straight into ring rows; ``spanning``: it goes through scratch."""
    p = data_path(batch_size=4, ring_batches=3)
    first = random_arrays(SPEC, 2, seed=1)
    p.ingest.handle(encode(first, seq=0, episodes=[(1.0, 4)]))
    before = ring_state(p.ring)
    assert before == (2, 2, 0)

    good = random_arrays(SPEC, n, seed=2)
    p.ingest.handle(_corrupt(reason, good, lambda arrays: encode(arrays, seq=1, episodes=[(99.0, 5)])))
    got = p.ingest.counters()
    assert ring_state(p.ring) == before and p.ingest.pending is None
    assert got[f"rejected_{reason}"] == 1 and got["messages_rejected"] == 1
    # A message refused by parse() counts as 1 trajectory (ingest.py: its n is not trusted yet), else as its n.
    assert got["trajectories_rejected"] == (1 if reason == "bad_size" else n)
    assert (
        got["trajectories_received"] == 2
        and got["env_steps"] == 10
        and got["decoded_bytes"] == 2 * trajectory_nbytes(first)
    )
    assert got["episodes"] == ends(first) and got["episode_return_mean"] == 1.0
    assert got["trajectories_by_key"] == {UNAUTHENTICATED: 2}
    assert p.pacer.calls == [("a", 2)]

    p.ingest.handle(encode(good, seq=1, episodes=[(99.0, 5)]))  # the same seq, good data
    got = p.ingest.counters()
    assert got["rejected_replay"] == 0 and got["messages_rejected"] == 1
    assert got["trajectories_received"] == 2 + n and got["episodes"] == ends(first) + ends(good)
    assert p.pacer.calls == [("a", 2), ("a", n)]
    assert_batch_holds(p.ring.get(0.0), rows(concat(first, good), 0, 4))


def test_replays_are_rejected_per_actor():
    """A (actor id, seq) not newer than the last accepted one is a replay; sequence numbers are per actor. Guards
    against accepting a resent message twice, or one actor's sequence blocking another's."""
    p = data_path()
    one = random_arrays(SPEC, 1, seed=1)
    p.ingest.handle(encode(one, actor="a", seq=5))
    p.ingest.handle(encode(one, actor="a", seq=5))
    p.ingest.handle(encode(one, actor="a", seq=4))
    assert p.ingest.counters()["rejected_replay"] == 2 and p.ingest.counters()["trajectories_rejected"] == 2
    p.ingest.handle(encode(one, actor="a", seq=6))
    p.ingest.handle(encode(one, actor="b", seq=0))
    got = p.ingest.counters()
    assert got["rejected_replay"] == 2 and got["trajectories_received"] == 3
    assert p.pacer.calls == [("a", 1), ("a", 1), ("b", 1)]


def test_replay_state_is_per_key_name_under_curve():
    """With CURVE key names, replay state is per (key name, actor id), a message without a key name is rejected
    ``bad_identity``, and trajectories count per key name, every allowed name listed. Guards against one client
    blocking (or replaying into) another's actor id, and against an unauthenticated message slipping through."""
    p = data_path(key_names=["alice", "bob"])
    one = random_arrays(SPEC, 1, seed=1)
    p.ingest.handle(encode(one, actor="a", seq=3), user_id="alice")
    p.ingest.handle(encode(one, actor="a", seq=3), user_id="bob")  # the same actor id and seq, another key
    p.ingest.handle(encode(one, actor="a", seq=3), user_id="alice")
    p.ingest.handle(encode(one, actor="a", seq=9), user_id=None)
    got = p.ingest.counters()
    assert got["trajectories_received"] == 2
    assert got["rejected_replay"] == 1 and got["rejected_bad_identity"] == 1
    assert got["trajectories_by_key"] == {"alice": 1, "bob": 1}
    assert p.pacer.calls == [("alice\0a", 1), ("bob\0a", 1)]
    assert data_path(key_names=["alice", "bob"]).ingest.counters()["trajectories_by_key"] == {"alice": 0, "bob": 0}


def test_stale_messages_are_dropped_and_future_ones_rejected():
    """With max_policy_lag 3 at learner version 10: version 7 is accepted, version 6 dropped (counted in
    ingest_dropped_stale by trajectories, not rejected, its seq not remembered), version 11 rejected
    ``future_version``; the learner's version is read per message. Guards against an off-by-one in the lag, stale
    data reaching the ring, and a cached learner version."""
    p = data_path(max_policy_lag=3)
    p.ingest.handle(encode(random_arrays(SPEC, 2, seed=1), seq=0, version=7))
    assert ring_state(p.ring)[1] == 2
    p.ingest.handle(encode(random_arrays(SPEC, 3, seed=2), seq=1, version=6))
    got = p.ingest.counters()
    assert got["ingest_dropped_stale"] == 3 and got["messages_rejected"] == 0 and got["trajectories_rejected"] == 0
    assert ring_state(p.ring)[1] == 2 and got["trajectories_received"] == 2

    p.ingest.handle(encode(random_arrays(SPEC, 2, seed=3), seq=1, version=11))
    got = p.ingest.counters()
    assert got["rejected_future_version"] == 1 and got["trajectories_rejected"] == 2
    assert ring_state(p.ring)[1] == 2

    p.version[0] = 11  # the learner moved on: the same message is now on time, and seq 1 was never taken
    p.ingest.handle(encode(random_arrays(SPEC, 2, seed=3), seq=1, version=11))
    assert p.ingest.counters()["trajectories_received"] == 4 and ring_state(p.ring)[1] == 4
    assert p.pacer.calls == [("a", 2), ("a", 2)]


def test_another_incarnation_is_dropped_not_rejected():
    """Messages acted under another learner run's weights are dropped (``dropped_incarnation``, by messages: what
    was received, not the trajectories they claim), never rejected, whatever else their header says (a version from
    the future is normal for an actor of the previous run); nothing reaches the ring or the pacer. Guards against
    counting a restart as an attack."""
    p = data_path()
    p.ingest.handle(encode(random_arrays(SPEC, 3, seed=1), incarnation=INCARNATION + 1, version=500))
    p.ingest.handle(encode(random_arrays(SPEC, 2, seed=1), incarnation=INCARNATION - 1, version=10))
    got = p.ingest.counters()
    assert got["dropped_incarnation"] == 2
    assert got["messages_rejected"] == 0 and got["trajectories_rejected"] == 0 and got["trajectories_received"] == 0
    assert got["messages_received"] == 2
    assert ring_state(p.ring) == (4, 0, 0) and p.pacer.calls == []


def test_another_runs_message_of_another_spec_is_dropped_not_rejected():
    """An actor of the previous run may still send under that run's spec (another unroll length, another network's
    core state) after a restart: the incarnation, read before the fields, drops it (counted by the trajectories it
    says it holds); checking its fields against this run's spec first rejected it as bad_field (docs/protocol.md,
    Learner restarts)."""
    p = data_path()
    other = TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=7)
    data = wire.encode_trajectories(
        other,
        actor_id="old",
        seq=0,
        policy_version=90,
        incarnation=INCARNATION + 1,
        arrays=random_arrays(other, 3, seed=1),
        episodes=[],
    )
    p.ingest.handle(data)
    got = p.ingest.counters()
    assert got["dropped_incarnation"] == 1 and got["messages_rejected"] == 0 and got["rejected_bad_field"] == 0
    with pytest.raises(wire.Rejected, match="bad_size|bad_field"):  # this run's own message of that shape: rejected
        p.ingest.decoder.parse(
            wire.encode_trajectories(
                other,
                actor_id="x",
                seq=0,
                policy_version=1,
                incarnation=INCARNATION,
                arrays=random_arrays(other, 1),
                episodes=[],
            )
        )


def test_the_pacer_hears_of_accepted_messages_only():
    """One ``accepted(actor key, trajectories)`` per accepted message, none for a rejected, replayed, stale, future
    or other-incarnation one. Guards against flow control counting senders whose data never arrived."""
    p = data_path(max_policy_lag=3)
    p.ingest.handle(encode(random_arrays(SPEC, 2, seed=1), actor="a", seq=0))
    p.ingest.handle(encode(random_arrays(SPEC, 2, seed=1), actor="a", seq=0))  # replay
    bad = random_arrays(SPEC, 1, seed=2)
    bad["action"][0, 0] = 7
    p.ingest.handle(encode(bad, actor="b", seq=0))
    p.ingest.handle(encode(random_arrays(SPEC, 1, seed=3), actor="c", seq=0, version=2))  # stale
    p.ingest.handle(encode(random_arrays(SPEC, 1, seed=3), actor="d", seq=0, version=12))  # future
    p.ingest.handle(encode(random_arrays(SPEC, 1, seed=3), actor="e", seq=0, incarnation=1))
    p.ingest.handle(b"\x93not a message")
    p.ingest.handle(encode(random_arrays(SPEC, 3, seed=4), actor="f", seq=0))
    assert p.pacer.calls == [("a", 2), ("f", 3)]
    got = p.ingest.counters()
    assert got["messages_received"] == 8 and got["messages_rejected"] == 4
    assert (got["rejected_replay"], got["rejected_bad_action"], got["rejected_future_version"]) == (1, 1, 1)
    assert got["rejected_malformed"] == 1


def test_a_message_waits_for_ring_room_when_full():
    """``when_full wait``: a message arriving at a full ring stays pending (``continue_pending()`` False) and goes in
    as slots are released, part by part, in order; its trajectories count as they land. Guards against a message lost
    or reordered while waiting, and against writing into a slot the trainer still holds."""
    p = data_path(batch_size=2, ring_batches=3, when_full="wait")
    msgs = [random_arrays(SPEC, 2, seed=s) for s in range(3)]
    for i, m in enumerate(msgs):
        p.ingest.handle(encode(m, seq=i, version=7 + i))
    assert not p.ring.writable() and ring_state(p.ring) == (0, 6, 3)

    late = random_arrays(SPEC, 3, seed=9)
    p.ingest.handle(encode(late, seq=3, version=10))
    assert p.ingest.pending is not None and not p.ingest.continue_pending() and not p.ingest.has_room()
    assert p.ingest.counters()["trajectories_received"] == 6 and p.ring.dropped_full == 0

    b0 = p.ring.get(0.0)
    assert_batch_holds(b0, msgs[0])
    p.ring.release(b0)
    assert not p.ingest.continue_pending(), "2 of 3 fit in the freed slot; 1 still waits"
    assert p.ingest.counters()["trajectories_received"] == 8
    b1 = p.ring.get(0.0)
    assert_batch_holds(b1, msgs[1])
    p.ring.release(b1)
    assert p.ingest.continue_pending() and p.ingest.pending is None
    assert p.ingest.counters()["trajectories_received"] == 9 and p.ingest.counters()["env_steps"] == 45

    assert_batch_holds(p.ring.get(0.0), msgs[2])
    tail = p.ring.get(0.0)
    assert_batch_holds(tail, rows(late, 0, 2))
    assert tail.policy_versions.tolist() == [10, 10]
    p.ring.release(tail)
    last = random_arrays(SPEC, 1, seed=10)
    p.ingest.handle(encode(last, seq=4, version=10))
    assert_batch_holds(p.ring.get(0.0), concat(rows(late, 2, 3), last))
    assert p.ring.dropped_full == 0 and p.ingest.counters()["messages_rejected"] == 0


# --------------------------------------------------------------------------------------------------- publisher
def test_weights_reach_subscribers_once_their_subscription_is_applied(ctx):
    """Manual subscriptions: weights published before the learner applied a subscription do not reach it (the first
    message it gets is the next one); ``publish`` reaches every subscriber; counters agree. Guards against the XPUB
    storing subscriptions on its own (memory per topic) and against a publish that reaches nobody."""
    pub, address = publisher(ctx)
    try:
        assert pub.resend_due(time.monotonic()) == pub.republish_interval_s and pub.sends == 0, "nothing to resend"
        s1 = subscriber(ctx, address)
        wait_until(lambda: pub.sock.poll(10), "the subscription message")  # arrived, not yet applied
        pub.publish(b"w0")
        joined(pub, 1)
        s2 = subscriber(ctx, address)
        joined(pub, 2)
        pub.publish(b"w1")
        assert receive(s1) == b"w1", "w0 went out before the subscription was applied"
        assert receive(s2) == b"w1"
        got = pub.counters()
        assert (got["weights_sends"], got["weights_resends"], got["subscriptions"]) == (2, 0, 2)
        assert got["subscriptions_ignored"] == 0 and got["connections_weights"] == 2
    finally:
        pub.close()


def test_resends_are_rate_limited_for_newcomers_and_periodic(ctx):
    """With min_resend_interval_s 10 and republish_interval_s 100 (explicit ``now``): a newcomer gets the latest
    weights at once; newcomers within the next 10 s share one re-send at its end, however many they are; with no
    newcomer the weights go again every 100 s. The returned wait says when the next one may be due. Guards against a
    peer multiplying sends by subscribing, and against newcomers or silent periods never getting weights."""
    pub, address = publisher(ctx, min_resend_interval_s=10.0, republish_interval_s=100.0)
    try:
        s1 = subscriber(ctx, address)
        joined(pub, 1)
        pub.publish(b"w1")
        t0 = time.monotonic()
        assert receive(s1) == b"w1"
        assert pub.resend_due(t0 + 1.0) == pytest.approx(99.0, abs=1.0) and pub.resends == 0

        s2 = subscriber(ctx, address)
        joined(pub, 2)
        pub.resend_due(t0 + 2.0)  # the first newcomer since the last re-send: at once
        assert pub.resends == 1 and receive(s2) == b"w1"

        late = [subscriber(ctx, address) for _ in range(4)]
        joined(pub, 6)
        assert pub.resend_due(t0 + 2.5) == pytest.approx(9.5)  # until t0 + 12, the end of the 10 s
        for now in (t0 + 3.0, t0 + 7.0, t0 + 11.99):
            pub.resend_due(now)
        assert pub.resends == 1, "newcomers within min_resend_interval_s wait"
        pub.resend_due(t0 + 12.0)
        assert pub.resends == 2, "one re-send for all four"
        for s in late:
            assert receive(s) == b"w1"
        pub.resend_due(t0 + 12.5)
        assert pub.resends == 2, "no newcomer: nothing until the periodic re-send"

        t1 = t0 + 12.0  # the last re-send
        assert pub.resend_due(t1 + 50.0) == pytest.approx(50.0)
        pub.resend_due(t1 + 99.99)
        assert pub.resends == 2
        pub.resend_due(t1 + 100.0)
        assert pub.resends == 3, "periodic"
        pub.resend_due(t1 + 150.0)
        pub.resend_due(t1 + 200.0)
        assert pub.resends == 4
        got = pub.counters()
        assert (got["weights_sends"], got["weights_resends"], got["subscriptions"]) == (5, 4, 6)
        assert got["connections_weights"] == 6
    finally:
        pub.close()


def test_a_publish_serves_waiting_newcomers(ctx):
    """New weights reach the newcomers that were waiting for a re-send: no re-send of the old ones follows, and the
    periodic one counts from the publish. Guards against sending stale weights right after fresh ones."""
    pub, address = publisher(ctx, min_resend_interval_s=10.0, republish_interval_s=100.0)
    try:
        pub.publish(b"w1")
        s = subscriber(ctx, address)
        joined(pub, 1)
        pub.publish(b"w2")
        t0 = time.monotonic()
        assert receive(s) == b"w2"
        assert pub.resend_due(t0 + 50.0) == pytest.approx(50.0, abs=1.0)
        assert pub.resends == 0 and pub.sends == 2
    finally:
        pub.close()


def test_other_topics_are_ignored_and_too_many_subscription_messages_cut(ctx):
    """Subscriptions to topics the learner never publishes are counted and not applied; a connection sending more
    subscription messages than max_subscriptions_per_connection is cut (``cut_weights_max_messages``) and its peer
    disconnected. Guards against a peer growing the learner's subscription state without bound."""
    pub, address = publisher(ctx, max_subscriptions_per_connection=2)
    try:
        s = subscriber(ctx, address, b"a", b"b", b"c", reconnect=False)
        events = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)

        def cut():
            if pub.sock.poll(10):
                pub.read_subscriptions()
            return pub.guard.cut["max_messages"] >= 1

        wait_until(cut, "the cut")
        assert events.poll(int(DEADLINE_S * 1000)), "the peer was not disconnected"
        got = pub.counters()
        assert got["cut_weights_max_messages"] == 1 and got["connections_weights"] == 0
        # 3 subscriptions to other topics, and, depending on timing, libzmq's unsubscriptions of them at the cut
        assert got["subscriptions"] == 0 and got["subscriptions_ignored"] >= 3
        s.disable_monitor()
    finally:
        pub.close()


# ------------------------------------------------------------------------------------------------------- guard
def test_the_guard_counts_connections_and_cuts_those_beyond_the_limit(ctx):
    """Connections are followed through the monitor; one beyond max_connections is shut down at once and counted,
    the others stay. Guards against a connection flood holding the learner's descriptors."""
    pull, address, guard = pull_with_guard(
        ctx, max_connections=2, max_unread_bytes=64 << 20, max_unread_bytes_total=128 << 20
    )
    try:
        pushers = [pusher(ctx, address) for _ in range(2)]
        wait_until(lambda: checked(guard, lambda: len(guard.conns) == 2), "2 connections")
        assert guard.counters()["connections_trajectories"] == 2 and guard.accepted == 2
        third = pusher(ctx, address)
        events = third.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        wait_until(lambda: checked(guard, lambda: guard.cut["max_connections"] == 1), "the third one cut")
        assert events.poll(int(DEADLINE_S * 1000)), "the third connection was not closed"
        got = guard.counters()
        assert got["connections_trajectories"] == 2 and got["cut_trajectories_max_connections"] == 1
        assert guard.accepted == 3
        third.disable_monitor()
        for s in pushers:  # the two within the limit still deliver
            s.send(b"x")
            assert receive(pull) == b"x"
    finally:
        guard.close(pull)


def test_the_guard_accounts_unread_bytes(ctx):
    """A complete message the learner has not read is held for its peer: ``check()`` shows about its size unread
    (TCP's bytes received less what was delivered, less the per-connection allowance); once read and ``delivered``,
    it falls back to 0. Guards against the accounting missing queued bytes, or never crediting delivered ones."""
    size = 4 << 20
    pull, address, guard = pull_with_guard(
        ctx, max_connections=4, max_unread_bytes=64 << 20, max_unread_bytes_total=128 << 20
    )
    try:
        s = pusher(ctx, address)
        s.send(b"\0" * size)
        wait_until(
            lambda: checked(guard, lambda: guard.unread_bytes_total >= size - PER_CONNECTION_OVERHEAD_BYTES),
            "the message's bytes unread",
        )
        assert guard.unread_bytes_total <= size, "more unread than was sent"
        assert guard.counters()["unread_bytes"] == guard.unread_bytes_total
        assert guard.max_unread_bytes_seen >= guard.unread_bytes_total
        assert pull.poll(int(DEADLINE_S * 1000))
        frame = pull.recv(zmq.NOBLOCK, copy=False)
        fd = guard_source(frame)
        assert fd in guard.conns and len(frame) == size
        guard.delivered(fd, len(frame))
        guard.check()
        assert guard.conns[fd].messages == 1
        assert guard.conns[fd].unread_bytes == 0 and guard.counters()["unread_bytes"] == 0
    finally:
        guard.close(pull)


def test_the_guard_cuts_connections_holding_too_much(ctx):
    """A connection holding more unread bytes than max_unread_bytes is cut (``unread_bytes``); while all together
    hold more than max_unread_bytes_total, the one holding most is cut (``unread_bytes_total``) and the rest stay.
    Guards against one peer (or many) making the learner hold unbounded memory."""
    mib = 1 << 20
    pull, address, guard = pull_with_guard(
        ctx, max_connections=8, max_unread_bytes=3 * mib, max_unread_bytes_total=3 * mib
    )
    try:
        big = pusher(ctx, address)
        events = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        big.send(b"\1" * (4 * mib))
        wait_until(lambda: checked(guard, lambda: guard.cut["unread_bytes"] == 1), "a cut for unread_bytes")
        assert events.poll(int(DEADLINE_S * 1000)), "the peer was not disconnected"
        big.disable_monitor()

        first, second = pusher(ctx, address), pusher(ctx, address)
        first_events = first.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        first.send(b"\2" * int(2.5 * mib))  # alone within both limits
        wait_until(lambda: checked(guard, lambda: guard.unread_bytes_total >= 2 * mib), "the first one's bytes")
        assert guard.cut["unread_bytes_total"] == 0
        second.send(b"\3" * (2 * mib))  # together over 3 MiB: the first, holding most, is cut
        wait_until(lambda: checked(guard, lambda: guard.cut["unread_bytes_total"] == 1), "a cut for the total")
        assert first_events.poll(int(DEADLINE_S * 1000)), "the connection holding most was not the one cut"
        first.disable_monitor()
        assert len(guard.conns) == 1
        got = guard.counters()
        assert got["cut_trajectories_unread_bytes"] == 1 and got["cut_trajectories_unread_bytes_total"] == 1
        # The one left still delivers. A message a cut peer had sent whole before its cut may come first: libzmq
        # delivers the complete messages already queued (only a partial one is freed).
        while (message := receive(pull))[:1] != b"\3":
            assert message[:1] in (b"\1", b"\2")
        assert message == b"\3" * (2 * mib)
    finally:
        guard.close(pull)


def test_the_guard_checks_many_connections_in_turns(ctx, monkeypatch):
    """300 connections and at most 200 checks a second: each check() looks at the next ones in turn, so a second of
    checks every 10 ms makes about 200 system calls, not 30,000 (connections are free to open: 1,000 idle ones checked
    every 50 ms took 13% of the learner's core, and an honest actor beside it kept under half its throughput); and a
    connection over its bound is still cut within a turn of them all (300 / 200 = 1.5 s)."""
    mib, calls = 1 << 20, [0]
    pull, address, guard = pull_with_guard(
        ctx, max_connections=400, max_unread_bytes=3 * mib, max_unread_bytes_total=1 << 30, max_checks_per_s=200
    )
    real = guard_module.tcp_bytes

    def counting(fd):  # the real system call, counted
        calls[0] += 1
        return real(fd)

    monkeypatch.setattr(guard_module, "tcp_bytes", counting)
    try:
        pushers = [pusher(ctx, address) for _ in range(300)]
        wait_until(lambda: checked(guard, lambda: len(guard.conns) == 300), "300 connections")
        guard.check()
        calls[0], t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 1.0:
            guard.check()
            time.sleep(0.01)
        assert 100 <= calls[0] <= 200 * (time.monotonic() - t0) + 1, calls[0]

        pushers[0].send(b"\1" * (4 * mib))
        sent_at = time.monotonic()
        wait_until(lambda: checked(guard, lambda: guard.cut["unread_bytes"] == 1), "a cut for unread_bytes")
        assert time.monotonic() - sent_at < 1.5 + 1.0, "not cut within a turn of all the connections"
        assert len(guard.conns) == 299
    finally:
        guard.close(pull)


# ------------------------------------------------------------------------------------------------------ pacing
def test_the_pacer_from_the_configuration_and_its_counters():
    """tests/test_pacing.py covers the formula, the adaptive target, the sender window and ranks; left out there:
    the target and capacity from_config derives, flow_control none, and what counters() reports. Guards against a
    target in batches where trajectories are meant, and against pacing that ``none`` should turn off."""
    cfg = LearnerConfig.of(batch_size=8, ring_batches=5, pace_target_batches=2.5, learner_ranks=2).check()
    p = Pacer.from_config(cfg)
    assert (p.base_target, p.capacity, p.ranks) == (20.0, 40, 2)
    for i in range(21):  # one sender faster than the learner: 168 a second reach this rank, half of what it sends
        p.accepted("a", 8, now=i * 0.05)
    for i in range(11):  # 10 batches of 8 after the first in 1 s: 80 a second on this rank, 160 on the learner
        p.consumed(8, 0.0, now=i * 0.1)
    pace = p.pace(20, now=1.0)  # at the target: factor 1
    assert pace == pytest.approx(1 / 160)
    assert p.counters() == {
        "pace_s_per_trajectory": round(1 / 160, 6),
        "pace_senders": 1,
        "pace_target_trajectories": 20.0,
    }
    off = Pacer.from_config(cfg.replace(flow_control="none"))
    off.accepted("a", 8, now=0.0)
    for i in range(11):
        off.consumed(8, 0.0, now=i * 0.1)
    assert off.pace(0, now=1.0) == 0.0 and off.counters()["pace_s_per_trajectory"] == 0.0


def test_a_learner_that_stopped_consuming_slows_the_pace_and_senders_are_bounded():
    """The rate is measured up to now: a trainer that stopped taking batches advertises a falling rate (a slower
    pace), not its old one; at most max_tracked_senders actors are remembered (the least recent forgotten)."""
    p = Pacer(target_trajectories=16, window_s=5.0, max_pace_s_per_trajectory=10.0, max_tracked_senders=2)
    p.accepted("a", 16, now=0.0)  # forgotten when a third sender comes: the least recent
    for i in range(11):  # b and c each send 160 a second, faster than their share: both held to it
        for actor in ("b", "c"):
            p.accepted(actor, 16, now=i * 0.1)
    for i in range(11):
        p.consumed(16, 0.0, now=i * 0.1)  # 160 trajectories over the 1 s after the first batch
    assert p.pace(16, now=1.0) == pytest.approx(2 / 160) and p.senders == 2
    assert p.pace(16, now=2.0) == pytest.approx(2 / 80), "nothing taken for 1 s: half the rate"


# ---------------------------------------------------------------------------------------------------- counters
def test_figures_merge_parts_and_derive_drops():
    """figures() merges every part's counters, sums the ring's and ingest's stale drops into dropped_stale (the two
    source names gone) and adds full and stale drops into trajectories_dropped (incarnation drops are messages, apart);
    two parts counting the
    same key are refused. Guards against a drop counted twice or not at all, and against one part's figure silently
    overwriting another's."""
    ring = {"dropped_full": 8, "ring_dropped_stale": 4, "ring_bytes": 100}
    ingest = {"ingest_dropped_stale": 3, "dropped_incarnation": 2, "env_steps": 50}
    got = counters.figures([lambda: ring, lambda: ingest])
    assert got == {
        "dropped_full": 8,
        "ring_bytes": 100,
        "dropped_incarnation": 2,
        "env_steps": 50,
        "dropped_stale": 7,
        "trajectories_dropped": 8 + 7,
    }
    with pytest.raises(RuntimeError, match="env_steps"):
        counters.figures([lambda: ring, lambda: ingest, lambda: {"env_steps": 1}])


def own_figures(**over) -> dict:
    """Every figure metrics.record reads, as this rank's parts would count them (before figures())."""
    base = {k: 0 for k in metrics.COPIED}
    for k in ("dropped_stale", "trajectories_dropped"):
        base.pop(k)
    base.update(
        ring_dropped_stale=0,
        ingest_dropped_stale=0,
        batches=0,
        ring_bytes=3 << 20,
        scratch_bytes=1 << 19,
        stage_parse_s=0.0,
        stage_decode_s=0.0,
        stage_receive_s=0.0,
        stage_h2d_s=0.0,
        stage_train_s=0.0,
        stage_wait_s=0.0,
        decoded_bytes=0,
        handshakes_refused_key=0,
        **{f"cut_{s}_{r}": 0 for s in ("trajectories", "weights") for r in ("max_connections", "unread_bytes")},
        **{f"cut_{s}_{r}": 0 for s in ("trajectories", "weights") for r in ("unread_bytes_total", "max_messages")},
        **{f"cut_{s}_{r}": 0 for s in ("trajectories", "weights") for r in ("stalled", "held_weights")},
        **{f"rejected_{r}": 0 for r in wire.REJECT_REASONS},
    )
    base.update(over)
    return base


def test_take_sums_over_ranks_and_lists_each():
    """With peers (rank 0 of three), SUMMED figures are summed over every rank (a peer's missing key counts 0),
    PER_RANK ones listed in rank order with alive flags, and ``Snapshot[key]`` is the sum for summed keys and this
    rank's own otherwise. Guards against rank 0 reporting only its own data, or summing what is not additive."""
    own = own_figures(env_steps=100, trajectories_received=20, dropped_full=4, ingest_dropped_stale=1, batches=7)
    peers = [
        (
            {"env_steps": 30, "trajectories_received": 6, "trajectories_dropped": 2, "ring_waiting_trajectories": 1},
            True,
        ),
        ({"env_steps": 5, "episodes": 2}, False),
    ]
    snap = counters.take([lambda: own], lambda: peers, now=42.0)
    assert snap.t == 42.0
    assert snap["env_steps"] == 135 and snap.own["env_steps"] == 100
    assert snap["trajectories_received"] == 26 and snap["episodes"] == 2
    assert snap["trajectories_dropped"] == 5 + 2, "own: 4 full + 1 stale; a peer's 2"
    assert snap["batches"] == 7, "not summed: this rank's"
    assert snap.per_rank["env_steps"] == [100, 30, 5]
    assert snap.per_rank["trajectories_dropped"] == [5, 2, 0]
    assert snap.per_rank["alive"] == [1, 1, 0]
    assert set(snap.per_rank) == {*counters.PER_RANK, "alive"}
    alone = counters.take([lambda: own], None, now=1.0)
    assert alone["env_steps"] == 100 and alone.per_rank["alive"] == [1] and alone.per_rank["env_steps"] == [100]


def _stats(skipped: bool, value: float, rho_hist: list[int]) -> dict:
    out = {name: (math.nan if skipped else value) for name in metrics.LOSS_FIGURES}
    out.update(skipped=skipped, rho_hist=rho_hist)
    return out


def test_record_rates_stages_lags_and_losses():
    """metrics.record against hand-computed figures: rates are deltas over the snapshots' time difference (the
    whole learner's for summed figures), trainer stages per trajectory trained (batches x batch_size), ingest stages
    per trajectory this rank received, policy lags from the per-batch (min, mean, max), losses averaged over the
    updates that were not skipped, rho_hist summed over them, cuts summed over both sockets."""
    prev_own = own_figures(
        env_steps=1000, trajectories_received=200, batches=10, bytes_received=1_000_000, decoded_bytes=500_000
    )
    prev_own.update(stage_train_s=1.0, stage_h2d_s=0.5, stage_wait_s=0.25, stage_parse_s=0.1, stage_decode_s=0.2)
    cur_own = own_figures(
        env_steps=6000,
        trajectories_received=1200,
        batches=30,
        bytes_received=6_000_000,
        decoded_bytes=3_000_000,
        cut_trajectories_unread_bytes=2,
        cut_weights_unread_bytes=3,
        rejected_replay=4,
        dropped_full=6,
        handshakes_refused_key=7,
    )
    cur_own.update(stage_train_s=5.0, stage_h2d_s=0.9, stage_wait_s=0.25, stage_parse_s=0.6, stage_decode_s=1.2)
    peer_before = {"env_steps": 500, "trajectories_received": 100}
    peer_after = {"env_steps": 1500, "trajectories_received": 300}
    prev = counters.take([lambda: prev_own], lambda: [(peer_before, True)], now=10.0)
    cur = counters.take([lambda: cur_own], lambda: [(peer_after, True)], now=12.5)
    stats = [
        _stats(False, 1.0, [1, 0, 0, 0, 0, 0, 0, 2]),
        _stats(True, 0.0, [100] * 8),
        _stats(False, 4.0, [0, 3, 0, 0, 0, 0, 0, 1]),
    ]
    lags = [(0, 1.5, 3), (2, 2.1, 5)]
    rec = metrics.record(cur, prev, stats, lags, wall_s=12.34567, batch_size=4, learner_ranks=2)
    assert rec["handshakes_refused_key"] == 7  # this rank's own count, as the report gives it

    dt = 2.5
    assert rec["wall_s"] == 12.346
    assert rec["sps"] == ((6000 + 1500) - (1000 + 500)) / dt == 2400.0, "the whole learner's steps"
    assert rec["trajectories_per_s"] == ((1200 + 300) - (200 + 100)) / dt
    assert rec["batches_per_s"] == (30 - 10) / dt
    assert rec["wire_mb_per_s"] == 2.0 and rec["decoded_mb_per_s"] == 1.0
    trained, received = (30 - 10) * 4, 1200 - 200
    stages = rec["stage_s_per_trajectory"]
    assert stages["train"] == pytest.approx(4.0 / trained) and stages["h2d"] == pytest.approx(0.4 / trained)
    assert stages["wait"] == 0.0
    assert stages["parse"] == pytest.approx(0.5 / received) and stages["decode"] == pytest.approx(1.0 / received)
    assert stages["receive"] == 0.0
    assert (rec["policy_lag_min"], rec["policy_lag_avg"], rec["policy_lag_max"]) == (0, 1.8, 5)
    for name in metrics.LOSS_FIGURES:
        assert rec[name] == 2.5, f"{name}: the mean of 1 and 4; the skipped update's NaN left out"
    assert rec["rho_hist"] == [1, 3, 0, 0, 0, 0, 0, 3] and rec["rho_hist_edges"] == list(RHO_BIN_EDGES)
    assert rec["connections_cut_unread_bytes"] == 5 and rec["rejected_replay"] == 4
    assert rec["trajectories_dropped"] == 6 and rec["env_steps"] == 7500
    assert rec["ring_mib"] == 3.0 and rec["scratch_mib"] == 0.5
    assert rec["ranks"]["env_steps"] == [6000, 1500] and rec["learner_ranks"] == 2

    idle = metrics.record(cur, cur, [_stats(True, 0.0, [1] * 8)], [], wall_s=0.0, batch_size=4, learner_ranks=2)
    assert idle["sps"] == 0.0 and idle["stage_s_per_trajectory"]["train"] is None
    assert idle["stage_s_per_trajectory"]["parse"] is None, "no trajectory received: no per-trajectory figure"
    assert idle["policy_lag_avg"] is None and idle["loss_pg"] is None and idle["rho_hist"] is None
