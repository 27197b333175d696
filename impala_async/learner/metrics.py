"""metrics.jsonl (one JSON object per report interval) and the live one-line console display."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from ..core.wire import REJECT_REASONS
from .guard import CUT_REASONS
from .ingest import UNAUTHENTICATED
from .rankwatch import totals

# Bin edges of the importance-weight histogram in the metrics (policy-collapse diagnosis: mass far from 1).
RHO_BIN_EDGES = (0.0, 0.1, 0.5, 0.8, 0.95, 1.05, 1.25, 2.0, 10.0)


class Reporter:
    """Builds one metrics record per report interval from the learner server's parts (rates over the interval)."""

    def __init__(self, server, start_monotonic: float):
        self.s = server
        self._prev = self._snapshot(start_monotonic)

    def _snapshot(self, now: float) -> dict:
        s, ing = self.s, self.s.ingest
        summed, per_rank = totals(s)  # every learner rank's (ranks.py); this one's alone with one rank
        return {
            "t": now,
            "summed": summed,
            "per_rank": per_rank,
            "env_steps": summed["env_steps"],
            "trajectories": summed["trajectories_received"],
            "own_trajectories": ing.trajectories_received,
            "bytes": summed["bytes_received"],
            "decoded": summed["decoded_bytes"],
            "batches": s.trainer.batches,
            "stages": {**s.stage_s, **ing.stage_s, **s.trainer.stage_s},
        }

    def record(self, stats: list[dict], lags: list[tuple[int, float, int]]) -> dict:
        """``stats``: the learner updates' statistics since the last record; ``lags``: (min, mean, max) policy lag of
        each trained batch."""
        s, ing, ring = self.s, self.s.ingest, self.s.ring
        now = time.monotonic()
        cur, prev = self._snapshot(now), self._prev
        dt = max(1e-9, now - prev["t"])
        d_traj = cur["trajectories"] - prev["trajectories"]
        d_own = cur["own_trajectories"] - prev["own_trajectories"]  # ingest stage times are this rank's
        d_trained = (cur["batches"] - prev["batches"]) * s.cfg.loss.batch_size
        rec = {
            "wall_s": round(s.wall_offset_s + now - s.t0, 3),
            "env_steps": ing.env_steps,
            "env_steps_trained": s.learner.env_steps_trained,
            "learner_steps": s.learner.updates,
            "sps": round((cur["env_steps"] - prev["env_steps"]) / dt, 1),
            "episode_return_mean": float(np.mean(ing.returns)) if ing.returns else None,
            "episode_length_mean": float(np.mean(ing.lengths)) if ing.lengths else None,
            "episodes": ing.episodes,
            "policy_version": s.trainer.policy_version,
            "policy_lag_min": min(lag[0] for lag in lags) if lags else None,
            "policy_lag_avg": round(float(np.mean([lag[1] for lag in lags])), 2) if lags else None,
            "policy_lag_max": max(lag[2] for lag in lags) if lags else None,
            "trajectories_received": ing.trajectories_received,
            "trajectories_rejected": ing.trajectories_rejected,
            "trajectories_jpeg": ing.trajectories_jpeg,
            "trajectories_by_key": trajectories_by_key(s),
            "messages_rejected": sum(ing.rejected.values()),
            "trajectories_dropped": (
                ring.dropped_full + ring.dropped_stale + ing.dropped_stale + ing.dropped_incarnation
            ),
            "dropped_full": ring.dropped_full,
            "dropped_stale": ring.dropped_stale + ing.dropped_stale,
            "dropped_incarnation": ing.dropped_incarnation,
            "messages_received": ing.messages_received,
            "bytes_received": ing.bytes_received,
            "trajectories_per_s": round(d_traj / dt, 1),
            "batches_per_s": round((cur["batches"] - prev["batches"]) / dt, 2),
            "wire_mb_per_s": round((cur["bytes"] - prev["bytes"]) / dt / 1e6, 3),
            "decoded_mb_per_s": round((cur["decoded"] - prev["decoded"]) / dt / 1e6, 3),
            "latency_p50_ms": _ms(ing.latency_s.quantile(0.5)),
            "latency_p99_ms": _ms(ing.latency_s.quantile(0.99)),
            "latency_implausible": ing.latency_implausible,
            "loop_lag_p99_ms": _ms(s.loop_lag_s.quantile(0.99)),
            # Seconds per trajectory in each stage: ingest stages per trajectory received, h2d and train per
            # trajectory trained (the two differ when batches are dropped).
            "stage_s_per_trajectory": {
                k: (v - prev["stages"][k]) / n if n else None
                for k, v in cur["stages"].items()
                for n in [d_trained if k in s.trainer.stage_s else d_own]
            },
            "ring_ready_batches": ring.ready_batches(),
            "ring_waiting_trajectories": ring.waiting_trajectories(),
            "pace_s_per_trajectory": round(s.pacer.pace_s_per_trajectory, 6),
            "pace_senders": s.pacer.senders,
            "pace_target_trajectories": round(s.pacer.target_now, 1),
            "ring_mib": round(ring.nbytes / 2**20, 2),
            "scratch_mib": round(ing.scratch_nbytes / 2**20, 2),
        }
        pub, pull = s.publisher, s.pull_guard
        rec.update(
            {
                "incarnation": s.incarnation,
                "difficulty": s.difficulty,
                "updates_skipped_nonfinite": s.learner.updates_skipped,
                "inputs_clipped": s.learner.inputs_clipped,
                "weights_refused_nonfinite": s.weights_refused_nonfinite,
                "checkpoint_failures": s.checkpoint_failures,
                "connections_trajectories": len(pull.conns),
                "connections_weights": len(pub.guard.conns),
                "unread_bytes": pull.unread_bytes_total,
                "weights_sends": pub.sends,
                "weights_resends": pub.resends,
                "subscriptions": pub.subscriptions,
                "subscriptions_ignored": pub.ignored_subscriptions,
            }
        )
        for reason in CUT_REASONS:
            rec[f"connections_cut_{reason}"] = pull.cut[reason] + pub.guard.cut[reason]
        if s.actors is not None:
            rec["actors_alive"] = s.actors.alive()
            rec["actor_restarts"] = s.actors.restarts_total
            rec["actors_replaced_silent"] = s.actors.replaced_silent  # killed for missing heartbeats
        for reason in REJECT_REASONS:
            rec[f"rejected_{reason}"] = ing.rejected[reason]
        stats = [st for st in stats if not st["skipped"]]  # a skipped update's losses are not finite
        for name in (
            "loss_pg",
            "loss_baseline",
            "entropy",
            "grad_norm",
            "rho_mean",
            "rho_clipped_frac",
            "rho_far_frac",
            "lr",
            "entropy_cost",
        ):
            rec[name] = float(np.mean([st[name] for st in stats])) if stats else None
        rec["rho_hist"] = np.sum([st["rho_hist"] for st in stats], axis=0).tolist() if stats else None
        rec["rho_hist_edges"] = list(RHO_BIN_EDGES)
        # With several learner ranks the ingest counters are sums over the ranks, and each rank's figures are under
        # "ranks" (the others' as of their latest heartbeat); episode_return_mean is over the episodes rank 0 got.
        summed, per_rank = cur["summed"], cur["per_rank"]
        rec.update(
            {
                k: summed[k]
                for k in (
                    "env_steps",
                    "episodes",
                    "trajectories_received",
                    "trajectories_rejected",
                    "messages_received",
                    "messages_rejected",
                    "bytes_received",
                    "trajectories_dropped",
                    "dropped_full",
                    "dropped_stale",
                    "dropped_incarnation",
                    "ring_ready_batches",
                    "ring_waiting_trajectories",
                )
            }
        )
        rec["learner_ranks"] = s.cfg.ranks.learner_ranks
        rec["ranks"] = per_rank
        ing.latency_s.reset()
        s.loop_lag_s.reset()
        self._prev = cur
        return rec


