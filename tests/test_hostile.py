"""Hostile input against a real, training learner: every bad message is counted under its reason, none of them
costs memory or stops training, and an honest client is still served afterwards.

One `impala-async learner` subprocess and one real actor (so the learner trains throughout); the test process is the
attacker, with raw ZeroMQ sockets. Messages that must be valid for the run's spec are built from the spec and the
policy version the learner publishes with its weights.
"""

from __future__ import annotations

import time
from pathlib import Path

import attacks
import lz4.block
import msgpack
import numpy as np
import psutil
import pytest
import zmq
from helpers import random_arrays
from procutil import CAPPED_ACTOR, TINY, cli, free_port_pair, read_metrics, stop, tail, wait_for
from zmq.utils.monitor import recv_monitor_message

from impala_async.core import wire
from impala_async.core.decoder import TrajectoryDecoder
from impala_async.core.spec import TrajectorySpec

MAX_MESSAGE_BYTES = 1 << 20
COUNTER_TIMEOUT_S = 20.0  # a rejection must show up in metrics.jsonl (written every 0.5 s) within this long
TWO_GIB = 2 << 30


class Learner:
    """The learner subprocess, its logdir, and a SUB socket for its weights (spec and current policy version)."""

    def __init__(self, tmp: Path, ctx: zmq.Context):
        self.port = free_port_pair()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.logdir, self.log = tmp / "run", tmp / "learner.log"
        self.proc = cli(
            "learner",
            *TINY,
            "--listen",
            self.endpoint,
            "--logdir",
            str(self.logdir),
            "--max-message-bytes",
            str(MAX_MESSAGE_BYTES),
            "--total-env-steps",
            "100000000",
            log=self.log,
        )
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.CONFLATE, 1)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{self.port + 1}")
        self.spec: TrajectorySpec | None = None

    def weights(self) -> wire.WeightsMessage:
        """The newest weights message (the learner republishes every second and after every update)."""
        assert self.sub.poll(15_000, zmq.POLLIN), "no weights message from the learner within 15 s\n" + tail(self.log)
        msg = wire.decode_weights(self.sub.recv(), 64 << 20)
        self.spec = TrajectorySpec.from_dict(msg.run_info["spec"])
        self.incarnation = msg.incarnation
        return msg

    def version(self) -> int:
        return self.weights().version

    def metrics(self) -> dict:
        rows = read_metrics(self.logdir)
        return rows[-1] if rows else {}

    def wait_metrics(self, cond, what: str, timeout_s: float = COUNTER_TIMEOUT_S) -> dict:
        """The first metrics line that satisfies cond; fails if the learner exits first."""

        def check():
            row = self.metrics()
            return row if row and cond(row) else None

        return wait_for(check, timeout_s, what, self.proc, self.log)


def valid_message(
    spec: TrajectorySpec, *, actor: str, seq: int, version: int, incarnation: int, seed: int = 0, **arrays_override
):
    arrays = random_arrays(spec, 1, seed=seed)
    for name, mutate in arrays_override.items():
        mutate(arrays[name])
    return wire.encode_trajectories(
        spec, actor_id=actor, seq=seq, policy_version=version, incarnation=incarnation, arrays=arrays
    )


def repacked(data: bytes, mutate) -> bytes:
    """A valid message, decoded with plain msgpack, changed by ``mutate(map)`` and packed again."""
    msg = msgpack.unpackb(data, raw=False)
    mutate(msg)
    return msgpack.packb(msg, use_bin_type=True)


@pytest.fixture
def training(tmp_path, ctx):
    """A learner with one real actor attached, already training."""
    learner = Learner(tmp_path, ctx)
    alog = tmp_path / "actor.log"
    actor = cli("actor", "--learner", learner.endpoint, "--envs-per-actor", "2", *CAPPED_ACTOR, log=alog)
    try:
        learner.wait_metrics(lambda r: r["learner_steps"] > 0, "the learner to train", 120)
        learner.actor, learner.actor_log = actor, alog
        yield learner
    finally:
        stop(actor)
        stop(learner.proc)


