"""The learner's configuration, continued: the sections of a learner as a service (its sockets and what peers may make
it hold, checkpoints, what it tells its operator, several ranks). Same rules as config/sections.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .actors import MetricsHttp
from .fields import Section, at_least, finite, finite_positive, need, opt, positive


@dataclass(frozen=True)
class Network(Section):
    """Sockets: where trajectories arrive and weights leave, CurveZMQ, and how often weights go out."""

    NAME = "network"
    TITLE = "network"
    listen: str = opt(
        "",
        "ZeroMQ address trajectories arrive on (PULL; default tcp://127.0.0.1:5555 for "
        "'learner', a free loopback port for 'train')",
    )
    publish: str = opt("", "ZeroMQ address weights go out on (PUB; default: the listen port + 1)")
    curve_keys: str = opt(
        "",
        "directory with learner.key_secret and allowed/*.key: CurveZMQ on both sockets, only "
        "actors whose public key is in allowed/ get in (see README, Security)",
    )
    insecure: int = opt(0, "1: allow binding a non-loopback address without --curve-keys", choices=(0, 1))
    receive_hwm_messages: int = opt(8, "ZMQ_RCVHWM: messages queued per connected actor before it must wait")
    receive_buffer_bytes: int = opt(
        0,
        "ZMQ_RCVBUF of the trajectory socket, the kernel's receive buffer per connection (0: auto, about "
        "receive_hwm_messages messages of envs_per_actor trajectories, or the system's autotuned buffer when that "
        "would exceed 256 KiB; the system's grows to megabytes: hundreds of small messages, that is data acted "
        "with ever older weights, queue there when the learner does not read)",
    )
    publish_interval_s: float = opt(0.0, "least time between two weight publications (0: after every update)")
    republish_interval_s: float = opt(5.0, "resend the latest weights this often (actors that join get them at once)")
    min_resend_interval_s: float = opt(
        1.0,
        "least time between two re-sends of the weights to new subscribers "
        "(subscriptions meanwhile share the next one)",
    )
    peer_timeout_s: float = opt(
        30.0,
        "close a connection whose peer has answered no ZeroMQ heartbeat for this long "
        "(a machine gone, or a link down, without the connection being closed; 0: "
        "TCP's own timeouts, about 15 minutes)",
    )
    handshake_timeout_s: float = opt(10.0, "close a connection that has not completed the ZeroMQ handshake by then")
    connection_check_interval_s: float = opt(0.05, "how often unread bytes per connection are checked")

    def check(self) -> None:
        super().check()
        at_least(self, 1, "receive_hwm_messages")
        at_least(self, 0, "receive_buffer_bytes")
        need(self.publish_interval_s >= 0, "publish_interval_s must be >= 0")
        need(self.min_resend_interval_s >= 0, "min_resend_interval_s must be >= 0")
        finite("peer_timeout_s", self.peer_timeout_s)
        positive(self, "republish_interval_s", "handshake_timeout_s", "connection_check_interval_s")


@dataclass(frozen=True)
class Limits(Section):
    """What a peer can make the learner accept and hold (README, Operations: limits); every rejection is counted by
    reason."""

    NAME = "limits"
    TITLE = "limits"
    max_message_bytes: int = opt(16 << 20, "largest trajectory message accepted (ZMQ_MAXMSGSIZE)")
    max_trajectories_per_message: int = opt(
        0,
        "most trajectories in one message (0: auto, 256 or as many as fit "
        "in 64 MiB decoded, whichever is fewer; sizes the decode scratch)",
    )
    max_episodes_per_message: int = opt(4096, "most episode records in one message")
    max_actor_id_bytes: int = opt(64, "longest actor id")
    max_abs_episode_return: float = opt(1e12, "reject a message reporting an episode return beyond +-this")
    max_episode_length_steps: int = opt(1 << 40, "reject a message reporting an episode longer than this")
    max_tracked_actors: int = opt(100_000, "actor ids remembered for replay detection (least recent forgotten)")
    max_plausible_latency_s: float = opt(
        3600.0,
        "latency figures take only sent_at_ns within this of the learner's "
        "clock (a peer's clock far off or lying is counted, not averaged)",
    )
    max_connections: int = opt(
        1024,
        "most connections per socket (trajectories, weights), authenticated or not; "
        "newer ones are closed at once (lowered to fit the file-descriptor limit)",
    )
    max_connection_checks_per_s: int = opt(
        2048,
        "most connections per socket whose unread bytes are checked a second; above "
        "connection_check_interval_s x this many connections each is checked less often (a check is a system call: "
        "1,000 idle connections checked every 50 ms took an eighth of a core)",
    )
    max_unread_bytes_per_connection: int = opt(
        0,
        "close a connection that makes the learner hold more unread bytes "
        "(queued or partial messages) than this (0: auto, "
        "(receive_hwm_messages + 2) * max_message_bytes)",
    )
    max_unread_bytes_total: int = opt(
        2 << 30, "while all connections together hold more unread bytes than this, close the one holding most"
    )
    max_subscription_bytes: int = opt(1024, "ZMQ_MAXMSGSIZE of the weights socket: subscriptions and handshakes")
    max_subscriptions_per_connection: int = opt(
        16,
        "close a weights connection that sends more subscription messages than this (an honest subscriber sends one)",
    )
    max_subscriber_stall_s: float = opt(
        10.0,
        "close a weights connection that, with weights waiting for it, has not taken one whole weights message for "
        "this long (a subscriber that reads nothing, or a trickle, keeps old weight versions in the learner's memory; "
        "its ZMTP PINGs keep it clear of peer_timeout_s); a link slower than a weights message per this long is cut",
    )
    max_weights_held_bytes: int = opt(
        256 << 20,
        "most bytes of weights messages held for subscribers that have not taken them yet (one copy per version, "
        "shared by the subscribers of that version; never less than 3 messages); while over it, the subscriber "
        "that has taken nothing for longest is closed",
    )
    max_send_buffer_bytes_per_subscriber: int = opt(
        256 << 10,
        "ZMQ_SNDBUF of the weights socket: the kernel's send buffer per subscriber (Linux reserves twice this: what "
        "a subscriber that reads nothing holds in the kernel); a subscriber then gets at most about twice this per "
        "network round trip (0: the system's autotuning, up to net.ipv4.tcp_wmem's maximum, 4 MiB by default)",
    )

    def check(self) -> None:
        super().check()
        need(self.max_message_bytes >= 1024, "max_message_bytes must be >= 1024")
        at_least(self, 0, "max_trajectories_per_message")
        at_least(
            self,
            1,
            "max_episodes_per_message",
            "max_actor_id_bytes",
            "max_tracked_actors",
            "max_connections",
            "max_connection_checks_per_s",
            "max_subscriptions_per_connection",
            "max_episode_length_steps",
        )
        need(
            self.max_unread_bytes_per_connection == 0 or self.max_unread_bytes_per_connection >= self.max_message_bytes,
            "max_unread_bytes_per_connection must be 0 (auto) or >= max_message_bytes: "
            "a connection must be able to hold one whole message",
        )
        need(
            self.max_unread_bytes_total >= self.max_message_bytes,
            "max_unread_bytes_total must be >= max_message_bytes: no message could ever be received",
        )
        need(
            self.max_send_buffer_bytes_per_subscriber == 0 or self.max_send_buffer_bytes_per_subscriber >= 4096,
            "max_send_buffer_bytes_per_subscriber must be 0 (the system's) or >= 4096: below, weights crawl",
        )
        need(
            self.max_weights_held_bytes >= 1 << 20,
            "max_weights_held_bytes must be >= 1048576 (1 MiB): below, subscribers would be closed as soon as a few "
            "small weights messages wait for them",
        )
        finite_positive(self, "max_subscriber_stall_s")
        need(
            self.max_subscription_bytes >= 512,
            "max_subscription_bytes must be >= 512: a CurveZMQ handshake needs frames of about 300 bytes",
        )
        positive(self, "max_abs_episode_return", "max_plausible_latency_s")


@dataclass(frozen=True)
class Checkpoints(Section):
    """Checkpoints: how often, how many kept, and what a resume accepts (learner/checkpoint/)."""

    NAME = "checkpoints"
    TITLE = "checkpoints"
    checkpoint_interval_s: float = opt(600.0, "write a checkpoint this often (a final one is always written)")
    checkpoint_keep: int = opt(3, "checkpoints kept in logdir (older ones deleted)")
    checkpoint_retry_interval_s: float = opt(
        10.0,
        "after a failed checkpoint (disk full, no file descriptor), try "
        "again this much later; training goes on meanwhile",
    )
    max_checkpoint_bytes: int = opt(
        4 << 30,
        "at resume, skip a checkpoint larger than this, or one whose records are compressed (torch writes them stored)",
    )

    def check(self) -> None:
        super().check()
        positive(self, "checkpoint_interval_s", "checkpoint_retry_interval_s")
        at_least(self, 1, "max_checkpoint_bytes")
        need(self.checkpoint_keep >= 1, "checkpoint_keep must be >= 1: the newest checkpoint is the one resume needs")


@dataclass(frozen=True)
class Observe(MetricsHttp):
    """What the learner tells its operator: metrics reports, /metrics and /healthz, TensorBoard, collapse warnings."""

    NAME = "observe"
    TITLE = "observability"
    report_interval_s: float = opt(1.0, "write a metrics line this often")
    report_interval_rounds: int = opt(
        10,
        "with --reproducible 1, whose reports must not follow the clock: a metrics line at the end of every this many "
        "rounds of the lockstep instead (a round: one unroll of each local actor)",
    )
    health_stale_s: float = opt(
        60.0,
        "/healthz answers 503 when the training thread or the receive loop has not "
        "made progress for this long (one update, and a checkpoint write, must fit in "
        "it: both run on the training thread)",
    )
    tensorboard: int = opt(
        0,
        "1: also write every metrics.jsonl figure as TensorBoard events under "
        "LOGDIR/tensorboard (needs pip install 'impala-async[tensorboard]')",
        choices=(0, 1),
    )
    tensorboard_flush_interval_s: float = opt(10.0, "TensorBoard events reach the disk at least this often")
    max_tensorboard_queue_records: int = opt(
        100,
        "metrics records waiting for the TensorBoard writer thread; one "
        "more is dropped (and a warning logged) rather than waited for",
    )
    collapse_entropy_fraction: float = opt(
        0.1,
        "warn of a policy collapse when the entropy (median of the last 3 "
        "reports) falls below this fraction of its maximum over the last "
        "collapse_window_updates updates: 0.1, an order of magnitude (0: off)",
    )
    collapse_window_updates: int = opt(
        1000,
        "updates over which the entropy's recent maximum is taken (a fall "
        "slower than this is a policy settling down, not a cliff)",
    )
    collapse_rho_far_frac: float = opt(
        0.1,
        "warn of policy drift when more than this share of importance weights "
        "(median of the last 3 reports) lies outside [1/2, 2]: the policy being "
        "trained and the one that acted disagree by 2x on the action taken "
        "(healthy runs: near 0; 0: off)",
    )
    collapse_warn_interval_s: float = opt(60.0, "at most one warning of each kind (entropy, drift) this often")

    def check(self) -> None:
        super().check()
        positive(self, "report_interval_s")
        finite_positive(self, "health_stale_s", "tensorboard_flush_interval_s")
        at_least(self, 1, "max_tensorboard_queue_records", "collapse_window_updates", "report_interval_rounds")
        for name in ("collapse_entropy_fraction", "collapse_rho_far_frac"):
            v = getattr(self, name)
            need(math.isfinite(v) and 0 <= v < 1, f"{name} must lie in [0, 1) (0: off), got {v}")
        need(self.collapse_warn_interval_s >= 0, "collapse_warn_interval_s must be >= 0")


@dataclass(frozen=True)
class Ranks(Section):
    """Several learner ranks (torch.distributed; learner/ranks/, README "Several learner ranks")."""

    NAME = "ranks"
    TITLE = "learner ranks"
    learner_ranks: int = opt(
        1,
        "learner ranks (processes) training in lock step with averaged gradients, each on "
        "its own trajectory socket (rank r >= 1 on the listen port + 1 + r) and, on CUDA, "
        "GPU cuda:r; under torchrun WORLD_SIZE gives it",
    )
    rank_collective_timeout_s: float = opt(
        60.0,
        "the longest a rank waits in a collective for the others (one of "
        "them has no batch yet); then the learner stops (exit 6)",
    )
    rank_start_timeout_s: float = opt(120.0, "every learner rank must have joined (and bound its socket) within this")
    rank_heartbeat_interval_s: float = opt(
        0.5, "learner ranks report that they are alive (and their counters) this often"
    )
    rank_heartbeat_timeout_s: float = opt(
        5.0, "a learner rank silent for this long is taken for dead: the learner stops (exit 6)"
    )
    rank_state_dump: int = opt(
        0,
        "1: at exit every learner rank writes LOGDIR/rank-<r>-state.pt (model and "
        "optimizer state, updates) so that ranks can be compared (tests)",
        choices=(0, 1),
    )

    def check(self) -> None:
        super().check()
        at_least(self, 1, "learner_ranks")
        finite_positive(self, "rank_collective_timeout_s", "rank_start_timeout_s", "rank_heartbeat_interval_s")
        need(
            self.rank_heartbeat_timeout_s > 2 * self.rank_heartbeat_interval_s,
            "rank_heartbeat_timeout_s must "
            "exceed twice rank_heartbeat_interval_s, or healthy ranks would be taken for dead",
        )
