"""The fork server (tests/forkserver.py) gives the tests' processes what a fresh interpreter would: the arguments,
environment, working directory and output they were given, the exit code or signal death subprocess reports, the
interpreter's exit (non-daemon threads joined, atexit run) and fresh per-process state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from procutil import cli, run_cli, wait_for

pytestmark = pytest.mark.process

SCRIPT = """
import atexit, json, os, sys, threading, time
import numpy
import impala_async.cli

mode = sys.argv[1]
if mode == "report":
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "var": os.environ.get("FS_VAR"),
                      "draw": numpy.random.randint(1 << 30), "pid": os.getpid(),
                      "started": impala_async.cli.START_MONOTONIC}))
    print("to stderr", file=sys.stderr)
    sys.exit(3)
if mode == "wait":
    open(sys.argv[2], "w").close()
    threading.Event().wait()
if mode == "raise":
    raise RuntimeError("boom")
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "exit-work":
    done = sys.argv[2]
    atexit.register(lambda: open(done, "a").write("atexit\\n"))
    threading.Thread(target=lambda: (time.sleep(0.3), open(done, "a").write("thread\\n"))).start()
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(SCRIPT)
    return path


def test_a_child_gets_its_arguments_environment_directory_and_output(tmp_path, script):
    work = tmp_path / "work"
    work.mkdir()
    runs, asked = [], []
    for i in range(2):
        asked.append(time.monotonic())  # the system's monotonic clock, the same in every process
        runs.append(run_cli("report", script=script, cwd=work, env=dict(os.environ, FS_VAR=str(i)), timeout=60))
    said = [json.loads(r.stdout) for r in runs]
    for i, (r, s) in enumerate(zip(runs, said, strict=True)):
        assert r.returncode == 3 and r.stderr == "to stderr\n", r
        assert s["argv"] == [str(script), "report"] and s["cwd"] == str(work) and s["var"] == str(i), s
        assert s["path0"] == str(script.parent), "sys.path[0] is the script's folder, as python SCRIPT sets it"
        assert s["started"] > asked[i], "the CLI's start time (wall_s counts from it) is the child's, not the server's"
    assert said[0]["pid"] != said[1]["pid"] and said[0]["draw"] != said[1]["draw"], "NumPy's generator is reseeded"


def test_signals_and_deaths_are_reported_as_subprocess_reports_them(tmp_path, script):
    ready = tmp_path / "ready"
    proc = cli("wait", str(ready), script=script, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(ready.exists, 60, "the child to start", proc)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.1)
    assert proc.poll() is None and os.getpgid(proc.pid) > 0  # a real process of its own
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    proc.kill()  # after its end: nothing, and no error
    raised = run_cli("raise", script=script, timeout=60)
    assert raised.returncode == 1 and "RuntimeError: boom" in raised.stderr and "Traceback" in raised.stderr
    assert run_cli("interrupt", script=script, timeout=60).returncode == -signal.SIGINT


def test_the_interpreters_exit_joins_threads_and_runs_atexit(tmp_path, script):
    done = tmp_path / "done"
    t0 = time.monotonic()
    out = run_cli("exit-work", str(done), script=script, timeout=60)
    assert out.returncode == 0, out.stderr
    assert done.read_text().split() == ["thread", "atexit"], "the thread joined first, then atexit, as at exit"
    assert time.monotonic() - t0 >= 0.3


def test_a_variable_read_at_import_is_compared_with_the_servers_not_the_workers(monkeypatch):
    """The server's modules were imported under the worker's environment as it was when the server started: a
    variable read at import that the worker sets later (a test's monkeypatch) needs a real interpreter, even though
    the child's environment is the worker's."""
    import procutil

    if os.environ.get("IMPALA_ASYNC_TEST_FORK", "1") == "0":
        pytest.skip("IMPALA_ASYNC_TEST_FORK=0: no fork server")
    differences = procutil.import_time_differences(dict(os.environ))  # starts the server (if not yet)
    assert not differences, f"this worker's environment changed since its fork server started: {differences}"
    monkeypatch.setenv("IMPALA_ASYNC_METRICS_HOST", "127.0.0.2")  # read at import: a config default
    assert not procutil._forkable(dict(os.environ))
