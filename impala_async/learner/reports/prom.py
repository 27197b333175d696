"""Prometheus ``/metrics`` and ``/healthz`` of a learner (docs/metrics.md, Prometheus; README, Operations).

/metrics reads the latest report's snapshot (counters.py), the one its metrics.jsonl record was made of, so the two
always agree (under ``--learner-ranks`` both hold the sums over the ranks): cumulative figures as counters (rates are
left to PromQL), the cumulative histograms of policy lag and importance weights, and the interval figures that have
no underlying counter (losses, latency quantiles) from that record, as gauges. Only the health figures are read live
at the scrape: /healthz says what the learner is doing now. Served on the HTTP server's thread (ops/httpd.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.registry import CollectorRegistry

from ...actors.observe import server_options
from ...config.service import Observe
from ...core.wire import REJECT_REASONS
from ...ops import httpd
from ..ranks.watch import REJECT_REASONS as RANK_REJECT_REASONS
from ..transport.guard import CUT_REASONS
from .counters import Snapshot
from .histograms import LAG_BUCKETS, RHO_BUCKETS

P = "impala_async_"
# Cumulative figures of the snapshot exported as counters: key -> (name without _total, help).
COUNTERS = {
    "env_steps": ("env_steps", "environment steps in accepted trajectories (continues across resumes)"),
    "env_steps_trained": ("env_steps_trained", "environment steps in batches the learner consumed"),
    "learner_steps": ("learner_steps", "updates applied (skipped ones not counted)"),
    "episodes": ("episodes", "episodes reported in accepted messages"),
    "batches": ("batches", "batches the training thread took"),
    "trajectories_received": ("trajectories_received", "trajectories accepted into the ring"),
    "trajectories_rejected": ("trajectories_rejected", "trajectories in rejected messages"),
    "trajectories_jpeg": ("trajectories_jpeg", "accepted trajectories whose observations came as JPEG"),
    "messages_received": ("messages_received", "messages read from the trajectory socket"),
    "bytes_received": ("received_bytes", "message bytes read from the trajectory socket"),
    "decoded_bytes": ("decoded_bytes", "decoded trajectory bytes written to the ring"),
    "dropped_incarnation": (
        "messages_dropped_incarnation",
        "messages acted with another learner run's weights, dropped unread",
    ),
    "latency_implausible": (
        "latency_implausible_messages",
        "accepted messages with a latency outside the plausible range",
    ),
    "weights_sends": ("weights_sends", "weights messages sent"),
    "weights_resends": ("weights_resends", "re-sends of unchanged weights"),
    "subscriptions": ("subscriptions", "subscriptions to the weights"),
    "subscriptions_ignored": ("subscriptions_ignored", "subscriptions to topics never published"),
    "updates_skipped_nonfinite": ("updates_skipped_nonfinite", "updates skipped: loss or gradient not finite"),
    "inputs_clipped": ("inputs_clipped", "values from the wire clipped into their range"),
    "weights_refused_nonfinite": ("weights_refused_nonfinite", "times weights were not published: not finite"),
    "checkpoint_failures": ("checkpoint_failures", "checkpoints that could not be written"),
    "actor_restarts": ("actor_restarts", "restarts of local actors"),
    "actors_replaced_silent": ("actors_replaced_silent", "local actors killed for missing heartbeats"),
    "handshakes_refused_key": ("handshakes_refused_key", "CURVE handshakes refused: the client's key is not listed"),
}
# Figures of the snapshot that are levels, exported as gauges: key -> (name, help).
GAUGES = {
    "policy_version": ("policy_version", "the learner's current policy version"),
    "episode_return_mean": ("episode_return_mean", "mean return of the last 100 episodes (raw reward units)"),
    "episode_length_mean": ("episode_length_mean_steps", "mean length of the last 100 episodes"),
    "ring_ready_batches": ("ring_ready_batches", "full batches waiting for the training thread"),
    "ring_waiting_trajectories": (
        "ring_waiting_trajectories",
        "trajectories in the ring not yet taken by the training thread",
    ),
    "pace_s_per_trajectory": ("pace_seconds_per_trajectory", "flow control: the pace last sent to actors (0: none)"),
    "pace_senders": ("pace_senders", "flow control: actors whose messages were accepted within the pace window"),
    "ring_bytes": ("ring_bytes", "size of the ring buffer"),
    "scratch_bytes": ("scratch_bytes", "size of the decode scratch area"),
    "unread_bytes": ("unread_bytes", "bytes trajectory connections made the learner hold unread at the last check"),
    "weights_held_bytes": ("weights_held_bytes", "weights message bytes held for subscribers not done with them"),
    "difficulty": ("curriculum_difficulty", "the curriculum's value sent with the latest weights"),
    "actors_alive": ("actors_alive", "local actor processes running"),
}
# Interval figures of the record exported as gauges: key -> (name, help). Keys in ms become seconds.
INTERVAL_GAUGES = {
    "loss_pg": ("loss_pg", "policy-gradient loss, mean over the last report interval's updates"),
    "loss_baseline": ("loss_baseline", "baseline loss 0.5*mean((v_s - V)^2), mean over the last interval's updates"),
    "entropy": ("entropy_nats", "mean policy entropy over the last interval's updates"),
    "grad_norm": (
        "grad_norm",
        "global gradient norm before clipping (of the loss summed over B x T steps), mean over the last interval's "
        "updates",
    ),
    "advantage_abs_mean": (
        "advantage_abs_mean",
        "mean |advantage| of the policy gradient (before normalisation), mean over the last interval's updates",
    ),
    "value_explained_variance": (
        "value_explained_variance_ratio",
        "1 - Var(v_s - V) / Var(v_s) of the value head against the V-trace targets, mean over the last interval",
    ),
    "rho_mean": ("rho_mean_ratio", "mean importance weight pi/mu (unclipped) over the last interval's updates"),
    "rho_clipped_frac": ("rho_clipped_ratio", "share of importance weights above rho-bar, last interval"),
    "rho_far_frac": ("rho_far_ratio", "share of importance weights outside [1/2, 2], last interval"),
    "lr": ("learning_rate", "mean learning rate of the last interval's updates"),
    "entropy_cost": ("entropy_cost", "mean weight of the entropy bonus in the last interval's updates"),
    "latency_p50_ms": ("latency_p50_seconds", "median actor-send to ring-slot latency over the last interval"),
    "latency_p99_ms": ("latency_p99_seconds", "99th percentile actor-send to ring-slot latency, last interval"),
    "loop_lag_p99_ms": (
        "loop_lag_p99_seconds",
        "99th percentile lateness of the event loop's 10 ms probe sleep, last interval",
    ),
}


@dataclass(frozen=True)
class View:
    """What one scrape reads: the latest report's snapshot and record, and the live health figures."""

    snapshot: Snapshot
    record: dict | None
    run: dict  # the run_info metric's labels: env, incarnation, device
    ring_slots: int
    uptime_s: float
    beats: dict  # thread -> seconds since it last went round its loop
    healthy: bool


