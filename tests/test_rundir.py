"""One learner per run directory (learner/rundir.py): the lock in process, against a killed holder, and a second real
`train --resume DIR` refused beside a live learner without touching its files."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
from procutil import ENDLESS, cli, read_metrics, run_cli, stop, tail, wait_for

from impala_async.learner.rundir import LOCK_FILE, LogdirInUse, RunDirLock

SMALL = [*ENDLESS, "--report-interval-s", "0.2"]


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path):
    first = RunDirLock(tmp_path / "run")
    with pytest.raises(LogdirInUse, match=f"PID {os.getpid()}"):
        RunDirLock(tmp_path / "run")  # another open file description: flock refuses it, in this process too
    first.release()
    RunDirLock(tmp_path / "run").release()
    assert (tmp_path / "run" / LOCK_FILE).stat().st_mode & 0o777 == 0o600


def _hold(path, ready):
    RunDirLock(path)
    ready.set()
    signal.pause()


@pytest.mark.process
def test_the_kernel_releases_the_lock_of_a_killed_holder(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold, args=(tmp_path, ready))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(LogdirInUse, match=f"PID {holder.pid}"):
            RunDirLock(tmp_path)
    finally:
        holder.kill()
        holder.join(30)
    RunDirLock(tmp_path).release()  # no stale lock after a SIGKILL


@pytest.mark.process
def test_a_second_learner_is_refused_beside_a_live_one(tmp_path):
    logdir, log = tmp_path / "run", tmp_path / "first.log"
    first = cli("train", *SMALL, "--checkpoint-interval-s", "1", "--logdir", str(logdir), log=log)
    try:
        wait_for(lambda: list(logdir.glob("checkpoint-*.pt")), 120, "a checkpoint", first, log)
        config_before = (logdir / "config.json").read_bytes()
        second = run_cli("train", "--resume", str(logdir), "--total-env-steps", "100000000", timeout=120)
        assert second.returncode == 1, second.stderr
        last = second.stderr.strip().splitlines()[-1]
        assert f"in use by another learner (PID {first.pid})" in last and "Traceback" not in second.stderr, last
        assert (logdir / "config.json").read_bytes() == config_before, "the refused learner wrote into the run"
        rows = len(read_metrics(logdir))
        wait_for(lambda: len(read_metrics(logdir)) > rows + 5, 60, "the first learner going on", first, log)
        steps = [r["env_steps"] for r in read_metrics(logdir)]
        assert steps == sorted(steps), "metrics.jsonl interleaved"
    finally:
        stop(first)
    assert first.returncode == 0, tail(log)
