#!/usr/bin/env python3
"""Learning curves from runs' metrics.jsonl: a metric against env steps and against wall time, several runs at once.

    python tools/plot.py runs/a runs/b -o curve.png [--labels a,b] [--metric episode_return_mean]
    python tools/plot.py runs/s0 runs/s1 runs/s2 runs/t0 runs/t1 runs/t2 --labels A,A,A,B,B,B --median -o seeds.png

Each LOGDIR (or a metrics.jsonl path) is one run, drawn as one line per panel: ``--metric`` (default
``episode_return_mean``, see docs/metrics.md) against ``env_steps`` (left) and ``wall_s`` (right); records where
either is missing (null before the first episode) are left out. Labels default to the directory names. With
``--median``, runs that share a label are drawn faintly, with their median as a bold line and the range between
their minimum and maximum shaded: each run is interpolated linearly onto a common grid spanning only the x range all
of them cover. ``--per-label`` draws one panel per label instead (against env steps: five games in one figure), and
``--anchor LABEL=VALUE:TEXT`` a dashed line at VALUE labelled TEXT in LABEL's panel (every panel without
``--per-label``): a published result to compare with. Needs matplotlib (``pip install 'impala-async[plot]'``); draws
with the Agg backend, no display.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

X_AXES = (("env_steps", "environment steps"), ("wall_s", "wall time (s)"))
GRID_POINTS = 200


def metrics_path(run: str) -> Path:
    path = Path(run)
    return path / "metrics.jsonl" if path.is_dir() else path


def read_series(path: Path, metric: str, x_key: str) -> tuple[list[float], list[float]]:
    """``(x, y)`` of the records that have both as numbers, ordered by x; a line still being written is skipped."""
    points = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        x, y = (row.get(x_key), row.get(metric)) if isinstance(row, dict) else (None, None)
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in (x, y)):
            points.append((float(x), float(y)))
    points.sort()
    return [p[0] for p in points], [p[1] for p in points]


def median_band(series: list[tuple[list[float], list[float]]]):
    """Runs ``[(x, y)]`` -> ``(grid [G], median [G], low [G], high [G])`` over the x range all runs cover (None if
    they share none)."""
    start, stop = max(xs[0] for xs, _ in series), min(xs[-1] for xs, _ in series)
    if not start < stop:
        return None
    grid = np.linspace(start, stop, GRID_POINTS)
    ys = np.stack([np.interp(grid, xs, y) for xs, y in series])  # [runs, G]
    return grid, np.median(ys, axis=0), ys.min(axis=0), ys.max(axis=0)


def parse_anchor(text: str) -> tuple[str, float, str]:
    """``LABEL=VALUE:TEXT`` -> ``(label, value, text)``."""
    label, _, rest = text.partition("=")
    value, _, name = rest.partition(":")
    try:
        return label.strip(), float(value), name.strip()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected LABEL=VALUE:TEXT, e.g. 'Breakout=50:Pgx PPO, 20M', got {text!r}"
        ) from None


def draw_label(ax, label: str, series: list, colour: str, median: bool) -> None:
    """One label's runs ``[(x, y)]`` on ``ax``: a line each, or with ``median`` (and several runs) faint lines, their
    median in bold and the min-max range shaded."""
    faint = median and len(series) > 1
    for i, (x, y) in enumerate(series):
        ax.plot(
            x,
            y,
            color=colour,
            lw=0.8 if faint else 1.5,
            alpha=0.3 if faint else 1.0,
            marker="o" if len(x) < 5 else None,
            ms=3,
            label=None if faint or i else label,
        )
    band = median_band(series) if faint else None
    if band is not None:
        grid, mid, low, high = band
        ax.fill_between(grid, low, high, color=colour, alpha=0.2, lw=0)
        ax.plot(grid, mid, color=colour, lw=2, label=f"{label} (median of {len(series)})")
    elif faint:  # runs that share no x range: their lines alone
        ax.plot([], [], color=colour, label=f"{label} ({len(series)} runs)")


def draw_anchors(ax, anchors: list[tuple[str, float, str]]) -> None:
    for _, value, text in anchors:
        ax.axhline(value, color="0.35", ls="--", lw=1)
        ax.annotate(
            text, (0.01, value), xycoords=("axes fraction", "data"), va="bottom", fontsize="small", color="0.25"
        )


def parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in pixels, e.g. 1200x450, got {text!r}") from None
    if w < 100 or h < 100:
        raise argparse.ArgumentTypeError(f"{text}: at least 100x100 pixels")
    return w, h


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("runs", nargs="+", metavar="LOGDIR", help="run directories (or metrics.jsonl files)")
    p.add_argument("-o", "--output", required=True, help="image to write (.png, .svg, .pdf)")
    p.add_argument("--labels", default="", help="comma-separated label per LOGDIR (default: the directory names)")
    p.add_argument(
        "--metric", default="episode_return_mean", help="metrics.jsonl key on the y axis (default: episode_return_mean)"
    )
    p.add_argument(
        "--median",
        action="store_true",
        help="per label: the median of its runs, with the range between min and max shaded",
    )
    p.add_argument(
        "--size", type=parse_size, default=(1200, 450), metavar="WxH", help="image size in pixels (default: 1200x450)"
    )
    p.add_argument(
        "--per-label", action="store_true", help="one panel per label, against env steps (several games in one figure)"
    )
    p.add_argument(
        "--anchor",
        type=parse_anchor,
        action="append",
        default=[],
        metavar="LABEL=VALUE:TEXT",
        help="a dashed line at VALUE, labelled TEXT, in LABEL's panel (every panel without --per-label); repeatable",
    )
    p.add_argument("--dpi", type=int, default=100, help="dots per inch (default: 100)")
    p.add_argument("--title", default="", help="figure title")
    args = p.parse_args(argv)

    labels = (
        [s.strip() for s in args.labels.split(",")]
        if args.labels
        else [metrics_path(r).parent.name or str(r) for r in args.runs]
    )
    if len(labels) != len(args.runs):
        p.error(f"--labels names {len(labels)} runs, {len(args.runs)} given")
    try:
        import matplotlib
    except ImportError:
        print(
            "plot.py: needs matplotlib: pip install 'impala-async[plot]' (or pip install 'matplotlib>=3.7')",
            file=sys.stderr,
        )
        return 2
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []  # (label, {x_key: (x, y)})
    for run, label in zip(args.runs, labels, strict=True):
        path = metrics_path(run)
        if not path.is_file():
            print(f"plot.py: {path}: no such file", file=sys.stderr)
            return 2
        data = {x_key: read_series(path, args.metric, x_key) for x_key, _ in X_AXES}
        if not data["env_steps"][0]:
            print(f"plot.py: {path}: no record with both env_steps and {args.metric}: skipped", file=sys.stderr)
            continue
        runs.append((label, data))
    if not runs:
        print(f"plot.py: nothing to draw: no run has {args.metric}", file=sys.stderr)
        return 1

    width, height = args.size
    order = list(dict.fromkeys(label for label, _ in runs))
    colours = {label: f"C{i % 10}" for i, label in enumerate(order)}
    if args.per_label:
        cols = min(3, len(order))
        rows = -(-len(order) // cols)
        fig, grid = plt.subplots(rows, cols, figsize=(width / args.dpi, height / args.dpi), dpi=args.dpi, squeeze=False)
        panels = [(ax, [label], X_AXES[0]) for ax, label in zip(grid.flat, order, strict=False)]
        for ax in list(grid.flat)[len(order) :]:
            ax.set_visible(False)
    else:
        fig, axes = plt.subplots(1, 2, figsize=(width / args.dpi, height / args.dpi), dpi=args.dpi)
        panels = [(ax, order, x_axis) for ax, x_axis in zip(axes, X_AXES, strict=True)]
    for ax, labels_here, (x_key, x_name) in panels:
        for label in labels_here:
            series = [data[x_key] for lab, data in runs if lab == label and data[x_key][0]]
            draw_label(ax, label, series, colours[label], args.median)
        draw_anchors(ax, [a for a in args.anchor if not args.per_label or a[0] in labels_here])
        if args.per_label:
            ax.set_title(labels_here[0])
        ax.set_xlabel(x_name)
        ax.set_ylabel(args.metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.output, dpi=args.dpi)
    print(f"wrote {args.output} ({width}x{height}): {len(runs)} runs, {len(order)} labels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
