#!/usr/bin/env python3
"""The ingest benchmark of BENCHMARKS.md: the learner's ingest rate as a fraction of this machine's ceiling.

One script, one run after the other, nothing else running:
  1. ../shared/bench/limits.py --quick --only 5: the machine's end-to-end ingest ceilings for the same payloads
     (Pong-like and CartPole 80-step trajectories; its best path decompresses LZ4 straight into the ring slot);
  2. tools/loadtest.py, ingest-only, learner pinned to CPU 0 and actors to CPU 1 as limits.py pins them:
     Atari profile (as whole stacks, like limits.py's payload, and as single frames, the default) and CartPole
     profile with 8 actors, then 4 and 64 actors.
Prints one JSON object per measurement and a summary with the ratios.

    python tools/bench_ingest.py [--limits ../shared/bench/limits.py] [--seconds 15]
    python tools/bench_ingest.py --limits none --only cartpole_8x1 --actors 1 --seconds 1 --warmup-s 0.5  # the smallest

``--limits none`` measures no ceiling (the summary then has no ratios); ``--only`` runs the named rows alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def limits(path: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix="limits-")) / "limits.json"
    subprocess.run(
        [sys.executable, str(path), "--quick", "--only", "5", "--json", str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
        cwd=ROOT,
    )
    rows = {r["label"]: r for r in json.loads(out.read_text())["e2e"] if "error" not in r}
    return {
        "atari_best": rows["Atari: lz4b -> ctypes straight into slot"]["frames_per_s"],
        "atari_spec_path": rows["Atari: lz4f -> np.copyto  [spec path]"]["frames_per_s"],
        "cartpole_best": rows["CartPole: lz4b -> ctypes straight into slot"]["frames_per_s"],
        "cartpole_spec_path": rows["CartPole: lz4f -> np.copyto  [spec path]"]["frames_per_s"],
    }


def loadtest(obs: str, actors: int, per_message: int, seconds: float, warmup_s: float, extra=()) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "loadtest.py"),
            "--obs",
            obs,
            "--actors",
            str(actors),
            "--trajectories-per-message",
            str(per_message),
            "--seconds",
            str(seconds),
            "--warmup-s",
            str(warmup_s),
            "--pin",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    if out.returncode != 0:
        raise SystemExit(f"loadtest failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


PLAN = [  # (row, observations, actors, trajectories a message, loadtest's extra flags)
    # Atari as whole 4-frame stacks (--frame-dedup 0): the payload limits.py measures, so the ratio is like for like.
    # "atari_frames_*" is the default since frame dedup: the same env frames in a quarter of the bytes; its ratio to
    # the stacks' ceiling says how much faster the learner takes in Atari frames, not how close to a limit it runs.
    ("atari_8x1", "atari", 8, 1, ("--learner-flag=--frame-dedup=0",)),
    ("atari_8x16", "atari", 8, 16, ("--learner-flag=--frame-dedup=0",)),
    ("atari_frames_8x1", "atari", 8, 1, ()),
    ("atari_frames_8x16", "atari", 8, 16, ()),
    ("cartpole_8x1", "cartpole", 8, 1, ()),
    ("cartpole_8x16", "cartpole", 8, 16, ()),
]
SCALING = [
    ("atari_4x16", "atari", 4, 16, ("--learner-flag=--frame-dedup=0",)),
    ("atari_64x16", "atari", 64, 16, ("--learner-flag=--frame-dedup=0",)),
    ("cartpole_4x16", "cartpole", 4, 16, ()),
    ("cartpole_64x16", "cartpole", 64, 16, ()),
]


def row_summary(r: dict, best: float | None) -> dict:
    return {
        "frames_per_s": round(r["frames_per_s"]),
        "of_best_path": None if best is None else round(r["frames_per_s"] / best, 3),
        "decoded_mb_per_s": round(r["decoded_mb_per_s"]),
        "latency_p50_ms": r["latency_p50_ms"],
        "latency_p99_ms": r["latency_p99_ms"],
        "loop_lag_p99_ms": r["loop_lag_p99_ms"],
        "stages_us_per_traj": {k: round(v * 1e6, 1) for k, v in r["stages"].items()},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limits", default=str(ROOT.parent / "shared" / "bench" / "limits.py"), help="or none")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--warmup-s", type=float, default=5.0, help="each loadtest run's ignored start")
    p.add_argument("--skip-scaling", action="store_true")
    p.add_argument("--only", default="", help="comma-separated rows to run (default: all)")
    p.add_argument("--actors", type=int, default=0, help="actors in every row (default 0: each row's own)")
    a = p.parse_args()
    plan = PLAN + ([] if a.skip_scaling else SCALING)
    if a.only:
        wanted = a.only.split(",")
        unknown = sorted(set(wanted) - {row[0] for row in PLAN + SCALING})
        if unknown:
            p.error(f"unknown rows {unknown}; rows: {', '.join(row[0] for row in PLAN + SCALING)}")
        plan = [row for row in PLAN + SCALING if row[0] in wanted]
    ceiling = None if a.limits == "none" else limits(Path(a.limits))
    print(json.dumps({"limits": ceiling}), flush=True)
    runs = {}
    for name, obs, actors, n, extra in plan:
        runs[name] = loadtest(obs, a.actors or actors, n, a.seconds, a.warmup_s, extra)
        print(json.dumps({name: runs[name]}), flush=True)
    summary: dict = {"ceiling_frames_per_s": ceiling}
    for name, r in runs.items():
        best = None if ceiling is None else ceiling["atari_best" if name.startswith("atari") else "cartpole_best"]
        summary[name] = row_summary(r, best)
    for obs in ("atari", "cartpole"):
        if f"{obs}_4x16" in runs and f"{obs}_64x16" in runs:
            ratio = runs[f"{obs}_64x16"]["frames_per_s"] / runs[f"{obs}_4x16"]["frames_per_s"]
            summary[f"{obs}_64_vs_4"] = round(ratio, 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
