#!/usr/bin/env python3
"""Soak test: train for a while under chaos and check that nothing was lost.

Runs `impala-async train --env CartPole-v1` with local actors for --seconds while
  - every --kill-every-s, a random local actor is killed (SIGKILL) or frozen (SIGSTOP), alternately;
  - a sender pushes --garbage-per-s hostile messages to the learner (random bytes, truncated and corrupted valid
    messages, NaN rewards, bad actions, future versions, replays, multipart messages).
It samples the learner's resident memory every second. At the end it stops the learner with SIGTERM and checks:
exit code 0, training progressed (learner steps grew in every quarter of the run), the newest checkpoint loads with
torch.load(weights_only=True), and memory stayed flat after warm-up (the median RSS of the last minute is within
--max-rss-growth-mib of the median of the minute after warm-up).

    python tools/soak.py --seconds 600 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import psutil
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from impala_async import checkpoint, wire  # noqa: E402
from impala_async.metrics import read_metrics  # noqa: E402
from impala_async.spec import TrajectorySpec  # noqa: E402


def garbage_sender(listen: str, weights: str, rate_per_s: float, stop: threading.Event, sent: list) -> None:
    """Push hostile messages at rate_per_s until stop is set."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(weights)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 100)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(listen)
    if not sub.poll(60_000):
        return
    first = wire.decode_weights(sub.recv(), 1 << 30)
    spec = TrajectorySpec.from_dict(first.run_info["spec"])
    rng = np.random.default_rng(0)
    A = spec.num_actions
    current = [first.version]  # the learner's current version: older garbage would only be dropped as stale
    incarnation = first.incarnation

    def arrays():
        return {f.name: np.zeros((1, *f.shape), f.dtype) for f in spec.fields}

    def valid(seq, version=None, **edits):
        a = arrays()
        for name, value in edits.items():
            a[name].flat[0] = value
        return wire.encode_trajectories(spec, actor_id="garbage", seq=seq, incarnation=incarnation,
                                        policy_version=current[0] if version is None else version, arrays=a)

    kinds = [
        lambda s: rng.bytes(int(rng.integers(0, 2000))),
        lambda s: valid(s)[: int(rng.integers(1, 200))],
        lambda s: valid(s, reward=np.nan),
        lambda s: valid(s, action=A + 3),
        lambda s: valid(s, terminated=7),
        lambda s: valid(s, version=10**12),
        lambda s: valid(0),  # replay after the first one
        lambda s: b"\x91" * 50_000 + b"\xc0",
        lambda s: b"\xdd\xff\xff\xff\xff",
        lambda s: msgpack.packb({"v": 1, "type": "trajectories", "n": 1, "fields": {"obs": {"data": (2**31).to_bytes(
            4, "little") + b"x" * 30}}}),
    ]
    seq = 1
    while not stop.is_set():
        while sub.poll(0):
            current[0] = wire.decode_weights(sub.recv(), 1 << 30).version
        kind = int(rng.integers(len(kinds)))
        try:
            if kind == 0 and rng.random() < 0.1:
                push.send_multipart([b"x"] * 100, zmq.NOBLOCK)
            else:
                push.send(kinds[kind](seq), zmq.NOBLOCK)
            sent[0] += 1
        except zmq.Again:
            pass
        seq += 1
        stop.wait(1.0 / rate_per_s)
    push.close(0)
    sub.close(0)
    ctx.term()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--warmup-s", type=float, default=60)
    p.add_argument("--kill-every-s", type=float, default=20)
    p.add_argument("--garbage-per-s", type=float, default=50)
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--max-rss-growth-mib", type=float, default=20)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    logdir = Path(tempfile.mkdtemp(prefix="soak-"))
    cmd = [sys.executable, "-m", "impala_async", "train", "--env", "CartPole-v1", "--num-actors", str(a.actors),
           "--envs-per-actor", "8", "--total-env-steps", str(10**13), "--logdir", str(logdir),
           "--checkpoint-interval-s", "30", "--heartbeat-timeout-s", "5", "--max-actor-restarts", "1000",
           "--report-interval-s", "2"]
    log = open(logdir / "train.log", "w")
    learner = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
    line = learner.stdout.readline()
    listen, weights = line.split("--learner ")[1].split(" --weights ")
    weights = weights.strip()
    stop = threading.Event()
    sent = [0]
    sender = threading.Thread(target=garbage_sender, args=(listen, weights, a.garbage_per_s, stop, sent), daemon=True)
    sender.start()
    proc = psutil.Process(learner.pid)
    rss: list[tuple[float, float]] = []
    chaos = {"killed": 0, "stopped": 0}
    rnd = random.Random(0)
    t0 = time.monotonic()
    next_chaos = t0 + a.warmup_s / 2
    try:
        while time.monotonic() - t0 < a.seconds:
            time.sleep(1.0)
            if learner.poll() is not None:
                raise SystemExit(f"soak: the learner exited early with {learner.returncode}; see {logdir}/train.log")
            rss.append((time.monotonic() - t0, proc.memory_info().rss / 2**20))
            if time.monotonic() >= next_chaos:
                next_chaos += a.kill_every_s
                kids = [c for c in proc.children() if c.status() != psutil.STATUS_ZOMBIE]
                if kids:
                    victim = rnd.choice(kids)
                    how = "killed" if chaos["killed"] <= chaos["stopped"] else "stopped"
                    os.kill(victim.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
                    chaos[how] += 1
    finally:
        stop.set()
        sender.join(10)
        learner.send_signal(signal.SIGTERM)
        try:
            code = learner.wait(60)
        except subprocess.TimeoutExpired:
            learner.kill()
            code = "timeout"
    rows = read_metrics(logdir / "metrics.jsonl")
    quarters = [[r for r in rows if q * a.seconds / 4 <= r["wall_s"] < (q + 1) * a.seconds / 4] for q in range(4)]
    progressed = all(len(q) >= 2 and q[-1]["learner_steps"] > q[0]["learner_steps"] for q in quarters)
    found = checkpoint.load_latest(logdir)
    early = [m for t, m in rss if a.warmup_s <= t < a.warmup_s + 60]
    late = [m for t, m in rss if t >= a.seconds - 60]
    growth = statistics.median(late) - statistics.median(early) if early and late else None
    final = rows[-1] if rows else {}
    result = {
        "seconds": a.seconds,
        "exit_code": code,
        "learner_steps": final.get("learner_steps"),
        "env_steps": final.get("env_steps"),
        "episode_return_mean": final.get("episode_return_mean"),
        "progressed_in_every_quarter": progressed,
        "checkpoint_loads": found is not None,
        "checkpoint": str(found[1]) if found else None,
        "rss_mib_after_warmup": round(statistics.median(early), 1) if early else None,
        "rss_mib_last_minute": round(statistics.median(late), 1) if late else None,
        "rss_growth_mib": round(growth, 1) if growth is not None else None,
        "rss_max_mib": round(max(m for _, m in rss), 1) if rss else None,
        "garbage_sent": sent[0],
        "messages_rejected": final.get("messages_rejected"),
        "rejected_by_reason": {k[len("rejected_"):]: v for k, v in final.items() if k.startswith("rejected_") and v},
        "actors_killed": chaos["killed"],
        "actors_stopped": chaos["stopped"],
        "actor_restarts": final.get("actor_restarts"),
        "logdir": str(logdir),
    }
    ok = (code == 0 and progressed and found is not None and growth is not None
          and growth < a.max_rss_growth_mib)
    result["ok"] = ok
    print(json.dumps(result) if a.json else json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
