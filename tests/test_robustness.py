"""A learner no single peer can stall, fill, poison or end: each class of attack against a real, training learner.

One `impala-async learner` subprocess with one real actor attached trains throughout the module; the test process
is the attacker (tests/attacks.py: raw ZMTP where libzmq would not send the bytes, pyzmq sockets otherwise). Each
test checks what the attack cost the learner (time, memory, copies sent) and that training went on. Two attacks
need a learner of their own: running out of file descriptors (under CURVE, before authentication) and resuming from
bad checkpoints. Every test here fails on the code before these defences (commit dc127ff).
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import inprocess
import numpy as np
import pytest
import torch
from attacks import (
    CopyCounter,
    LearnerView,
    PeakRss,
    connection_flood,
    message,
    oversized_frame,
    poisoned,
    push,
    resubscribe_flood,
    subscription_flood,
    tree_message,
    unfinished_multipart,
)
from procutil import LearnerProcess, free_port_pair, read_metrics, tail, wait_for

from impala_async.learner import checkpoint

MIB = 1 << 20


@pytest.fixture(scope="module")
def plain(tmp_path_factory, ctx):
    """A learner without CURVE (loopback) and one real actor, training; small bounds on unread bytes."""
    learner = LearnerProcess(
        tmp_path_factory.mktemp("plain"),
        "--max-unread-bytes-per-connection",
        str(24 * MIB),
        "--max-unread-bytes-total",
        str(48 * MIB),
        "--publish-interval-s",
        "1",
        "--max-policy-lag",
        "1000",
    )
    try:
        learner.attach_actor()
        learner.view = LearnerView(ctx, learner.weights).refresh()
        yield learner
    finally:
        if hasattr(learner, "view"):
            learner.view.close()
        learner.close()


# ------------------------------------------- 2. every socket bounded (memory first: freed memory is retained)
@pytest.mark.process
def test_subscriptions_do_not_grow_memory(plain):
    """Every distinct topic used to be stored (400K held 1.3 GiB); now only the one the learner publishes is, and a
    connection that sends more than 16 subscription messages is closed."""
    before = plain.last()
    with PeakRss(plain.proc.pid) as rss:
        sent = subscription_flood(plain.host, plain.port + 1, topics=400_000)
        time.sleep(2.0)  # whatever was sent is read meanwhile
    assert rss.grown_mib < 48, f"{sent} subscriptions raised the RSS by {rss.grown_mib:.0f} MiB"
    assert sent < 400_000, "the learner read 400K subscription messages from one connection"
    row = plain.last()
    assert row["connections_cut_max_messages"] > before["connections_cut_max_messages"]
    assert row["subscriptions_ignored"] > before["subscriptions_ignored"]


@pytest.mark.process
def test_the_weights_socket_refuses_large_frames(plain):
    """No ZMQ_MAXMSGSIZE on the weights socket buffered a 2 GiB frame in full; now 1 KiB is the most it takes."""
    with PeakRss(plain.proc.pid) as rss:
        sent = oversized_frame(plain.host, plain.port + 1, claimed_bytes=2 << 30, total_bytes=300 * MIB)
    assert sent < 64 * MIB, f"the learner read {sent / MIB:.0f} MiB of one oversized frame"
    assert rss.grown_mib < 64, f"an oversized frame on the weights socket raised the RSS by {rss.grown_mib:.0f} MiB"


# ----------------------------------------------------------------------------------- 1. parse cost is bounded
@pytest.mark.process
def test_a_message_of_millions_of_objects_costs_microseconds(plain, ctx):
    """15 MiB of nested arrays (15.7M objects) where the layout has an integer, a string, a list of episodes or the
    fields map: msgpack.unpackb built the whole tree first (about 10 s of stalled event loop and a GiB per message
    here, and the tree was then written to the log). Now each is rejected at its first wrong value."""
    s = push(ctx, plain.listen)
    log_before = plain.log.stat().st_size
    with PeakRss(plain.proc.pid) as rss:
        for key in ("v", "actor", "episodes", "fields"):
            before = plain.last()["messages_rejected"]
            t0 = time.monotonic()
            s.send(tree_message(key, 15 * MIB))
            plain.wait(lambda r, b=before: r["messages_rejected"] > b, f"the {key} tree to be rejected")
            assert time.monotonic() - t0 < 5.0, f"the {key} tree took {time.monotonic() - t0:.1f} s to reject"
    s.close(linger=5000)  # what is queued is delivered
    assert rss.grown_mib < 100, f"four 15 MiB trees raised the learner's RSS by {rss.grown_mib:.0f} MiB"
    logged = plain.log.read_bytes()[log_before:]
    assert len(logged) < 64 << 10, f"{len(logged)} bytes logged for four rejections"
    assert max(map(len, logged.splitlines()), default=0) < 1000, "a log line carries a peer's value at length"
    row = plain.last()
    assert row["loop_lag_p99_ms"] is None or row["loop_lag_p99_ms"] < 1000
    plain.trains_on("the trees")


# ---------------------------------------------------------------- 2. every socket bounded (continued)
@pytest.mark.process
def test_unfinished_multipart_messages_are_cut(plain):
    """Frames that all say 'more follows' stay in libzmq until the last one: two connections held 2 GiB. The guard
    closes a connection holding more than max_unread_bytes_per_connection (24 MiB here)."""
    sent, rss = [0, 0], PeakRss(plain.proc.pid)
    before = plain.last()

    def attack(i):
        sent[i] = unfinished_multipart(plain.host, plain.port, total_bytes=600 * MIB)

    with rss:
        threads = [threading.Thread(target=attack, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        plain.wait(
            lambda r: (
                r["connections_cut_unread_bytes"] + r["connections_cut_unread_bytes_total"]
                >= before["connections_cut_unread_bytes"] + before["connections_cut_unread_bytes_total"] + 2
            ),
            "both attacking connections to be cut",
        )
    assert max(sent) < 600 * MIB, f"an attacker sent {max(sent) / MIB:.0f} MiB without being cut"
    assert rss.grown_mib < 250, f"unfinished multipart messages raised the RSS by {rss.grown_mib:.0f} MiB"
    plain.trains_on("the multipart attack")


# --------------------------------------------------------------------------------------- 3. no amplification
@pytest.mark.process
def test_resubscribing_does_not_multiply_what_subscribers_receive(plain, ctx):
    """50 new subscriptions a second each made the learner re-send its weights to everyone (1,000 copies to an
    honest subscriber in 20 s). Now re-sends are at most one per min_resend_interval_s (1 s), so with weights
    published at most once a second (--publish-interval-s 1) an honest subscriber gets about 2 copies a second."""
    honest = CopyCounter(ctx, plain.weights)
    honest.start()
    time.sleep(1.0)  # its own subscription is answered
    honest.counting.set()
    t0 = time.monotonic()
    made = resubscribe_flood(ctx, plain.weights, per_s=50, seconds=5.0)
    honest.counting.clear()
    elapsed = time.monotonic() - t0
    honest.done.set()
    honest.join(5)
    rate = honest.copies / elapsed
    assert made >= 150
    assert rate <= 3.0, f"{honest.copies} copies in {elapsed:.1f} s ({rate:.1f}/s) under {made} subscriptions"
    assert honest.copies >= 2, "the honest subscriber got no weights at all"


# --------------------------------------------------------------------------------- 5. one trajectory, no NaN
@pytest.mark.process
def test_one_extreme_trajectory_cannot_poison_the_model(plain, ctx):
    """A valid trajectory with a truncation_value of 3e38 turned every weight into NaN, which was published,
    checkpointed and resumed from. Now values from the wire are clipped before the loss."""
    view = plain.view.refresh()
    before = plain.last()
    s = push(ctx, plain.listen)
    for i in range(20):  # spread over batches: some may land in batches the ring drops (drop_oldest)
        s.send(poisoned(view, actor="poisoner", seq=i))
        time.sleep(0.05)
    s.close(linger=5000)  # what is queued is delivered
    plain.wait(lambda r: r["learner_steps"] > before["learner_steps"] + 20, "training after the poison")
    time.sleep(1.5)  # a publication after those updates (--publish-interval-s 1)
    for _ in range(3):
        assert view.refresh().weights_finite(), "the learner published non-finite weights"
    row = plain.last()
    assert row["inputs_clipped"] > before["inputs_clipped"], "no poisoned trajectory was trained on"
    plain.trains_on("the poisoned trajectories")
    row = plain.last()
    assert row["rejected_nonfinite"] == 0, "the actor's messages are rejected: its weights went NaN"
    assert row["weights_refused_nonfinite"] == 0 and row["loss_baseline"] is not None


# ---------------------------------------------------------- 6. rejected whole; metrics trust nothing claimed
@pytest.mark.process
def test_a_rejected_message_counts_nothing_and_its_retry_is_accepted(plain, ctx):
    view = plain.view.refresh()
    s = push(ctx, plain.listen)
    before = plain.last()
    nan_reward = message(
        view, actor="retrier", seq=5, episodes=[(1e9, 10)], edit=lambda a: a["reward"].__setitem__((0, 0), np.nan)
    )
    s.send(nan_reward)
    row = plain.wait(lambda r: r["rejected_nonfinite"] > before["rejected_nonfinite"], "the NaN message's rejection")
    assert row["episodes"] == before["episodes"] or row["episode_return_mean"] < 1e6, "its episode was counted"
    s.send(message(view.refresh(), actor="retrier", seq=5, episodes=[(3.0, 10)]))  # the honest retry, same seq
    row = plain.wait(
        lambda r: (
            r["messages_received"] >= before["messages_received"] + 2
            and r["trajectories_received"] > row["trajectories_received"]
        ),
        "the retry to be accepted",
    )
    assert row["rejected_replay"] == before["rejected_replay"], "the honest retry was taken for a replay"
    assert max(r["episode_return_mean"] or 0 for r in read_metrics(plain.logdir)) < 1e6

    # Clocks and episodes a peer claims: sent_at_ns = 0, and absurd returns and lengths.
    for i in range(200):
        s.send(message(view, actor="clock", seq=i, sent_at_ns=0))
    s.send(message(view, actor="absurd", seq=0, episodes=[(1.7e308, 1)]))
    s.send(message(view, actor="absurd", seq=1, episodes=[(1.0, 1 << 62)]))
    row = plain.wait(
        lambda r: (
            r["latency_implausible"] >= before["latency_implausible"] + 200
            and r["rejected_bad_header"] >= before["rejected_bad_header"] + 2
        ),
        "the claims to be judged",
    )
    s.close(linger=5000)  # what is queued is delivered
    later = [r for r in read_metrics(plain.logdir) if r["wall_s"] >= before["wall_s"]]
    assert all(r["latency_p99_ms"] is None or r["latency_p99_ms"] < 60_000 for r in later), (
        "a peer's sent_at_ns = 0 entered the latency figures"
    )
    assert all(r["episode_return_mean"] is not None and r["episode_return_mean"] < 1e6 for r in later)


# ---------------------------------------------------------------------------------------- 7. stricter types
@pytest.mark.process
@pytest.mark.parametrize(
    "what,reason,raw_edit,edit",
    [
        ("a shape of floats", "bad_field", lambda m: m["fields"]["obs"].update(shape=[11.0, 4.0]), None),
        ("a nil sent_at_ns", "bad_header", lambda m: m.update(sent_at_ns=None), None),
        (
            "terminated and truncated both 1",
            "inconsistent",
            None,
            lambda a: (a["terminated"].__setitem__((0, 3), 1), a["truncated"].__setitem__((0, 3), 1)),
        ),
        (
            "a truncation value where nothing was cut",
            "inconsistent",
            None,
            lambda a: (a["truncated"].fill(0), a["truncation_value"].__setitem__((0, 2), 0.5)),
        ),
    ],
)
def test_stricter_types(plain, ctx, what, reason, raw_edit, edit):
    before = plain.last()
    s = push(ctx, plain.listen)
    s.send(
        message(plain.view.refresh(), actor=f"strict-{reason}", seq=int(time.time_ns()), raw_edit=raw_edit, edit=edit)
    )
    s.close(linger=5000)  # what is queued is delivered
    row = plain.wait(lambda r: r["messages_rejected"] > before["messages_rejected"], f"{what} to be rejected")
    assert row[f"rejected_{reason}"] == before[f"rejected_{reason}"] + 1, what


# ------------------------------------------------ 4. resource exhaustion never ends the run (under CURVE too)
def _keys(tmp: Path) -> tuple[Path, Path]:
    ldir, adir = tmp / "learner-keys", tmp / "actor-keys"
    for d, name in ((ldir, "learner"), (adir, "actor")):
        out = subprocess.run([*cli_argv(), "keygen", str(d), "--name", name], capture_output=True, timeout=60)
        assert out.returncode == 0, out.stderr
    (ldir / "allowed").mkdir(mode=0o700)
    shutil.copy(adir / "actor.key", ldir / "allowed" / "box.key")
    shutil.copy(ldir / "learner.key", adir / "learner.key")
    return ldir, adir


def cli_argv() -> list[str]:
    import sys

    return [sys.executable, "-m", "impala_async"]


def _nofile(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


@pytest.mark.process
def test_thousands_of_connections_before_authentication_do_not_end_the_run(tmp_path):
    """1,500 TCP connections that never authenticate (the learner runs under CURVE) and frames claiming 2 GiB before
    any handshake: with a 1024-descriptor limit the old learner's periodic checkpoint failed with EMFILE, the
    exception ended the training thread and the run ended with no checkpoint at all."""
    ldir, adir = _keys(tmp_path)
    learner = LearnerProcess(
        tmp_path, "--curve-keys", str(ldir), "--checkpoint-interval-s", "1", preexec_fn=_nofile(1024)
    )
    held = []
    try:
        learner.attach_actor("--curve-keys", str(adir))
        started = time.time()
        with PeakRss(learner.proc.pid) as rss:
            held += connection_flood(learner.host, learner.port, 1200)
            held += connection_flood(learner.host, learner.port + 1, 300)
            learner.trains_on("1,500 unauthenticated connections")
            newest = wait_for(
                lambda: [p for p in checkpoint.list_checkpoints(learner.logdir) if p.stat().st_mtime > started + 1],
                30,
                "a checkpoint during the attack",
                learner.proc,
                learner.log,
            )
            for port in (learner.port, learner.port + 1):  # a 'HELLO' claiming 2 GiB, before any authentication
                sent = oversized_frame(
                    learner.host, port, claimed_bytes=2 << 30, total_bytes=200 * MIB, mechanism_greeting_only=True
                )
                assert sent < 200 * MIB, f"port {port}: took {sent / MIB:.0f} MiB of an unauthenticated frame"
            row = learner.wait(lambda r: r["connections_cut_max_connections"] > 0, "connections over the cap to be cut")
        assert row["connections_trajectories"] <= 1024 // 2 and row["checkpoint_failures"] == 0, row
        assert rss.grown_mib < 200, f"the attack raised the RSS by {rss.grown_mib:.0f} MiB"
        assert newest
        for s in held:
            s.close()
        learner.proc.send_signal(signal.SIGTERM)
        assert learner.proc.wait(30) == 0, tail(learner.log)
        state, _ = checkpoint.load_latest(learner.logdir, validate=checkpoint.validate_learner_state)
        assert state["learner"]["updates"] > 0
    finally:
        for s in held:
            s.close()
        learner.close()


# -------------------------------------------- 5 and 8. resume never trusts a checkpoint; 7. the --listen bug
def test_resume_skips_bad_checkpoints_and_publishes_on_the_new_address(tmp_path, ctx, caplog):
    """A run's good checkpoint and three newer bad ones (NaN weights, malformed, over --max-checkpoint-bytes): the
    resume sets each aside with a warning, restores the good one and publishes on the --listen it is given (its port
    + 1), not the run's. The learners serve in this test's loop (tests/inprocess.py)."""
    logdir = tmp_path / "run"
    cfg, spec = inprocess.configuration(
        tmp_path, "--batch-size", "4", "--unroll-length", "10", "--total-env-steps", "2000"
    )

    asyncio.run(inprocess.train(cfg, spec, envs_per_actor=2))
    (good,) = checkpoint.list_checkpoints(logdir)
    state = torch.load(good, weights_only=True)
    steps = int(good.name[len("checkpoint-") : -len(".pt")])
    # Three newer checkpoints, each bad in its own way.
    nan = {
        **state,
        "learner": {
            **state["learner"],
            "model": {k: torch.full_like(v, float("nan")) for k, v in state["learner"]["model"].items()},
        },
    }
    torch.save(nan, checkpoint.checkpoint_path(logdir, steps + 10))  # NaN weights
    torch.save({"learner": "not a dict"}, checkpoint.checkpoint_path(logdir, steps + 20))  # malformed
    big = {**state, "padding": torch.zeros(1 << 20)}  # 4 MiB: over --max-checkpoint-bytes below
    torch.save(big, checkpoint.checkpoint_path(logdir, steps + 30))
    port = free_port_pair()
    caplog.set_level(logging.INFO, logger="impala_async.learner")
    cfg, spec, restored = inprocess.resumed(
        logdir, "--listen", f"tcp://127.0.0.1:{port}", "--max-checkpoint-bytes", str(2 * MIB)
    )

    async def resume():
        async with inprocess.serving(cfg, spec, state=restored):
            view = LearnerView(ctx, f"tcp://127.0.0.1:{port + 1}")  # the new --listen's port + 1, not the old run's
            try:
                await asyncio.to_thread(view.refresh, 30)
                assert view.weights_finite()
            finally:
                view.close()

    asyncio.run(resume())
    assert len(re.findall(r"skipping checkpoint", caplog.text)) == 3, caplog.text
    assert f"resumed at {steps} env steps" in caplog.text, caplog.text
    # The good checkpoint survives (the bad ones, renamed NAME.bad, no longer count among the newest to keep).
    assert [p.name for p in checkpoint.list_checkpoints(logdir)] == [good.name]
    assert len(list(logdir.glob("checkpoint-*.pt.bad"))) == 3
    assert checkpoint.load_latest(logdir, validate=checkpoint.validate_learner_state) is not None
