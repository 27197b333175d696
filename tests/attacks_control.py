"""Issue 15's attacks on what a learner believes (classes 2, 7, 8), each as a function that measures one real learner
of any checkout: ``python -m impala_async`` run with ``python`` in ``cwd`` (the checkout measured), loopback, one real
honest actor, the caller as the attacker sending valid messages (tests/attacks.py). No pytest here:
tools/attack_figures.py and tools/soak.py call these; tests/test_misleading.py holds the suite's tests.

    python tests/attacks_control.py fresh_ids [PYTHON [CHECKOUT]]     # one attack's figures, as JSON
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq
from attacks import LearnerView, message, push
from helpers import random_arrays
from procutil import cli, free_port_pair, read_metrics, stop

FLAGS = ["--unroll-length", "10", "--batch-size", "4", "--report-interval-s", "0.25", "--total-env-steps", "1000000000"]
CURRICULUM = ["--curriculum", "linear", "--curriculum-env-steps", "100000000"]
CURRICULUM += ["--curriculum-start", "0.5", "--curriculum-end", "2.0"]


class Target:
    """A learner of the checkout measured (``python`` in ``cwd``) and, with ``actor``, one honest actor of it."""

    def __init__(self, tmp: Path, python: str, cwd, *extra: str, env: str = "CartPole-v1", actor: bool = True):
        port = free_port_pair()
        self.listen, self.weights = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
        self.logdir, self.log = tmp / f"run-{port}", tmp / f"learner-{port}.log"
        self.python, self.cwd = python, cwd
        args = ["--env", env, *FLAGS, "--listen", self.listen, "--logdir", str(self.logdir), *extra]
        self.proc = self._cli(self.log, "learner", *args)
        self.actor = None
        if actor:
            self.actor = self._cli(self.log.with_suffix(".actor.log"), "actor", "--learner", self.listen)
            self.wait(lambda r: r["learner_steps"] > 0, 180)

    def _cli(self, log: Path, *args: str) -> subprocess.Popen:
        env = dict(os.environ)
        env.pop("IMPALA_ASYNC_METRICS_PORT", None)
        return cli(*args, log=log, env=env, python=self.python, cwd=self.cwd)

    def last(self) -> dict:
        rows = read_metrics(self.logdir) if (self.logdir / "metrics.jsonl").exists() else []
        return rows[-1] if rows else {}

    def wait(self, cond, timeout_s: float = 30.0) -> dict | None:
        """The first report for which ``cond`` holds, or None (time out, or the learner exited)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            row = self.last()
            if row and cond(row):
                return row
            time.sleep(0.1)
        return None

    def close(self) -> None:
        if self.actor is not None:
            stop(self.actor)
        stop(self.proc)


def message_of(view: LearnerView, n: int, *, actor: str, seq: int, seed: int = 0, image_codec: str = "lz4") -> bytes:
    """A valid message of ``n`` trajectories, encoded by this checkout's encoder (core/wire.py)."""
    from impala_async.core import wire

    return wire.encode_trajectories(
        view.spec,
        actor_id=actor,
        seq=seq,
        policy_version=view.version,
        incarnation=view.incarnation,
        arrays=random_arrays(view.spec, n, seed=seed),
        image_codec=image_codec,
    )


def _window(t: Target, seconds: float) -> tuple[dict, dict, float]:
    """(report at the start, report at the end, seconds between them) of a ``seconds`` window."""
    a, t0 = t.last(), time.monotonic()
    time.sleep(seconds)
    return a, t.last(), time.monotonic() - t0


def _received(t: Target, total: int, timeout_s: float = 60.0) -> dict:
    """The report once ``total`` messages were read, a second later (the attacker's are not the only ones)."""
    t.wait(lambda r: r["messages_received"] >= total, timeout_s)
    time.sleep(1.0)
    return t.last()


def _rate(a: dict, b: dict, key: str, dt: float) -> float:
    return round((b.get(key, 0) - a.get(key, 0)) / dt, 2)


