#!/usr/bin/env python3
"""Time for `impala-async train` to reach a target episode return, over several seeds.

Runs the real CLI once per seed, one after the other, watches LOGDIR/metrics.jsonl, and stops the run (SIGINT) once
`episode_return_mean` reaches the target (or at --timeout-s). Prints one line per seed and a summary: the wall time
to the target (from the command's start, the metrics' wall_s), and the steady-state env steps/s (median `sps` of the
metrics lines after the first 3 s with data).

    python tools/time_to_return.py --seeds 0 1 2 --target 475 -- --env CartPole-v1 [more train flags]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from impala_async.learner.reports.metrics import read_metrics


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def run_one(seed: int, target: float, timeout_s: float, train_args: list[str], keep_logs: bool) -> dict:
    logdir = Path(tempfile.mkdtemp(prefix=f"ttr-seed{seed}-"))
    cmd = [sys.executable, "-m", "impala_async", "train", "--seed", str(seed), "--logdir", str(logdir), *train_args]
    log = open(logdir / "stderr.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    reached = None
    try:
        while proc.poll() is None and time.monotonic() - t0 < timeout_s:
            time.sleep(0.25)
            rows = read_metrics(logdir / "metrics.jsonl")
            hit = [r for r in rows if (r.get("episode_return_mean") or -1e9) >= target]
            if hit:
                reached = hit[0]
                break
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
    rows = read_metrics(logdir / "metrics.jsonl")
    live = [r for r in rows if r["env_steps"] > 0]
    start = live[0]["wall_s"] + 3 if live else 0
    steady = [r["sps"] for r in live if r["wall_s"] >= start and (reached is None or r["wall_s"] <= reached["wall_s"])]
    out = {
        "seed": seed,
        "time_to_target_s": reached["wall_s"] if reached else None,
        "env_steps_to_target": reached["env_steps"] if reached else None,
        "steady_sps": statistics.median(steady) if steady else None,
        "best_return": max((r["episode_return_mean"] or 0) for r in rows) if rows else None,
        "exit_code": proc.returncode,
        "logdir": str(logdir),
    }
    if not keep_logs and reached:
        for p in logdir.iterdir():
            p.unlink()
        logdir.rmdir()
        out["logdir"] = None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--target", type=float, default=475.0)
    p.add_argument("--timeout-s", type=float, default=180.0)
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON summary object at the end")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: flags for impala-async train")
    a = p.parse_args()
    train_args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    if not any(x == "--env" for x in train_args):
        train_args = ["--env", "CartPole-v1", *train_args]
    results = []
    for seed in a.seeds:
        r = run_one(seed, a.target, a.timeout_s, train_args, a.keep_logs)
        results.append(r)
        print(json.dumps(r), flush=True)
    times = [r["time_to_target_s"] for r in results]
    done = [t for t in times if t is not None]
    summary = {
        "train_args": train_args,
        "target": a.target,
        "reached": f"{len(done)}/{len(times)}",
        "times_s": times,
        # A seed that missed the target counts as infinitely slow; a median that is infinite is reported as null.
        "median_time_s": _finite(statistics.median(t if t is not None else math.inf for t in times)),
        "steady_sps": [r["steady_sps"] for r in results],
        "cpus": os.cpu_count(),
    }
    print(
        json.dumps(summary)
        if a.json
        else f"reached {summary['reached']}; times {times}; median {summary['median_time_s']}; "
        f"steady sps {summary['steady_sps']}"
    )
    return 0 if len(done) == len(times) else 1


if __name__ == "__main__":
    sys.exit(main())
