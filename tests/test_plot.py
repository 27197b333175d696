"""tools/plot.py: learning curves from synthetic metrics.jsonl files, drawn by the real script as a subprocess."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from procutil import run_cli

pytest.importorskip("matplotlib", reason="tools/plot.py needs matplotlib: pip install -e '.[plot]'")
Image = pytest.importorskip("PIL.Image", reason="reading the PNG back needs Pillow (matplotlib depends on it)")

PLOT = Path(__file__).resolve().parent.parent / "tools" / "plot.py"


def write_run(directory: Path, scale: float, steps: int = 30) -> Path:
    """A run's metrics.jsonl: a return rising with env steps, null before the first episode, and a torn last line."""
    directory.mkdir(parents=True)
    lines = [json.dumps({"wall_s": 0.5, "env_steps": 0, "episode_return_mean": None})]
    for i in range(1, steps):
        lines.append(
            json.dumps(
                {"wall_s": 0.5 * (i + 1), "env_steps": 1000 * i, "episode_return_mean": scale * (1 - np.exp(-i / 10))}
            )
        )
    (directory / "metrics.jsonl").write_text("\n".join(lines) + '\n{"wall_s": 99, "env_st')
    return directory


def plot(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, script=PLOT, timeout=120)


def read_png(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        assert img.format == "PNG"
        return np.asarray(img.convert("RGB"))


@pytest.mark.process
def test_two_runs_at_the_requested_size(tmp_path):
    a, b = write_run(tmp_path / "run-a", 200.0), write_run(tmp_path / "run-b", 450.0, steps=20)
    out = tmp_path / "curve.png"
    done = plot(str(a), str(b / "metrics.jsonl"), "-o", str(out), "--size", "900x400", "--title", "test")
    assert done.returncode == 0, done.stderr
    assert "2 runs, 2 labels" in done.stdout
    pixels = read_png(out)
    assert pixels.shape == (400, 900, 3)
    colours = {tuple(c) for c in pixels.reshape(-1, 3)[::7]}
    assert (31, 119, 180) in colours and (255, 127, 14) in colours, "the two runs' lines (C0 and C1) are missing"


@pytest.mark.process
def test_median_of_runs_sharing_a_label(tmp_path):
    runs = [str(write_run(tmp_path / f"s{i}", 100.0 * (i + 1))) for i in range(3)]
    out = tmp_path / "median.png"
    done = plot(*runs, "--labels", "seeds,seeds,seeds", "--median", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "3 runs, 1 labels" in done.stdout
    assert read_png(out).shape == (450, 1200, 3)  # the default size


@pytest.mark.process
def test_refusals(tmp_path):
    a = write_run(tmp_path / "a", 1.0)
    wrong = plot(str(a), "--labels", "x,y", "-o", str(tmp_path / "x.png"))
    assert wrong.returncode == 2 and "--labels names 2 runs, 1 given" in wrong.stderr
    empty = plot(str(a), "--metric", "no_such_metric", "-o", str(tmp_path / "x.png"))
    assert empty.returncode == 1 and "nothing to draw" in empty.stderr
    assert not (tmp_path / "x.png").exists()


def test_median_band_spans_the_common_range():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_tool", PLOT)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    series = [([0, 10, 20], [0, 1, 2]), ([5, 15, 30], [3, 3, 3]), ([0, 20, 25], [0, 4, 5])]
    grid, median, low, high = tool.median_band(series)
    assert (grid[0], grid[-1]) == (5, 20)  # where all three have data
    at = np.searchsorted(grid, 10)
    x = grid[at]
    values = sorted([x / 10, 3.0, x / 5])
    assert (median[at], low[at], high[at]) == pytest.approx(values[1:2] + values[:1] + values[2:])
    assert tool.median_band([([0, 1], [0, 0]), ([2, 3], [0, 0])]) is None


@pytest.mark.process
def test_one_panel_per_label_with_anchors(tmp_path):
    """--per-label: a panel per game; an anchor is a dashed grey line in its own game's panel only."""
    runs = [
        str(write_run(tmp_path / f"{game}{i}", scale)) for game, scale in (("a", 100.0), ("b", 5.0)) for i in (0, 1)
    ]
    out = tmp_path / "games.png"
    done = plot(*runs, "--labels", "A,A,B,B", "--median", "--per-label", "--anchor", "A=150:paper", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "4 runs, 2 labels" in done.stdout
    pixels = read_png(out)
    grey = (pixels == 89).all(axis=2)  # the anchor's colour, 0.35 grey
    left, right = grey[:, : pixels.shape[1] // 2].sum(), grey[:, pixels.shape[1] // 2 :].sum()
    assert left > 100 and right < 10, (left, right)
    bad = plot(runs[0], "--anchor", "A:150", "-o", str(tmp_path / "x.png"))
    assert bad.returncode == 2 and "expected LABEL=VALUE:TEXT" in bad.stderr
