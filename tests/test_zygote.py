"""The actors' zygote (impala_async/actors/zygote.py): train's actors are forked from it, each a process of its own
that looks like what it runs; a zygote that dies costs a restart of the actors, as fresh interpreters, not the run."""

from __future__ import annotations

import os
import signal
import threading

import psutil
import pytest
from procutil import (
    CAPPED_ACTORS,
    TINY,
    actors_under,
    cli,
    descendants,
    gone,
    read_metrics,
    stop,
    tail,
    wait_for,
    words,
)

from impala_async.actors.zygote import Zygote
from impala_async.config import ActorOptions


def _updates(logdir) -> int:
    rows = read_metrics(logdir)
    return rows[-1].get("learner_steps", 0) if rows else 0


@pytest.mark.process
def test_actors_are_forked_from_the_zygote_and_outlive_its_death(tmp_path):
    logdir, log = tmp_path / "run", tmp_path / "log"
    flags = [*TINY, "--num-actors", "2", *CAPPED_ACTORS, "--total-env-steps", "100000000"]  # not flat out
    proc = cli("train", *flags, "--logdir", str(logdir), log=log)
    try:
        wait_for(lambda: _updates(logdir) > 0, 90, "training", proc, log)
        learner = psutil.Process(proc.pid)
        zygotes = [p for p in learner.children() if "zygote" in words(p)]
        assert len(zygotes) == 1, [words(p) for p in learner.children()]
        zygote = zygotes[0]
        actors = [psutil.Process(pid) for pid in actors_under(proc.pid)]
        assert len(actors) == 2
        for actor in actors:
            cmd = words(actor)
            assert actor.ppid() == zygote.pid, "an actor not forked from the zygote"
            assert cmd[cmd.index("--parent-pid") + 1] == str(zygote.pid)  # it dies with its parent, the zygote
            assert os.getsid(actor.pid) == actor.pid, "an actor in the learner's session gets the terminal's Ctrl-C"
            assert os.readlink(f"/proc/{actor.pid}/fd/0") == "/dev/null"
            heartbeat = int(cmd[cmd.index("--heartbeat-fd") + 1])
            assert os.readlink(f"/proc/{actor.pid}/fd/{heartbeat}").startswith("pipe:"), "no heartbeat pipe there"
        assert sorted(int(words(a)[words(a).index("--index") + 1]) for a in actors) == [0, 1]

        zygote.kill()  # an OOM kill, an operator's mistake: its actors die with it (PR_SET_PDEATHSIG)
        assert gone([a.pid for a in actors], 10.0), "actors outlived their zygote"
        wait_for(lambda: len(actors_under(proc.pid)) == 2, 60, "the actors restarted", proc, log)
        restarted = [psutil.Process(pid) for pid in actors_under(proc.pid)]
        assert all(a.ppid() == proc.pid for a in restarted), "restarted without a zygote: fresh interpreters"
        before = _updates(logdir)
        wait_for(lambda: _updates(logdir) > before + 5, 90, "training after the zygote died", proc, log)
        assert "zygote" in log.read_text()  # said in the log

        kids = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, tail(log)
        assert gone(kids, 5.0), "processes left behind"
    finally:
        stop(proc)


def test_a_supervisor_running_threads_starts_fresh_interpreters():
    """A fork copies one thread and the locks the others held: with a Python thread running there is no zygote."""
    stop_event = threading.Event()
    thread = threading.Thread(target=stop_event.wait, daemon=True)
    thread.start()
    try:
        assert Zygote.fork() is None
    finally:
        stop_event.set()
        thread.join(5)


def test_which_actors_fork():
    assert ActorOptions().forks()
    assert not ActorOptions(actor_start="spawn").forks()
    assert not ActorOptions(device="cuda:0").forks(), "a child may not use CUDA in a process its parent touched it in"
