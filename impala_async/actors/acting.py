"""The acting loop of an actor process: unroll, send, take newer weights, wait for the pace, and follow the learner
into a new incarnation (docs/protocol.md, "Learner restarts"; "Flow control")."""

from __future__ import annotations

import logging
import time

import zmq

from ..core import frames, wire
from ..ops import exitcodes
from .endpoints import Endpoints
from .rollout import unroll
from .runs import Run, RunError, _cut, build_run, run_changes, same_envs

log = logging.getLogger("impala_async.actors.acting")

MAX_WEIGHTS_BYTES = 256 << 20  # ZMQ_MAXMSGSIZE of the weights socket: the largest weights message taken
MAX_UNPACED_WAIT_S = 1.0  # flow control on, no pace yet (a learner warming up): the longest wait for newer weights
MAX_PACE_WAIT_S = 60.0  # flow control: the longest an actor waits between two unrolls for the pace
WARN_INTERVAL_S = 10.0  # weights messages this actor ignores are logged at most this often


class Throttled:
    """A warning logged at most once per ``interval_s``, with the count of those left out since the last one."""

    def __init__(self, interval_s: float = WARN_INTERVAL_S):
        self.interval_s, self.next_at, self.left_out = interval_s, 0.0, 0

    def __call__(self, fmt: str, *args) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.left_out += 1
            return
        if self.left_out:
            fmt, args = fmt + " (%d more like it not logged)", (*args, self.left_out)
        log.warning(fmt, *args)
        self.next_at, self.left_out = now + self.interval_s, 0


def _receive_weights(
    sub: zmq.Socket,
    max_bytes: int,
    timeout_ms: int,
    have: tuple[int, int] | None = None,
    warn=log.warning,
) -> wire.WeightsMessage | None:
    """Newest weights message (SUB is CONFLATEd) unless it is the ``(version, incarnation)`` already ``have``, or
    None if none arrived within timeout_ms. One that cannot be decoded is ``warn``-ed about and ignored."""
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
        warn("ignoring a weights message: %s", e)
        return None


