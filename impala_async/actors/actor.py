"""An actor: steps K environments with the latest policy it has received and pushes unrolls to the learner.

Runs in its own process. Imports only the pure core (spec, wire, models) and never learner code. It learns everything
about the run (environment id, trajectory spec, network) from the weights messages, and never acts before the first.
Everything built from a run is one :class:`Run`; when the learner restarts (a new incarnation in its weights) the actor
compares the new run with its own and acts on in it, rebuilding what changed, or exits with
:data:`exitcodes.RUN_CHANGED` (docs/protocol.md, "Learner restarts").
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import time

import torch
import zmq

from ..config import lockstep
from ..config.actors import ActorConfig
from ..config.resolve import auto_buffer_bytes
from ..core import wire
from ..core.address import port_offset
from ..ops import exitcodes, zmtp
from .acting import MAX_WEIGHTS_BYTES, Acting, Throttled, _receive_weights
from .procs import Heartbeat, die_with_parent
from .runs import RunError, build_run, check_actor_id

log = logging.getLogger("impala_async.actors.actor")


__all__ = [
    "ActorConfig",
    "HandshakeWatch",
    "attach",
    "run",
    "weights_address",
]


def weights_address(learner: str) -> str:
    """Default weights address: the learner's port + 1 (tcp), as the learner binds it by default."""
    return port_offset(learner, 1, "a weights address (give --weights)")


class _Stop:
    def __init__(self):
        self.requested = False

    def __call__(self, *_):
        self.requested = True


def run(cfg: ActorConfig) -> int:
    """An actor process: act until SIGINT/SIGTERM (or the parent's death). Returns the exit code (ops/exitcodes.py)."""
    die_with_parent(cfg.parent_pid)
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    torch.set_num_threads(1)
    return attach(cfg, stop)


def attach(cfg: ActorConfig, stop) -> int:
    """The actor itself, from its sockets to its exit code: attach to the learner, act until ``stop.requested``.
    :func:`run` gives it a process of its own; a test may run it in a thread (tests/inprocess.py)."""
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
    push.setsockopt(zmq.LINGER, 0)
    # Messages queue only on live connections: what was queued for a learner that went away is dropped with the
    # connection, never delivered to the next learner at that address (which may run another spec).
    push.setsockopt(zmq.IMMEDIATE, 1)  # connected by _connect_push once the first weights give the spec
    try:
        return _act(cfg, actor_id, sub, push, stop, Heartbeat(cfg.heartbeat_fd, opts.heartbeat_interval_s), watch)
    finally:
        watch.close(sub)
        sub.close(0)
        push.close(0)
        ctx.term()


def _first_weights(
    cfg: ActorConfig, sub: zmq.Socket, stop: _Stop, beat: Heartbeat, watch: HandshakeWatch
) -> wire.WeightsMessage | int:
    """The first weights message, or an exit code: 0 if stopped first, else no weights within
    ``--max-wait-for-weights-s`` (refused, or absent)."""
    opts = cfg.options
    deadline = time.monotonic() + opts.max_wait_for_weights_s
    warn = Throttled()
    while True:
        beat()
        watch.poll()
        if stop.requested:
            return exitcodes.OK
        if time.monotonic() > deadline:
            log.error(
                "actor %d: no weights from %s within %.0f s: %s",
                cfg.index,
                cfg.weights,
                opts.max_wait_for_weights_s,
                watch.diagnosis(),
            )
            return exitcodes.REFUSED if watch.refused else exitcodes.NO_WEIGHTS
        first = _receive_weights(sub, MAX_WEIGHTS_BYTES, 100, warn=warn)
        if first is not None:
            return first


def _act(
    cfg: ActorConfig,
    actor_id: str,
    sub: zmq.Socket,
    push: zmq.Socket,
    stop: _Stop,
    beat: Heartbeat,
    watch: HandshakeWatch,
) -> int:
    first = _first_weights(cfg, sub, stop, beat, watch)
    if isinstance(first, int):
        return first
    if first.run_info.get("lockstep") is True:  # --reproducible 1: the learner orders a round by actor index
        actor_id = lockstep.actor_id(cfg.index)
    try:
        check_actor_id(first.run_info, actor_id)
        current = build_run(cfg, first, beat)
    except RunError as e:
        log.error("actor %d: cannot act in the learner's run: %s", cfg.index, e)
        return exitcodes.USAGE
    log.info(
        "actor %d (%s): %d x %s (%s, %s), policy version %d",
        cfg.index,
        actor_id,
        cfg.options.envs_per_actor,
        current.info["env_id"],
        current.envs.backend,
        current.policy.device,
        current.policy.version,
    )
    _connect_push(push, cfg, current.spec.trajectory_nbytes)
    acting = Acting(cfg, actor_id, sub, push, stop, beat, watch, current, first)
    try:
        return acting.loop()
    finally:
        acting.run.close()


def _connect_push(push: zmq.Socket, cfg: ActorConfig, trajectory_nbytes: int) -> None:
    """Connect the trajectory socket, its kernel send buffer sized first: --send-buffer-bytes, or with 0 about
    --send-hwm-messages messages of the run's spec (config/resolve.py), so that no more than that waits for a
    learner that does not read. Connected once, when the first weights have given the spec: a connection made
    earlier and made again to take the size (disconnect, connect) could take the first message into the pipe being
    torn down, and a lockstep run (--reproducible 1) then waited for that message for ever (1 start in 5 on a loaded
    machine)."""
    opts = cfg.options
    nbytes = opts.send_buffer_bytes or auto_buffer_bytes(opts.send_hwm_messages, opts.envs_per_actor, trajectory_nbytes)
    if nbytes:  # 0: the system's autotuning (messages too large for a fixed buffer)
        push.setsockopt(zmq.SNDBUF, nbytes)
    push.connect(cfg.learner)


class HandshakeWatch:
    """Tells, from the weights socket's monitor, a learner that refuses this actor's key from one that is absent.

    A CurveZMQ server whose ZAP handler refuses a client sends it an ERROR command; libzmq reports it to the client
    as ``ZMQ_EVENT_HANDSHAKE_FAILED_AUTH`` with the ZAP status code (400) as its value. A wrong learner key shows as
    ``ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL`` (the handshake cannot be decrypted); nothing listening shows as no
    ``ZMQ_EVENT_CONNECTED`` at all. docs/protocol.md (Keys) says the same for actors in other languages.
    ``disconnected`` counts the weights connections lost (the learner gone, restarting, or a link down)."""

    EVENTS = (
        zmq.EVENT_CONNECTED
        | zmq.EVENT_DISCONNECTED
        | zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )

    def __init__(self, sock: zmq.Socket, address: str):
        self.address = address
        self.monitor = sock.get_monitor_socket(self.EVENTS)
        self.connected = self.refused = self.failed = self.succeeded = self.disconnected = 0

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
            elif kind == zmq.EVENT_DISCONNECTED:
                self.disconnected += 1
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
