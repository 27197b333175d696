"""CurveZMQ through the real CLI: keys made with `impala-async keygen`, a learner that admits only the listed actor,
clients without keys or with an unlisted key that get nothing in and nothing out, and the learner's refusals to start
with an exposed address or unusable keys."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from helpers import random_arrays
from procutil import cli, finish, free_port_pair, read_metrics, stop, tail, wait_for
from procutil import run_cli as _run_cli

from impala_async.core import wire
from impala_async.core.spec import TrajectorySpec
from impala_async.ops import auth

ACTOR_NAME = "gpu-box-3"
LEARNER_FLAGS = ["--env", "CartPole-v1", "--unroll-length", "10", "--batch-size", "4", "--report-interval-s", "0.5"]
SPEC = TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=10)  # CartPole, T=10
NOTHING_ARRIVES_S = 2.0  # how long refused clients send (and listen) without anything getting through
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return _run_cli(*args, timeout=timeout_s, env=ENV)


def keygen(directory: Path, name: str) -> None:
    out = run_cli("keygen", str(directory), "--name", name)
    assert out.returncode == 0, out.stderr
    assert (directory / f"{name}.key").is_file() and (directory / f"{name}.key_secret").is_file()
    assert (directory / f"{name}.key_secret").stat().st_mode & 0o777 == 0o600


@pytest.fixture(scope="module")
def key_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(learner dir, actor dir), laid out as impala_async/ops/auth.py describes, from keys the CLI made."""
    root = tmp_path_factory.mktemp("keys")
    ldir, adir = root / "learner", root / "actor"
    keygen(ldir, "learner")
    keygen(adir, "actor")
    (ldir / "allowed").mkdir(mode=0o700)
    shutil.copy(adir / "actor.key", ldir / "allowed" / f"{ACTOR_NAME}.key")
    shutil.copy(ldir / "learner.key", adir / "learner.key")
    return ldir, adir


def last_metrics(logdir: Path) -> dict:
    rows = read_metrics(logdir)
    return rows[-1] if rows else {}


