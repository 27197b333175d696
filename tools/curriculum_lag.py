#!/usr/bin/env python3
"""How far behind the learner's count the environments play, in env steps (one-step episodes): the curriculum test's
two CLI phases (tests/test_curriculum.py, test_cli_environments_follow_the_schedule_across_a_resume), then, for every
metrics record past the start, env_steps_trained - 50 - the count at which the schedule gives the difficulty the last
100 episodes played (DifficultyProbe's reward is its episode's difficulty). Prints (worst lag in steps, worst policy
lag in versions) per run. Data in flight between the encoding of a difficulty and the training of the episodes played
with it is what this measures: socket buffers, queues, the ring, unrolls under way.

    python tools/curriculum_lag.py --runs 5
    python tools/curriculum_lag.py --logdir DIR   # the smallest: measure a run already made (test_curriculum's)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import CURRICULUM_ENV_STEPS as N_STEPS  # noqa: E402  (the test's run, exactly)
from helpers import CURRICULUM_FLAGS as FLAGS  # noqa: E402

WINDOW = 100  # episode_return_mean: the last 100 episodes


def steps_at(difficulty: float) -> float:
    return (difficulty - 0.5) / 1.5 * N_STEPS


def one_run() -> Path:
    """The test's two CLI phases: a run stopped at 3,000 env steps, resumed to the ramp's end and 2,100 past it."""
    logdir = Path(tempfile.mkdtemp(prefix="curriculum-lag-")) / "run"
    for args, budget in [([*FLAGS, "--logdir", str(logdir)], 3000), (["--resume", str(logdir)], N_STEPS + 2100)]:
        subprocess.run(
            [sys.executable, "-m", "impala_async", "train", *args, "--total-env-steps", str(budget)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=300,
            check=True,
        )
    return logdir


def lags(logdir: Path) -> tuple[int, int]:
    """(worst lag in env steps, worst policy lag in versions) over the run's metrics records past its start."""
    worst, lag = 0.0, 0
    for line in (logdir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        seen = r["episode_return_mean"]
        if seen is None or r["env_steps_trained"] < 2100 or seen >= 2.0:
            continue
        worst = max(worst, r["env_steps_trained"] - WINDOW / 2 - steps_at(seen))
        lag = max(lag, r["policy_lag_max"] or 0)
    return round(worst), lag


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--logdir", type=Path, help="measure this run (made with the test's flags) instead of making runs")
    args = p.parse_args()
    if args.logdir:
        worst, lag = lags(args.logdir)
        print(json.dumps({"run": str(args.logdir), "worst_lag_steps": worst, "worst_policy_lag_versions": lag}))
        return 0
    for i in range(args.runs):
        worst, lag = lags(one_run())
        print(json.dumps({"run": i, "worst_lag_steps": worst, "worst_policy_lag_versions": lag}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
