"""Prometheus ``/metrics`` and ``/healthz`` of a learner (docs/metrics.md, Prometheus; README, Operations).

The figures are read at scrape time, on the HTTP server's thread (ops/httpd.py), from the same objects the metrics
Reporter reads (learner/metrics.py): cumulative counters as counters (rates are left to PromQL), cumulative
histograms of policy lag and importance weights that the training thread keeps (:class:`Totals`), and the interval
figures that have no underlying counter (losses, latency quantiles) from the last metrics.jsonl record, as gauges.
Reading an int or a float another thread writes is safe under the GIL; containers the event loop mutates are copied
in one C call (``deque.copy``, ``dict(...)``) before they are read, and Totals has a lock of its own.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.registry import CollectorRegistry

from ..core.wire import REJECT_REASONS
from ..ops import httpd
from .guard import CUT_REASONS
from .metrics import RHO_BIN_EDGES, trajectories_by_key

P = "impala_async_"
# Upper bounds (le) of the policy-lag histogram, in versions.
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024)
# rho_hist's bins are (edge_i, edge_i+1] (torch.bucketize): their upper edges are Prometheus' le buckets exactly.
RHO_BUCKETS = (*RHO_BIN_EDGES[1:], float("inf"))
# Interval figures of the last metrics.jsonl record exported as gauges: key -> (name, help). Keys in ms become seconds.
INTERVAL_GAUGES = {
    "loss_pg": ("loss_pg", "policy-gradient loss, mean over the last report interval's updates"),
    "loss_baseline": ("loss_baseline", "baseline loss 0.5*mean((v_s - V)^2), mean over the last interval's updates"),
    "entropy": ("entropy_nats", "mean policy entropy over the last interval's updates"),
    "grad_norm": ("grad_norm", "global gradient norm before clipping, mean over the last interval's updates"),
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


def _buckets(bounds, counts) -> list[tuple[str, float]]:
    cum = np.cumsum(counts)
    return [("+Inf" if b == float("inf") else f"{b:g}", float(c)) for b, c in zip(bounds, cum, strict=True)]


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(P + name, doc, value=float(value))


def _by(name: str, doc: str, label: str, values: dict) -> CounterMetricFamily:
    """A counter with one label: ``values`` maps each label value to its count."""
    family = CounterMetricFamily(P + name, doc, labels=[label])
    for label_value, count in values.items():
        family.add_metric([label_value], float(count))
    return family


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    family = GaugeMetricFamily(P + name, doc)
    if value is not None:  # a figure with nothing to measure is absent, not 0
        family.add_metric([], float(value))
    return family


class LearnerCollector:
    """A prometheus_client collector reading a :class:`~impala_async.learner.server.LearnerServer` live."""

    def __init__(self, server):
        self.s = server

    def collect(self):
        s, ing, ring = self.s, self.s.ingest, self.s.ring
        yield InfoMetricFamily(
            P + "run",
            "this learner run",
            value={"env": s.cfg.env.env, "incarnation": str(s.incarnation), "device": str(s.device)},
        )
        yield _counter(
            "env_steps", "environment steps in accepted trajectories (continues across resumes)", ing.env_steps
        )
        yield _counter(
            "env_steps_trained", "environment steps in batches the learner consumed", s.learner.env_steps_trained
        )
        yield _counter("learner_steps", "updates applied (skipped ones not counted)", s.learner.updates)
        yield _counter("episodes", "episodes reported in accepted messages", ing.episodes)
        yield _counter("batches", "batches the training thread took", s.trainer.batches)
        yield _gauge("policy_version", "the learner's current policy version", s.trainer.policy_version)
        returns, lengths = ing.returns.copy(), ing.lengths.copy()
        yield _gauge(
            "episode_return_mean",
            "mean return of the last 100 episodes (raw reward units)",
            float(np.mean(returns)) if returns else None,
        )
        yield _gauge(
            "episode_length_mean_steps",
            "mean length of the last 100 episodes",
            float(np.mean(lengths)) if lengths else None,
        )
        yield _counter("trajectories_received", "trajectories accepted into the ring", ing.trajectories_received)
        yield _counter("trajectories_rejected", "trajectories in rejected messages", ing.trajectories_rejected)
        yield _counter(
            "trajectories_jpeg", "accepted trajectories whose observations came as JPEG", ing.trajectories_jpeg
        )
        yield _by(
            "trajectories_by_key",
            "trajectories of accepted messages, by the name of the CURVE key they came "
            "with (allowed/NAME.key; unauthenticated without CURVE)",
            "key",
            trajectories_by_key(s),
        )
        yield _by(
            "trajectories_dropped",
            "trajectories dropped, by reason",
            "reason",
            {
                "full": ring.dropped_full,
                "stale": ring.dropped_stale + ing.dropped_stale,
                "incarnation": ing.dropped_incarnation,
            },
        )
        yield _counter("messages_received", "messages read from the trajectory socket", ing.messages_received)
        yield _by(
            "rejected_messages",
            "messages rejected, by reason (docs/protocol.md)",
            "reason",
            {r: ing.rejected[r] for r in REJECT_REASONS},
        )
        yield _counter("received_bytes", "message bytes read from the trajectory socket", ing.bytes_received)
        yield _counter("decoded_bytes", "decoded trajectory bytes written to the ring", ing.decoded_bytes)
        yield _counter(
            "latency_implausible_messages",
            "accepted messages with a latency outside the plausible range",
            ing.latency_implausible,
        )
        stages = {**dict(s.stage_s), **dict(ing.stage_s), **dict(s.trainer.stage_s)}
        yield _by(
            "stage_seconds",
            "seconds spent in each stage (per trajectory: divide by the rate of "
            "trajectories received, or trained for h2d, train and wait)",
            "stage",
            stages,
        )
        yield _gauge("ring_ready_batches", "full batches waiting for the training thread", ring.ready_batches())
        yield _gauge(
            "ring_waiting_trajectories",
            "trajectories in the ring not yet taken by the training thread",
            ring.waiting_trajectories(),
        )
        yield _gauge(
            "pace_seconds_per_trajectory",
            "flow control: the pace last sent to actors (0: none)",
            s.pacer.pace_s_per_trajectory,
        )
        yield _gauge(
            "pace_senders", "flow control: actors whose messages were accepted within the pace window", s.pacer.senders
        )
        yield _gauge("ring_slots", "batch slots in the ring buffer", s.cfg.ring.ring_batches)
        yield _gauge("ring_bytes", "size of the ring buffer", ring.nbytes)
        yield _gauge("scratch_bytes", "size of the decode scratch area", ing.scratch_nbytes)
        pull, pub = s.pull_guard, s.publisher
        conns = GaugeMetricFamily(P + "connections", "open connections, by socket", labels=["socket"])
        conns.add_metric(["trajectories"], len(pull.conns))
        conns.add_metric(["weights"], len(pub.guard.conns))
        yield conns
        yield _gauge(
            "unread_bytes",
            "bytes trajectory connections made the learner hold unread at the last check",
            pull.unread_bytes_total,
        )
        cut = CounterMetricFamily(
            P + "connections_cut",
            "connections closed by the learner, by socket and reason",
            labels=["socket", "reason"],
        )
        for reason in CUT_REASONS:
            cut.add_metric(["trajectories", reason], float(pull.cut[reason]))
            cut.add_metric(["weights", reason], float(pub.guard.cut[reason]))
        yield cut
        yield _counter("weights_sends", "weights messages sent", pub.sends)
        yield _counter("weights_resends", "re-sends of unchanged weights", pub.resends)
        yield _counter("subscriptions", "subscriptions to the weights", pub.subscriptions)
        yield _counter("subscriptions_ignored", "subscriptions to topics never published", pub.ignored_subscriptions)
        yield _counter(
            "updates_skipped_nonfinite", "updates skipped: loss or gradient not finite", s.learner.updates_skipped
        )
        yield _counter("inputs_clipped", "values from the wire clipped into their range", s.learner.inputs_clipped)
        yield _counter(
            "weights_refused_nonfinite", "times weights were not published: not finite", s.weights_refused_nonfinite
        )
        yield _counter("checkpoint_failures", "checkpoints that could not be written", s.checkpoint_failures)
        yield _gauge("curriculum_difficulty", "the curriculum's value sent with the latest weights", s.difficulty)
        if s.actors is not None:
            yield _gauge("actors_alive", "local actor processes running", s.actors.alive())
            yield _counter("actor_restarts", "restarts of local actors", s.actors.restarts_total)
            yield _counter(
                "actors_replaced_silent", "local actors killed for missing heartbeats", s.actors.replaced_silent
            )
        lag_counts, lag_sum, rho_counts, rho_sum = s.totals.snapshot()
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
        rec = s.last_record or {}
        for key, (name, doc) in INTERVAL_GAUGES.items():
            value = rec.get(key)
            yield _gauge(name, doc, None if value is None else value / 1000 if key.endswith("_ms") else value)
        now = time.monotonic()
        yield _gauge("uptime_seconds", "run time, a resumed run's earlier time included", s.wall_offset_s + now - s.t0)
        beats = GaugeMetricFamily(
            P + "heartbeat_age_seconds",
            "time since the thread last made progress (/healthz: over health_stale_s is unhealthy)",
            labels=["thread"],
        )
        beats.add_metric(["trainer"], now - s.trainer.heartbeat)
        if s.receive_beat is not None:
            beats.add_metric(["receive"], now - s.receive_beat)
        yield beats
        yield _gauge("healthy", "1 while /healthz answers 200", float(health(s, now)[0]))


def health(s, now: float | None = None) -> tuple[bool, str]:
    """(healthy, reason): the training thread and the receive loop are alive and have made progress within
    health_stale_s, and shutdown has not begun. Before the first trajectory both wait, and go round their loops
    while they do (at least every 0.1 s): that is healthy."""
    now = time.monotonic() if now is None else now
    stale = s.cfg.observe.health_stale_s
    if s.stopping():
        return False, f"shutting down: {s.exit_reason or 'stop requested'}"
    if not s.trainer.alive():
        return False, f"training thread dead: {s.trainer.error!r}"
    age = now - s.trainer.heartbeat
    if age > stale:
        return False, f"training thread stuck: no progress for {age:.1f} s (health_stale_s={stale:g})"
    if s.receive_beat is None:
        return False, "receive loop not started"
    age = now - s.receive_beat
    if age > stale:
        return False, (
            f"receive loop stuck (event loop blocked?): no progress for {age:.1f} s (health_stale_s={stale:g})"
        )
    return True, (
        f"ok: training thread and receive loop alive; {s.ingest.env_steps} env steps, {s.learner.updates} updates"
    )


def start(server) -> None:
    """At the end of the server's startup: the TensorBoard writer and the /metrics and /healthz server, if asked for
    (the server's shutdown closes them, the HTTP server last)."""
    cfg = server.cfg
    server.receive_beat = time.monotonic()  # the receive loop starts right after the startup
    if cfg.observe.tensorboard:
        from .tboard import TensorBoardWriter

        server.tboard = TensorBoardWriter(
            server.logdir,
            flush_interval_s=cfg.observe.tensorboard_flush_interval_s,
            max_queue_records=cfg.observe.max_tensorboard_queue_records,
        )
    if cfg.observe.metrics_port:
        try:
            server.http = serve(server)
        except OSError as e:
            raise SystemExit(
                f"impala-async: cannot serve /metrics on {cfg.observe.metrics_host}:{cfg.observe.metrics_port} "
                f"(--metrics-host, --metrics-port): {e}"
            ) from None


def serve(server) -> httpd.HttpServer:
    """Start the learner's HTTP server on cfg.observe.metrics_host:metrics_port; OSError if it cannot bind."""
    from prometheus_client import ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(LearnerCollector(server))
    ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...

    def healthz() -> httpd.Response:
        ok, reason = health(server)
        return httpd.text(200 if ok else 503, reason)

    cfg = server.cfg
    http = httpd.HttpServer(
        cfg.observe.metrics_host,
        cfg.observe.metrics_port,
        {"/metrics": httpd.metrics_route(registry), "/healthz": healthz},
        max_connections=cfg.observe.max_metrics_connections,
        request_timeout_s=cfg.observe.metrics_request_timeout_s,
        max_request_bytes=cfg.observe.max_metrics_request_bytes,
        name="learner",
    )
    http.start()
    return http