@pytest.mark.process
def test_hostile_inputs_are_counted_and_training_goes_on(training, ctx):
    learner = training
    learner.weights()
    spec = learner.spec
    T, A = spec.unroll_length, spec.num_actions
    push = attacks.push(ctx, learner.endpoint)
    start = learner.metrics()
    assert start["messages_rejected"] == 0, "the real actor's messages were rejected:\n" + tail(learner.log)
    expected = {reason: 0 for reason in wire.REJECT_REASONS}
    seq = iter(range(1, 1 << 30))

    def send(data, reason: str, *, multipart: bool = False) -> None:
        """Send one hostile message and wait until the learner has counted it under ``reason``."""
        if multipart:
            push.send_multipart(data)
        else:
            push.send(data)
        expected[reason] += 1
        learner.wait_metrics(
            lambda r: r[f"rejected_{reason}"] >= expected[reason], f"rejected_{reason} to reach {expected[reason]}"
        )

    def valid(**kw) -> bytes:
        return valid_message(
            spec, actor="hostile-test", seq=next(seq), version=learner.version(), incarnation=learner.incarnation, **kw
        )

    # --- not MessagePack, or MessagePack beyond the caps
    noise = np.random.default_rng(7).bytes(4096)
    with pytest.raises(wire.Rejected, match="malformed"):  # precondition: this noise does not parse
        TrajectoryDecoder(spec).parse(noise)
    send(noise, "malformed")
    send(b"", "malformed")
    send(b"\xdd\xff\xff\xff\xff", "malformed")  # array32 header claiming 2^32 - 1 items
    send(b"\x91" * 100_000 + b"\xc0", "malformed")  # 10^5 levels of nesting

    # --- header and field errors
    send(repacked(valid(), lambda m: m.update(v=3)), "bad_version")
    send(
        repacked(
            valid(),
            lambda m: m["fields"]["reward"].update(dtype="<f8", codec="none", data=np.zeros(T, "<f8").tobytes()),
        ),
        "bad_field",
    )  # wrong dtype (size consistent)
    send(repacked(valid(), lambda m: m["fields"]["obs"].update(shape=[T + 1, 5])), "bad_field")  # wrong shape
    obs_nbytes = spec.field_map["obs"].nbytes
    short = lz4.block.compress(np.zeros(obs_nbytes // 4 - 1, np.float32))  # valid LZ4, truthful header, too short
    send(repacked(valid(), lambda m: m["fields"]["obs"].update(data=short)), "bad_size")

    # --- LZ4 size headers claiming 2 GiB: rejected before any allocation, so the learner's memory does not move.
    rss = psutil.Process(learner.proc.pid)
    rss_before = rss.memory_info().rss

    def claims_2gib(m):
        data = m["fields"]["obs"]["data"]
        m["fields"]["obs"]["data"] = (TWO_GIB - 1).to_bytes(4, "little") + data[4:] + b"\0" * 1024

    for _ in range(16):
        send(repacked(valid(), claims_2gib), "bad_size")
    grown = rss.memory_info().rss - rss_before
    assert grown < 10 << 20, f"learner RSS grew by {grown / 2**20:.1f} MiB over 16 messages claiming 2 GiB"

    # --- values
    send(valid(reward=lambda a: a.__setitem__((0, T // 2), np.nan)), "nonfinite")
    send(valid(action=lambda a: a.__setitem__((0, 0), A)), "bad_action")
    send(valid(action=lambda a: a.__setitem__((0, T - 1), -1)), "bad_action")
    send(valid(terminated=lambda a: a.__setitem__((0, 1), 2)), "bad_flag")

    # --- policy version from the future, replayed (actor id, seq)
    send(
        valid_message(
            spec,
            actor="hostile-test",
            seq=next(seq),
            version=learner.version() + 1_000_000,
            incarnation=learner.incarnation,
        ),
        "future_version",
    )
    replayed = valid()
    push.send(replayed)
    send(replayed, "replay")

    # --- 10^5 tiny frames in one multipart message
    send([b"x"] * 100_000, "multipart", multipart=True)

    # Every hostile message was counted once, under its own reason, and nothing else was rejected (the actor's
    # messages included); every one of them held one trajectory or did not parse.
    row = learner.wait_metrics(lambda r: r["messages_rejected"] >= sum(expected.values()), "the final counts")
    assert {r: row[f"rejected_{r}"] for r in wire.REJECT_REASONS} == expected
    assert row["messages_rejected"] == row["trajectories_rejected"] == sum(expected.values())

    # --- a frame over --max-message-bytes: ZMQ_MAXMSGSIZE drops the sender's connection before the learner sees it
    big = ctx.socket(zmq.PUSH)
    big.setsockopt(zmq.LINGER, 0)
    monitor = big.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    big.connect(learner.endpoint)
    assert _wait_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED), "the oversize sender never connected"
    big.send(b"\0" * (MAX_MESSAGE_BYTES + 4096))
    assert _wait_event(monitor, zmq.EVENT_DISCONNECTED), "the learner kept a connection that sent an oversize frame"
    big.disable_monitor()
    monitor.close(0)
    big.close(0)

    # The learner is alive, the real actor still gets in and training goes on ...
    steps = learner.metrics()["learner_steps"]
    assert steps > start["learner_steps"]
    received = learner.metrics()["trajectories_received"]
    learner.wait_metrics(
        lambda r: r["learner_steps"] > steps and r["trajectories_received"] > received,
        "training to go on after the hostile input",
    )
    assert learner.proc.poll() is None and learner.actor.poll() is None, tail(learner.actor_log)

    # ... and a fresh connection is served: an honest message is accepted whole. Proof: its replay (sent behind it on
    # the same connection) is the only new rejection, so the honest one went through every check before it.
    fresh = attacks.push(ctx, learner.endpoint)
    honest = valid_message(
        spec, actor="fresh-connection", seq=0, version=learner.version(), incarnation=learner.incarnation, seed=3
    )
    before = learner.metrics()
    fresh.send(honest)
    fresh.send(honest)
    row = learner.wait_metrics(
        lambda r: r["rejected_replay"] > before["rejected_replay"], "the honest message's replay"
    )
    assert row["messages_rejected"] == before["messages_rejected"] + 1
    assert row["rejected_too_large"] == 0
    assert row["dropped_stale"] == before["dropped_stale"]
    assert learner.proc.poll() is None
    fresh.close(0)
    push.close(0)


def _wait_event(monitor: zmq.Socket, event: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if monitor.poll(int(left * 1000) + 1, zmq.POLLIN) and recv_monitor_message(monitor)["event"] == event:
            return True
    return False


@pytest.mark.process
def test_bin_map_key_does_not_stop_the_learner(tmp_path, ctx):
    learner = Learner(tmp_path, ctx)
    try:
        learner.weights()
        spec = learner.spec
        push = attacks.push(ctx, learner.endpoint)
        msg = msgpack.unpackb(
            valid_message(spec, actor="bin-key", seq=0, version=0, incarnation=learner.incarnation), raw=False
        )
        msg[b"x"] = 1  # docs/protocol.md: keys are strings; a non-string key is 'malformed'
        push.send(msgpack.packb(msg, use_bin_type=True))
        row = learner.wait_metrics(lambda r: r["messages_rejected"] >= 1, "the bin-key message to be rejected")
        assert row["rejected_malformed"] + row["rejected_bad_header"] == 1
        assert learner.proc.poll() is None
        push.close(0)
    finally:
        stop(learner.proc)
        learner.sub.close(0)
