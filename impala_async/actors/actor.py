"""An actor: steps K environments with the latest policy it has received and pushes unrolls to the learner.

Runs in its own process. Imports only the pure core (spec, wire, models) and never learner code. It learns everything
about the run (environment id, trajectory spec, network) from the first weights message, and never acts before that.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import zmq

from ..config import ActorOptions
from ..core import codecs, frames, wire
from ..core.address import port_offset
from ..ops import zmtp
from .endpoints import Endpoints
from .procs import BEAT, GRACE, die_with_parent
from .rollout import Policy, unroll
from .vec import AUTO, BACKENDS, VecEnv, make_vec

log = logging.getLogger("impala_async.actors.actor")


MAX_WEIGHTS_BYTES = 256 << 20  # ZMQ_MAXMSGSIZE of the weights socket: the largest weights message taken
MAX_PACE_WAIT_S = 60.0  # flow control: the longest an actor waits between two unrolls for the pace


@dataclass(frozen=True)
class ActorConfig:
    """One actor process: the learner it attaches to, its options (config/actors.py: the same whoever starts it),
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


def weights_address(learner: str) -> str:
    """Default weights address: the learner's port + 1 (tcp), as the learner binds it by default."""
    return port_offset(learner, 1, "a weights address (give --weights)")


class _Stop:
    def __init__(self):
        self.requested = False

    def __call__(self, *_):
        self.requested = True


class Heartbeat:
    """Writes a byte to the supervisor's pipe at most every interval_s; called from every loop of the actor, so that
    silence means the actor is stuck (or stopped), not merely that some helper thread is alive."""

    def __init__(self, fd: int, interval_s: float):
        self.fd, self.interval_s = fd, interval_s
        self.next_at = 0.0
        if fd >= 0:
            os.set_blocking(fd, False)

    def __call__(self) -> None:
        if self.fd < 0:
            return
        now = time.monotonic()
        if now >= self.next_at:
            self.next_at = now + self.interval_s
            self._write(BEAT)

    def grace(self) -> None:
        """Tell the supervisor that a long step without beats comes next (building the environments): it then waits
        up to procs.STARTUP_GRACE_S for the next beat instead of heartbeat_timeout_s."""
        if self.fd >= 0:
            self.next_at = 0.0  # the step's end beats at once
            self._write(GRACE)

    def _write(self, byte: bytes) -> None:
        try:
            os.write(self.fd, byte)
        except (BlockingIOError, BrokenPipeError):
            pass  # a full pipe means the supervisor is behind; a broken one, that it is gone


def image_codec(run_info: dict, codec: str) -> tuple[str, int]:
    """``(codec, JPEG quality)`` for the image field: jpeg at ``run.jpeg_quality`` where the learner's ``run.obs_codec``
    asks for it, else this actor's own ``codec`` (lz4, an absent or unknown value included: the learner accepts lz4
    from any actor). ImportError, one line naming the ``pip install``, if jpeg is asked for and simplejpeg missing."""
    if run_info.get("obs_codec") != wire.CODEC_JPEG:
        return codec, codecs.DEFAULT_QUALITY
    codecs.jpeg_module()
    return wire.CODEC_JPEG, int(run_info.get("jpeg_quality", codecs.DEFAULT_QUALITY))


def _receive_weights(
    sub: zmq.Socket, max_bytes: int, timeout_ms: int, have: tuple[int, int] | None = None
) -> wire.WeightsMessage | None:
    """Newest weights message (SUB is CONFLATEd) unless it is the ``(version, incarnation)`` already ``have``, or
    None if none arrived within timeout_ms."""
    if not sub.poll(timeout_ms, zmq.POLLIN):
        return None
    try:
        data = sub.recv(zmq.NOBLOCK)
        if have is not None and wire.weights_header(data) == have:
            return None  # a re-sent copy: skip decoding the tensors
        return wire.decode_weights(data, max_bytes)
    except zmq.Again:
        return None
    except wire.Rejected as e:
        log.warning("ignoring a weights message: %s", e)
        return None


