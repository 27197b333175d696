"""Crashes, hangs, restarts and checkpoints, with real processes: the learner must keep training or fail clearly."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import inprocess
import pytest
import torch
import zmq
from procutil import (
    CAPPED_ACTOR,
    CAPPED_ACTORS,
    TINY,
    actors_under,
    cli,
    ended,
    finish,
    free_port_pair,
    read_metrics,
    stop,
    tail,
    wait_for,
)

from impala_async.core import wire
from impala_async.learner import checkpoint

LEARNER = TINY  # CartPole, T 10, B 4, a report every 0.5 s
SMALL = [*LEARNER, "--envs-per-actor", "4"]


def last(logdir):
    rows = read_metrics(logdir)
    return rows[-1] if rows else {}


def steps_grow(logdir, proc, log, by=5, timeout_s=60):
    start = last(logdir).get("learner_steps", 0)
    wait_for(lambda: last(logdir).get("learner_steps", 0) >= start + by, timeout_s, "learner steps to grow", proc, log)


@pytest.mark.process
def test_killed_and_stopped_actors_are_replaced(tmp_path):
    logdir, log = tmp_path / "run", tmp_path / "log"
    proc = cli(
        "train",
        *SMALL,
        "--num-actors",
        "2",
        "--total-env-steps",
        "100000000",
        "--logdir",
        str(logdir),
        "--heartbeat-interval-s",
        "0.5",
        "--heartbeat-timeout-s",
        "3",
        *CAPPED_ACTORS,  # training goes on, not flat out on both cores
        log=log,
    )
    try:
        wait_for(lambda: last(logdir).get("learner_steps", 0) > 0, 90, "training", proc, log)
        actors = actors_under(proc.pid)
        assert len(actors) == 2
        os.kill(actors[0], signal.SIGKILL)  # a crash
        wait_for(
            lambda: last(logdir).get("actor_restarts", 0) >= 1 and last(logdir).get("actors_alive") == 2,
            60,
            "the killed actor to be restarted",
            proc,
            log,
        )
        survivor = actors[1]
        os.kill(survivor, signal.SIGSTOP)  # a hang: alive, silent
        t0 = time.monotonic()
        wait_for(
            lambda: ended(survivor),
            30,
            "the stopped actor to be killed",
            proc,
            log,
        )
        assert time.monotonic() - t0 < 15, "heartbeat_timeout_s=3 should catch a stopped actor within seconds"
        wait_for(
            lambda: last(logdir).get("actor_restarts", 0) >= 2 and last(logdir).get("actors_alive") == 2,
            60,
            "the stopped actor to be replaced",
            proc,
            log,
        )
        steps_grow(logdir, proc, log)  # training went on
        assert "silent" in log.read_text()
    finally:
        stop(proc)


@pytest.mark.process
def test_an_actor_slow_to_build_its_environments_is_not_taken_for_hung(tmp_path):
    """8 environments that take 0.6 s each to build (as 32 ALE games take ~10 s): 4.8 s without a beat, longer than
    --heartbeat-timeout-s 2. The actor announces the step (procs.GRACE), so it is neither killed nor restarted; before
    that announcement existed it was killed at every start and no trajectory ever arrived."""
    logdir, log = tmp_path / "run", tmp_path / "log"
    slow = ["--env", "impala_async.actors.envs:DifficultyProbe-v0", "--env-kwargs", '{"build_delay_s": 0.6}']
    proc = cli(
        "train",
        *slow,
        "--num-actors",
        "1",
        "--envs-per-actor",
        "8",
        "--unroll-length",
        "10",
        "--batch-size",
        "4",
        "--report-interval-s",
        "0.5",
        "--total-env-steps",
        "4000",
        "--heartbeat-interval-s",
        "0.5",
        "--heartbeat-timeout-s",
        "2",
        "--logdir",
        str(logdir),
        log=log,
    )
    finish(proc, log, 120)
    assert last(logdir)["env_steps"] >= 4000
    assert last(logdir).get("actor_restarts", 0) == 0, tail(log)
    assert "silent" not in log.read_text()


@pytest.mark.process
def test_all_actors_gone_exits_nonzero(tmp_path):
    logdir, log = tmp_path / "run", tmp_path / "log"
    proc = cli(
        "train",
        *SMALL,
        "--num-actors",
        "1",
        "--total-env-steps",
        "100000000",
        "--logdir",
        str(logdir),
        "--max-actor-restarts",
        "0",
        "--no-data-timeout-s",
        "5",
        log=log,
    )
    try:
        wait_for(lambda: last(logdir).get("learner_steps", 0) > 0, 90, "training", proc, log)
        for pid in actors_under(proc.pid):
            os.kill(pid, signal.SIGKILL)
        code = proc.wait(30)
        assert code != 0
        assert "every local actor failed" in log.read_text() or "no trajectory arrived" in log.read_text()
    finally:
        stop(proc)


@pytest.mark.process
def test_learner_without_actors_says_why(tmp_path):
    log = tmp_path / "log"
    port = free_port_pair()
    proc = cli(
        "learner",
        *LEARNER,
        "--listen",
        f"tcp://127.0.0.1:{port}",
        "--logdir",
        str(tmp_path / "run"),
        "--actor-start-timeout-s",
        "3",
        log=log,
    )
    try:
        assert proc.wait(60) == 4
        assert "no trajectory arrived within actor_start_timeout_s=3 s" in log.read_text()
    finally:
        stop(proc)


def _sub(port):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port + 1}")
    return sub


def test_late_subscriber_gets_weights_at_once(tmp_path):
    """A subscriber that joins a second after the first publication gets the weights at once, long before the
    republish interval: its subscription triggers them. The learner serves in this test's loop."""
    port = free_port_pair()
    cfg, spec = inprocess.configuration(
        tmp_path, *LEARNER, "--listen", f"tcp://127.0.0.1:{port}", "--republish-interval-s", "30"
    )

    async def scenario():
        async with inprocess.serving(cfg, spec):
            await asyncio.sleep(1.0)  # join late on purpose: the first publication is long gone
            sub = _sub(port)
            try:
                t0 = time.monotonic()
                assert await asyncio.to_thread(sub.poll, 3000), "no weights within 3 s"
                assert time.monotonic() - t0 < 1.5  # long before the 30 s republish interval
                return wire.decode_weights(sub.recv(), 1 << 30)
            finally:
                sub.close(0)

    msg = asyncio.run(scenario())
    assert msg.version == 0 and msg.run_info["env_id"] == "CartPole-v1"


