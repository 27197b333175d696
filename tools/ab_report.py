"""The A/B harness's report (tools/ab.py): each run's figures from its metrics, the median and range of each arm's,
the markdown table and the figure of the curves."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from ab_experiment import Experiment, planned

from impala_async.learner.reports.metrics import read_metrics

PLOT = Path(__file__).resolve().parent / "plot.py"
BUSY_CORES = 0.5  # cores busy at a run's start with work other than the experiment's: something else is running


def twins_agree(first: Path, twin: Path) -> bool:
    """Whether two runs' final checkpoints agree: parameters bit for bit, counters, the last 100 returns in order."""
    import torch

    from impala_async.learner import checkpoint

    a, b = (checkpoint.load_latest(d, validate=checkpoint.validate_learner_state)[0] for d in (first, twin))
    ma, mb = a["learner"]["model"], b["learner"]["model"]
    same = ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    return same and all(a[k] == b[k] for k in ("policy_version", "env_steps", "episodes", "returns", "lengths"))


def return_at(rows: list[dict], steps: float) -> float | None:
    """The return of the last report at or before ``steps`` env steps (None if the run did not get that far)."""
    if not rows or rows[-1]["env_steps"] < steps * 0.99:
        return None
    before = [r["episode_return_mean"] for r in rows if r["env_steps"] <= steps]
    return before[-1] if before else None


def run_figures(exp: Experiment, logdir: Path) -> dict:
    """One run's figures from its metrics.jsonl and ab-run.json."""
    record = json.loads((logdir / "ab-run.json").read_text())
    rows = [r for r in read_metrics(logdir / "metrics.jsonl") if r.get("episode_return_mean") is not None]
    last = read_metrics(logdir / "metrics.jsonl")[-1:] or [{}]
    hit = next((r for r in rows if exp.threshold is not None and r["episode_return_mean"] >= exp.threshold), None)
    wall_s = last[0].get("wall_s")
    twin = logdir.with_name(logdir.name + "-twin")
    return {
        "twin_agrees": twins_agree(logdir, twin) if exp.twice and (twin / "ab-run.json").exists() else None,
        "final": rows[-1]["episode_return_mean"] if rows else None,
        "at": [return_at(rows, f * exp.total_env_steps) for f in exp.checkpoints],
        "steps_to_threshold": hit["env_steps"] if hit else None,
        "wall_to_threshold_s": hit["wall_s"] if hit else None,
        "wall_s": record["wall_s"],
        "env_steps": last[0].get("env_steps"),
        "env_steps_per_s": (last[0].get("env_steps") or 0) / wall_s if wall_s else None,
        "busy": record.get("busy_cores_at_start", record.get("load_at_start", 0)) > BUSY_CORES,  # (older: load)
        "resumed": record.get("resumes", 0) > 0,
        "exit_code": record["exit_code"],
    }


def spread(values: list) -> dict:
    """Median, minimum and maximum of the values that exist, and how many do."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def summarise(exp: Experiment, out: Path) -> dict:
    """arm -> {"runs": [per-run figures], figure -> spread over the arm's finished seeds}."""
    summary = {}
    for arm in exp.arms:
        runs = [run_figures(exp, d) for a, _, d in planned(exp, out) if a == arm and (d / "ab-run.json").exists()]
        arm_summary = {"runs": runs}
        for key in ("final", "steps_to_threshold", "wall_to_threshold_s", "wall_s", "env_steps_per_s"):
            arm_summary[key] = spread([r[key] for r in runs])
        arm_summary["at"] = [spread([r["at"][i] for r in runs]) for i in range(len(exp.checkpoints))]
        summary[arm] = arm_summary
    return summary


def fmt(s: dict, digits: int = 1, scale: float = 1.0) -> str:
    if s["median"] is None:
        return "-"
    med, lo, hi = (v / scale for v in (s["median"], s["min"], s["max"]))
    return f"{med:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]" if s["n"] > 1 else f"{med:.{digits}f}"


def table(exp: Experiment, summary: dict) -> str:
    """The summary as a markdown table: median [min, max] over each arm's seeds."""
    budget = exp.total_env_steps
    cols = ["arm", "seeds"] + [f"return at {f * budget / 1e6:g}M" for f in exp.checkpoints] + ["final return"]
    if exp.threshold is not None:
        cols += [f"M steps to {exp.threshold:g} (seeds)", f"minutes to {exp.threshold:g}"]
    cols += ["wall minutes", "env steps/s"] + (["twins agree"] if exp.twice else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for arm, s in summary.items():
        runs = s["runs"]
        seeds = f"{len(runs)}" + (f" ({sum(r['busy'] for r in runs)} busy)" if any(r["busy"] for r in runs) else "")
        seeds += f" ({sum(r['resumed'] for r in runs)} resumed)" if any(r["resumed"] for r in runs) else ""
        seeds += f", {sum(r['exit_code'] != 0 for r in runs)} failed" if any(r["exit_code"] for r in runs) else ""
        cells = [arm, seeds] + [fmt(a) for a in s["at"]] + [fmt(s["final"])]
        if exp.threshold is not None:
            n = s["steps_to_threshold"]["n"]
            cells += [f"{fmt(s['steps_to_threshold'], 2, 1e6)} ({n}/{len(runs)})", fmt(s["wall_to_threshold_s"], 1, 60)]
        cells += [fmt(s["wall_s"], 1, 60), fmt(s["env_steps_per_s"], 0)]
        if exp.twice:
            checked = [r["twin_agrees"] for r in runs if r["twin_agrees"] is not None]
            cells.append(f"{sum(checked)}/{len(checked)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(exp: Experiment, out: Path) -> None:
    done = [(a, d) for a, _, d in planned(exp, out) if (d / "ab-run.json").exists() and (d / "metrics.jsonl").exists()]
    if not done:
        return
    cmd = [sys.executable, str(PLOT), *(str(d) for _, d in done), "--labels", ",".join(a for a, _ in done)]
    cmd += ["--median", "-o", str(out / "curves.png"), "--title", exp.name]
    if exp.threshold is not None:
        cmd += ["--anchor", f"all={exp.threshold}:threshold {exp.threshold:g}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(result.stdout.strip() or result.stderr.strip(), flush=True)
