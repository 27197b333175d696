"""Configuration of a learner (and of the local actors ``train`` starts), with checks that explain what they prevent.

Every field is also a command-line flag (``--field-name``); ``help`` comes from the field's metadata. Limits are named
``max_*`` with their unit in the name; durations end in ``_s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

AUTO_SCRATCH_BYTES = 64 << 20  # decoded bytes of one message at most, when max_trajectories_per_message is auto
MODEL_CHOICES = ("auto", "mlp", "shallow", "minatar", "deep")


def usable_cpus(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (``docker run --cpus 4`` on a
    64-core host gives 4, where ``os.cpu_count()`` says 64 and one actor per core would oversubscribe 16x)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cgroup_cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota readable: the affinity mask is the answer
    return n


# Where /metrics and /healthz are served (README, Operations): the environment gives the defaults, so that a container
# image can turn them on for every command it runs; a flag still wins.
METRICS_PORT_ENV, METRICS_HOST_ENV = "IMPALA_ASYNC_METRICS_PORT", "IMPALA_ASYNC_METRICS_HOST"


def env_metrics_port() -> int:
    """The default metrics port: IMPALA_ASYNC_METRICS_PORT, else 0 (off); -1 if that variable is not a number (the
    config check then names it)."""
    raw = os.environ.get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        return -1


def env_metrics_host() -> str:
    return os.environ.get(METRICS_HOST_ENV, "").strip() or "127.0.0.1"


def metrics_address_problem(port: int, host: str) -> str | None:
    """Why ``port``/``host`` cannot be served (None if they can), naming the environment variable they came from."""
    if not 0 <= port <= 65535:
        source = f" (from {METRICS_PORT_ENV}={os.environ.get(METRICS_PORT_ENV)!r})" if os.environ.get(
            METRICS_PORT_ENV) else ""
        return f"metrics_port must be 0 (off) or a TCP port 1-65535, got {port}{source}"
    if port and not host:
        return "metrics_host must be an address to bind, e.g. 127.0.0.1"
    return None


# Fields about this process, not the run: a resumed run takes them from its own command line and environment, never
# from the checkpoint's configuration (a learner restarted in another container must not reuse the old port).
PER_INVOCATION_FIELDS = ("metrics_port", "metrics_host")
CURRICULA = ("none", "linear")  # --curriculum: the schedules of learner/curriculum.py, and none
FLOW_CONTROLS = ("pace", "none")  # --flow-control (learner/pacing.py)
OBS_CODECS = ("lz4", "jpeg")  # --obs-codec: how actors are asked to send image observations (core/codecs.py)
ENV_BACKENDS = ("auto", "gymnasium", "envpool")  # --env-backend (actors/vec.py)
DEFAULT_ENV_BACKEND = "auto"  # envpool for Atari where installed: ~10% more Pong steps per actor core (BENCHMARKS.md 9)


def opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class LearnerConfig:
    # ---- run
    env: str = opt("CartPole-v1", "gymnasium environment id (Discrete actions; vector or uint8-image observations)")
    env_kwargs: str = opt("", "JSON object of keyword arguments for the environment, the same in learner and "
                              "actors: '{\"max_episode_steps\": 200}'; for ALE '{\"repeat_action_probability\": 0}'")
    seed: int = opt(0, "random seed of the learner; actor i seeds its environments from seed, i and env index")
    logdir: str = opt("", "directory for metrics.jsonl and checkpoints (default: runs/<env>-<UTC time>)")
    device: str = opt("auto", "where the learner trains: auto (cuda if available), cpu or cuda[:N]")
    precision: str = opt("fp32", "fp32, or bf16: the network's forward pass under bf16 autocast (importance weights, "
                                 "V-trace and the losses stay fp32; no loss scaling needed)")
    total_env_steps: int = opt(1_000_000, "stop after training on this many environment steps")
    # ---- local actors (train only)
    num_actors: int = opt(-1, "actor processes started by 'train' (-1: one per usable CPU core, a container's quota "
                                 "included, but the one the learner keeps; 0: none, attach external actors instead)")
    envs_per_actor: int = opt(32, "environments each actor steps with one batched forward pass")
    unroll_length: int = opt(20, "T: environment steps per trajectory")
    env_backend: str = opt(DEFAULT_ENV_BACKEND, "how actors step Atari ids: gymnasium, envpool (EnvPool's C++ "
                                                "batch, pip install 'impala-async[envpool]'), or auto (envpool where "
                                                "installed, else gymnasium); other ids (MinAtar, CartPole, ...) "
                                                "always use gymnasium. Sent to actors as run.env_backend (the "
                                                "backend chosen); an actor's --env-backend wins")
    actor_device: str = opt("cpu", "where local actors run the policy's forward pass: cpu or cuda[:N]")
    # ---- model
    model: str = opt("auto", "network: auto (mlp for vectors; for uint8 images the MinAtar net up to 16x16 pixels, the "
                             "Nature CNN above), mlp, shallow (the Nature CNN), minatar, or deep (the IMPALA ResNet)")
    hidden_sizes: str = opt("64,64", "MLP layer widths, comma separated (vector observations)")
    activation: str = opt("tanh", "MLP activation: tanh, relu or elu")
    use_lstm: int = opt(0, "1: an LSTM core after the torso (image networks); actors carry its state across unrolls")
    lstm_size: int = opt(256, "units of the LSTM core (with --use-lstm 1)")
    input_scale: float = opt(0.0, "image networks multiply uint8 pixels by this (0: auto, 1 / the observation space's "
                                  "maximum: 1/255 for Atari frames, 1 for MinAtar's 0/1 planes)")
    # ---- optimisation
    batch_size: int = opt(16, "B: trajectories per learner update")
    optimizer: str = opt("adam", "adam (the source article's choice) or rmsprop (torchbeast's)")
    learning_rate: float = opt(1e-3, "initial learning rate")
    lr_schedule: str = opt("linear", "linear (decay to 0 at total_env_steps) or constant")
    adam_eps: float = opt(1e-5, "Adam epsilon")
    rmsprop_alpha: float = opt(0.99, "RMSprop smoothing constant")
    rmsprop_eps: float = opt(0.01, "RMSprop epsilon")
    rmsprop_momentum: float = opt(0.0, "RMSprop momentum")
    max_grad_norm: float = opt(40.0, "clip the global gradient norm to this (0: no clipping)")
    discount: float = opt(0.99, "gamma")
    entropy_cost: float = opt(0.001, "weight of the entropy bonus")
    final_entropy_cost: float = opt(-1.0, "anneal the entropy bonus linearly from entropy_cost to this at "
                                          "total_env_steps (-1: no annealing, entropy_cost throughout)")
    baseline_cost: float = opt(0.5, "weight of the baseline (value) loss")
    reward_clip: float = opt(0.0, "clip rewards to [-x, x] before learning (0: no clipping)")
    reward_scale: float = opt(0.1, "multiply rewards by this before learning, after clipping (keeps values near "
                                        "unit scale: CartPole returns of 500 would otherwise make values of ~100)")
    normalize_advantages: int = opt(0, "1: divide policy-gradient advantages by their batch standard deviation")
    clip_rho_threshold: float = opt(1.0, "V-trace rho-bar (0: no clipping)")
    clip_pg_rho_threshold: float = opt(1.0, "clip of the policy-gradient importance weight (0: no clipping)")
    clip_c_threshold: float = opt(1.0, "V-trace c-bar (0: no clipping)")
    vtrace_lambda: float = opt(1.0, "V-trace lambda: c_t = lambda * min(c-bar, rho_t); < 1 trades bias for variance")
    # ---- sockets
    listen: str = opt("", "ZeroMQ address trajectories arrive on (PULL; default tcp://127.0.0.1:5555 for "
                          "'learner', a free loopback port for 'train')")
    publish: str = opt("", "ZeroMQ address weights go out on (PUB; default: the listen port + 1)")
    receive_hwm_messages: int = opt(8, "ZMQ_RCVHWM: messages queued per connected actor before it must wait")
    receive_buffer_bytes: int = opt(0, "ZMQ_RCVBUF of the trajectory socket, the kernel's receive buffer per "
                                       "connection (0: the system's, which grows to megabytes: hundreds of small "
                                       "messages, that is policy lag, queue there when training falls behind)")
    actor_send_hwm_messages: int = opt(4, "ZMQ_SNDHWM of local actors: messages an actor queues before it waits")
    actor_send_buffer_bytes: int = opt(0, "ZMQ_SNDBUF of local actors, the kernel's send buffer (0: the "
                                          "system's); small buffers with --when-full wait keep policy lag small")
    curve_keys: str = opt("", "directory with learner.key_secret and allowed/*.key: CurveZMQ on both sockets, only "
                              "actors whose public key is in allowed/ get in (see README, Security)")
    insecure: int = opt(0, "1: allow binding a non-loopback address without --curve-keys")
    # ---- limits and flow control
    max_message_bytes: int = opt(16 << 20, "largest trajectory message accepted (ZMQ_MAXMSGSIZE)")
    max_trajectories_per_message: int = opt(0, "most trajectories in one message (0: auto, 256 or as many as fit "
                                                "in 64 MiB decoded, whichever is fewer; sizes the decode scratch)")
    max_episodes_per_message: int = opt(4096, "most episode records in one message")
    max_actor_id_bytes: int = opt(64, "longest actor id")
    max_abs_episode_return: float = opt(1e12, "reject a message reporting an episode return beyond +-this")
    max_episode_length_steps: int = opt(1 << 40, "reject a message reporting an episode longer than this")
    max_policy_lag: int = opt(100, "drop trajectories whose behaviour policy is more than this many versions old")
    max_tracked_actors: int = opt(100_000, "actor ids remembered for replay detection (least recent forgotten)")
    max_plausible_latency_s: float = opt(3600.0, "latency figures take only sent_at_ns within this of the learner's "
                                                 "clock (a peer's clock far off or lying is counted, not averaged)")
    # ---- what a peer can make the learner hold (see README, Operations: limits)
    max_connections: int = opt(1024, "most connections per socket (trajectories, weights), authenticated or not; "
                                     "newer ones are closed at once (lowered to fit the file-descriptor limit)")
    max_unread_bytes_per_connection: int = opt(0, "close a connection that makes the learner hold more unread bytes "
                                                  "(queued or partial messages) than this (0: auto, "
                                                  "(receive_hwm_messages + 2) * max_message_bytes)")
    max_unread_bytes_total: int = opt(2 << 30, "while all connections together hold more unread bytes than this, "
                                               "close the one holding most")
    max_subscription_bytes: int = opt(1024, "ZMQ_MAXMSGSIZE of the weights socket: subscriptions and handshakes")
    max_subscriptions_per_connection: int = opt(16, "close a weights connection that sends more subscription "
                                                    "messages than this (an honest subscriber sends one)")
    peer_timeout_s: float = opt(30.0, "close a connection whose peer has answered no ZeroMQ heartbeat for this long "
                                      "(a machine gone, or a link down, without the connection being closed; 0: "
                                      "TCP's own timeouts, about 15 minutes)")
    handshake_timeout_s: float = opt(10.0, "close a connection that has not completed the ZeroMQ handshake by then")
    connection_check_interval_s: float = opt(0.05, "how often unread bytes per connection are checked")
    min_resend_interval_s: float = opt(1.0, "least time between two re-sends of the weights to new subscribers "
                                            "(subscriptions meanwhile share the next one)")
    # ---- what enters the loss (values from the wire are clipped into these ranges; see docs/protocol.md)
    max_abs_reward: float = opt(1e6, "clip rewards to +-this (raw units, before --reward-clip and --reward-scale)")
    max_abs_truncation_value: float = opt(1e6, "clip truncation_value to +-this (reward-scaled units)")
    max_abs_logit: float = opt(1e3, "clip behaviour_logits to +-this")
    max_abs_obs: float = opt(1e6, "clip float observations to +-this")
    ring_batches: int = opt(8, "batch slots in the ring buffer (>= 3)")
    flow_control: str = opt("pace", "pace: the weights tell actors how fast to act so that they produce what "
                                    "training consumes (learner/pacing.py; actors slow down instead of being dropped), "
                                    "or none (actors act as fast as they can; when_full decides what gives)")
    pace_target_batches: float = opt(2.0, "pacing: batches the learner wants waiting in its ring (fewer: less policy "
                                          "lag; too few and training waits for data)")
    pace_window_s: float = opt(5.0, "pacing: the consumption rate and the number of actors are measured over this")
    max_pace_s_per_trajectory: float = opt(10.0, "pacing: the slowest pace the learner asks for")
    when_full: str = opt("drop_oldest", "when every ring slot is taken: drop_oldest (the oldest waiting batch) or "
                                        "wait (stop reading; socket high-water marks then make actors wait)")
    # ---- intervals and timeouts
    publish_interval_s: float = opt(0.0, "least time between two weight publications (0: after every update)")
    republish_interval_s: float = opt(5.0, "resend the latest weights this often (actors that join get them at once)")
    report_interval_s: float = opt(1.0, "write a metrics line this often")
    checkpoint_interval_s: float = opt(600.0, "write a checkpoint this often (a final one is always written)")
    shutdown_timeout_s: float = opt(10.0, "graceful shutdown gives up and forces exit after this long")
    actor_start_timeout_s: float = opt(120.0, "exit non-zero if no trajectory arrives this long after start")
    no_data_timeout_s: float = opt(60.0, "exit non-zero if no trajectory arrives for this long once data has flowed")
    heartbeat_interval_s: float = opt(1.0, "local actors report that they are alive this often")
    heartbeat_timeout_s: float = opt(10.0, "replace a local actor silent (hung, stopped) for this long")
    max_actor_restarts: int = opt(10, "restarts of one local actor before it is given up")
    checkpoint_keep: int = opt(3, "checkpoints kept in logdir (older ones deleted)")
    checkpoint_retry_interval_s: float = opt(10.0, "after a failed checkpoint (disk full, no file descriptor), try "
                                                   "again this much later; training goes on meanwhile")
    max_checkpoint_bytes: int = opt(4 << 30, "at resume, skip a checkpoint larger than this, or one whose records "
                                             "are compressed (torch writes them stored)")
    # ---- modes
    frame_dedup: int = opt(1, "1: observations that stack consecutive frames (Atari) travel and sit in the ring as "
                              "single frames, 4x less data; 0: whole stacks")
    obs_codec: str = opt("lz4", "how actors send uint8 image observations (obs, frames): lz4 (lossless) or jpeg "
                                "(lossy, at --jpeg-quality; needs pip install 'impala-async[jpeg]'); every other "
                                "field travels as lz4. The learner accepts lz4, jpeg or none from any actor")
    jpeg_quality: int = opt(90, "JPEG quality, 1 to 100, that actors encode images with under --obs-codec jpeg")
    ingest_only: int = opt(0, "1: decode into the ring and release batches without training (load tests)")
    overlap_copies: int = opt(1, "CUDA: copy batch k+1 to the GPU on its own stream while batch k trains (0: serial)")
    # ---- several learner ranks (torch.distributed; learner/ranks.py, README "Several learner ranks")
    learner_ranks: int = opt(1, "learner ranks (processes) training in lock step with averaged gradients, each on "
                                "its own trajectory socket (rank r >= 1 on the listen port + 1 + r) and, on CUDA, "
                                "GPU cuda:r; under torchrun WORLD_SIZE gives it")
    rank_collective_timeout_s: float = opt(60.0, "the longest a rank waits in a gradient all-reduce for the others "
                                                 "(one of them has no batch yet); then the learner stops (exit 6)")
    rank_start_timeout_s: float = opt(120.0, "every learner rank must have joined (and bound its socket) within this")
    rank_heartbeat_interval_s: float = opt(0.5, "learner ranks report that they are alive (and their counters) "
                                                "this often")
    rank_heartbeat_timeout_s: float = opt(5.0, "a learner rank silent for this long is taken for dead: the learner "
                                               "stops (exit 6)")
    rank_state_dump: int = opt(0, "1: at exit every learner rank writes LOGDIR/rank-<r>-state.pt (model and "
                                  "optimizer state, updates) so that ranks can be compared (tests)")
    # ---- policy-collapse warnings on the console (learner/watch.py; the source article, section 4)
    collapse_entropy_fraction: float = opt(0.1, "warn of a policy collapse when the entropy (median of the last 3 "
                                                "reports) falls below this fraction of its maximum over the last "
                                                "collapse_window_updates updates: 0.1, an order of magnitude (0: off)")
    collapse_window_updates: int = opt(1000, "updates over which the entropy's recent maximum is taken (a fall "
                                             "slower than this is a policy settling down, not a cliff)")
    collapse_rho_far_frac: float = opt(0.1, "warn of policy drift when more than this share of importance weights "
                                            "(median of the last 3 reports) lies outside [1/2, 2]: the policy being "
                                            "trained and the one that acted disagree by 2x on the action taken "
                                            "(healthy runs: near 0; 0: off)")
    collapse_warn_interval_s: float = opt(60.0, "at most one warning of each kind (entropy, drift) this often")
    # ---- operations: /metrics, /healthz, TensorBoard (README, Operations; docs/metrics.md, Prometheus)
    metrics_port: int = opt(env_metrics_port(), "serve Prometheus /metrics and /healthz over plain HTTP on this TCP "
                                                "port (0: off; default: $IMPALA_ASYNC_METRICS_PORT, else 0)")
    metrics_host: str = opt(env_metrics_host(), "address the metrics port binds (default: $IMPALA_ASYNC_METRICS_HOST, "
                                                "else 127.0.0.1; nothing authenticates it, see README, Operations)")
    max_metrics_connections: int = opt(8, "metrics HTTP connections answered at once; more are answered 503")
    max_metrics_request_bytes: int = opt(8192, "a metrics HTTP request head (request line and headers) longer than "
                                               "this is refused (431)")
    metrics_request_timeout_s: float = opt(5.0, "a metrics HTTP request must be read and answered within this long "
                                                "or its connection is closed")
    health_stale_s: float = opt(60.0, "/healthz answers 503 when the training thread or the receive loop has not "
                                      "made progress for this long (one update, and a checkpoint write, must fit in "
                                      "it: both run on the training thread)")
    tensorboard: int = opt(0, "1: also write every metrics.jsonl figure as TensorBoard events under "
                              "LOGDIR/tensorboard (needs pip install 'impala-async[tensorboard]')")
    tensorboard_flush_interval_s: float = opt(10.0, "TensorBoard events reach the disk at least this often")
    max_tensorboard_queue_records: int = opt(100, "metrics records waiting for the TensorBoard writer thread; one "
                                                  "more is dropped (and a warning logged) rather than waited for")
    # ---- curriculum (learner/curriculum.py; the source article, section 5.2)
    curriculum: str = opt("none", "environment difficulty by the episodes actors finished: none, or linear "
                                  "(curriculum_start to curriculum_end over curriculum_episodes); the value travels "
                                  "with the weights and each environment gets it through "
                                  "env.unwrapped.set_difficulty(value) at its next reset (README, Curriculum)")
    curriculum_start: float = opt(0.5, "difficulty at episode 0")
    curriculum_end: float = opt(2.0, "difficulty from curriculum_episodes on")
    curriculum_episodes: int = opt(10_000, "episodes over which a linear curriculum goes from start to end")

    def check(self) -> LearnerConfig:
        """Raise ValueError naming the field and the failure it would cause."""
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)
        need(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
             f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        try:
            self.env_kwargs_dict  # noqa: B018 (parsed for its errors)
        except ValueError as e:
            raise ValueError(f"env_kwargs: {e}") from None
        need(self.total_env_steps > 0, "total_env_steps must be > 0: the run would end before it starts")
        need(self.num_actors >= -1, "num_actors must be >= 0, or -1 for one per CPU core but one")
        need(self.envs_per_actor >= 1, "envs_per_actor must be >= 1: an actor without environments sends nothing")
        need(self.unroll_length >= 1, "unroll_length must be >= 1")
        need(self.batch_size >= 1, "batch_size must be >= 1")
        need(self.model in MODEL_CHOICES, f"model must be one of {', '.join(MODEL_CHOICES)}, got {self.model!r}")
        need(self.lstm_size >= 1, "lstm_size must be >= 1")
        need(self.use_lstm in (0, 1), "use_lstm must be 0 or 1")
        need(math.isfinite(self.input_scale) and self.input_scale >= 0, "input_scale must be >= 0 (0: auto)")
        need(not (self.use_lstm and self.model == "mlp"), "use_lstm needs an image network: the MLP has two torsos "
                                                          "and no core (choose --model auto, shallow, minatar or deep)")
        need(self.optimizer in ("adam", "rmsprop"), f"optimizer must be adam or rmsprop, got {self.optimizer!r}")
        need(self.precision in ("fp32", "bf16"), f"precision must be fp32 or bf16, got {self.precision!r} (fp16 would "
                                                 "need loss scaling, and bf16 has fp32's range without it)")
        need(self.lr_schedule in ("linear", "constant"), "lr_schedule must be linear or constant")
        need(self.learning_rate > 0, "learning_rate must be > 0")
        need(0.0 <= self.discount <= 1.0, "discount must lie in [0, 1]: values would diverge")
        for name in ("entropy_cost", "baseline_cost", "reward_clip", "max_grad_norm", "clip_rho_threshold",
                     "clip_pg_rho_threshold", "clip_c_threshold"):
            v = getattr(self, name)
            need(math.isfinite(v) and v >= 0, f"{name} must be a finite number >= 0, got {v}")
        need(self.final_entropy_cost == -1.0 or (math.isfinite(self.final_entropy_cost) and
                                                 self.final_entropy_cost >= 0),
             "final_entropy_cost must be a finite number >= 0, or -1 for no annealing")
        need(0.0 <= self.vtrace_lambda <= 1.0, "vtrace_lambda must lie in [0, 1]: above 1 the traces explode")
        need(self.baseline_cost > 0, "baseline_cost must be > 0: without a trained baseline V-trace targets are noise")
        need(self.ring_batches >= 3, "ring_batches must be >= 3 (one filling, one training, one waiting); with fewer "
                                     "the receiver and the trainer would wait on each other")
        need(self.when_full in ("drop_oldest", "wait"), "when_full must be drop_oldest or wait")
        need(self.flow_control in FLOW_CONTROLS, f"flow_control must be one of {', '.join(FLOW_CONTROLS)}, got "
                                                 f"{self.flow_control!r}")
        need(math.isfinite(self.pace_target_batches) and self.pace_target_batches > 0,
             "pace_target_batches must be > 0: with nothing waiting the trainer would wait for every batch")
        need(self.pace_window_s > 0 and self.max_pace_s_per_trajectory > 0,
             "pace_window_s and max_pace_s_per_trajectory must be > 0")
        need(self.max_policy_lag >= 1, "max_policy_lag must be >= 1: 0 would drop everything the actors send")
        need(self.max_message_bytes >= 1024, "max_message_bytes must be >= 1024")
        need(self.receive_hwm_messages >= 1, "receive_hwm_messages must be >= 1")
        need(self.actor_send_hwm_messages >= 1, "actor_send_hwm_messages must be >= 1")
        need(self.receive_buffer_bytes >= 0 and self.actor_send_buffer_bytes >= 0,
             "receive_buffer_bytes and actor_send_buffer_bytes must be >= 0 (0: the system's default)")
        need(self.max_trajectories_per_message >= 0, "max_trajectories_per_message must be >= 0 (0: auto)")
        for name in ("max_episodes_per_message", "max_actor_id_bytes", "max_tracked_actors", "max_connections",
                     "max_subscriptions_per_connection", "max_episode_length_steps", "max_checkpoint_bytes"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1")
        need(self.max_unread_bytes_per_connection == 0 or self.max_unread_bytes_per_connection
             >= self.max_message_bytes, "max_unread_bytes_per_connection must be 0 (auto) or >= max_message_bytes: "
                                        "a connection must be able to hold one whole message")
        need(self.max_unread_bytes_total >= self.max_message_bytes,
             "max_unread_bytes_total must be >= max_message_bytes: no message could ever be received")
        need(self.max_subscription_bytes >= 512, "max_subscription_bytes must be >= 512: a CurveZMQ handshake "
                                                 "needs frames of about 300 bytes")
        for name in ("max_abs_reward", "max_abs_truncation_value", "max_abs_logit", "max_abs_obs",
                     "max_abs_episode_return", "max_plausible_latency_s"):
            v = getattr(self, name)
            need(math.isfinite(v) and v > 0, f"{name} must be a finite number > 0, got {v}")
        for name in ("republish_interval_s", "report_interval_s", "checkpoint_interval_s", "shutdown_timeout_s",
                     "actor_start_timeout_s", "no_data_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s",
                     "handshake_timeout_s", "connection_check_interval_s", "checkpoint_retry_interval_s"):
            need(getattr(self, name) > 0, f"{name} must be > 0")
        need(self.publish_interval_s >= 0, "publish_interval_s must be >= 0")
        need(math.isfinite(self.peer_timeout_s) and self.peer_timeout_s >= 0, "peer_timeout_s must be >= 0 (0: off)")
        need(self.min_resend_interval_s >= 0, "min_resend_interval_s must be >= 0")
        need(self.heartbeat_timeout_s > 2 * self.heartbeat_interval_s,
             "heartbeat_timeout_s must exceed twice heartbeat_interval_s, or healthy actors would be killed")
        need(self.max_actor_restarts >= 0, "max_actor_restarts must be >= 0")
        for name in ("collapse_entropy_fraction", "collapse_rho_far_frac"):
            v = getattr(self, name)
            need(math.isfinite(v) and 0 <= v < 1, f"{name} must lie in [0, 1) (0: off), got {v}")
        need(self.collapse_window_updates >= 1, "collapse_window_updates must be >= 1")
        need(self.collapse_warn_interval_s >= 0, "collapse_warn_interval_s must be >= 0")
        need(self.env_backend in ENV_BACKENDS, f"env_backend must be one of {', '.join(ENV_BACKENDS)}, got "
                                               f"{self.env_backend!r}")
        need(self.actor_device == "cpu" or self.actor_device.startswith("cuda"),
             f"actor_device must be cpu or cuda[:N], got {self.actor_device!r}")
        need(self.obs_codec in OBS_CODECS, f"obs_codec must be one of {', '.join(OBS_CODECS)}, got "
                                           f"{self.obs_codec!r}")
        need(1 <= self.jpeg_quality <= 100, f"jpeg_quality must lie in [1, 100], got {self.jpeg_quality}")
        need(self.curriculum in CURRICULA, f"curriculum must be one of {', '.join(CURRICULA)}, got {self.curriculum!r}")
        need(math.isfinite(self.curriculum_start) and math.isfinite(self.curriculum_end),
             "curriculum_start and curriculum_end must be finite: they travel to actors as difficulties")
        need(self.curriculum_episodes >= 1, "curriculum_episodes must be >= 1")
        problem = metrics_address_problem(self.metrics_port, self.metrics_host)
        need(problem is None, problem)
        need(self.max_metrics_connections >= 1, "max_metrics_connections must be >= 1")
        need(self.max_metrics_request_bytes >= 256, "max_metrics_request_bytes must be >= 256: a GET with its usual "
                                                    "headers would be refused")
        for name in ("metrics_request_timeout_s", "health_stale_s", "tensorboard_flush_interval_s"):
            v = getattr(self, name)
            need(math.isfinite(v) and v > 0, f"{name} must be a finite number > 0, got {v}")
        need(self.tensorboard in (0, 1), "tensorboard must be 0 or 1")
        need(self.max_tensorboard_queue_records >= 1, "max_tensorboard_queue_records must be >= 1")
        need(self.learner_ranks >= 1, "learner_ranks must be >= 1")
        need(self.rank_state_dump in (0, 1), "rank_state_dump must be 0 or 1")
        for name in ("rank_collective_timeout_s", "rank_start_timeout_s", "rank_heartbeat_interval_s"):
            need(math.isfinite(getattr(self, name)) and getattr(self, name) > 0, f"{name} must be a finite number > 0")
        need(self.rank_heartbeat_timeout_s > 2 * self.rank_heartbeat_interval_s, "rank_heartbeat_timeout_s must "
             "exceed twice rank_heartbeat_interval_s, or healthy ranks would be taken for dead")
        need(self.checkpoint_keep >= 1, "checkpoint_keep must be >= 1: the newest checkpoint is the one resume needs")
        try:
            sizes = self.hidden_size_tuple
        except ValueError:
            sizes = ()
        need(len(sizes) >= 1 and all(h >= 1 for h in sizes),
             f"hidden_sizes must be comma-separated positive integers, got {self.hidden_sizes!r}")
        return self

    def resolve_for(self, trajectory_nbytes: int) -> None:
        """Fill the fields whose default depends on the trajectory size."""
        if self.max_trajectories_per_message == 0:
            self.max_trajectories_per_message = min(256, max(1, AUTO_SCRATCH_BYTES // trajectory_nbytes))
        if self.max_unread_bytes_per_connection == 0:
            self.max_unread_bytes_per_connection = (self.receive_hwm_messages + 2) * self.max_message_bytes

    @property
    def local_actors(self) -> int:
        return max(1, usable_cpus() - 1) if self.num_actors == -1 else self.num_actors

    @property
    def env_kwargs_dict(self) -> dict:
        """``env_kwargs`` parsed; ValueError unless it is empty or a JSON object."""
        if not self.env_kwargs.strip():
            return {}
        try:
            value = json.loads(self.env_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e}): {self.env_kwargs!r}") from None
        if type(value) is not dict:
            raise ValueError(f"must be a JSON object such as '{{\"max_episode_steps\": 200}}', got {self.env_kwargs!r}")
        return value

    @property
    def hidden_size_tuple(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.hidden_sizes.split(",") if x.strip())

    @staticmethod
    def threshold(x: float) -> float | None:
        """V-trace thresholds: 0 in the config means no clipping (None in vtrace)."""
        return None if x == 0 else x


def add_arguments(parser: argparse.ArgumentParser, cls, skip=()) -> None:
    """One ``--field-name`` flag per dataclass field, typed from its default."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=f.default,
                            metavar=kind.__name__.upper(), help=f"{f.metadata['help']} (default: {f.default!r})")


def from_arguments(cls, args: argparse.Namespace, **overrides):
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return cls(**values)
