"""Reports: every ``report_interval_s`` one counters snapshot (counters.py) becomes one metrics record, written to
metrics.jsonl, shown on the console, queued for TensorBoard, fed to the policy-collapse watch, and kept as the latest
for Prometheus /metrics (docs/metrics.md lists every key with its unit).

The record is a pure function of two snapshots (this one and the last) and the updates made between them
(:func:`record`); the updates' statistics come from the training thread through :class:`UpdateLog`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...core.wire import REJECT_REASONS
from ...ops.console import say
from ..ranks.watch import REJECTED_RANK_VALUES
from ..transport.guard import CUT_REASONS
from .counters import Snapshot
from .histograms import RHO_BIN_EDGES, Totals

log = logging.getLogger("impala_async.learner.metrics")
watch_log = logging.getLogger("impala_async.learner.watch")  # the collapse warnings are the watch's
LOSS_FIGURES = (
    "loss_pg",
    "loss_baseline",
    "entropy",
    "advantage_abs_mean",
    "value_explained_variance",
    "grad_norm",
    "rho_mean",
    "rho_clipped_frac",
    "rho_far_frac",
    "lr",
    "entropy_cost",
)
# Figures of the snapshot copied into the record as they are (whole-learner sums where summed over ranks).
COPIED = (
    "env_steps",
    "env_steps_trained",
    "learner_steps",
    "episode_return_mean",
    "episode_length_mean",
    "episodes",
    "policy_version",
    "trajectories_received",
    "trajectories_rejected",
    "trajectories_jpeg",
    "trajectories_by_key",
    "messages_rejected",
    "trajectories_dropped",
    "dropped_full",
    "dropped_stale",
    "dropped_incarnation",
    "messages_received",
    "bytes_received",
    "latency_p50_ms",
    "latency_p99_ms",
    "latency_implausible",
    "loop_lag_p99_ms",
    "ring_ready_batches",
    "ring_waiting_trajectories",
    "pace_s_per_trajectory",
    "pace_senders",
    "pace_target_trajectories",
    "incarnation",
    "difficulty",
    "updates_skipped_nonfinite",
    "inputs_clipped",
    "weights_refused_nonfinite",
    "checkpoint_failures",
    "connections_trajectories",
    "connections_weights",
    "unread_bytes",
    "weights_held_bytes",
    "weights_sends",
    "weights_resends",
    "subscriptions",
    "subscriptions_ignored",
)
ACTOR_FIGURES = ("actors_alive", "actor_restarts", "actors_replaced_silent")
TRAINER_STAGES = ("h2d", "train", "wait")  # seconds per trajectory trained; the other stages per trajectory received


@dataclass(frozen=True)
class Update:
    """One trained batch, as the training thread hands it over."""

    version: int  # the policy version after it
    stats: dict  # Learner.update's statistics (``skipped``: the weights were left unchanged)
    lag: np.ndarray  # [B] versions between the learner's policy and the one that acted, per trajectory
    waited_s: float  # how long the training thread waited for this batch


class UpdateLog:
    """Updates since the last report (the training thread adds, the report takes), and the cumulative histograms of
    policy lag and importance weights (Totals)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats: list[dict] = []
        self._lags: list[tuple[int, float, int]] = []
        self.totals = Totals()

    def add(self, update: Update) -> None:
        lag = update.lag
        with self._lock:
            self._stats.append(update.stats)
            self._lags.append((int(lag.min()), float(lag.mean()), int(lag.max())))
        self.totals.add(update.stats, lag)

    def take(self) -> tuple[list[dict], list[tuple[int, float, int]]]:
        with self._lock:
            stats, self._stats = self._stats, []
            lags, self._lags = self._lags, []
        return stats, lags


