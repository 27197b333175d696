"""Policy-collapse warnings (learner/watch.py): the detector on synthetic metrics series, and the real CLI warning
on stderr when a run collapses."""

from __future__ import annotations

import asyncio
import logging
import math

import inprocess
import numpy as np
from procutil import read_metrics

from impala_async.config import LearnerConfig
from impala_async.learner.reports.watch import CollapseWatch

KNOBS = ("--clip-rho-threshold", "--entropy-cost", "--learning-rate")


def watch(fresh: bool = True, **kw) -> CollapseWatch:
    cfg = LearnerConfig.of(**kw)
    return CollapseWatch.from_config(cfg, num_actions=2, fresh=fresh)


def feed(w: CollapseWatch, series, updates_per_report: int = 10, report_s: float = 1.0, rho=None) -> list[str]:
    """Feed one record per value of ``series`` (entropies), ``updates_per_report`` updates and ``report_s`` apart."""
    out = []
    for i, entropy in enumerate(series):
        rec = {
            "wall_s": (i + 1) * report_s,
            "learner_steps": (i + 1) * updates_per_report,
            "entropy": entropy,
            "rho_far_frac": None if rho is None else rho[i],
            "policy_lag_avg": 3.0,
            "episode_return_mean": 20.0,
        }
        out += w.feed(rec)
    return out


def noisy(level: float, n: int, seed: int = 0, spread: float = 0.5) -> list[float]:
    """``level`` times a factor drawn from [1 - spread, 1 + spread]: report-to-report noise."""
    rng = np.random.default_rng(seed)
    return list(level * rng.uniform(1 - spread, 1 + spread, n))


def test_fires_on_an_entropy_cliff_naming_the_knobs():
    # 0.6 nats for 500 updates, then down to 1e-4 within 100 updates (the MinAtar probe: 0.97 -> 7e-5 in ~600).
    series = noisy(0.6, 50, spread=0.2) + list(np.geomspace(0.6, 1e-4, 10)) + noisy(1e-4, 20, seed=1)
    warned = feed(watch(), series)
    assert len(warned) == 1, warned  # 30 s of collapse, one warning (at most one a minute)
    assert "entropy" in warned[0] and all(k in warned[0] for k in KNOBS), warned[0]
    assert "0.8-1.2" in warned[0]


def test_quiet_on_noise_a_single_outlier_and_slow_settling():
    w = watch()
    assert feed(w, noisy(0.5, 300, spread=0.6)) == []  # +-60 % report to report
    spikes = noisy(0.5, 300, seed=2, spread=0.3)
    for i in range(10, 300, 30):
        spikes[i] = 1e-4  # one odd report at a time: the median of 3 ignores it
    assert feed(watch(), spikes) == []
    # A policy settling over 20,000 updates from log 2 to 0.01 nats: never an order of magnitude within 1000 updates.
    assert feed(watch(), list(np.geomspace(math.log(2), 0.01, 2000))) == []


def test_rate_limited_once_a_minute_per_kind():
    series = noisy(0.6, 20) + noisy(1e-3, 600, seed=3)  # ten minutes of collapse, a report a second
    rho = [0.0] * 20 + [0.4] * 600
    w = watch()
    warned = feed(w, series, rho=rho)
    # Drift: once a minute for as long as it lasts. The cliff: once a minute while the fall lies within the window
    # (1000 updates: 100 s here); after that the entropy's recent maximum is its collapsed level, and the cliff is old.
    assert w.warnings == {"entropy": 2, "rho": 10}, w.warnings
    assert len(warned) == 12
    w = watch(collapse_warn_interval_s=300.0)
    feed(w, series, rho=rho)
    assert w.warnings == {"entropy": 1, "rho": 2}


def test_policy_drift_from_importance_weights():
    healthy = list(np.random.default_rng(4).uniform(0, 0.002, 200))
    healthy[50] = healthy[120] = 0.6  # single odd reports
    assert feed(watch(), noisy(0.5, 200, spread=0.1), rho=healthy) == []
    drifting = healthy[:100] + [0.05, 0.3, 0.25, 0.3] + healthy[:96]
    warned = feed(watch(), noisy(0.5, 200, spread=0.1), rho=drifting)
    assert len(warned) == 1 and "[1/2, 2]" in warned[0] and all(k in warned[0] for k in KNOBS), warned
    assert "policy lag 3" in warned[0]
    assert feed(watch(collapse_rho_far_frac=0.0), noisy(0.5, 200), rho=[0.9] * 200) == []  # 0: off


def test_collapse_before_the_first_report_and_resumed_runs():
    # CartPole at --learning-rate 0.5: entropy 0.066 in the first report (14 updates), then 0.0015, 0.003 ...
    first = [0.066, 0.0015, 0.0031, 0.0088, 0.0095]
    assert len(feed(watch(), first)) == 1  # a fresh run counts log(2) at update 0
    # Resumed at a low, steady entropy: nothing fell, nothing to say.
    assert feed(watch(fresh=False), noisy(0.003, 100)) == []
    assert feed(watch(collapse_entropy_fraction=0.0), first) == []  # 0: off


def test_records_without_updates_are_skipped():
    w = watch()
    recs = [{"wall_s": float(i), "learner_steps": 0, "entropy": None, "rho_far_frac": None} for i in range(5)]
    assert [w.feed(r) for r in recs] == [[]] * 5


def test_a_collapsing_run_is_warned_of_once_per_kind(tmp_path, caplog):
    """An absurd learning rate without entropy bonus collapses CartPole's policy within seconds; the learner's log
    says so once per kind (the run is shorter than the minute between repeats) and names the remedies. The learner
    serves in this test's loop, a real actor of 8 environments in a thread (tests/inprocess.py)."""
    logdir = tmp_path / "run"
    flags = ["--unroll-length", "10", "--batch-size", "4", "--report-interval-s", "0.25", "--learning-rate", "0.5"]
    cfg, spec = inprocess.configuration(tmp_path, *flags, "--entropy-cost", "0", "--total-env-steps", "20000")
    caplog.set_level(logging.WARNING, logger="impala_async.learner.watch")
    asyncio.run(inprocess.train(cfg, spec, envs_per_actor=8))
    lines = [r.getMessage() for r in caplog.records if r.name == "impala_async.learner.watch"]
    cliffs = [ln for ln in lines if "policy collapse?" in ln]
    assert len(cliffs) == 1, caplog.text
    assert all(k in cliffs[0] for k in KNOBS), cliffs[0]
    assert len([ln for ln in lines if "policy drift" in ln]) <= 1
    rows = [r for r in read_metrics(logdir) if r["entropy"] is not None]
    assert rows[-1]["entropy"] < 0.1 * math.log(2), rows[-1]  # it did collapse
    assert all(0 <= r["rho_far_frac"] <= 1 for r in rows)
