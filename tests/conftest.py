import compileall
import os
import subprocess
from pathlib import Path

import forkserver
import pytest
import zmq

import impala_async
from impala_async.core.spec import TrajectorySpec

# Hundreds of processes a run (learners, actors, tools) each import the package. Where PYTHONDONTWRITEBYTECODE is set
# (this machine's environment, CI's too) none of them writes its compiled modules, so each compiled the package from
# source again: 0.3-0.4 s of CPU a process, measured with -X importtime. Compiled once here, they are read.
compileall.compile_dir(Path(impala_async.__file__).parent, quiet=1)

# The Docker image sets these for every command it runs; tests start many learners at once, each with ports of its
# own, so a shared default would make them collide (tests that want a metrics port pass --metrics-port themselves).
for _name in ("IMPALA_ASYNC_METRICS_PORT", "IMPALA_ASYNC_METRICS_HOST"):
    os.environ.pop(_name, None)


@pytest.fixture
def cartpole_spec():
    return TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=5)


@pytest.fixture
def atari_spec():
    return TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=4)


@pytest.fixture(scope="module")
def ctx():
    """A ZeroMQ context for a test module's sockets, destroyed (linger 0) after its last test."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


# Tests that start processes carry the ``process`` marker (``pytest -m "not process"`` runs the in-process suite in
# a fraction of the time): every subprocess.Popen a test starts, in its setup (a module's fixture too) or its body,
# and every process the fork server starts for it (tests/forkserver.py), is counted, and a test that started one
# unmarked fails, naming the marker. IMPALA_ASYNC_LIST_PROCESS_TESTS=PATH lists such tests in PATH instead of failing
# them (for marking a new file's tests in one pass).
_popen_started = [0]
_SERVER = str(Path(forkserver.__file__).resolve())
_POPEN_BEFORE = pytest.StashKey[int]()


def _counting(init):
    def counted(self, *args, **kwargs):
        argv = args[0] if args else kwargs.get("args")
        if not (isinstance(argv, list) and _SERVER in argv):  # the fork server is the suite's, not a test's
            _popen_started[0] += 1
        init(self, *args, **kwargs)

    return counted


subprocess.Popen.__init__ = _counting(subprocess.Popen.__init__)  # type: ignore[method-assign]
forkserver.Forked.__init__ = _counting(forkserver.Forked.__init__)  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[_POPEN_BEFORE] = _popen_started[0]
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    started = _popen_started[0] - item.stash.get(_POPEN_BEFORE, _popen_started[0])
    if call.when == "call" and started:
        report.user_properties.append(("processes_started", started))  # summed below, across xdist workers
    if call.when != "call" or not started or item.get_closest_marker("process") is not None:
        return
    listing = os.environ.get("IMPALA_ASYNC_LIST_PROCESS_TESTS")
    if listing:
        with open(listing, "a") as f:
            f.write(f"{item.nodeid}\n")
    elif report.passed:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} started {started} process(es) without the process marker: add @pytest.mark.process "
            "(tests/conftest.py)"
        )


def pytest_terminal_summary(terminalreporter):
    """How many processes the tests started themselves (their setup and body; not the processes those started, such
    as train's actors): each pays the interpreter and ``import torch``, most of the suite's time (BENCHMARKS.md,
    section 20)."""
    counts = [
        dict(r.user_properties).get("processes_started", 0)
        for key in ("passed", "failed")
        for r in terminalreporter.stats.get(key, [])
        if getattr(r, "when", "") == "call"
    ]
    if any(counts):
        tests = sum(1 for c in counts if c)
        terminalreporter.write_line(f"processes started by the tests themselves: {sum(counts)}, by {tests} tests")