# ----------------------------------------------------------------------------------------------- class 2 (a)
def fresh_ids(t: Target, ctx: zmq.Context, per_s: float = 10.0, seconds: float = 20.0) -> dict:
    """``per_s`` valid one-trajectory messages a second, each from a fresh actor id, for ``seconds``: the honest
    actor's trajectories/s and the updates/s before and during (its last half), the attacker's share of what was
    received, the most ``pace_senders`` seen, and the seconds the honest rate took to come back to half its own."""
    view = LearnerView(ctx, t.weights).refresh(60)
    a, b, dt = _window(t, 10.0)
    honest_before, updates_before = _rate(a, b, "trajectories_received", dt), _rate(a, b, "learner_steps", dt)
    sock, sent, senders, mid = push(ctx, t.listen), 0, 0, None
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds and t.proc.poll() is None:
        if mid is None and time.monotonic() - t0 >= seconds / 2:
            mid = (t.last(), sent, time.monotonic())
        view.refresh()
        sock.send(message(view, actor=f"fresh-{sent}", seq=0, seed=sent))
        sent += 1
        senders = max(senders, t.last().get("pace_senders", 0))
        time.sleep(1.0 / per_s)
    end, dt = t.last(), time.monotonic() - mid[2]
    attacker = sent - mid[1]
    received = end["trajectories_received"] - mid[0]["trajectories_received"]
    sock.close(0)
    view.close()
    recovered = _recovery(t, honest_before / 2)
    return {
        "honest_trajectories_per_s_before": honest_before,
        "honest_trajectories_per_s_during": round((received - attacker) / dt, 2),
        "updates_per_s_before": updates_before,
        "updates_per_s_during": _rate(mid[0], end, "learner_steps", dt),
        "attacker_share_of_received": round(attacker / max(1, received), 3),
        "pace_senders_max": senders,
        "messages_rejected": end["messages_rejected"] - a["messages_rejected"],
        "recovery_s": recovered,
    }


def _recovery(t: Target, honest_per_s: float, timeout_s: float = 60.0) -> float | None:
    """Seconds until a 2 s window's rate of received trajectories reaches ``honest_per_s`` (None: not within)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and t.proc.poll() is None:
        a, b, dt = _window(t, 2.0)
        if _rate(a, b, "trajectories_received", dt) >= honest_per_s:
            return round(time.monotonic() - t0, 1)
    return None


# ----------------------------------------------------------------------------------------------- class 2 (b)
def large_message(t: Target, ctx: zmq.Context, n: int = 256, seconds: float = 15.0) -> dict:
    """One valid message of ``n`` trajectories: the share of trajectories dropped, the mean policy lag and the pace's
    target, over ``seconds`` before and over ``seconds`` from 5 s after."""

    def figures(a, b):
        got = b["trajectories_received"] - a["trajectories_received"]
        dropped = b["trajectories_dropped"] - a["trajectories_dropped"]
        rows = [r for r in read_metrics(t.logdir) if a["wall_s"] < r["wall_s"] <= b["wall_s"]]
        lags = [r["policy_lag_avg"] for r in rows if r.get("policy_lag_avg") is not None]
        return {
            "dropped_share": round(dropped / max(1, got + dropped), 3),
            "policy_lag_avg": round(float(np.mean(lags)), 2) if lags else None,
            "pace_target_max": max((r.get("pace_target_trajectories", 0) for r in rows), default=None),
        }

    view = LearnerView(ctx, t.weights).refresh(60)
    a, b, _ = _window(t, seconds)
    before = figures(a, b)
    sock = push(ctx, t.listen)
    view.refresh()  # the latest version: not dropped as stale
    sock.send(message_of(view, n, actor="large", seq=0))
    time.sleep(5.0)
    a2, b2, _ = _window(t, seconds)
    sock.close(0)
    view.close()
    accepted = b2["trajectories_received"] - b["trajectories_received"] >= n
    return {"before": before, "after": figures(a2, b2), "accepted": accepted}


# ----------------------------------------------------------------------------------------------- class 2 (c)
def record_inflation(t: Target, ctx: zmq.Context, messages: int = 250) -> dict:
    """``messages`` valid one-trajectory messages claiming 4,096 ended episodes each, to a learner under a curriculum
    of 1,000,000 episodes: episodes counted, the difficulty reached and the seconds it took. ``t`` runs CURRICULUM."""
    view = LearnerView(ctx, t.weights).refresh(60)
    before, sock, t0 = t.last(), push(ctx, t.listen), time.monotonic()
    for i in range(messages):
        view.refresh()
        sock.send(message(view, actor="claimer", seq=i, seed=i, episodes=[(1.0, 1)] * 4096))
    total = before["messages_received"] + messages
    row = _received(t, total)
    sock.close(0)
    view.close()
    return {
        "episodes_added": row["episodes"] - before["episodes"],
        "difficulty_before": before.get("difficulty"),
        "difficulty_after": row.get("difficulty"),
        "seconds": round(time.monotonic() - t0, 1),
        "rejected_inconsistent": row.get("rejected_inconsistent", 0) - before.get("rejected_inconsistent", 0),
    }


# ----------------------------------------------------------------------------------------------- class 2 (d)
def claimed_drops(t: Target, ctx: zmq.Context, messages: int = 2000, n: int = 256) -> dict:
    """``messages`` valid messages of another learner run (the next incarnation), each of ``n`` all-zero trajectories
    (a few hundred bytes under LZ4): what trajectories_dropped and dropped_incarnation gained."""
    from impala_async.core import wire

    view = LearnerView(ctx, t.weights).refresh(60)
    zeros = {k: np.zeros_like(v) for k, v in random_arrays(view.spec, n).items()}
    data = wire.encode_trajectories(
        view.spec, actor_id="old-run", seq=0, policy_version=0, incarnation=view.incarnation + 1, arrays=zeros
    )
    before, sock = t.last(), push(ctx, t.listen)
    for _ in range(messages):
        sock.send(data)
    total = before["messages_received"] + messages
    row = _received(t, total)
    sock.close(0)
    view.close()
    return {
        "message_bytes": len(data),
        "trajectories_dropped_added": row["trajectories_dropped"] - before["trajectories_dropped"],
        "dropped_incarnation_added": row["dropped_incarnation"] - before["dropped_incarnation"],
        "messages_rejected_added": row["messages_rejected"] - before["messages_rejected"],
    }


# ------------------------------------------------------------------------------------------------- class 8
def jpeg_flood(tmp: Path, python: str, cwd, ctx: zmq.Context, messages: int = 2000) -> dict:
    """A learner of a pixel env started with the default --obs-codec (lz4), ``messages`` valid JPEG messages: how many
    it accepted (decoding each) and rejected. Needs simplejpeg here (to encode) and in the measured checkout's venv."""
    t = Target(tmp, python, cwd, env="impala_async.actors.envs:PongLike-v0", actor=False)
    try:
        view = LearnerView(ctx, t.weights).refresh(120)
        sock, t0 = push(ctx, t.listen), time.monotonic()
        for i in range(messages):  # each its own sequence number: a replay is refused before its fields are decoded
            sock.send(message_of(view, 1, actor="jpeg", seq=i, seed=i % 16, image_codec="jpeg"))
        row = t.wait(lambda r: r["messages_received"] >= messages, 120) or t.last()
        sock.close(0)
        view.close()
        return {
            "sent": messages,
            "accepted": row.get("trajectories_received", 0),
            "rejected": row.get("messages_rejected", 0),
            "seconds": round(time.monotonic() - t0, 1),
        }
    finally:
        t.close()


