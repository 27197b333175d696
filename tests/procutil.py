"""Running the real CLI in tests: start it, wait on conditions (never sleep-and-hope), and clean up."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import psutil

from impala_async.learner.reports import metrics

METRICS_FIELDS = (
    "wall_s",
    "env_steps",
    "learner_steps",
    "sps",
    "episode_return_mean",
    "episodes",
    "policy_version",
    "policy_lag_min",
    "policy_lag_avg",
    "policy_lag_max",
    "trajectories_received",
    "trajectories_rejected",
    "loss_pg",
    "loss_baseline",
    "entropy",
    "grad_norm",
    "rho_mean",
    "rho_clipped_frac",
)


def documented_metrics() -> set[str]:
    """Every key docs/metrics.md lists, with `<reason>` expanded to the reasons the code knows."""
    import re

    from impala_async.core import wire
    from impala_async.learner.ranks import watch as rankwatch
    from impala_async.learner.transport import guard

    text = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    keys = set()
    for cell in re.findall(r"^\| (`[^|]+`) \|", text, flags=re.M):
        for key in re.findall(r"`([a-z0-9_<>]+)`", cell):
            if key.startswith("rejected_<"):
                keys |= {f"rejected_{r}" for r in wire.REJECT_REASONS}
            elif key.startswith("rank_values_rejected_<"):
                keys |= {f"rank_values_rejected_{r}" for r in rankwatch.REJECT_REASONS}
            elif key.startswith("connections_cut_<"):
                keys |= {f"connections_cut_{r}" for r in guard.CUT_REASONS}
            else:
                keys.add(key)
    return keys


# Actors that a test needs only to keep training going, capped: uncapped, a CartPole actor and its learner keep a core
# and a half busy through a test (a module's learner lives through several), beside the other xdist worker. At 1,000
# env steps/s a learner and its actor of 2 environments take 0.29 of a core (0.50 at 2,000; BENCHMARKS.md, section 20).
ACTOR_ENV_STEPS_PER_S = 1000.0
CAPPED_ACTOR = ("--max-env-steps-per-s", str(ACTOR_ENV_STEPS_PER_S))  # the `actor` command's flag
CAPPED_ACTORS = ("--actor-max-env-steps-per-s", str(ACTOR_ENV_STEPS_PER_S))  # the same for train's local actors

TINY = ["--config", str(Path(__file__).resolve().parent / "tiny.toml")]  # tests/tiny.toml: CartPole, 1 actor, B 4
ENDLESS = [*TINY, "--total-env-steps", "100000000", "--lr-schedule", "constant", *CAPPED_ACTORS]  # until stopped
TINY_PONG = ["--config", str(Path(__file__).resolve().parent / "tiny-pong.toml")]  # 400 steps of Pong, B 2
# The `learner` command's endless CartPole (T 10, B 4, four reports a second), for actors a test attaches itself.
CARTPOLE_LEARNER = ["--env", "CartPole-v1", "--unroll-length", "10", "--batch-size", "4", "--report-interval-s", "0.25",
                    "--total-env-steps", "100000000"]  # fmt: skip


def cli(*args: str, log: Path | None = None, env: dict | None = None, preexec_fn=None, script=None, python=None, **kw):
    """``python -m impala_async *args`` (``python SCRIPT *args`` given a script), stdout and stderr to ``log`` unless
    ``stdout``/``stderr`` are given (discarded without either): forked from this worker's fork server
    (tests/forkserver.py: no `import torch` a process); a real interpreter where the process must run code before
    (``preexec_fn``), where ``env`` changes how modules import, where ``python`` names another interpreter or, with
    ``cwd``, the checkout to run (the attacks measure any checkout), or with IMPALA_ASYNC_TEST_FORK=0."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    out = open(log, "w") if log else subprocess.DEVNULL
    kw = {"stdout": out, "stderr": subprocess.STDOUT, **kw}
    elsewhere = python is not None and (python != sys.executable or kw.get("cwd"))
    try:
        if preexec_fn is None and not elsewhere and _forkable(env):
            return forkserver.client().spawn(list(args), script=script, env=env, **kw)
        return subprocess.Popen(_argv(script, args, python), env=env, preexec_fn=preexec_fn, **kw)
    finally:
        if log:
            out.close()  # type: ignore[union-attr]


