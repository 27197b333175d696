"""tools/keep_curve.py: a run's metrics thinned to a committable curve. The choice of records against one written out
by hand, and the real script on a metrics.jsonl with a torn last line, its output read back as a run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import tool
from procutil import run_cli

from impala_async.learner.reports.metrics import read_metrics

TOOL = Path(__file__).resolve().parent.parent / "tools" / "keep_curve.py"
keep_curve = tool("keep_curve")
plot = tool("plot")


def records(n: int = 23, steps_per_record: int = 1000, first_return_at: int = 3) -> list[dict]:
    """Records every 1000 env steps with a noise key a curve does not need; no return before record 3."""
    return [
        {
            "wall_s": 0.5 * i,
            "env_steps": steps_per_record * i,
            "episode_return_mean": None if i < first_return_at else float(i),
            "rho_hist": [i, i],
        }
        for i in range(n)
    ]


def test_thin_keeps_first_first_return_each_mark_and_last():
    kept = keep_curve.thin(records(), every_env_steps=5000, keys=("env_steps", "episode_return_mean", "wall_s"))
    # record 0 (first), 3 (first return), 5, 10, 15, 20 (the marks), 22 (last)
    assert [r["env_steps"] for r in kept] == [0, 3000, 5000, 10000, 15000, 20000, 22000]
    assert all(set(r) == {"env_steps", "episode_return_mean", "wall_s"} for r in kept)
    assert kept[1] == {"wall_s": 1.5, "env_steps": 3000, "episode_return_mean": 3.0}  # values unchanged


def test_thin_steps_that_skip_a_mark_keep_the_first_record_past_it():
    """Records 7000 steps apart with marks every 5000: each record past a mark is kept once, no mark twice."""
    kept = keep_curve.thin(records(n=6, steps_per_record=7000, first_return_at=0), 5000, ("env_steps",))
    # marks 0, 5000 (met at 7000), 10000 (14000), 15000 (21000), 25000 (28000), 30000 (35000): every record
    assert [r["env_steps"] for r in kept] == [0, 7000, 14000, 21000, 28000, 35000]
    kept = keep_curve.thin(records(n=9, steps_per_record=2000, first_return_at=0), 5000, ("env_steps",))
    assert [r["env_steps"] for r in kept] == [0, 6000, 10000, 16000]


@pytest.mark.process
def test_real_script_thins_a_run_that_plot_reads_as_before(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps(r) for r in records(n=101)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"wall_s": 99, "env_st')
    out = tmp_path / "kept" / "curve.jsonl"
    done = run_cli(str(run), "-o", str(out), "--every-env-steps", "10000", script=TOOL, timeout=60)
    assert done.returncode == 0, done.stderr
    kept = read_metrics(out)
    assert [r["env_steps"] for r in kept] == [0, 3000, *range(10000, 100001, 10000)]
    assert "rho_hist" not in kept[0] and "101 records" in done.stdout and "12 records" in done.stdout
    full = plot.read_series(run / "metrics.jsonl", "episode_return_mean", "env_steps")
    thinned = plot.read_series(out, "episode_return_mean", "env_steps")
    assert set(zip(*thinned, strict=True)) <= set(zip(*full, strict=True)) and len(thinned[0]) == 11
    assert not list(out.parent.glob("*.partial"))


@pytest.mark.process
@pytest.mark.parametrize(
    ("has_metrics", "argv", "message"),
    [(True, ["--every-env-steps", "0"], "--every-env-steps must be positive"), (False, [], "no metrics.jsonl")],
)
def test_real_script_refuses_bad_input(tmp_path, has_metrics, argv, message):
    run = tmp_path / "run"
    run.mkdir()
    if has_metrics:
        (run / "metrics.jsonl").write_text(json.dumps(records(n=1)[0]) + "\n")
    done = run_cli(str(run), "-o", str(tmp_path / "out.jsonl"), *argv, script=TOOL, timeout=60)
    assert done.returncode == 2 and message in done.stderr
    assert not (tmp_path / "out.jsonl").exists()