# ------------------------------------------------------------------------------------------------- class 7
def startup_and_files(tmp: Path, python: str, cwd) -> dict:
    """The trajectory port taken (exit code, stderr lines, a traceback or not), then a 2,000-step ``train``: the
    permission bits of its logdir and of the files holding weights."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [python, "-m", "impala_async", "learner", "--listen", f"tcp://127.0.0.1:{port}"]
            + ["--logdir", str(tmp / "x")],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=cwd,
        )
    logdir = tmp / "private"
    logdir.mkdir(mode=0o755)
    subprocess.run(
        [python, "-m", "impala_async", "train", "--num-actors", "1", *FLAGS[:4], "--total-env-steps", "2000"]
        + ["--logdir", str(logdir)],
        capture_output=True,
        timeout=300,
        cwd=cwd,
    )
    return {
        "port_taken_exit": out.returncode,
        "port_taken_stderr_lines": len(out.stderr.strip().splitlines()),
        "port_taken_traceback": "Traceback" in out.stderr,
        "logdir_mode": oct(stat.S_IMODE(os.stat(logdir).st_mode)),
        "checkpoint_modes": sorted({oct(stat.S_IMODE(p.stat().st_mode)) for p in logdir.glob("checkpoint-*.pt")}),
    }


def run_attack(kind: str, *, python: str = sys.executable, cwd=None, workdir: Path | None = None) -> dict:
    """One attack's figures against a fresh learner of the checkout ``cwd`` (``python -m impala_async`` there)."""
    tmp = Path(workdir or tempfile.mkdtemp(prefix=f"attack-{kind}-"))
    ctx = zmq.Context()
    try:
        if kind == "jpeg_flood":
            return jpeg_flood(tmp, python, cwd, ctx)
        if kind == "startup_and_files":
            return startup_and_files(tmp, python, cwd)
        attack = {"fresh_ids": fresh_ids, "large_message": large_message, "record_inflation": record_inflation}
        attack["claimed_drops"] = claimed_drops
        t = Target(tmp, python, cwd, *(CURRICULUM if kind == "record_inflation" else ()))
        try:
            return attack[kind](t, ctx)
        finally:
            t.close()
    finally:
        ctx.destroy(linger=0)


