#!/usr/bin/env python3
"""Sample Factory's APPO against impala-async on CartPole-v1, same machine, same number of environments, one script.

Runs, one after the other:
  1. Sample Factory APPO (from a separate virtualenv, --sf-python) with --num_workers 2 --num_envs_per_worker 8 on the
     CPU, with the settings of its own CartPole example command;
  2. `impala-async train --env CartPole-v1` with --num-actors x --envs-per-actor giving the same 16 environments.
Each run stops once its average episode return reaches --target or after --timeout-s. Reports, for both, the time to
the target (from the command's start) and the steady-state env steps/s (median of the rates each system reports,
after its first 10 s and until the target or the end).

Set up Sample Factory once (a separate venv, so that its pins do not touch this project's):
    python3 -m venv .venv-sf && .venv-sf/bin/pip install torch==2.13.0 && .venv-sf/bin/pip install sample-factory
    python tools/compare_sample_factory.py --sf-python .venv-sf/bin/python

--skip-sf runs impala-async's half alone: CI's smallest mode (tests/test_tools.py), where Sample Factory's venv is not;
the lines its half reads are checked on lines Sample Factory printed (tests/test_sf_pong.py).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from sf_pong import REWARD, stop_group  # tools/sf_pong.py: Sample Factory's reward line, and how it is stopped

ROOT = Path(__file__).resolve().parent.parent
FPS = re.compile(r"Fps is \(10 sec: ([\d.na]+), 60 sec: ([\d.na]+), 300 sec: ([\d.na]+)\)\. Total num frames: (\d+)")


def run_sample_factory(sf_python: str, seed: int, target: float, timeout_s: float) -> dict:
    train_dir = tempfile.mkdtemp(prefix="sf-")
    cmd = [
        sf_python,
        "-m",
        "sf_examples.train_gym_env",
        "--env=CartPole-v1",
        "--algo=APPO",
        "--use_rnn=False",
        "--num_workers=2",
        "--num_envs_per_worker=8",
        "--device=cpu",
        "--recurrence=1",
        "--with_vtrace=False",
        "--batch_size=512",
        "--reward_scale=0.1",
        "--save_every_sec=1000",
        "--experiment_summaries_interval=10",
        f"--seed={seed}",
        f"--train_dir={train_dir}",
        f"--experiment=cartpole_seed{seed}",
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    fps, hit, lines = [], None, []
    deadline = t0 + timeout_s

    def reader():
        nonlocal hit
        for line in proc.stdout:
            lines.append(line)
            now = time.monotonic() - t0
            m = FPS.search(line)
            if m and m.group(1) != "nan":
                fps.append((now, float(m.group(1)), int(m.group(4))))
            m = REWARD.search(line)
            if m and hit is None and float(m.group(1)) >= target:
                hit = now

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    while proc.poll() is None and time.monotonic() < deadline and hit is None:
        time.sleep(0.25)
    stop_group(proc, 30.0)
    t.join(5)
    end = hit if hit is not None else timeout_s
    steady = [f for now, f, _ in fps if 10 <= now <= end]
    return {
        "system": "sample-factory APPO 2x8",
        "seed": seed,
        "time_to_target_s": hit,
        "steady_sps": statistics.median(steady) if steady else None,
        "fps_samples": len(steady),
        "log_tail": "".join(lines[-3:]) if hit is None else None,
    }


def run_impala_async(seed: int, target: float, timeout_s: float, actors: int, envs: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "time_to_return.py"),
            "--seeds",
            str(seed),
            "--target",
            str(target),
            "--timeout-s",
            str(timeout_s),
            "--json",
            "--",
            "--env",
            "CartPole-v1",
            "--num-actors",
            str(actors),
            "--envs-per-actor",
            str(envs),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    per_seed = json.loads(out.stdout.strip().splitlines()[0])
    return {
        "system": f"impala-async {actors}x{envs}",
        "seed": seed,
        "time_to_target_s": per_seed["time_to_target_s"],
        "steady_sps": per_seed["steady_sps"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sf-python", default=str(ROOT / ".venv-sf" / "bin" / "python"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--target", type=float, default=475.0)
    p.add_argument("--timeout-s", type=float, default=240.0)
    p.add_argument("--actors", type=int, default=1, help="impala-async actors (actors x envs-per-actor = 16)")
    p.add_argument("--envs-per-actor", type=int, default=16)
    p.add_argument("--skip-sf", action="store_true", help="impala-async's runs only (CI's smallest mode)")
    a = p.parse_args()
    results = []
    for seed in a.seeds:
        if not a.skip_sf:
            results.append(run_sample_factory(a.sf_python, seed, a.target, a.timeout_s))
            print(json.dumps(results[-1]), flush=True)
        results.append(run_impala_async(seed, a.target, a.timeout_s, a.actors, a.envs_per_actor))
        print(json.dumps(results[-1]), flush=True)
    sf = [r["steady_sps"] for r in results if r["system"].startswith("sample") and r["steady_sps"]]
    ours = [r["steady_sps"] for r in results if r["system"].startswith("impala") and r["steady_sps"]]
    summary = {
        "sf_steady_sps": statistics.median(sf) if sf else None,
        "impala_async_steady_sps": statistics.median(ours) if ours else None,
        "sf_times_s": [r["time_to_target_s"] for r in results if r["system"].startswith("sample")],
        "impala_async_times_s": [r["time_to_target_s"] for r in results if r["system"].startswith("impala")],
    }
    if sf and ours:
        summary["sps_ratio"] = summary["impala_async_steady_sps"] / summary["sf_steady_sps"]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