@pytest.mark.process
def test_learner_restart_with_surviving_external_actors(tmp_path):
    port = free_port_pair()
    logdir, llog, alog = tmp_path / "run", tmp_path / "learner.log", tmp_path / "actors.log"
    args = [
        "learner",
        *LEARNER,
        "--listen",
        f"tcp://127.0.0.1:{port}",
        "--logdir",
        str(logdir),
        "--total-env-steps",
        "100000000",
        "--checkpoint-interval-s",
        "1",
    ]
    learner = cli(*args, log=llog)
    actors = cli(
        "actor", "--learner", f"tcp://127.0.0.1:{port}", "--num-actors", "2", "--envs-per-actor", "2", *CAPPED_ACTOR,
        log=alog,
    )  # fmt: skip
    try:
        wait_for(lambda: last(logdir).get("learner_steps", 0) > 0, 90, "training", learner, llog)
        wait_for(lambda: checkpoint.list_checkpoints(logdir), 30, "a periodic checkpoint", learner, llog)
        actor_pids = actors_under(actors.pid)
        learner.kill()  # SIGKILL: no goodbye to the actors
        learner.wait()
        before = last(logdir)["learner_steps"]
        rows_before_inc = last(logdir)["incarnation"]
        learner = cli(*args, "--resume", str(logdir), log=tmp_path / "learner2.log")
        wait_for(
            lambda: (
                last(logdir).get("trajectories_received", 0) > 0 and last(logdir).get("learner_steps", 0) > before + 5
            ),
            90,
            "training after the restart",
            learner,
            tmp_path / "learner2.log",
        )
        assert actors_under(actors.pid) == actor_pids, "the external actors were restarted"
        assert actors.poll() is None
        # What the actors had queued was acted with the first run's weights: dropped as another incarnation's,
        # never rejected (their versions are above the resumed learner's: they used to count as future_version).
        after = [r for r in read_metrics(logdir) if r["wall_s"] > 0 and r.get("incarnation") != rows_before_inc]
        assert after and all(r["messages_rejected"] == 0 for r in after), [r["messages_rejected"] for r in after]
    finally:
        stop(learner)
        stop(actors)