def soak_steps(ctx: zmq.Context, listen: str, weights: str, metrics_port: int, stop, seen: dict) -> list:
    """Issue 15's attacks as (name, step) pairs for tools/soak.py's attacker, against its running CartPole learner,
    each short: fresh actor ids (10 a second for 5 s), one 256-trajectory message, 50 messages claiming 4,096 episodes,
    200 messages of another learner run, 100 weights subscribers that read nothing (held until cut, at most 30 s),
    200K empty messages then 200 MiB unfinished, 200 idle connections on the metrics port while /healthz is probed;
    and issue 27's: 200 connections sending 20 one-trajectory messages a second in all (10 s), 20 messages of 256
    trajectories whose every step ends an episode (``seen`` gathers what the steps measured: probes answered 200,
    subscribers cut, bypass cut, valid trajectories the attacker got accepted)."""
    import itertools

    import attacks_health
    import attacks_outbound

    from impala_async.core import wire

    host, port = listen.removeprefix("tcp://").rsplit(":", 1)
    wport = int(weights.rsplit(":", 1)[1])
    view, sock, ids = LearnerView(ctx, weights), push(ctx, listen), itertools.count()

    def fresh_ids():
        for i in range(50):
            if stop.is_set():
                return
            view.refresh()
            sock.send(message(view, actor=f"fresh-{next(ids)}", seq=0, seed=i))
            seen["accepted"] = seen.get("accepted", 0) + 1  # valid: counted among trajectories received
            stop.wait(0.1)

    def inflated():
        name = f"claimer-{next(ids)}"
        for i in range(50):
            view.refresh()
            sock.send(message(view, actor=name, seq=i, seed=i, episodes=[(1.0, 1)] * 4096))

    def slow_connections():  # issue 27, row 1: 20 one-trajectory messages a second in all over 200 connections
        socks = [push(ctx, listen) for _ in range(200)]
        for i in range(200):
            if stop.is_set():
                break
            view.refresh()
            socks[i].send(message(view, actor=f"slow-{next(ids)}", seq=0, seed=i))
            seen["accepted"] = seen.get("accepted", 0) + 1
            stop.wait(0.05)
        for s in socks:
            s.close(0)

    def ended_episodes():  # issue 27, row 6: 20 messages of 256 trajectories whose every step ends an episode
        view.refresh()
        arrays = random_arrays(view.spec, 256, seed=7)
        arrays["terminated"][:], arrays["truncated"][:], arrays["truncation_value"][:] = 1, 0, 0
        name = f"ender-{next(ids)}"
        for i in range(20):
            view.refresh()
            episodes = [(1.0, 1)] * min(4096, 256 * view.spec.unroll_length)
            sock.send(
                wire.encode_trajectories(
                    view.spec,
                    actor_id=name,
                    seq=i,
                    policy_version=view.version,
                    incarnation=view.incarnation,
                    arrays=arrays,
                    episodes=episodes,
                )
            )
            seen["accepted"] = seen.get("accepted", 0) + 256

    def other_run():
        view.refresh()
        zeros = {k: np.zeros_like(v) for k, v in random_arrays(view.spec, 256).items()}
        data = wire.encode_trajectories(
            view.spec, actor_id="old-run", seq=0, policy_version=0, incarnation=view.incarnation + 1, arrays=zeros
        )
        for _ in range(200):
            sock.send(data)

    def idle_subscribers():
        got = attacks_outbound.idle_subscribers(host, wport, 100, hold_s=30.0, spread_s=2.0)
        seen.setdefault("idle_subscribers_cut", []).append((got["cut"], got["connected"]))

    def bypass():
        got = attacks_outbound.credit_bypass(host, int(port), empty_messages=200_000, hold_bytes=200 << 20, hold_s=5.0)
        seen.setdefault("credit_bypass_cut", []).append(got["cut"])

    def health():
        if metrics_port:
            got = attacks_health.starve_health("127.0.0.1", metrics_port, idle_connections=200, probes=20)
            seen.setdefault("health_probes", []).append((got["probes_200"], got["probes"]))

    def large():
        view.refresh()
        sock.send(message_of(view, 256, actor=f"large-{next(ids)}", seq=0))
        seen["accepted"] = seen.get("accepted", 0) + 256

    steps = [
        ("fresh_ids", fresh_ids),
        ("large_message", large),
        ("record_inflation", inflated),
        ("claimed_drops", other_run),
        ("idle_subscribers", idle_subscribers),
        ("credit_bypass", bypass),
        ("health_starvation", health),
        ("slow_connections", slow_connections),
        ("ended_episodes", ended_episodes),
    ]
    assert tuple(name for name, _ in steps) == SOAK_STEPS
    return steps


SOAK_STEPS = ("fresh_ids", "large_message", "record_inflation", "claimed_drops", "idle_subscribers", "credit_bypass",
              "health_starvation", "slow_connections", "ended_episodes")  # fmt: skip


KINDS = ("fresh_ids", "large_message", "record_inflation", "claimed_drops", "jpeg_flood", "startup_and_files")

if __name__ == "__main__":  # python tests/attacks_control.py KIND [PYTHON [CHECKOUT]]
    args = sys.argv[1:] + ["", ""]
    print(json.dumps(run_attack(args[0], python=args[1] or sys.executable, cwd=args[2] or None), indent=1))
