"""What an actor process takes, from one source: :class:`ActorOptions` is read by ``impala-async actor``, by ``train``
(its local actors, under the learner's flag names: ``--actor-device`` for an actor's ``--device``) and by the actor
supervisor, with one set of defaults and checks, and :meth:`ActorOptions.argv` is the one way a child actor's command
line is written. :class:`MetricsHttp` is the /metrics and /healthz server's, shared by the learner and the actor
supervisor."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .fields import Section, at_least, finite_positive, need, opt, positive
from .machine import env_metrics_host, env_metrics_port, metrics_address_problem

CODECS = ("lz4", "none")  # array compression of an actor's messages (core/wire.py); JPEG is the learner's to ask


@dataclass(frozen=True)
class MetricsHttp(Section):
    """Prometheus /metrics and /healthz over plain HTTP (README, Operations; docs/metrics.md)."""

    NAME = "metrics"
    TITLE = "metrics and health"
    metrics_port: int = opt(
        env_metrics_port(),
        "serve Prometheus /metrics and /healthz over plain HTTP on this TCP "
        "port (0: off; default: $IMPALA_ASYNC_METRICS_PORT, else 0)",
    )
    metrics_host: str = opt(
        env_metrics_host(),
        "address the metrics port binds (default: $IMPALA_ASYNC_METRICS_HOST, "
        "else 127.0.0.1; nothing authenticates it, see README, Operations)",
    )
    max_metrics_connections: int = opt(
        256,
        "metrics HTTP connections held at once, from all addresses (and at most a quarter of the process's "
        "descriptor limit): at the cap the oldest one still sending its request head is closed for the newest; "
        "a request that arrives whole with its connection (a probe's) is answered at once, caps or not",
    )
    max_metrics_connections_per_address: int = opt(
        32,
        "metrics HTTP connections held at once from one source address: at the cap its oldest one still sending "
        "its request head is closed for the newest, so one client cannot crowd out the others (above "
        "max_metrics_connections, that cap binds first: a checkpoint of a run from before this field says 8)",
    )
    max_metrics_request_bytes: int = opt(
        8192, "a metrics HTTP request head (request line and headers) longer than this is refused (431)"
    )
    metrics_head_timeout_s: float = opt(
        2.0,
        "a metrics HTTP connection that has not sent its whole request head within this long is closed "
        "(what frees the room idle or slow clients hold)",
    )
    metrics_request_timeout_s: float = opt(
        5.0, "a metrics HTTP request must be read and answered within this long or its connection is closed"
    )
    metrics_threads: int = opt(2, "threads that compute /metrics answers (/healthz is answered without them)")
    max_metrics_queued_requests: int = opt(
        16, "/metrics requests waiting for one of metrics_threads; one more is answered 503"
    )
    metrics_allowed_hosts: str = opt(
        "",
        "host names, comma separated, the metrics HTTP server answers to besides IP addresses and localhost "
        "(the request's Host header; .example.org: every name under it); others are refused (421), which "
        "stops a DNS-rebinding web page in a browser on this machine from reading /metrics",
    )

    def check(self) -> None:
        super().check()
        problem = metrics_address_problem(self.metrics_port, self.metrics_host)
        need(problem is None, problem or "")
        at_least(self, 1, "max_metrics_connections", "max_metrics_connections_per_address", "metrics_threads")
        at_least(self, 1, "max_metrics_queued_requests")
        need(
            self.max_metrics_request_bytes >= 256,
            "max_metrics_request_bytes must be >= 256: a GET with its usual headers would be refused",
        )
        finite_positive(self, "metrics_head_timeout_s", "metrics_request_timeout_s")
        need(
            self.metrics_head_timeout_s <= self.metrics_request_timeout_s,
            "metrics_head_timeout_s must be <= metrics_request_timeout_s: the request head is part of the request",
        )
        self.allowed_hosts()

    def allowed_hosts(self) -> tuple[str, ...]:
        """metrics_allowed_hosts as names, lower case; ValueError for an entry that is not a host name (a port, a
        wildcard, a scheme: a Host check against it would refuse what it was meant to allow)."""
        names = tuple(h.strip().lower().rstrip(".") for h in self.metrics_allowed_hosts.split(",") if h.strip())
        for name in names:
            need(
                _HOST_NAME.fullmatch(name) is not None,
                f"metrics_allowed_hosts: {name!r} is not a host name (letters, digits, '-' and '.'; a leading "
                f"'.' for every name under it; no port, no '*')",
            )
        return names


_HOST_NAME = re.compile(r"\.?[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*")

# Fields about this process, not the run: a resumed run takes them from its own command line and environment, never
# from the checkpoint's configuration (a learner restarted in another container must not reuse the old port).
PER_INVOCATION = ("metrics_port", "metrics_host", "metrics_allowed_hosts")


@dataclass(frozen=True)
class ActorOptions(Section):
    """Actor processes: how each steps, sends, beats and is supervised (the same for train's local actors and
    impala-async actor)."""

    NAME = "actors"
    TITLE = "actors"
    envs_per_actor: int = opt(32, "environments each actor steps with one batched forward pass")
    send_hwm_messages: int = opt(
        4, "ZMQ_SNDHWM: messages an actor queues before it waits", learner_flag="actor_send_hwm_messages"
    )
    send_buffer_bytes: int = opt(
        0,
        "ZMQ_SNDBUF of an actor, the kernel's send buffer (0: auto, about send_hwm_messages messages, or the "
        "system's autotuned buffer when that would exceed 256 KiB); small buffers keep policy lag small",
        learner_flag="actor_send_buffer_bytes",
    )
    device: str = opt(
        "cpu", "where an actor runs the policy's forward pass: cpu or cuda[:N]", learner_flag="actor_device"
    )
    codec: str = opt(
        "lz4",
        "array compression of an actor's messages; images go as JPEG instead when the learner "
        "asks for it (--obs-codec jpeg)",
        learner_flag="actor_codec",
        choices=CODECS,
    )
    connection_timeout_s: float = opt(
        6.0,
        "an actor drops and remakes a connection to the learner that answers no "
        "ZeroMQ heartbeat for this long, and connection attempts give up after "
        "half of it (0: TCP's own timeouts, minutes after a long outage)",
        learner_flag="actor_connection_timeout_s",
    )
    max_wait_for_weights_s: float = opt(
        600.0, "an actor gives up if no weights arrive within this long", learner_flag="actor_max_wait_for_weights_s"
    )
    actor_start: str = opt(
        "fork",
        "how a supervisor starts an actor process: fork (from its zygote, a copy of the supervisor made at its "
        "start with torch imported: a few milliseconds) or spawn (a fresh interpreter: about 3 s of CPU importing "
        "torch); actors on CUDA always spawn",
        choices=("fork", "spawn"),
    )
    max_env_steps_per_s: float = opt(
        0.0,
        "each actor steps its environments at most this many env steps a second, all of them together (0: as fast "
        "as the learner's pace allows); leaves a shared machine's cores to its other work",
        learner_flag="actor_max_env_steps_per_s",
    )
    heartbeat_interval_s: float = opt(1.0, "actors report to their supervisor that they are alive this often")
    heartbeat_timeout_s: float = opt(10.0, "the supervisor replaces an actor silent (hung, stopped) for this long")
    max_actor_restarts: int = opt(
        10,
        "restarts in a row of one actor process (each after it ran under --actor-stable-after-s) before the "
        "supervisor gives it up",
    )
    actor_stable_after_s: float = opt(
        30.0,
        "an actor process that ran this long before it exited is restarted after 1 s again, and its count toward "
        "--max-actor-restarts starts over (shorter runs double the delay, up to 30 s)",
    )

    def check(self) -> None:
        super().check()
        at_least(self, 1, "envs_per_actor", "send_hwm_messages")
        at_least(self, 0, "send_buffer_bytes", "max_actor_restarts", "max_env_steps_per_s")
        need(
            self.device == "cpu" or self.device.startswith("cuda"),
            f"device (--actor-device) must be cpu or cuda[:N], got {self.device!r}",
        )
        need(self.connection_timeout_s >= 0, "connection_timeout_s must be >= 0 (0: TCP's own timeouts)")
        positive(self, "max_wait_for_weights_s", "heartbeat_interval_s", "heartbeat_timeout_s", "actor_stable_after_s")
        need(
            self.heartbeat_timeout_s > 2 * self.heartbeat_interval_s,
            "heartbeat_timeout_s must exceed twice heartbeat_interval_s, or healthy actors would be killed",
        )

    def forks(self) -> bool:
        """Whether a supervisor of these actors forks them from a zygote (actors/zygote.py)."""
        return self.actor_start == "fork" and self.device == "cpu"

    def argv(self) -> list[str]:
        """These options as ``impala-async actor`` flags, every one spelled out (a child never relies on defaults
        that could differ between versions)."""
        from .fields import fields_of

        out = []
        for f in fields_of(ActorOptions):
            out += ["--" + f.name.replace("_", "-"), str(getattr(self, f.name))]
        return out


@dataclass(frozen=True)
class ActorTarget(Section):
    """Which learner an impala-async actor command attaches to, and who it is."""

    NAME = "actor"
    TITLE = "learner to attach to"
    learner: str = opt("", "the learner's trajectory address (its --listen), e.g. tcp://HOST:5555 (required)")
    weights: str = opt("", "the learner's weights address (default: the learner port + 1)")
    num_actors: int = opt(1, "actor processes to run on this machine")
    seed: int = opt(0, "base seed: actor i seeds its environments from seed, i and the environment's index")
    index: int = opt(0, "index of the first actor, for seeding")
    curve_keys: str = opt(
        "", "directory with actor.key_secret and learner.key: connect with CurveZMQ (README, Security)"
    )
    env_backend: str = opt(
        "",
        "how to step Atari ids: gymnasium, envpool (pip install 'impala-async[envpool]') or "
        "auto (envpool where installed); other ids always use gymnasium (default: the "
        "learner's run.env_backend, else gymnasium)",
        choices=("", "auto", "gymnasium", "envpool"),
    )

    def check(self) -> None:
        super().check()
        need(bool(self.learner), "--learner is required: the learner's trajectory address, e.g. tcp://HOST:5555")
        at_least(self, 1, "num_actors")
        at_least(self, 0, "index")


@dataclass(frozen=True)
class ActorConfig:
    """One actor process: the learner it attaches to, its options (the same whoever starts it),
    and its place among its supervisor's actors."""

    learner: str  # PUSH connects here (the learner's --listen)
    weights: str  # SUB connects here (the learner's --publish)
    options: ActorOptions = ActorOptions()
    index: int = 0
    seed: int = 0
    curve_keys: str = ""  # directory with actor.key_secret and learner.key: connect with CURVE
    env_backend: str = ""  # gymnasium or envpool (Atari ids only); "": the learner's run.env_backend
    parent_pid: int = 0  # exit when this process goes away (local actors)
    heartbeat_fd: int = -1  # write end of the supervisor's heartbeat pipe (local actors)
