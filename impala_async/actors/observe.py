"""``/healthz`` and ``/metrics`` of the ``impala-async actor`` supervisor (README, Operations). No learner code.

Healthy (200) while at least one actor process is alive and heartbeating (a heartbeat within the supervisor's
``--heartbeat-timeout-s``); 503 before the first heartbeat, when every actor is dead, hung or being restarted, and
once the supervisor is stopping. It says nothing about the learner: an actor waiting for weights heartbeats too.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from ..config import MetricsHttp
from ..ops import httpd
from .procs import ActorProcesses

P = "impala_async_"


class SupervisorState:
    """What /healthz and /metrics read: the processes, and whether the supervisor is stopping."""

    def __init__(self, procs: ActorProcesses):
        self.procs = procs
        self.stopping = False

    def health(self) -> tuple[bool, str]:
        p = self.procs
        if self.stopping:
            return False, "shutting down"
        beating, alive = p.heartbeating(), p.alive()
        if beating:
            return True, f"ok: {beating} of {p.count} actor processes alive and heartbeating"
        return False, (
            f"no actor process heartbeating: {alive} of {p.count} alive (starting, hung or restarting), "
            f"{p.restarts_total} restarts, {len(p.gave_up)} given up"
        )

    def collect(self):
        p = self.procs
        for name, doc, value in (
            ("actor_processes", "actor processes this supervisor runs", p.count),
            ("actors_alive", "actor processes running", p.alive()),
            ("actors_heartbeating", "actor processes running with a recent heartbeat", p.heartbeating()),
            ("actors_given_up", "actors restarted too often and given up", len(p.gave_up)),
            ("healthy", "1 while /healthz answers 200", float(self.health()[0])),
        ):
            yield GaugeMetricFamily(P + name, doc, value=float(value))
        yield CounterMetricFamily(P + "actor_restarts", "restarts of actor processes", value=float(p.restarts_total))
        yield CounterMetricFamily(
            P + "actors_replaced_silent", "actors killed for missing heartbeats", value=float(p.replaced_silent)
        )


def server_options(metrics: MetricsHttp) -> dict:
    """The :class:`httpd.HttpServer` limits a MetricsHttp section (the learner's Observe too) asks for, as keywords."""
    return {
        "max_connections": metrics.max_metrics_connections,
        "max_connections_per_address": metrics.max_metrics_connections_per_address,
        "request_timeout_s": metrics.metrics_request_timeout_s,
        "head_timeout_s": metrics.metrics_head_timeout_s,
        "max_request_bytes": metrics.max_metrics_request_bytes,
        "threads": metrics.metrics_threads,
        "max_queued_requests": metrics.max_metrics_queued_requests,
        "allowed_hosts": metrics.allowed_hosts(),
    }


def serve(state: SupervisorState, host: str, port: int, **limits) -> httpd.HttpServer:
    """Start the supervisor's HTTP server; OSError if it cannot bind. ``limits``: :class:`httpd.HttpServer`'s
    keywords (:func:`server_options`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(state)

    def healthz() -> httpd.Response:
        ok, reason = state.health()
        return httpd.text(200 if ok else 503, reason)

    server = httpd.HttpServer(
        host, port, {"/metrics": httpd.metrics_route(registry), "/healthz": healthz}, name="actors", **limits
    )
    registry.register(server.collector())
    server.start()
    return server