def run_cli(*args: str, timeout: float, env: dict | None = None, cwd=None, script=None) -> subprocess.CompletedProcess:
    """subprocess.run(``python -m impala_async *args``, capture_output=True, text=True, timeout=...) through
    :func:`cli`'s fork server (``python SCRIPT *args`` given a script): the process is killed at the timeout, and
    TimeoutExpired raised."""
    env = dict(os.environ if env is None else env)
    if not _forkable(env):
        return subprocess.run(_argv(script, args), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    proc = forkserver.client().spawn(
        list(args), script=script, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# Variables read when modules are imported (IMPALA_ASYNC_METRICS_PORT sets a config default): a process whose
# environment sets them otherwise than this one's gets an interpreter of its own, as the fork server's modules were
# imported under this process's values.
_IMPORT_TIME = ("PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "CUDA", "TORCH", "PYTORCH", "KMP_", "NUMEXPR_", "GYM",
                "IMPALA_ASYNC_METRICS_")  # fmt: skip


def _argv(script, args, python=None) -> list[str]:
    return [python or sys.executable, *([str(script)] if script else ["-m", "impala_async"]), *args]


def _forkable(env: dict) -> bool:
    if os.environ.get("IMPALA_ASYNC_TEST_FORK", "1") == "0":
        return False
    return not import_time_differences(env)


def import_time_differences(env: dict) -> dict[str, tuple]:
    """{variable: (env's value, the fork server's)} for the variables read at import where they differ."""
    imported = forkserver.client().env  # what the server's modules were imported under (not this worker's now)
    keys = {k for k in (*env, *imported) if k.startswith(_IMPORT_TIME) and k != "PYTHONUNBUFFERED"}
    return {k: (env.get(k), imported.get(k)) for k in sorted(keys) if env.get(k) != imported.get(k)}


def read_metrics(logdir: Path) -> list[dict]:
    return metrics.read_metrics(Path(logdir) / "metrics.jsonl")


def wait_for(cond, timeout_s: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    """Poll cond() until it returns something truthy; fail with the log's tail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}\n{tail(log)}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{tail(log)}")


def tail(log: Path | None, n: int = 40) -> str:
    if log is None or not Path(log).exists():
        return ""
    return "\n".join(Path(log).read_text().splitlines()[-n:])


def descendants(pid: int) -> list[int]:
    return [p.pid for p in _below(pid)]


def actors_under(pid: int) -> list[int]:
    """The actor processes below ``pid``: its children, or its zygote's (impala_async/actors/zygote.py)."""
    return [p.pid for p in _below(pid) if _is_actor(p)]


def _is_actor(p: psutil.Process) -> bool:
    """An 'impala_async actor' process, known by its command line (a forked actor's is set to its own), not ended."""
    try:
        cmd, status = words(p), p.status()
    except psutil.Error:
        return False
    return "impala_async" in cmd and "actor" in cmd and status != psutil.STATUS_ZOMBIE


def words(p: psutil.Process) -> list[str]:
    """A process's command line as words, however it was set (a title that setproctitle wrote is one string)."""
    return " ".join(p.cmdline()).split()


def _below(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def actor_pids() -> list[int]:
    """Every 'impala_async actor' process of this user, wherever it is in the process tree."""
    return [p.pid for p in psutil.process_iter() if _is_actor(p)]


def gone(pids, timeout_s: float) -> bool:
    """Whether every one of ``pids`` has ended (a zombie has) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if all(ended(p) for p in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: reaped, or a zombie (reaped any moment: its parent may be quick)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stop(proc: subprocess.Popen, timeout_s: float = 15) -> None:
    """Terminate a CLI process and everything it started (test cleanup)."""
    if proc.poll() is None:
        kids = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def get(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """(status, body) of GET http://127.0.0.1:port/path, or (0, why) when nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    except OSError as e:
        return 0, repr(e)
    finally:
        conn.close()


def scrape(port: int) -> dict:
    """{family name: family} of one /metrics scrape, parsed by prometheus_client's own parser."""
    from prometheus_client import parser

    status, body = get(port, "/metrics")
    assert status == 200, body
    return {f.name: f for f in parser.text_string_to_metric_families(body)}


def value(families: dict, name: str, **labels) -> float:
    """The sample ``name`` (a sample name: with _total, _bucket, _count ...) whose labels include ``labels``."""
    for family in families.values():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{name} {labels} not in the scrape")


def free_port() -> int:
    """A port free on 127.0.0.1 (for --metrics-port)."""
    return free_ports(1)


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free on 127.0.0.1 (for --listen and its default --publish)."""
    return free_ports(2)


def free_ports(n: int) -> int:
    """A port p such that p .. p + n - 1 are free on 127.0.0.1, from this worker's own block below the ephemeral
    range. A port the system handed out (bind to 0) is in the range every outgoing connection takes its local port
    from, so p + 1 could go to another test's connection before the learner bound it (seen: "cannot bind ...
    --publish: Address already in use"); below the range only the tests choose ports, each xdist worker in its own
    block, and a worker moves through its block rather than handing out a port again at once."""
    low, high = _port_block()
    for _ in range(high - low):
        port = _next_port[0]
        _next_port[0] = port + n if port + 2 * n <= high else low
        if all(_bindable(p) for p in range(port, port + n)):
            return port
    raise RuntimeError(f"no {n} free consecutive ports in {low}-{high}")


def _port_block() -> tuple[int, int]:
    """[low, high) of this process's ports: the range 10000 to the ephemeral range's start, split among workers."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = max(16, (ephemeral_low - 10000) // max(1, workers))
    low = 10000 + index * size
    if not _next_port:
        _next_port.append(low + (os.getpid() * 7919) % (size - 16))  # two pytest runs at once start apart
    return low, low + size


_next_port: list[int] = []


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def finish(proc: subprocess.Popen, log: Path | None, timeout_s: float, code: int = 0) -> None:
    """Wait up to ``timeout_s`` for ``proc`` to exit with ``code``; stop it (and what it started) whatever happens,
    and fail with the log's tail otherwise."""
    try:
        got = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        got = f"no exit within {timeout_s:g} s"
    finally:
        stop(proc)
    assert got == code, f"exit {got}, expected {code}\n{tail(log, 80)}"


class LearnerProcess:
    """`impala-async learner` (``flags``, then ``extra``) on two free loopback ports, logging to ``tmp/NAME.log`` with
    its logdir ``tmp/NAME``; one real actor of 2 environments once :meth:`attach_actor` is called. Its metrics are
    read back and every wait is bounded and names what it waited for."""

    def __init__(self, tmp: Path, *extra: str, flags=CARTPOLE_LEARNER, name: str = "learner", preexec_fn=None):
        self.port = free_port_pair()
        self.host = "127.0.0.1"
        self.listen, self.weights = f"tcp://{self.host}:{self.port}", f"tcp://{self.host}:{self.port + 1}"
        self.logdir, self.log = tmp / name, tmp / f"{name}.log"
        self.actor, self.actor_log = None, tmp / f"{name}-actor.log"
        self.proc = cli(
            "learner", *flags, "--listen", self.listen, "--logdir", str(self.logdir), *extra, log=self.log,
            preexec_fn=preexec_fn,
        )  # fmt: skip

    def attach_actor(self, *extra: str, max_env_steps_per_s: float = ACTOR_ENV_STEPS_PER_S) -> None:
        """The actor, at most ``max_env_steps_per_s`` (0: as fast as the learner takes them)."""
        cap = ["--max-env-steps-per-s", str(max_env_steps_per_s)]
        self.actor = cli("actor", "--learner", self.listen, "--envs-per-actor", "2", *cap, *extra, log=self.actor_log)
        self.wait(lambda r: r["learner_steps"] > 0, "the learner to train", 120)

    def rows(self) -> list[dict]:
        return read_metrics(self.logdir)

    def last(self) -> dict:
        rows = self.rows()
        return rows[-1] if rows else {}

    def wait(self, cond, what: str, timeout_s: float = 30.0) -> dict:
        """The first metrics record (the latest at each look) for which ``cond(record)`` holds."""

        def check():
            row = self.last()
            return row if row and cond(row) else None

        return wait_for(check, timeout_s, what, self.proc, self.log)

    def trains_on(self, what: str, max_policy_lag: int | None = None) -> dict:
        """Training goes on and the real actor's messages are accepted (and, given ``max_policy_lag``, it acts with
        weights at most that many updates old)."""
        row = self.last()
        got = self.wait(
            lambda r: (
                r["learner_steps"] > row["learner_steps"] + 2
                and r["trajectories_received"] > row["trajectories_received"]
            ),
            f"training to go on after {what}",
        )
        assert self.actor is not None and self.actor.poll() is None, tail(self.actor_log)
        lag = got["policy_lag_max"]
        assert max_policy_lag is None or lag is None or lag <= max_policy_lag, f"the actor's weights are old: {got}"
        return got

    def close(self) -> None:
        if self.actor is not None:
            stop(self.actor)
        stop(self.proc)