def _buckets(bounds, counts) -> list[tuple[str, float]]:
    cum = np.cumsum(counts)
    return [("+Inf" if b == float("inf") else f"{b:g}", float(c)) for b, c in zip(bounds, cum, strict=True)]


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    family = GaugeMetricFamily(P + name, doc)
    if value is not None:  # a figure with nothing to measure is absent, not 0
        family.add_metric([], float(value))
    return family


def _by(name: str, doc: str, label: str, values: dict, kind=CounterMetricFamily):
    """A family with one label: ``values`` maps each label value to its figure."""
    family = kind(P + name, doc, labels=[label])
    for label_value, v in values.items():
        family.add_metric([label_value], float(v))
    return family


class LearnerCollector:
    """A prometheus_client collector reading the :class:`View` ``view()`` gives (None before the first report's
    parts exist: nothing but the process metrics then)."""

    def __init__(self, view: Callable[[], View | None]):
        self.view = view

    def collect(self):
        v = self.view()
        if v is None:
            return
        snap = v.snapshot
        yield InfoMetricFamily(P + "run", "this learner run", value=v.run)
        for key, (name, doc) in COUNTERS.items():
            if key in snap.own:
                yield CounterMetricFamily(P + name, doc, value=float(snap[key]))
        for key, (name, doc) in GAUGES.items():
            if key in snap.own:
                yield _gauge(name, doc, snap[key])
        yield _gauge("ring_slots", "batch slots in the ring buffer", v.ring_slots)
        yield from self._labelled(snap)
        yield from self._histograms(snap)
        rec = v.record or {}
        for key, (name, doc) in INTERVAL_GAUGES.items():
            value = rec.get(key)
            yield _gauge(name, doc, None if value is None else value / 1000 if key.endswith("_ms") else value)
        yield _gauge("uptime_seconds", "run time, a resumed run's earlier time included", v.uptime_s)
        yield _by(
            "heartbeat_age_seconds",
            "time since the thread last made progress (/healthz: over health_stale_s is unhealthy)",
            "thread",
            v.beats,
            GaugeMetricFamily,
        )
        yield _gauge("healthy", "1 while /healthz answers 200", float(v.healthy))

    @staticmethod
    def _labelled(snap: Snapshot):
        own = snap.own
        yield _by(
            "trajectories_by_key",
            "trajectories of accepted messages, by the name of the CURVE key they came "
            "with (allowed/NAME.key; unauthenticated without CURVE)",
            "key",
            own["trajectories_by_key"],
        )
        yield _by(
            "trajectories_dropped",
            "trajectories dropped, by reason",
            "reason",
            {"full": snap["dropped_full"], "stale": snap["dropped_stale"]},
        )
        yield _by(
            "rejected_messages",
            "messages rejected, by reason (docs/protocol.md)",
            "reason",
            {r: own[f"rejected_{r}"] for r in REJECT_REASONS},
        )
        yield _by(
            "rank_values_rejected",
            "values read from the learner ranks' store and ignored as malformed, by reason (0 with one rank)",
            "reason",
            {r: own.get(f"rank_values_rejected_{r}", 0) for r in RANK_REJECT_REASONS},
        )
        stages = {
            k[len("stage_") : -len("_s")]: v for k, v in own.items() if k.startswith("stage_") and k.endswith("_s")
        }
        yield _by(
            "stage_seconds",
            "seconds spent in each stage (per trajectory: divide by the rate of trajectories "
            "received, or trained for h2d, train and wait)",
            "stage",
            stages,
        )
        yield _by(
            "connections",
            "open connections, by socket",
            "socket",
            {s: own[f"connections_{s}"] for s in ("trajectories", "weights")},
            GaugeMetricFamily,
        )
        cut = CounterMetricFamily(
            P + "connections_cut",
            "connections closed by the learner, by socket and reason",
            labels=["socket", "reason"],
        )
        for reason in CUT_REASONS:
            for socket in ("trajectories", "weights"):
                cut.add_metric([socket, reason], float(own[f"cut_{socket}_{reason}"]))
        yield cut

    @staticmethod
    def _histograms(snap: Snapshot):
        lag_counts, lag_sum, rho_counts, rho_sum = snap.own["histograms"]
        lag = HistogramMetricFamily(
            P + "policy_lag_versions", "per trained trajectory: learner version minus the version that acted"
        )
        lag.add_metric([], _buckets((*LAG_BUCKETS, float("inf")), lag_counts), float(lag_sum))
        yield lag
        rho = HistogramMetricFamily(
            P + "rho_ratio", "importance weights pi/mu of the actions taken, over every update (skipped ones excluded)"
        )
        rho.add_metric([], _buckets(RHO_BUCKETS, rho_counts), rho_sum)
        yield rho