def run(cfg: ActorConfig) -> int:
    """Act until SIGINT/SIGTERM (or the parent's death). Returns the exit code."""
    die_with_parent(cfg.parent_pid)
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    torch.set_num_threads(1)
    actor_id = f"{socket.gethostname()[:32]}/{os.getpid()}/{secrets.token_hex(4)}"
    ctx = zmq.Context(1)
    sub = ctx.socket(zmq.SUB)
    push = ctx.socket(zmq.PUSH)
    if cfg.curve_keys:
        from ..ops import auth

        keys = auth.load_actor_keys(cfg.curve_keys)
        auth.make_curve_client(sub, keys)
        auth.make_curve_client(push, keys)
    watch = HandshakeWatch(sub, cfg.weights)  # before connect: tells a refusal from an absent learner
    opts = cfg.options
    for sock in (sub, push):  # a link down and up again resumes within about connection_timeout_s
        zmtp.heartbeats(sock, opts.connection_timeout_s, connecting=True)
    sub.setsockopt(zmq.CONFLATE, 1)
    sub.setsockopt(zmq.MAXMSGSIZE, MAX_WEIGHTS_BYTES)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(cfg.weights)
    push.setsockopt(zmq.SNDHWM, opts.send_hwm_messages)
    if opts.send_buffer_bytes:
        push.setsockopt(zmq.SNDBUF, opts.send_buffer_bytes)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(cfg.learner)
    try:
        return _act(cfg, actor_id, sub, push, stop, Heartbeat(cfg.heartbeat_fd, opts.heartbeat_interval_s), watch)
    finally:
        watch.close(sub)
        sub.close(0)
        push.close(0)
        ctx.term()


def _act(
    cfg: ActorConfig,
    actor_id: str,
    sub: zmq.Socket,
    push: zmq.Socket,
    stop: _Stop,
    beat: Heartbeat,
    watch: HandshakeWatch,
) -> int:
    opts = cfg.options
    deadline = time.monotonic() + opts.max_wait_for_weights_s
    first = None
    while first is None:
        beat()
        watch.poll()
        if stop.requested:
            return 0
        if time.monotonic() > deadline:
            log.error(
                "actor %d: no weights from %s within %.0f s: %s",
                cfg.index,
                cfg.weights,
                opts.max_wait_for_weights_s,
                watch.diagnosis(),
            )
            return EXIT_REFUSED if watch.refused else EXIT_NO_WEIGHTS
        first = _receive_weights(sub, MAX_WEIGHTS_BYTES, 100)
    policy = Policy(first, opts.device)
    ranks = Endpoints(push, cfg.learner)  # a learner of several ranks lists them all: push to each (endpoints.py)
    ranks.update(first.run_info)
    spec, run_info = policy.spec, policy.run_info
    T, K = spec.unroll_length, opts.envs_per_actor
    per_message = int(run_info.get("max_trajectories_per_message", K)) or K
    try:
        images, quality = image_codec(run_info, opts.codec)
    except ImportError as e:
        log.error("actor %d: the learner asks for JPEG images (run.obs_codec): %s", cfg.index, e)
        return 2
    seeds = np.random.SeedSequence([cfg.seed, cfg.index]).generate_state(K + 1)
    rng = np.random.default_rng(seeds[K])
    beat.grace()  # building K environments can take longer than heartbeat_timeout_s (32 ALE games: about 10 s)
    envs = _make_envs(cfg, run_info, K, spec.obs_dtype, seeds[:K])
    if envs is None:
        return 2
    envs.set_difficulty(first.difficulty)  # the curriculum's value (None: none); each env takes it at its reset
    envs.reset(seeds[:K])
    beat()
    buf = {f.name: np.zeros((K, *f.shape), f.dtype) for f in spec.fields}
    # Observations [K, T+1, *obs_shape]; with frame_stack they are packed into buf["frames"] before sending.
    obs_buf = np.zeros((K, T + 1, *spec.obs_shape), spec.obs_dtype) if spec.frame_stack else buf["obs"]
    seq = 0
    state = policy.initial_state(K)  # carried across unrolls; reset where an episode begins
    pace = first.pace_s_per_trajectory  # flow control: the least seconds per trajectory between unroll starts
    log.info(
        "actor %d (%s): %d x %s (%s, %s), policy version %d",
        cfg.index,
        actor_id,
        K,
        run_info["env_id"],
        envs.backend,
        policy.device,
        policy.version,
    )
    while not stop.requested:
        unroll_start = time.monotonic()
        state = unroll(policy, envs, state, rng, buf, obs_buf, beat)
        if spec.frame_stack:
            try:
                buf["frames"][:] = frames.pack(obs_buf, buf["terminated"] | buf["truncated"])
            except ValueError as e:
                log.error("actor %d: %s", cfg.index, e)
                return 2
        episodes = envs.pop_episodes()
        for lo in range(0, K, per_message):  # the learner caps trajectories per message
            part = buf if per_message >= K else {name: a[lo : lo + per_message] for name, a in buf.items()}
            msg = wire.encode_trajectories(
                spec,
                actor_id=actor_id,
                seq=seq,
                policy_version=policy.version,
                incarnation=policy.incarnation,
                arrays=part,
                episodes=episodes,
                codec=opts.codec,
                sent_at_ns=time.time_ns(),
                image_codec=images,
                jpeg_quality=quality,
            )
            if not _send(push, msg, stop, beat):
                break
            seq += 1
            episodes = []
        # Newer weights, then, while the learner's pace says this actor is ahead, wait for the pace (taking weights
        # that arrive meanwhile: the next unroll then acts with a fresher policy). docs/protocol.md, Flow control.
        wait_ms = 0
        while True:
            watch.poll()
            beat()
            newer = _receive_weights(sub, MAX_WEIGHTS_BYTES, wait_ms, have=(policy.version, policy.incarnation))
            if newer is not None:
                policy.load(newer)
                ranks.update(newer.run_info)
                if newer.difficulty is not None:
                    envs.set_difficulty(newer.difficulty)
                pace = newer.pace_s_per_trajectory
            left_s = unroll_start + min(K * pace, MAX_PACE_WAIT_S) - time.monotonic()
            if left_s <= 0 or stop.requested:
                break
            wait_ms = max(1, min(100, int(left_s * 1000)))
    envs.close()
    return 0