def trajectories_by_key(server) -> dict[str, int]:
    """Trajectories of accepted messages by key name: every key in allowed/ (0 until it has sent), or the one
    ``unauthenticated`` bucket without CURVE. Also read by the metrics HTTP thread (prom.py)."""
    names = sorted(server.keys.allowed.values()) if server.keys is not None else [UNAUTHENTICATED]
    counts = dict(server.ingest.trajectories_by_key)  # one C call: the event loop may be adding a key
    return {**dict.fromkeys(names, 0), **counts}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def read_metrics(path: Path | None) -> list[dict]:
    """The records of a metrics.jsonl file, oldest first; a line still being written is skipped."""
    if path is None or not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


class MetricsWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


class Progress:
    """One status line: redrawn in place on a terminal, one line per report otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._open = False

    def show(self, r: dict) -> None:
        ret = r.get("episode_return_mean")
        text = (
            f"{r['wall_s']:7.1f}s  steps {r['env_steps']:>10,}  sps {r['sps']:>8,.0f}  "
            f"return {'-' if ret is None else f'{ret:8.1f}'}  updates {r['learner_steps']:>7,}  "
            f"lag {r['policy_lag_avg'] if r['policy_lag_avg'] is not None else '-':>5}  "
            f"rejected {r['trajectories_rejected']}  dropped {r['trajectories_dropped']}"
        )
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
            self._open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
