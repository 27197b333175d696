"""--tensorboard 1 (reports/tboard.py): a real training run's events read back with TensorBoard's own reader, figure
for figure against its metrics.jsonl."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

import inprocess
import pytest
from procutil import read_metrics

from impala_async.learner.reports import metrics, tboard


def test_a_run_writes_every_figure_and_the_rho_histogram(tmp_path):
    """--tensorboard 1: every figure of every metrics record is a scalar, and the rho histogram is written. The learner
    serves in this test's loop, a real actor in a thread (tests/inprocess.py)."""
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install 'impala-async[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "run"
    flags = ["--unroll-length", "10", "--batch-size", "4", "--report-interval-s", "0.25", "--tensorboard", "1"]
    cfg, spec = inprocess.configuration(tmp_path, *flags, "--total-env-steps", "6000")
    asyncio.run(inprocess.train(cfg, spec))
    rows = read_metrics(logdir)
    assert rows
    events = EventAccumulator(str(logdir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {tag for row in rows for tag, _ in tboard.scalars(row)}
    assert tags == expected, (sorted(expected - tags), sorted(tags - expected))
    for tag in ("episode_return_mean", "loss_pg", "env_steps", "sps", "stage_s_per_trajectory/train"):
        assert tag in tags, tag
    assert "incarnation" not in tags and "rho_hist" not in tags

    def written(tag):
        return sorted((e.step, e.value) for e in events.Scalars(tag))

    for tag in ("episode_return_mean", "loss_pg", "policy_lag_avg"):
        want = sorted((r["env_steps"], r[tag]) for r in rows if r[tag] is not None)
        got = written(tag)
        assert len(got) == len(want) > 0, tag
        for (gs, gv), (ws, wv) in zip(got, want, strict=True):  # scalars are stored as float32
            assert gs == ws and math.isclose(gv, wv, rel_tol=1e-6, abs_tol=1e-6), (tag, gs, gv, ws, wv)
    nested = written("stage_s_per_trajectory/train")
    assert len(nested) == sum(r["stage_s_per_trajectory"]["train"] is not None for r in rows)

    hists = events.Histograms("rho")
    with_rho = [r for r in rows if r["rho_hist"]]
    assert len(hists) == len(with_rho) > 0
    assert sum(sum(h.histogram_value.bucket) for h in hists) == sum(sum(r["rho_hist"]) for r in with_rho)
    assert sorted(h.step for h in hists) == sorted(r["env_steps"] for r in with_rho)
    first = hists[0].histogram_value
    assert list(first.bucket_limit[:-1]) == pytest.approx(list(metrics.RHO_BIN_EDGES[1:]))
    assert first.bucket_limit[-1] == sys.float_info.max
    # Two reports can share env_steps (the trainer goes on with what is in the ring after actors stop), so the
    # histograms are matched as a multiset of (step, counts), not by step alone.
    got = sorted((h.step, tuple(int(c) for c in h.histogram_value.bucket)) for h in hists)
    assert got == sorted((r["env_steps"], tuple(r["rho_hist"])) for r in with_rho)


def test_rho_histogram_edges():
    edges = list(metrics.RHO_BIN_EDGES)
    counts = [0] * len(edges)
    counts[4], counts[5] = 3, 7  # (0.95, 1.05] and (1.05, 1.25]
    h = tboard.rho_histogram({"rho_hist": counts, "rho_hist_edges": edges, "rho_mean": 1.0})
    assert (h["min"], h["max"], h["num"], h["sum"]) == (0.95, 1.25, 10.0, 10.0)
    counts[-1] = 1  # the open bin (10, inf)
    h = tboard.rho_histogram({"rho_hist": counts, "rho_hist_edges": edges, "rho_mean": None})
    assert h["max"] == 10 * tboard.OPEN_BIN_DRAWN_TO and h["sum"] == 0.0
    assert tboard.rho_histogram({"rho_hist": None, "rho_hist_edges": edges}) is None
    assert dict(
        tboard.scalars({"a": 1, "b": None, "c": {"d": 2.5, "e": None}, "f": float("nan"), "g": [1], "incarnation": 5})
    ) == {"a": 1.0, "c/d": 2.5}


@pytest.mark.process
def test_without_the_extra_it_says_what_to_install(tmp_path):
    """tensorboard made unimportable: one line naming the pip install, before anything starts."""
    code = (
        "import sys; sys.modules['tensorboard'] = None; from impala_async import cli; sys.exit(cli.main(sys.argv[1:]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "learner", "--tensorboard", "1", "--logdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert out.stderr.strip() == (
        "impala-async: --tensorboard 1 needs the tensorboard package, which is not "
        "installed: pip install 'impala-async[tensorboard]'"
    ), out.stderr
