"""Histograms the learner keeps, with no I/O: log-bucketed quantiles of latencies (:class:`Histogram`), and the
cumulative histograms of policy lag and importance weights Prometheus exports (:class:`Totals`)."""

from __future__ import annotations

import math
import threading

import numpy as np

# Bin edges of the importance-weight histogram in the metrics (policy-collapse diagnosis: mass far from 1).
RHO_BIN_EDGES = (0.0, 0.1, 0.5, 0.8, 0.95, 1.05, 1.25, 2.0, 10.0)
# rho_hist's bins are (edge_i, edge_i+1] (torch.bucketize): their upper edges are Prometheus' le buckets exactly.
RHO_BUCKETS = (*RHO_BIN_EDGES[1:], float("inf"))
# Upper bounds (le) of the policy-lag histogram, in versions.
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024)


class Histogram:
    """Counts in logarithmic buckets (5% wide) between ``lo`` and ``hi``; constant memory, cheap quantiles."""

    def __init__(self, lo: float = 1e-6, hi: float = 1e3, ratio: float = 1.05):
        self.lo, self.log_ratio = lo, math.log(ratio)
        self.counts = np.zeros(int(math.log(hi / lo) / self.log_ratio) + 2, np.int64)

    def add(self, x: float) -> None:
        i = 0 if x <= self.lo else min(len(self.counts) - 1, int(math.log(x / self.lo) / self.log_ratio) + 1)
        self.counts[i] += 1

    def quantile(self, q: float) -> float | None:
        total = int(self.counts.sum())
        if total == 0:
            return None
        i = int(np.searchsorted(np.cumsum(self.counts), q * total))
        return self.lo * math.exp(self.log_ratio * i)  # the bucket's upper edge

    def quantile_ms(self, q: float) -> float | None:
        s = self.quantile(q)
        return None if s is None else round(s * 1000, 3)

    def reset(self) -> None:
        self.counts[:] = 0


class Totals:
    """Cumulative histograms since the start of this process, fed by the training thread after each update."""

    def __init__(self):
        self._lock = threading.Lock()
        self.lag_counts = np.zeros(len(LAG_BUCKETS) + 1, np.int64)  # non-cumulative; the last one is > 1024
        self.lag_sum = 0
        self.rho_counts = np.zeros(len(RHO_BUCKETS), np.int64)  # rho_hist's bins, summed over updates
        self.rho_sum = 0.0

    def add(self, stats: dict, lag) -> None:
        """One trained batch: ``lag`` per trajectory (versions); the update's ``stats`` (skipped ones have no rho)."""
        lag = np.asarray(lag).reshape(-1)
        counts = np.bincount(np.searchsorted(LAG_BUCKETS, lag, side="left"), minlength=len(self.lag_counts))
        hist = None if stats.get("skipped") else np.asarray(stats["rho_hist"], np.int64)
        with self._lock:
            self.lag_counts += counts
            self.lag_sum += int(lag.sum())
            if hist is not None:
                self.rho_counts[: len(hist)] += hist
                self.rho_sum += float(stats["rho_mean"]) * int(hist.sum())

    def snapshot(self) -> tuple[np.ndarray, int, np.ndarray, float]:
        with self._lock:
            return self.lag_counts.copy(), self.lag_sum, self.rho_counts.copy(), self.rho_sum