def record(
    cur: Snapshot,
    prev: Snapshot,
    stats: list[dict],
    lags: list[tuple[int, float, int]],
    *,
    wall_s: float,
    batch_size: int,
    learner_ranks: int,
) -> dict:
    """One metrics.jsonl record: figures of ``cur``, rates over the time since ``prev``, the updates' statistics
    (``stats``) and policy lags ((min, mean, max) per trained batch, ``lags``)."""
    rec: dict = {"wall_s": round(wall_s, 3)}
    rec.update({k: cur[k] for k in COPIED})
    rec.update(_lag(lags))
    rec.update(_rates(cur, prev))
    rec["stage_s_per_trajectory"] = _stages(cur, prev, batch_size)
    rec["ring_mib"] = round(cur.own["ring_bytes"] / 2**20, 2)
    rec["scratch_mib"] = round(cur.own["scratch_bytes"] / 2**20, 2)
    for reason in CUT_REASONS:
        rec[f"connections_cut_{reason}"] = cur.own[f"cut_trajectories_{reason}"] + cur.own[f"cut_weights_{reason}"]
    rec.update({k: cur.own[k] for k in ACTOR_FIGURES if k in cur.own})
    rec.update({f"rejected_{r}": cur.own[f"rejected_{r}"] for r in REJECT_REASONS})
    rec["handshakes_refused_key"] = cur.own["handshakes_refused_key"]
    rec.update({k: cur.own.get(k, 0) for k in REJECTED_RANK_VALUES})  # 0 with one rank
    rec.update(_losses(stats))
    rec["learner_ranks"] = learner_ranks
    rec["ranks"] = cur.per_rank
    return rec


def _lag(lags: list[tuple[int, float, int]]) -> dict:
    if not lags:
        return dict.fromkeys(("policy_lag_min", "policy_lag_avg", "policy_lag_max"))
    return {
        "policy_lag_min": min(lag[0] for lag in lags),
        "policy_lag_avg": round(float(np.mean([lag[1] for lag in lags])), 2),
        "policy_lag_max": max(lag[2] for lag in lags),
    }


def _rates(cur: Snapshot, prev: Snapshot) -> dict:
    dt = max(1e-9, cur.t - prev.t)

    def rate(key: str) -> float:
        return (cur[key] - prev[key]) / dt

    return {
        "sps": round(rate("env_steps"), 1),
        "trajectories_per_s": round(rate("trajectories_received"), 1),
        "batches_per_s": round(rate("batches"), 2),
        "wire_mb_per_s": round(rate("bytes_received") / 1e6, 3),
        "decoded_mb_per_s": round(rate("decoded_bytes") / 1e6, 3),
    }


def _stages(cur: Snapshot, prev: Snapshot, batch_size: int) -> dict:
    """Seconds per trajectory in each stage: ingest stages per trajectory this rank received, h2d, train and wait per
    trajectory trained (the two differ when batches are dropped)."""
    trained = (cur.own["batches"] - prev.own["batches"]) * batch_size
    received = cur.own["trajectories_received"] - prev.own["trajectories_received"]
    out = {}
    for key, value in cur.own.items():
        if key.startswith("stage_") and key.endswith("_s"):
            stage = key[len("stage_") : -len("_s")]
            n = trained if stage in TRAINER_STAGES else received
            out[stage] = (value - prev.own[key]) / n if n else None
    return out


def _losses(stats: list[dict]) -> dict:
    stats = [st for st in stats if not st["skipped"]]  # a skipped update's losses are not finite
    out: dict = {name: float(np.mean([st[name] for st in stats])) if stats else None for name in LOSS_FIGURES}
    out["rho_hist"] = np.sum([st["rho_hist"] for st in stats], axis=0).tolist() if stats else None
    out["rho_hist_edges"] = list(RHO_BIN_EDGES)
    return out


