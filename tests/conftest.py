import compileall
import getpass
import os
import subprocess
import tempfile
from pathlib import Path

import forkserver
import psutil
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

# torch writes its inductor cache's folder into os.environ the first time it looks it up (a learner's first update
# does, as test_assembly's does in this process). Unpinned, the worker's environment then differs from its fork
# server's in a variable read at import, and every later process of that worker paid a fresh interpreter
# (tests/procutil.py, _forkable). Pinned here to torch's own default, before any fork server starts.
_INDUCTOR_DEFAULT = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _INDUCTOR_DEFAULT)


@pytest.fixture(autouse=True)
def _import_time_environment_kept():
    """A test that leaves a variable read at import changed in this worker's environment (torch writing one as it
    runs, a test setting one without monkeypatch) would send every later process of the worker through a fresh
    interpreter, silently (tests/procutil.py, _forkable): that test fails here instead, naming the variable."""
    yield
    if forkserver.started():  # the server's environment is the reference once there is one
        import procutil

        differences = procutil.import_time_differences(dict(os.environ))
        assert not differences, f"this test left the environment's import-time variables changed: {differences}"


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
_CPU_BEFORE = pytest.StashKey[float]()


def _counting(init):
    def counted(self, *args, **kwargs):
        argv = args[0] if args else kwargs.get("args")
        if not (isinstance(argv, list) and _SERVER in argv):  # the fork server is the suite's, not a test's
            _popen_started[0] += 1
        init(self, *args, **kwargs)

    return counted


subprocess.Popen.__init__ = _counting(subprocess.Popen.__init__)  # type: ignore[method-assign]
forkserver.Forked.__init__ = _counting(forkserver.Forked.__init__)  # type: ignore[method-assign]


def _cpu_s() -> float:
    """CPU seconds (user + system) of this worker, the processes it has reaped, and the fork server with the processes
    it has reaped: the CLI processes a test starts and theirs (train's zygote and actors, rank 1) once they ended."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    if forkserver._client:
        try:
            c = psutil.Process(forkserver._client[0].server.pid).cpu_times()
            total += c.user + c.system + c.children_user + c.children_system
        except psutil.Error:
            pass
    return total


def pytest_collection_modifyitems(items):
    """Each module's users of its own module-scoped fixtures run last in it (otherwise in file order), so that such a
    fixture (a learner training with an actor: a core and a half) ends with its last user instead of running on
    through the module's other tests (test_misleading's learner outlived its users by five tests that start
    processes of their own; BENCHMARKS.md, section 20). The order is the same in every xdist worker."""
    module_rank: dict[str, int] = {}
    for item in items:
        module_rank.setdefault(item.nodeid.split("::")[0], len(module_rank))
    items.sort(key=lambda item: (module_rank[item.nodeid.split("::")[0]], _uses_own_module_fixture(item)))


def _uses_own_module_fixture(item) -> bool:
    module = item.nodeid.split("::")[0]
    info = getattr(item, "_fixtureinfo", None)  # pytest's own; without it the order stays the file's
    for name in getattr(info, "names_closure", ()):
        defs = info.name2fixturedefs.get(name)
        if defs and defs[-1].scope == "module" and defs[-1].baseid == module:
            return True
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[_POPEN_BEFORE] = _popen_started[0]
    item.stash[_CPU_BEFORE] = _cpu_s()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown" and _CPU_BEFORE in item.stash:
        report.user_properties.append(("cpu_s", _cpu_s() - item.stash[_CPU_BEFORE]))
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
    _cpu_summary(terminalreporter)


def _cpu_summary(terminalreporter, shown: int = 25) -> None:
    """The suite's CPU by test, beside each test's wall time: on two cores a test that holds both for its whole
    time costs the run twice what a waiting one does. A test's CPU is its own process tree's once reaped (so a module
    fixture's learner counts where it ends), and fairly level on a busy machine where wall time is not."""
    wall_s: dict[str, float] = {}
    cpu_s: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if isinstance(r, pytest.TestReport):
                wall_s[r.nodeid] = wall_s.get(r.nodeid, 0.0) + r.duration
                cpu_s[r.nodeid] = cpu_s.get(r.nodeid, 0.0) + dict(r.user_properties).get("cpu_s", 0.0)
    if not any(cpu_s.values()):
        return
    total = f"{sum(cpu_s.values()):.1f} s of CPU in {sum(wall_s.values()):.1f} s of tests"
    terminalreporter.write_sep("=", f"most CPU ({total})")
    for nodeid in sorted(cpu_s, key=cpu_s.__getitem__, reverse=True)[:shown]:
        terminalreporter.write_line(f"{cpu_s[nodeid]:8.2f}s cpu {wall_s[nodeid]:8.2f}s wall  {nodeid}")