class Acting:
    """The acting loop: unroll, send, take newer weights, wait for the pace; follows the learner into a new
    incarnation (docs/protocol.md, "Learner restarts"). ``run`` is the current :class:`Run`."""

    def __init__(self, cfg, actor_id, sub, push, stop, beat, watch, current: Run, first: wire.WeightsMessage):
        self.cfg, self.actor_id, self.sub, self.push = cfg, actor_id, sub, push
        self.stop, self.beat, self.watch = stop, beat, watch
        self.run = current
        self.ranks = Endpoints(push, cfg.learner)  # a learner of several ranks lists them all: push to each
        self.ranks.update(first.run_info)
        self.pace = first.pace_s_per_trajectory  # flow control: the least seconds per trajectory between unroll starts
        rate = cfg.options.max_env_steps_per_s  # the user's cap: the least seconds per unroll, whatever the pace
        self.min_unroll_s = cfg.options.envs_per_actor * current.spec.unroll_length / rate if rate else 0.0
        self.pending: wire.WeightsMessage | None = None  # received, not taken yet
        self.seq = 0
        self.unheard = 0  # messages sent since newer weights last arrived
        self.warn = Throttled()
        # Whether the learner's incarnation is known since the weights connection last dropped (after a drop, the
        # learner at that address may be a new one: nothing is sent until its weights say which).
        self.confirmed, self.disconnects = True, watch.disconnected if watch is not None else 0

    def loop(self) -> int:
        while not self.stop.requested:
            unroll_start = time.monotonic()
            code = self.unroll_and_send()
            if code is None:
                code = self.wait_turn() if self.run.info.get("lockstep") is True else self.between_unrolls(unroll_start)
            if code is not None:
                return code
        return exitcodes.OK

    def unroll_and_send(self) -> int | None:
        """One unroll, sent in parts of at most the learner's cap; an exit code if the actor must stop."""
        r, K = self.run, self.cfg.options.envs_per_actor
        r.state = unroll(r.policy, r.envs, r.state, r.rng, r.buf, r.obs_buf, self.beat)
        if r.spec.frame_stack:
            try:
                r.buf["frames"][:] = frames.pack(r.obs_buf, r.buf["terminated"] | r.buf["truncated"])
            except ValueError as e:
                log.error("actor %d: %s", self.cfg.index, e)
                return exitcodes.USAGE
        ended = r.envs.pop_episodes_by_env()
        for lo in range(0, K, r.per_message):
            hi = lo + r.per_message
            part = r.buf if r.per_message >= K else {name: a[lo:hi] for name, a in r.buf.items()}
            # Each episode goes with the part holding its environment's steps: a message carries no more episode
            # records than its steps end episodes (the learner checks it; docs/protocol.md).
            episodes = [episode for k, episode in ended if lo <= k < hi]
            msg = wire.encode_trajectories(
                r.spec,
                actor_id=self.actor_id,
                seq=self.seq,
                policy_version=r.policy.version,
                incarnation=r.policy.incarnation,
                arrays=part,
                episodes=episodes,
                codec=self.cfg.options.codec,
                sent_at_ns=time.time_ns(),
                image_codec=r.images,
                jpeg_quality=r.quality,
            )
            if not self.send(msg):
                break
            self.seq += 1
            self.unheard += 1
        return None

    def send(self, msg: bytes) -> bool:
        """Send, waiting (interruptibly) while the learner's queues are full or it is away, and after the weights
        connection dropped until the learner's weights confirm its incarnation. False if stopped first, or if weights
        of a new incarnation arrived meanwhile: ``msg`` was acted in the old run and is never sent to the new one."""
        while not self.stop.requested:
            self.beat()
            self.watch.poll()
            if self.watch.disconnected != self.disconnects:  # the learner went away, or the link
                self.disconnects, self.confirmed = self.watch.disconnected, False
            self.poll_weights(0 if self.confirmed else 100)
            if self.pending is not None and self.pending.incarnation != self.run.policy.incarnation:
                return False
            if not self.confirmed:
                continue
            try:
                self.push.send(msg, zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                self.push.poll(100, zmq.POLLOUT)
        return False

    def poll_weights(self, timeout_ms: int) -> bool:
        """Receive from the weights socket (waiting up to ``timeout_ms``): a newer message goes to ``pending``, a
        re-sent copy of the current one is skipped unread; either confirms the incarnation. Whether one is pending."""
        if not self.sub.poll(timeout_ms, zmq.POLLIN):
            return self.pending is not None
        try:
            data = self.sub.recv(zmq.NOBLOCK)
        except zmq.Again:
            return self.pending is not None
        have, header = self.pending or self.run.policy, wire.weights_header(data)
        if header is not None and header[1] == self.run.policy.incarnation:
            self.confirmed = True
        if header != (have.version, have.incarnation):
            try:
                self.pending = wire.decode_weights(data, MAX_WEIGHTS_BYTES)
                self.confirmed = True
            except wire.Rejected as e:
                self.warn("actor %d: ignoring a weights message: %s", self.cfg.index, e)
        return self.pending is not None

    def between_unrolls(self, unroll_start: float) -> int | None:
        """Newer weights, then, while the learner's pace (or the user's ``--max-env-steps-per-s``) says this actor is
        ahead, wait (taking weights that arrive meanwhile: the next unroll then acts with a fresher policy).
        docs/protocol.md, Flow control."""
        wait_ms, K, held_at = 0, self.cfg.options.envs_per_actor, time.monotonic()
        while True:
            self.watch.poll()
            self.beat()
            if self.poll_weights(wait_ms):
                msg, self.pending = self.pending, None
                code = self.take(msg)
                if code is not None:
                    return code
            now = time.monotonic()
            left_s = unroll_start + max(min(K * self.pace, MAX_PACE_WAIT_S), self.min_unroll_s) - now
            if self._ahead_unpaced() and now - held_at < MAX_UNPACED_WAIT_S:
                left_s = max(left_s, 0.001)
            if left_s <= 0 or self.stop.requested:
                return None
            wait_ms = max(1, min(100, int(left_s * 1000)))

    def wait_turn(self) -> int | None:
        """In lockstep (``--reproducible 1``; config/lockstep.py): wait for the weights the learner publishes once it
        has trained on the round this actor's unroll belonged to, newer than those the unroll acted with; the next
        unroll acts with exactly those. No pace: the lockstep is the flow control."""
        acted = self.run.policy.version, self.run.policy.incarnation
        while not self.stop.requested:
            self.watch.poll()
            self.beat()
            if self.poll_weights(100):
                msg, self.pending = self.pending, None
                code = self.take(msg)
                if code is not None:
                    return code
                if (self.run.policy.version, self.run.policy.incarnation) != acted:
                    return None
        return None

    def _ahead_unpaced(self) -> bool:
        """Flow control is on but sets no pace yet (the learner has not measured its consumption: its first seconds)
        and this actor has sent --send-hwm-messages messages since newer weights came: it waits for them rather than
        fill socket buffers with unrolls acted with ever older weights (docs/protocol.md, Flow control)."""
        return (
            self.run.info.get("flow_control") == "pace"
            and self.pace == 0
            and self.unheard >= self.cfg.options.send_hwm_messages
        )

    def take(self, msg: wire.WeightsMessage) -> int | None:
        """Act with ``msg`` from the next unroll on. Of this incarnation: weights that do not fit are ignored (with a
        warning). Of another: :meth:`follow`. An exit code if the actor cannot go on."""
        if msg.incarnation != self.run.policy.incarnation:
            return self.follow(msg)
        try:
            self.run.policy.load(msg)
        except ValueError as e:
            self.warn("actor %d: ignoring weights version %d: %s", self.cfg.index, msg.version, e)
            return None
        self.adopt(msg)
        return None

    def adopt(self, msg: wire.WeightsMessage) -> None:
        """What the latest weights message says besides the weights: addresses, difficulty, pace."""
        self.ranks.update(msg.run_info)
        self.unheard = 0
        if msg.difficulty is not None:
            self.run.envs.set_difficulty(msg.difficulty)
        self.pace = msg.pace_s_per_trajectory

    def follow(self, msg: wire.WeightsMessage) -> int | None:
        """A new learner incarnation: the same run, new weights loaded; another run, rebuilt (the environments kept
        unless their id, kwargs, backend or observation dtype changed, and reset either way); a run this actor cannot
        act in: one line, and exitcodes.RUN_CHANGED."""
        old, index = self.run, self.cfg.index
        changes = run_changes(old.info, msg.run_info)
        if not changes:
            try:
                old.policy.load(msg)  # logs "the learner restarted (new incarnation)"
            except ValueError as e:
                log.error("actor %d: the learner restarted (new incarnation) with weights unlike its run: %s", index, e)
                return exitcodes.RUN_CHANGED
            old.info = msg.run_info
            self.adopt(msg)
            return None
        log.info(
            "actor %d: the learner restarted (new incarnation) with another run (%s): rebuilding",
            index,
            _cut("; ".join(changes), 500),
        )
        keep = old.release_envs() if same_envs(self.cfg, old.info, msg.run_info) else None
        old.close()
        try:
            self.run = build_run(self.cfg, msg, self.beat, keep)
        except RunError as e:
            log.error("actor %d: cannot act in the learner's new run: %s", index, e)
            return exitcodes.RUN_CHANGED
        self.adopt(msg)
        log.info(
            "actor %d: acting in the new run: %d x %s (%s), policy version %d",
            index,
            self.cfg.options.envs_per_actor,
            msg.run_info["env_id"],
            self.run.envs.backend,
            msg.version,
        )
        return None