@pytest.mark.process
def test_only_the_listed_actor_gets_in(tmp_path, key_dirs):
    ldir, adir = key_dirs
    port = free_port_pair()
    listen, weights = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    logdir, llog, alog = tmp_path / "run", tmp_path / "learner.log", tmp_path / "actor.log"
    learner = cli(
        "learner",
        *LEARNER_FLAGS,
        "--curve-keys",
        str(ldir),
        "--listen",
        listen,
        "--logdir",
        str(logdir),
        "--total-env-steps",
        "100000000",
        log=llog,
    )
    actor = None
    ctx = zmq.Context()
    try:
        wait_for(lambda: last_metrics(logdir), 90, "the learner's first metrics line", learner, llog)
        assert "CURVE on: 1 allowed actor key(s)" in llog.read_text()

        # Clients that must get nothing in and nothing out: no keys at all (b), and a key pair not in allowed/ (c).
        stranger = auth.load_actor_keys(_stranger_dir(tmp_path, adir))
        clients = []
        for keys in (None, stranger):
            push, sub = ctx.socket(zmq.PUSH), ctx.socket(zmq.SUB)
            for s in (push, sub):
                s.setsockopt(zmq.LINGER, 0)
                if keys is not None:
                    auth.make_curve_client(s, keys)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            push.connect(listen)
            sub.connect(weights)
            clients.append((push, sub))
        messages = (
            wire.encode_trajectories(
                SPEC,
                actor_id=f"refused-{i}",
                seq=seq,
                policy_version=0,
                incarnation=1,
                arrays=random_arrays(SPEC, 1, seed=seq),
            )
            for seq in range(1 << 30)
            for i in range(len(clients))
        )
        deadline = time.monotonic() + NOTHING_ARRIVES_S
        while time.monotonic() < deadline:  # both send valid messages all along, and listen for weights
            for push, sub in clients:
                try:
                    push.send(next(messages), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no connection was ever admitted: messages wait in the socket
                assert not sub.poll(0, zmq.POLLIN), "a refused subscriber received weights"
            time.sleep(0.01)
        rows = len(read_metrics(logdir))  # counters from after the sending window
        row = wait_for(
            lambda: len(read_metrics(logdir)) >= rows + 2 and last_metrics(logdir),
            10,
            "two more metrics lines",
            learner,
            llog,
        )
        assert row["messages_received"] == 0 and row["trajectories_received"] == 0, row
        # Each refusal is counted: the stranger's two sockets were refused at least once each. The keyless client
        # fails before ZAP (no CURVE mechanism), so it is not among them.
        assert row["handshakes_refused_key"] >= 2, row
        assert f"refused a CURVE client with an unlisted public key {stranger.public.decode()}" in llog.read_text()

        # The listed key gets weights (so the refusals above were not a learner that is simply not publishing) ...
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        auth.make_curve_client(sub, auth.load_actor_keys(adir))
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(weights)
        assert sub.poll(10_000, zmq.POLLIN), "the listed actor's key received no weights"
        assert wire.decode_weights(sub.recv(), 64 << 20).run_info["spec"] == SPEC.to_dict()
        for _, refused in clients:
            assert not refused.poll(0, zmq.POLLIN), "a refused subscriber received weights"

        # ... and the real actor with that key trains the learner (a).
        actor = cli("actor", "--curve-keys", str(adir), "--learner", listen, "--envs-per-actor", "2", log=alog)
        row = wait_for(
            lambda: (r := last_metrics(logdir)).get("learner_steps", 0) > 0 and r, 90, "learner steps", learner, llog
        )
        assert row["trajectories_received"] > 0 and row["messages_rejected"] == 0, row
        assert actor.poll() is None, tail(alog)
    finally:
        ctx.destroy(linger=0)
        if actor is not None:
            stop(actor)
        stop(learner)


def _stranger_dir(tmp_path: Path, adir: Path) -> Path:
    """An actor key directory whose pair is not in the learner's allowed/ (it does know the learner's key)."""
    sdir = tmp_path / "stranger"
    keygen(sdir, "actor")
    shutil.copy(adir / "learner.key", sdir / "learner.key")
    return sdir


@pytest.mark.process
def test_an_actor_tells_refusal_from_absence(tmp_path, key_dirs):
    """A refused key shows in the actor's socket monitor as HANDSHAKE_FAILED_AUTH (ZAP status 400): the actor says
    so and exits 5; with nothing listening it says that and exits 3 (docs/protocol.md, Keys)."""
    ldir, adir = key_dirs
    port = free_port_pair()
    listen = f"tcp://127.0.0.1:{port}"
    logdir, llog = tmp_path / "run", tmp_path / "learner.log"
    learner = cli(
        "learner", *LEARNER_FLAGS, "--curve-keys", str(ldir), "--listen", listen, "--logdir", str(logdir), log=llog
    )
    try:
        wait_for(lambda: "listening" in llog.read_text(), 60, "the learner to start", learner, llog)
        refused = run_cli(
            "actor",
            "--curve-keys",
            str(_stranger_dir(tmp_path, adir)),
            "--learner",
            listen,
            "--max-wait-for-weights-s",
            "3",
        )
        assert refused.returncode == 5, refused.stderr
        assert "refused this actor's key" in refused.stderr
    finally:
        stop(learner)
    absent = run_cli("actor", "--learner", f"tcp://127.0.0.1:{free_port_pair()}", "--max-wait-for-weights-s", "2")
    assert absent.returncode == 3, absent.stderr
    assert "nothing accepted a connection" in absent.stderr


@pytest.mark.process
def test_train_with_curve_gives_its_local_actors_a_key(tmp_path, key_dirs):
    ldir, _ = key_dirs
    allowed_before = sorted(p.name for p in (ldir / "allowed").iterdir())
    logdir, log = tmp_path / "run", tmp_path / "train.log"
    proc = cli(
        "train",
        *LEARNER_FLAGS,
        "--curve-keys",
        str(ldir),
        "--num-actors",
        "1",
        "--envs-per-actor",
        "2",
        "--total-env-steps",
        "1500",
        "--logdir",
        str(logdir),
        log=log,
    )
    finish(proc, log, 120)
    last = last_metrics(logdir)
    assert last["learner_steps"] > 0 and last["env_steps_trained"] >= 1500, last
    assert last["messages_rejected"] == 0
    assert "CURVE on: 2 allowed actor key(s)" in log.read_text()  # the listed one and the run's own
    local = logdir / ".local-actor-keys"
    assert (local / "actor.key_secret").stat().st_mode & 0o777 == 0o600
    assert (local / "learner.key").read_text().count("public-key") == 1
    assert auth.load_actor_keys(local).server_public == auth.load_learner_keys(ldir).public
    assert sorted(p.name for p in (ldir / "allowed").iterdir()) == allowed_before  # the user's keys are untouched


# ------------------------------------------------------------------------------------------- refusals to start
def _refusal_cases(tmp_path: Path, ldir: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (learner flags, phrases its stderr must hold)."""
    empty, missing, loose = (tmp_path / n for n in ("empty", "missing", "loose"))
    for d in (empty, missing, loose):
        shutil.copytree(ldir, d)
    for p in (empty / "allowed").iterdir():
        p.unlink()
    shutil.rmtree(missing / "allowed")
    os.chmod(loose / "learner.key_secret", 0o644)
    port = free_port_pair()
    return {
        "exposed without CURVE": (["--listen", f"tcp://0.0.0.0:{port}"], ["refusing to bind", "--curve-keys"]),
        "empty allowed/": (["--curve-keys", str(empty)], [str(empty / "allowed"), "holds no *.key file"]),
        "missing allowed/": (["--curve-keys", str(missing)], [str(missing / "allowed"), "does not exist"]),
        "secret key mode 0644": (
            ["--curve-keys", str(loose)],
            [str(loose / "learner.key_secret"), "0644", "chmod 600"],
        ),
    }


@pytest.mark.process
def test_learner_refuses_to_start(tmp_path, key_dirs):
    cases = _refusal_cases(tmp_path, key_dirs[0])
    procs = {}
    for i, (name, (flags, _)) in enumerate(cases.items()):  # concurrently: each pays for the heavy imports
        listen = [] if "--listen" in flags else ["--listen", f"tcp://127.0.0.1:{free_port_pair()}"]
        procs[name] = cli(
            "learner", *LEARNER_FLAGS, *listen, *flags, "--logdir", str(tmp_path / f"run{i}"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
        )  # fmt: skip
    t0 = time.monotonic()
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=60)
            assert proc.returncode not in (0, None), f"{name}: started\n{out}\n{err}"
            for phrase in cases[name][1]:
                assert phrase in err, f"{name}: {phrase!r} not in stderr:\n{err}"
            assert "listening" not in out, f"{name}: bound its sockets\n{out}"
            assert "Traceback" not in err, f"{name}: a traceback instead of a message\n{err}"
            assert not (tmp_path / f"run{list(procs).index(name)}" / "metrics.jsonl").exists(), name
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert time.monotonic() - t0 < 60


@pytest.mark.process
def test_insecure_flag_allows_an_exposed_address(tmp_path):
    port = free_port_pair()
    logdir, log = tmp_path / "run", tmp_path / "learner.log"
    proc = cli(
        "learner",
        *LEARNER_FLAGS,
        "--listen",
        f"tcp://0.0.0.0:{port}",
        "--insecure",
        "1",
        "--logdir",
        str(logdir),
        log=log,
    )
    try:
        wait_for(lambda: "listening" in log.read_text(), 60, "the learner to start", proc, log)
        ctx = zmq.Context()  # it serves weights on the exposed address's port + 1
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{port + 1}")
            assert sub.poll(10_000, zmq.POLLIN), "no weights from the --insecure learner"
            assert np.isfinite(next(iter(wire.decode_weights(sub.recv(), 64 << 20).tensors.values()))).all()
        finally:
            ctx.destroy(linger=0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, tail(log)
    finally:
        stop(proc)
