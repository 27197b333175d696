"""/metrics and /healthz (README, Operations; docs/metrics.md, Prometheus): the real CLI as subprocesses, scraped over
real HTTP, and the bounded HTTP server (ops/httpd.py) itself."""

from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from procutil import (
    TINY,
    actors_under,
    cli,
    free_port,
    free_port_pair,
    get,
    run_cli,
    scrape,
    stop,
    tail,
    value,
    wait_for,
)

from impala_async import config
from impala_async.core import wire
from impala_async.ops import httpd

FLAGS = [
    *TINY,
    "--report-interval-s",
    "0.5",
    "--total-env-steps",
    "100000000",
]


# Families (names without _total; an info metric is exposed as a gauge NAME_info) and their types.
EXPECTED_TYPES = {
    "impala_async_env_steps": "counter",
    "impala_async_env_steps_trained": "counter",
    "impala_async_learner_steps": "counter",
    "impala_async_trajectories_received": "counter",
    "impala_async_trajectories_dropped": "counter",
    "impala_async_received_bytes": "counter",
    "impala_async_episodes": "counter",
    "impala_async_rejected_messages": "counter",
    "impala_async_checkpoint_failures": "counter",
    "impala_async_updates_skipped_nonfinite": "counter",
    "impala_async_policy_lag_versions": "histogram",
    "impala_async_rho_ratio": "histogram",
    "impala_async_ring_ready_batches": "gauge",
    "impala_async_ring_slots": "gauge",
    "impala_async_connections": "gauge",
    "impala_async_loop_lag_p99_seconds": "gauge",
    "impala_async_loss_pg": "gauge",
    "impala_async_entropy_nats": "gauge",
    "impala_async_grad_norm": "gauge",
    "impala_async_episode_return_mean": "gauge",
    "impala_async_actors_alive": "gauge",
    "impala_async_run_info": "gauge",
}


