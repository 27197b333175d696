"""actors/procs.py's supervisor on real child processes (small Python programs standing in for actors): a crash loop
backs off and is given up, an actor that ran long enough before it died is neither."""

from __future__ import annotations

import sys
import time

import pytest

from impala_async.actors.procs import ActorProcesses


def program(run_s: float):
    """argv of a child that beats once, runs ``run_s`` seconds and exits 1 (as an actor that crashed)."""
    code = f"import os, sys, time; os.write(int(sys.argv[1]), b'.'); time.sleep({run_s}); sys.exit(1)"
    return lambda index, heartbeat_fd, parent_pid: [sys.executable, "-c", code, str(heartbeat_fd)]


def supervise(procs: ActorProcesses, until, timeout_s: float) -> float:
    """Call procs.check() every 10 ms until ``until()`` holds; the seconds it took."""
    t0 = time.monotonic()
    procs.start()
    try:
        while not until():
            assert time.monotonic() - t0 < timeout_s, (
                f"not within {timeout_s} s: {procs.restarts_total} restarts, gave up {procs.gave_up}"
            )
            procs.check()
            time.sleep(0.01)
        return time.monotonic() - t0
    finally:
        procs.stop(5.0)


@pytest.mark.process
def test_a_crash_loop_backs_off_and_is_given_up():
    """Exits right after start: restarted after 0.1, 0.2, 0.4 s, then given up at max_restarts 3 (the delays alone
    take 0.7 s, so a supervisor without backoff would be far quicker)."""
    procs = ActorProcesses(program(0.0), 1, max_restarts=3, backoff_s=0.1, max_backoff_s=10.0, stable_after_s=5.0)
    took = supervise(procs, lambda: procs.gave_up == [0], timeout_s=30)
    assert procs.restarts_total == 3
    assert took >= 0.7


@pytest.mark.process
def test_an_actor_that_ran_long_enough_starts_its_count_over():
    """Exits after 0.3 s of running, with stable_after_s 0.2: each exit is no crash loop, so the delay stays at the
    1st (0.1 s) and max_restarts 3 is never reached; 8 restarts take about 8 x 0.4 s. Counted as failures in a row
    (the old supervisor) they would have been given up after 3, and waited 0.1 x (1 + 2 + ... + 128) = 25.5 s."""
    procs = ActorProcesses(program(0.3), 1, max_restarts=3, backoff_s=0.1, max_backoff_s=60.0, stable_after_s=0.2)
    took = supervise(procs, lambda: procs.restarts_total >= 8 or procs.gave_up, timeout_s=60)
    assert procs.gave_up == [], "an actor that ran stable_after_s before each exit was given up"
    assert took < 15, f"8 restarts of a stable actor took {took:.1f} s: the backoff did not start over"
