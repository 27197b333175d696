#!/usr/bin/env python3
"""What each flow control wastes: dropped fraction, policy lag and trained frames/s of `impala-async train` runs.

Runs the real CLI for a fixed time per setting, one after the other in the same invocation (so every setting sees
the same machine), with default settings apart from the flags given, and reads metrics.jsonl. Reports, over the
steady part of each run (after --warmup-s of data):

- dropped fraction: trajectories dropped (ring full, stale, earlier incarnation) / trajectories the actors delivered
  (accepted, plus those dropped before acceptance; rejected ones are not counted: there are none in these runs);
- policy lag: mean of the per-report averages, and the largest per-report maximum;
- trained env frames/s: env steps trained per second over the steady window (what the learner learns from);
- produced env frames/s: env steps delivered by the actors per second;
- learner steps/s: updates per second.

(Env frames here are agent steps, the unit of env_steps; ALE's emulator runs 4 frames per Atari agent step.)

    python tools/flow_control.py --env ALE/Pong-v5 --seconds 120 --settings "--flow-control none" "--flow-control pace"
    python tools/flow_control.py --env CartPole-v1 --seconds 40 --repeat 2 --json

Any train flags can be compared the same way, e.g. the deep network's variants on Pong:

    python tools/flow_control.py --env ALE/Pong-v5 --seconds 150 --warmup-s 30 --settings "--model deep" \
        "--model deep --use-lstm 1" "--model deep --obs-codec jpeg" "--model deep --use-lstm 1 --obs-codec jpeg"
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from impala_async.learner.reports.metrics import read_metrics

STARTUP_TIMEOUT_S = 120.0  # the longest a run may take to its first report of data


def _has_data(path: Path) -> bool:
    return path.exists() and any(r["env_steps"] > 0 for r in read_metrics(path))


def run(env: str, flags: list[str], seconds: float, warmup_s: float) -> dict:
    logdir = Path(tempfile.mkdtemp(prefix="flow-"))
    cmd = [
        sys.executable,
        "-m",
        "impala_async",
        "train",
        "--env",
        env,
        "--total-env-steps",
        str(10**12),
        "--logdir",
        str(logdir),
        *flags,
    ]
    with open(logdir / "stderr.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        # ``seconds`` from the first report of data: a slow start (a busy machine, cold imports, actors starting)
        # shortens no run.
        started, first_report = time.monotonic(), None
        try:
            while proc.poll() is None and time.monotonic() - started < STARTUP_TIMEOUT_S + seconds:
                if first_report is None and _has_data(logdir / "metrics.jsonl"):
                    first_report = time.monotonic()
                if first_report is not None and time.monotonic() - first_report >= seconds:
                    break
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    rows = [r for r in read_metrics(logdir / "metrics.jsonl") if r["env_steps"] > 0]
    if len(rows) < 3:
        return {"flags": " ".join(flags), "error": f"too few metrics lines; see {logdir}/stderr.log"}
    start = rows[0]["wall_s"] + warmup_s
    steady = [r for r in rows if r["wall_s"] >= start] or rows[-2:]
    a, b = steady[0], steady[-1]
    dt = max(1e-9, b["wall_s"] - a["wall_s"])

    def delta(key):
        return b[key] - a[key]

    # Stale and earlier-incarnation drops may happen before a trajectory is accepted (then it is not in
    # trajectories_received); ring-full drops always after. Counting stale drops in both is at worst a small excess.
    delivered = delta("trajectories_received") + delta("dropped_stale")
    dropped = delta("trajectories_dropped")
    lags = [r["policy_lag_avg"] for r in steady if r.get("policy_lag_avg") is not None]
    lag_max = [r["policy_lag_max"] for r in steady if r.get("policy_lag_max") is not None]
    return {
        "flags": " ".join(flags),
        "steady_s": round(dt, 1),
        "dropped_fraction": round(dropped / max(1, delivered), 4),
        "trajectories_delivered": delivered,
        "trajectories_dropped": dropped,
        "policy_lag_avg": round(statistics.mean(lags), 2) if lags else None,
        "policy_lag_max": max(lag_max) if lag_max else None,
        "trained_frames_per_s": round(delta("env_steps_trained") / dt, 1),
        "learner_steps_per_s": round(delta("learner_steps") / dt, 2),
        "produced_frames_per_s": round(delta("env_steps") / dt, 1),
        "pace_s_per_trajectory": b.get("pace_s_per_trajectory"),
        "logdir": str(logdir),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="CartPole-v1")
    p.add_argument("--seconds", type=float, default=60.0, help="length of each run, from its first report of data")
    p.add_argument("--warmup-s", type=float, default=10.0, help="left out at the start of each run's data")
    p.add_argument("--repeat", type=int, default=1, help="run every setting this many times, alternating")
    p.add_argument(
        "--settings",
        nargs="+",
        default=["--flow-control none", "--flow-control pace"],
        help="each one a string of train flags (one run each)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    results = []
    for _ in range(args.repeat):
        for setting in args.settings:
            r = run(args.env, shlex.split(setting), args.seconds, args.warmup_s)
            r["env"] = args.env
            results.append(r)
            if not args.json:
                print(" ".join(f"{k}={v}" for k, v in r.items() if k != "logdir"), flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    failed = [r for r in results if "error" in r]
    for r in failed:
        print(f"flow_control: {r['flags']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