def test_resume_continues_counters_and_appends_metrics(tmp_path):
    """A resume (configured as `train --resume` configures it) continues the counters and appends to metrics.jsonl,
    with the first run's configuration. The learner serves in this test's loop, a real actor in a thread."""
    logdir = tmp_path / "run"
    cfg, spec = inprocess.configuration(tmp_path, *LEARNER, "--total-env-steps", "3000")
    asyncio.run(inprocess.train(cfg, spec))
    rows1 = read_metrics(logdir)
    end1 = rows1[-1]
    cfg, spec, state = inprocess.resumed(logdir, "--total-env-steps", "6000")
    asyncio.run(inprocess.train(cfg, spec, state=state))
    rows2 = read_metrics(logdir)
    assert rows2[: len(rows1)] == rows1  # appended, not rewritten
    new = rows2[len(rows1) :]
    assert new[0]["learner_steps"] >= end1["learner_steps"] and new[0]["episodes"] >= end1["episodes"]
    assert new[0]["wall_s"] > end1["wall_s"]
    assert new[-1]["env_steps_trained"] >= 6000 > end1["env_steps_trained"]
    assert new[-1]["policy_version"] == new[-1]["learner_steps"] > end1["learner_steps"]
    state = torch.load(checkpoint.list_checkpoints(logdir)[-1], weights_only=True)
    assert state["config"]["unroll_length"] == 10  # the first run's configuration was kept


def test_truncated_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    a = checkpoint.save(tmp_path, {"x": torch.arange(10)}, 100)
    b = checkpoint.save(tmp_path, {"x": torch.arange(20)}, 200)
    b.write_bytes(b.read_bytes()[:50])
    state, path = checkpoint.load_latest(tmp_path)
    assert path == a and state["x"].shape == (10,)


WRITER = """
import sys, torch
from impala_async.learner import checkpoint
checkpoint.save(sys.argv[1], {"x": torch.ones(64 << 20, dtype=torch.uint8) * 7}, 2)
"""


def _writing(directory) -> bool:
    """A temporary checkpoint file with bytes in it: a write under way (an empty one is the pre-opened file of a write
    not begun, which a start removes without counting)."""
    for p in directory.iterdir():
        try:
            if p.name.endswith(".tmp") and p.stat().st_size > 0:
                return True
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return False


@pytest.mark.process
def test_kill_during_checkpoint_write_keeps_the_previous(tmp_path):
    checkpoint.save(tmp_path, {"x": torch.arange(5)}, 1)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    try:
        wait_for(lambda: _writing(tmp_path), 60, "the write to start", writer)
        writer.kill()
        writer.wait()
    finally:
        if writer.poll() is None:
            writer.kill()
    if (tmp_path / "checkpoint-000000000002.pt").exists():
        pytest.skip("the writer finished before it could be killed")
    state, path = checkpoint.load_latest(tmp_path)
    assert path.name == "checkpoint-000000000001.pt" and state["x"].tolist() == [0, 1, 2, 3, 4]
    assert checkpoint.remove_partial(tmp_path) == 1