def documented(table: str) -> set[str]:
    """Family names docs/metrics.md, Prometheus, lists for the learner or the actor supervisor (without _total)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    learner, actors = text[text.index("# Prometheus") :].split("## Actor supervisor")
    cells = re.findall(r"^\| (impala_async_[a-z0-9_, ]+) \|", learner if table == "learner" else actors, flags=re.M)
    return {name.removesuffix("_total") for cell in cells for name in cell.split(", ")}


def exported(families: dict) -> set[str]:
    return {name for name in families if name.startswith("impala_async_")}


def healthcheck(port: int) -> subprocess.CompletedProcess:
    """`impala-async healthcheck` with the port from the environment only, as the Docker HEALTHCHECK runs it."""
    env = dict(os.environ, IMPALA_ASYNC_METRICS_PORT=str(port))
    env.pop("IMPALA_ASYNC_METRICS_HOST", None)
    return run_cli("healthcheck", env=env, timeout=30)


@pytest.mark.process
def test_scrapes_move_while_training_and_rejections_count_by_reason(tmp_path):
    port, mport = free_port_pair(), free_port()
    listen = f"tcp://127.0.0.1:{port}"
    log = tmp_path / "log"
    proc = cli(
        "train", *FLAGS, "--listen", listen, "--metrics-port", str(mport), "--logdir", str(tmp_path / "run"), log=log
    )
    ctx = zmq.Context()
    try:
        wait_for(lambda: get(mport, "/healthz")[0] == 200, 60, "/healthz 200", proc, log)
        wait_for(lambda: value(scrape(mport), "impala_async_learner_steps_total") > 0, 60, "an update", proc, log)
        first = scrape(mport)
        kinds = {name: f.type for name, f in first.items()}
        for name, kind in EXPECTED_TYPES.items():
            assert kinds.get(name) == kind, (name, kinds.get(name))
        assert "impala_async_sps" not in kinds  # a rate: PromQL's rate() of env_steps_total
        assert exported(first) == documented("learner"), (
            f"exported, not in docs/metrics.md: "
            f"{sorted(exported(first) - documented('learner'))}; "
            f"documented, not exported: "
            f"{sorted(documented('learner') - exported(first))}"
        )
        reasons = {s.labels["reason"] for s in first["impala_async_rejected_messages"].samples}
        assert reasons == set(wire.REJECT_REASONS)  # every reason there from the start, at 0
        assert all(s.value == 0 for s in first["impala_async_rejected_messages"].samples)
        assert value(first, "impala_async_connections", socket="trajectories") >= 1

        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(listen)
        for _ in range(3):
            push.send(b"\x00 not a trajectory")
        push.send_multipart([b"two", b"frames"])

        def moved():
            now = scrape(mport)
            done = (
                value(now, "impala_async_rejected_messages_total", reason="malformed") >= 3
                and value(now, "impala_async_rejected_messages_total", reason="multipart") >= 1
                and value(now, "impala_async_env_steps_total") > value(first, "impala_async_env_steps_total")
                and value(now, "impala_async_policy_lag_versions_count")
                > value(first, "impala_async_policy_lag_versions_count")
            )
            return now if done else None

        second = wait_for(moved, 30, "the counters to move", proc, log)
        for name in (
            "impala_async_trajectories_received_total",
            "impala_async_received_bytes_total",
            "impala_async_learner_steps_total",
            "impala_async_rho_ratio_count",
        ):
            assert value(second, name) > value(first, name), name
        assert value(second, "impala_async_rejected_messages_total", reason="replay") == 0
        assert value(second, "impala_async_trajectories_rejected_total") >= 4
        # The histograms are cumulative: +Inf is the count, and every bucket at most the next one.
        buckets = [s.value for s in second["impala_async_policy_lag_versions"].samples if s.name.endswith("_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == value(second, "impala_async_policy_lag_versions_count")
        # --ring-batches 0 (auto) with batches of 4: room for the batch, pace's backlog and two more of the largest
        # message the learner accepts (256 CartPole trajectories): (4 + 256 + 512) / 4
        assert value(second, "impala_async_ring_slots") == 193
        status, body = get(mport, "/healthz")
        assert status == 200 and body.startswith("ok"), body
        assert get(mport, "/nothing")[0] == 404
        checked = healthcheck(mport)
        assert checked.returncode == 0 and "200 ok" in checked.stdout, checked
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, tail(log)
        assert get(mport, "/healthz")[0] == 0  # shut down with the learner
        assert healthcheck(mport).returncode == 1
    finally:
        ctx.destroy(linger=0)
        stop(proc)


# The learner, its training thread made to hang, or to fail, by a patched update: a genuine hang (as a deadlocked
# CUDA kernel or a stuck collective would hang it) and a genuine exception (as a CUDA out-of-memory would raise) in
# the real training thread of the real CLI in its own process. Patching from outside keeps test hooks out of the
# product; a signal would not do, as Python runs signal handlers on the main thread only.
SABOTAGED_CLI = """
import os, sys, threading
from impala_async import cli
from impala_async.learner import learn
mode, after, trigger = sys.argv[1], int(sys.argv[2]), sys.argv[3]
step, calls = learn.Learner.step, []
def sabotaged(self, batch):
    calls.append(1)
    if len(calls) > after or (trigger and os.path.exists(trigger)):
        if mode == "hang":
            threading.Event().wait()
        raise RuntimeError("sabotaged update")
    return step(self, batch)
