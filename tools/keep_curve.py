#!/usr/bin/env python3
"""A run's learning curve, small enough to commit: a metrics.jsonl thinned to one record per N env steps and the keys
a curve needs, itself a metrics.jsonl that tools/plot.py and tools/ab.py's report read as they read a run.

    python tools/keep_curve.py runs/ab/pong-v5-150min/preset/s0 -o docs/runs/pong-v5-preset-s0.jsonl
    python tools/keep_curve.py RUN -o OUT --every-env-steps 100000 --keys wall_s,env_steps,episode_return_mean

Why: a run directory (checkpoints, the full metrics.jsonl of ~100 keys a record, tens of MB) is not committed, and a
benchmark whose run was lost with its machine keeps only the figures someone copied out. The first record, the first
with an episode return, then the first record at or past each multiple of ``--every-env-steps`` and the last are kept;
a line still being written (a torn last line) is skipped. Records keep their order and their values unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from plot import metrics_path

from impala_async.learner.reports.metrics import read_metrics

DEFAULT_KEYS = (
    "wall_s",
    "env_steps",
    "env_steps_trained",
    "learner_steps",
    "episodes",
    "episode_return_mean",
    "episode_length_mean",
    "entropy",
    "entropy_cost",
    "lr",
    "grad_norm",
    "value_explained_variance",
    "sps",
    "policy_lag_avg",
    "trajectories_dropped",
    "trajectories_rejected",
)


def thin(records: list[dict], every_env_steps: int, keys: tuple[str, ...]) -> list[dict]:
    """The records a curve needs (see the module's docstring), each cut to ``keys`` (a key a record lacks is left
    out)."""
    kept, next_mark, seen_return = [], 0, False
    for i, row in enumerate(records):
        steps = row.get("env_steps")
        first_return = not seen_return and row.get("episode_return_mean") is not None
        seen_return = seen_return or first_return
        at_mark = isinstance(steps, int | float) and steps >= next_mark
        if i == 0 or first_return or at_mark or i == len(records) - 1:
            kept.append({k: row[k] for k in keys if k in row})
        if at_mark:
            next_mark = (int(steps) // every_env_steps + 1) * every_env_steps
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run's logdir or its metrics.jsonl")
    parser.add_argument("-o", "--out", required=True, help="the thinned metrics.jsonl to write")
    parser.add_argument("--every-env-steps", type=int, default=50_000, help="one record per this many env steps")
    parser.add_argument("--keys", default=",".join(DEFAULT_KEYS), help="comma-separated keys to keep")
    args = parser.parse_args(argv)
    if args.every_env_steps <= 0:
        parser.error(f"--every-env-steps must be positive, got {args.every_env_steps}")
    source = metrics_path(args.run)
    if not source.is_file():
        parser.error(f"no metrics.jsonl at {source}")
    records = [r for r in read_metrics(source) if isinstance(r, dict)]
    if not records:
        parser.error(f"{source} holds no records")
    kept = thin(records, args.every_env_steps, tuple(k for k in args.keys.split(",") if k))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # written whole, then renamed: never a half-written curve
    partial.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in kept))
    partial.replace(out)
    print(f"{source}: {len(records)} records -> {out}: {len(kept)} records, {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