def _make_envs(cfg: ActorConfig, run_info: dict, K: int, obs_dtype: str, seeds) -> VecEnv | None:
    """The actor's K environments on its backend: ``cfg.env_backend``, else the learner's ``run.env_backend``
    (informational: a backend the learner names that is unknown or not installed here falls back to gymnasium,
    with a warning). None, the reason logged, if they cannot be built."""
    backend, asked = cfg.env_backend, "--env-backend"
    if not backend:
        backend, asked = str(run_info.get("env_backend") or "gymnasium"), "the learner's run.env_backend"
        if backend not in (AUTO, *BACKENDS):
            log.warning("actor %d: unknown env backend %r from the learner: using gymnasium", cfg.index, backend)
            backend = "gymnasium"
    env_id, env_kwargs = run_info["env_id"], run_info.get("env_kwargs", {})
    try:
        return make_vec(env_id, env_kwargs, K, backend, obs_dtype, seeds=seeds)
    except (gym.error.DependencyNotInstalled, ValueError) as e:
        if cfg.env_backend or backend == "gymnasium":
            log.error("actor %d: cannot build %s (%s): %s", cfg.index, env_id, asked, e)
            return None
        log.warning("actor %d: %s (%s asks for envpool): using gymnasium", cfg.index, e, asked)
    try:
        return make_vec(env_id, env_kwargs, K, "gymnasium", obs_dtype)
    except (gym.error.DependencyNotInstalled, ValueError) as e:
        log.error("actor %d: cannot build %s: %s", cfg.index, env_id, e)
        return None


EXIT_NO_WEIGHTS, EXIT_REFUSED = 3, 5


class HandshakeWatch:
    """Tells, from the weights socket's monitor, a learner that refuses this actor's key from one that is absent.

    A CurveZMQ server whose ZAP handler refuses a client sends it an ERROR command; libzmq reports it to the client
    as ``ZMQ_EVENT_HANDSHAKE_FAILED_AUTH`` with the ZAP status code (400) as its value. A wrong learner key shows as
    ``ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL`` (the handshake cannot be decrypted); nothing listening shows as no
    ``ZMQ_EVENT_CONNECTED`` at all. docs/protocol.md (Keys) says the same for actors in other languages."""

    EVENTS = (
        zmq.EVENT_CONNECTED
        | zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )

    def __init__(self, sock: zmq.Socket, address: str):
        self.address = address
        self.monitor = sock.get_monitor_socket(self.EVENTS)
        self.connected = self.refused = self.failed = self.succeeded = 0

    def poll(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                self.connected += 1
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.succeeded += 1
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.refused += 1
                if self.refused == 1 or (self.refused & (self.refused - 1)) == 0:
                    log.error(
                        "the learner at %s refused this actor's key (ZAP status %s): its public key is not in "
                        "the learner's allowed/ directory",
                        self.address,
                        event["value"],
                    )
            else:
                self.failed += 1
                if self.failed == 1:
                    log.error(
                        "handshake with the learner at %s failed (%s): with --curve-keys, is learner.key the "
                        "learner's current public key?",
                        self.address,
                        event["event"],
                    )

    def diagnosis(self) -> str:
        if self.refused:
            return f"the learner refused this actor's key {self.refused} times (not in its allowed/ directory)"
        if self.failed:
            return "the handshake failed (a wrong learner.key, or CURVE on one side only)"
        if not self.connected:
            return "nothing accepted a connection there (no learner at that address, or a firewall)"
        return "connected, but no weights message came (is it an impala-async learner of this protocol version?)"

    def close(self, sock: zmq.Socket) -> None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)


def _send(push: zmq.Socket, msg: bytes, stop: _Stop, beat: Heartbeat) -> bool:
    """Send, waiting (interruptibly) while the learner's queues are full or it is away. False if stopped first."""
    while not stop.requested:
        beat()
        try:
            push.send(msg, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            push.poll(100, zmq.POLLOUT)
    return False