learn.Learner.step = sabotaged
sys.exit(cli.main(sys.argv[4:]))
"""


def sabotaged(
    tmp_path, mode: str, mport: int, *flags: str, after: int = 5, trigger: Path | None = None
) -> tuple[subprocess.Popen, object]:
    """The sabotaged ``train``: its update hangs or raises after ``after`` updates, or once ``trigger`` exists."""
    log = tmp_path / f"{mode}.log"
    out = open(log, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SABOTAGED_CLI,
            mode,
            str(after),
            str(trigger or ""),
            "train",
            *FLAGS,
            "--metrics-port",
            str(mport),
            "--logdir",
            str(tmp_path / mode),
            *flags,
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    return proc, log


@pytest.mark.process
def test_healthz_turns_503_when_the_training_thread_hangs(tmp_path):
    mport = free_port()
    proc, log = sabotaged(tmp_path, "hang", mport, "--health-stale-s", "2", "--shutdown-timeout-s", "3")
    try:
        wait_for(lambda: get(mport, "/healthz")[0] == 200, 60, "/healthz 200 before the hang", proc, log)
        status, body = wait_for(lambda: (r := get(mport, "/healthz"))[0] == 503 and r, 60, "/healthz 503", proc, log)
        assert "training thread stuck" in body, body
        assert proc.poll() is None  # it hangs: the learner itself goes on (receiving, dropping the oldest batches)
        now = scrape(mport)  # the scrape still answers: the HTTP server needs neither thread
        assert value(now, "impala_async_healthy") == 0
        assert value(now, "impala_async_heartbeat_age_seconds", thread="trainer") > 2
        assert value(now, "impala_async_heartbeat_age_seconds", thread="receive") < 2
        assert value(now, "impala_async_learner_steps_total") == 5
        checked = healthcheck(mport)
        assert checked.returncode == 1 and "503 training thread stuck" in checked.stdout, checked
    finally:
        stop(proc, 20)


@pytest.mark.process
def test_healthz_says_503_when_the_training_thread_dies(tmp_path):
    """The training thread raises: the run stops (exit 1), and /healthz answers 503 naming the failure until the port
    closes at the end of the shutdown; never 200 after the failure. The update raises once this test has seen 200 (a
    fixed count of updates could all be done before the first 200: seen once on a quiet machine)."""
    mport, trigger = free_port(), tmp_path / "raise-now"
    proc, log = sabotaged(tmp_path, "raise", mport, after=10**9, trigger=trigger)
    try:
        wait_for(lambda: get(mport, "/healthz")[0] == 200, 60, "/healthz 200 before the failure", proc, log)
        trigger.touch()
        answers = []
        while proc.poll() is None:
            answers.append(get(mport, "/healthz", timeout_s=2))
            time.sleep(0.01)
        assert proc.returncode == 1, tail(log)
        after = [a for a in answers if a[0] != 200]
        assert all(a[0] in (0, 503) for a in after), after
        failed = [body for status, body in after if status == 503]
        # "training thread dead: ..." until the loop has taken the thread's stop request, "shutting down: training
        # failed: ..." from then on (seen: about 60 such answers, 10 ms apart, before the port closed)
        assert failed and all(
            ("training thread dead" in b or "shutting down: training failed" in b) and "sabotaged update" in b
            for b in failed
        ), answers[-20:]
        assert answers[-1][0] in (0, 503)
    finally:
        stop(proc)


@pytest.mark.process
def test_a_taken_metrics_port_is_refused_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        listen = f"tcp://127.0.0.1:{free_port_pair()}"
        out = run_cli("learner", "--listen", listen, "--metrics-port", str(port), "--logdir", str(tmp_path / "run"),
                      timeout=120)  # fmt: skip
    assert out.returncode != 0
    assert f"cannot serve /metrics on 127.0.0.1:{port}" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


def test_metrics_defaults_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("IMPALA_ASYNC_METRICS_PORT", "9481")
    monkeypatch.setenv("IMPALA_ASYNC_METRICS_HOST", "0.0.0.0")
    assert config.env_metrics_port() == 9481 and config.env_metrics_host() == "0.0.0.0"
    monkeypatch.setenv("IMPALA_ASYNC_METRICS_PORT", "nine")
    problem = config.metrics_address_problem(config.env_metrics_port(), "127.0.0.1")
    assert "IMPALA_ASYNC_METRICS_PORT='nine'" in problem, problem
    monkeypatch.delenv("IMPALA_ASYNC_METRICS_PORT")
    monkeypatch.delenv("IMPALA_ASYNC_METRICS_HOST")
    assert config.env_metrics_port() == 0 and config.env_metrics_host() == "127.0.0.1"
    assert config.metrics_address_problem(70000, "127.0.0.1")
    assert config.metrics_address_problem(0, "127.0.0.1") is None


def test_a_resumed_run_serves_where_this_command_says(monkeypatch, tmp_path):
    """--metrics-port/--metrics-host belong to the process, not the run: a resume takes them from its own command line
    and environment, never from the checkpoint's configuration (other fields come from the checkpoint)."""
    from impala_async import cli
    from impala_async.learner import checkpoint

    def configured(argv):
        return cli.load_learner_config(cli.build_parser().parse_args(argv))[0].cfg

    saved = dict(config.LearnerConfig().flat(), metrics_port=1111, metrics_host="0.0.0.0", batch_size=7)
    found = ({"config": saved}, tmp_path / "checkpoint.pt")
    monkeypatch.setattr(checkpoint.files, "load_latest", lambda *a, **k: found)
    cfg = configured(["train", "--resume", str(tmp_path)])
    defaults = config.LearnerConfig().observe  # this process's defaults (from its environment at import)
    assert (
        (cfg.observe.metrics_port, cfg.observe.metrics_host)
        == (defaults.metrics_port, defaults.metrics_host)
        != (1111, "0.0.0.0")
    )
    assert cfg.loss.batch_size == 7
    assert configured(["train", "--resume", str(tmp_path), "--metrics-port", "3333"]).observe.metrics_port == 3333