def health(
    *,
    stopping: bool,
    exit_reason: str,
    trainer,
    receive_beat: float | None,
    stale_s: float,
    env_steps: int,
    updates: int,
    now: float | None = None,
) -> tuple[bool, str]:
    """(healthy, reason): the training thread and the receive loop are alive and have made progress within
    ``stale_s``, and shutdown has not begun. Before the first trajectory both wait, and go round their loops while
    they do (at least every 0.1 s): that is healthy."""
    now = time.monotonic() if now is None else now
    if stopping:
        return False, f"shutting down: {exit_reason or 'stop requested'}"
    if trainer is None or not trainer.alive():
        return False, f"training thread dead: {trainer.error if trainer is not None else None!r}"
    age = now - trainer.heartbeat
    if age > stale_s:
        return False, f"training thread stuck: no progress for {age:.1f} s (health_stale_s={stale_s:g})"
    if receive_beat is None:
        return False, "receive loop not started"
    age = now - receive_beat
    if age > stale_s:
        return False, (
            f"receive loop stuck (event loop blocked?): no progress for {age:.1f} s (health_stale_s={stale_s:g})"
        )
    return True, f"ok: training thread and receive loop alive; {env_steps} env steps, {updates} updates"


def start(
    observe: Observe, *, view: Callable[[], View | None], health: Callable[[], tuple[bool, str]]
) -> httpd.HttpServer | None:
    """The learner's HTTP server on ``metrics_host:metrics_port`` (None with port 0); SystemExit if it cannot bind."""
    if not observe.metrics_port:
        return None
    from prometheus_client import ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(LearnerCollector(view))
    ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...

    def healthz() -> httpd.Response:
        ok, reason = health()
        return httpd.text(200 if ok else 503, reason)

    try:
        http = httpd.HttpServer(
            observe.metrics_host,
            observe.metrics_port,
            {"/metrics": httpd.metrics_route(registry), "/healthz": healthz},
            **server_options(observe),
            name="learner",
        )
        registry.register(http.collector())
        http.start()
    except OSError as e:
        raise SystemExit(
            f"impala-async: cannot serve /metrics on {observe.metrics_host}:{observe.metrics_port} "
            f"(--metrics-host, --metrics-port): {e}"
        ) from None
    return http