class Reports:
    """The report's sinks: metrics.jsonl, the console, TensorBoard (optional), the collapse watch; the latest
    snapshot and record, for /metrics."""

    def __init__(
        self,
        logdir: Path,
        *,
        take: Callable[[], Snapshot],
        updates: UpdateLog,
        watch,
        tboard=None,
        reset_interval: Callable[[], None],
        wall_s: Callable[[], float],
        batch_size: int,
        learner_ranks: int,
    ):
        self.metrics = MetricsWriter(Path(logdir) / "metrics.jsonl")
        self.progress = Progress()
        self.tboard, self.watch = tboard, watch
        self._take, self._updates, self._reset_interval, self._wall_s = take, updates, reset_interval, wall_s
        self._static = {"batch_size": batch_size, "learner_ranks": learner_ranks}
        self.latest: tuple[Snapshot, dict | None] = (take(), None)  # read by the metrics HTTP thread

    def report(self) -> dict:
        cur = self._take()
        stats, lags = self._updates.take()
        rec = record(cur, self.latest[0], stats, lags, wall_s=self._wall_s(), **self._static)
        self._reset_interval()
        self.metrics.write(rec)
        self.latest = (cur, rec)
        if self.tboard is not None:
            self.tboard.write(rec)  # queued for its own thread
        for text in self.watch.feed(rec):  # policy-collapse warnings, rate-limited (watch.py)
            watch_log.warning(text)
        self.progress.show(rec)
        return rec

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()


def read_metrics(path: Path | None) -> list[dict]:
    """The records of a metrics.jsonl file, oldest first; a line still being written is skipped."""
    if path is None or not Path(path).exists():
        return []
    return parse_records(Path(path).read_bytes())


def parse_records(data: bytes) -> list[dict]:
    """The records of metrics.jsonl lines; a line that does not parse (one still being written) is skipped."""
    rows = []
    for line in data.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


class MetricsWriter:
    """metrics.jsonl, one whole line per record or none: a disk that fills up, fails or turns read-only is weather, not
    death. A write that fails is cut back to the last whole line (what it managed to write would be a line that does
    not parse), said once with the reason, and counted (``lost``); training goes on, and records are written again as
    soon as the disk takes them. A line torn by a killed writer (or an older version) is cut off when the file is
    opened."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._size = _last_whole_line(self._fd)  # the end of the last whole line
        self._newline = False  # the file does not end at a line's end: the next record starts one
        if self._size < os.fstat(self._fd).st_size:  # a line torn by a killed writer: it would not parse
            try:
                os.ftruncate(self._fd, self._size)
            except OSError:
                self._newline = True
        self.lost = 0  # records not written since the last one that was

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        data = (("\n" if self._newline else "") + json.dumps(clean, separators=(",", ":")) + "\n").encode()
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            self._failed(e)
            return
        self._size += len(data)
        self._newline = False
        if self.lost:
            log.warning("metrics.jsonl is written again; %d report(s) were lost while it could not be", self.lost)
            self.lost = 0

    def _failed(self, error: OSError) -> None:
        if not self.lost:
            log.error(
                "metrics.jsonl cannot be written (%s): reports are lost until it can; training and checkpoints go on",
                error.strerror or error,
            )
        self.lost += 1
        try:  # what part of the line did get written must go: cut back to the last whole line
            os.ftruncate(self._fd, self._size)
        except OSError:  # read-only: the part stays, and the next record starts a line of its own
            self._newline = True

    def close(self) -> None:
        os.close(self._fd)


def _last_whole_line(fd: int, window: int = 1 << 20) -> int:
    """The offset just past the last newline of the file (its size if it ends with one; records are far shorter than
    ``window``, within which the newline is looked for)."""
    size = os.fstat(fd).st_size
    start = max(0, size - window)
    tail = os.pread(fd, size - start, start)
    if not tail or tail.endswith(b"\n"):
        return size
    cut = tail.rfind(b"\n")
    return start + cut + 1 if cut >= 0 else start


class Progress:
    """One status line: redrawn in place on a terminal, one line per report otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._open = False

    def show(self, r: dict) -> None:
        ret, lag = r.get("episode_return_mean"), r.get("policy_lag_avg")
        text = (
            f"{r['wall_s']:7.1f}s  steps {r['env_steps']:>10,}  sps {r['sps']:>8,.0f}  "
            f"return {'-' if ret is None else f'{ret:8.1f}'}  updates {r['learner_steps']:>7,}  "
            f"lag {'-' if lag is None else lag:>5}  "
            f"rejected {r['trajectories_rejected']}  dropped {r['trajectories_dropped']}"
        )
        if self.tty:
            self._open = say("\r\x1b[2K" + text, self.stream, end="")
        else:
            say(text, self.stream)

    def close(self) -> None:
        if self._open:
            say("", self.stream)
            self._open = False