@pytest.mark.process
def test_actor_supervisor_healthz(tmp_path):
    """Actors heartbeat while they wait for weights, so no learner is needed. The port comes from the environment,
    which the actor processes inherit: they must not try to serve it too (the supervisor would then restart them
    over and over)."""
    mport = free_port()
    log = tmp_path / "actors.log"
    env = dict(os.environ, IMPALA_ASYNC_METRICS_PORT=str(mport))
    proc = cli(
        "actor", "--learner", f"tcp://127.0.0.1:{free_port_pair()}", "--num-actors", "2", "--envs-per-actor", "1",
        "--heartbeat-interval-s", "0.5", "--heartbeat-timeout-s", "5", log=log, env=env,
    )  # fmt: skip
    try:
        status, body = wait_for(lambda: (r := get(mport, "/healthz"))[0] == 200 and r, 60, "/healthz 200", proc, log)
        wait_for(lambda: get(mport, "/healthz")[1].startswith("ok: 2 of 2"), 60, "both actors heartbeating", proc, log)
        first = scrape(mport)
        assert value(first, "impala_async_actors_alive") == 2
        assert value(first, "impala_async_actor_restarts_total") == 0
        assert exported(first) == documented("actors")
        assert healthcheck(mport).returncode == 0
        children = actors_under(proc.pid)
        assert len(children) == 2
        for child in children:
            os.kill(child, signal.SIGKILL)
        status, body = wait_for(lambda: (r := get(mport, "/healthz"))[0] == 503 and r, 20, "/healthz 503", proc, log)
        assert "no actor process heartbeating" in body, body
        assert healthcheck(mport).returncode == 1
        wait_for(lambda: get(mport, "/healthz")[0] == 200, 60, "/healthz 200 after the restarts", proc, log)
        wait_for(lambda: value(scrape(mport), "impala_async_actor_restarts_total") == 2, 10, "2 restarts", proc, log)
        assert "Address already in use" not in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, tail(log)
        assert get(mport, "/healthz")[0] == 0
    finally:
        stop(proc)


# ------------------------------------------------------------------------------------------ the HTTP server itself
@pytest.fixture
def small_server():
    server = httpd.HttpServer(
        "127.0.0.1",
        0,
        {"/healthz": lambda: httpd.text(200, "fine"), "/boom": lambda: 1 / 0},
        max_connections=2,
        request_timeout_s=1.0,
        max_request_bytes=1024,
        name="test",
    )
    host, port = server.start()
    yield server, port
    server.close()


def test_answers_routes_and_refuses_the_rest(small_server):
    server, port = small_server
    assert get(port, "/healthz") == (200, "fine\n")
    assert get(port, "/healthz?x=1")[0] == 200
    assert get(port, "/metrics")[0] == 404
    assert get(port, "/boom")[0] == 500  # a failing route answers 500; the server goes on
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("POST", "/healthz", body=b"x")
    assert conn.getresponse().status == 405
    conn.close()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nX-Long: " + b"a" * 1500)  # over 1024, no end
        assert s.recv(100).startswith(b"HTTP/1.0 431")
    assert get(port, "/healthz")[0] == 200


def test_connections_and_request_time_are_bounded(small_server):
    """Two unfinished requests hold both places (max_connections 2): /healthz, arriving whole with its connection, is
    answered at once all the same; a third unfinished one takes the oldest's place; after request_timeout_s (1 s) the
    server closes the ones left."""
    server, port = small_server
    slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
    try:
        for s in slow[:2]:
            s.sendall(b"GET /hea")
        wait_for(lambda: server.connections_open == 2, 5, "both places taken")
        t0 = time.monotonic()
        assert get(port, "/healthz") == (200, "fine\n") and time.monotonic() - t0 < 0.9
        slow[2].sendall(b"GET /hea")
        assert slow[0].recv(100) == b""
        assert server.refusals["evicted"] == 1
        for s in slow[1:]:
            assert s.recv(100) == b""
        assert time.monotonic() - t0 < 3
        assert server.timed_out == 2 and server.refusals["busy"] == 0
        assert get(port, "/healthz")[0] == 200
    finally:
        for s in slow:
            s.close()


def test_close_stops_serving(small_server):
    server, port = small_server
    assert get(port, "/healthz")[0] == 200
    server.close()
    assert get(port, "/healthz")[0] == 0
    assert httpd.connect_host("0.0.0.0") == "127.0.0.1" and httpd.is_loopback("::1")
    assert not httpd.is_loopback("10.1.2.3")
