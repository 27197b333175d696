"""The learner server: asyncio (uvloop) for sockets, one thread for training.

Life: startup (bind sockets, start the training thread, start local actors) -> main loop (receive, publish, report,
supervise) -> graceful shutdown (stop intake, stop training, final checkpoint, stop actors, close sockets) -> forced
exit if that takes longer than ``shutdown_timeout_s`` or a second Ctrl-C arrives.

Threads: the event loop owns every socket and the ingest path (:mod:`ingest`). The training thread (:mod:`trainer`)
owns the model and optimizer; it hands encoded weights back to the loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from ..actors.procs import ActorProcesses
from ..config import LearnerConfig
from ..core import wire
from ..core.ring import TrajectoryRing
from ..core.spec import TrajectorySpec
from . import checkpoint, curriculum, prom
from .guard import ConnectionGuard, guard_source
from .ingest import Histogram, Ingest
from .learn import Learner
from .metrics import MetricsWriter, Progress, Reporter
from .pacing import Pacer
from .periodic import PeriodicTasks, _wait
from .publisher import WeightsPublisher
from .ranks import RankGroup
from .rankwatch import totals
from .trainer import Trainer
from .watch import CollapseWatch

log = logging.getLogger("impala_async.learner.server")

MAX_DRAIN_MESSAGES = 256  # messages handled per wake-up before yielding to other tasks ...
MAX_DRAIN_S = 0.005  # ... or this much time
# Exit codes (argparse uses 2 for usage errors; 6, a learner rank failed: EXIT_RANK_FAILED, rankwatch.py).
EXIT_ERROR, EXIT_NO_CHECKPOINT = 1, 5  # 3 and 4: periodic.py


class LearnerServer(PeriodicTasks, checkpoint.Checkpointing):
    def __init__(
        self,
        cfg: LearnerConfig,
        learner: Learner,
        spec: TrajectorySpec,
        run_info: dict,
        logdir: Path,
        *,
        start_monotonic: float,
        actors: ActorProcesses | None = None,
        resumed: dict | None = None,
        keys=None,
        ranks: RankGroup | None = None,
        config_layers: dict | None = None,
    ):
        """``keys``: an ``auth.LearnerKeys`` to run both sockets under CURVE with ZAP authentication. ``ranks``: this
        learner is one rank of several (ranks.py); only rank 0 (the lead) publishes, reports and checkpoints."""
        self.cfg, self.learner, self.spec, self.run_info = cfg, learner, spec, run_info
        self.config_layers = config_layers or {}
        self.ranks = ranks
        self.lead = ranks is None or ranks.rank == 0
        self.keys = keys
        self.logdir = Path(logdir)
        self.device = learner.device
        self.actors = actors
        self.t0 = start_monotonic
        self.ring = TrajectoryRing(
            spec,
            cfg.loss.batch_size,
            cfg.ring.ring_batches,
            pin_memory=self.device.type == "cuda",
            drop_when_full=cfg.ring.when_full == "drop_oldest",
        )
        self.trainer = Trainer(
            learner,
            self.ring,
            max_policy_lag=cfg.ring.max_policy_lag,
            ingest_only=bool(cfg.run.ingest_only),
            overlap_copies=bool(cfg.run.overlap_copies),
            on_update=self._on_update,
            after_update=self._after_update,
            on_exit=self._on_trainer_exit,
        )
        # A learner run's incarnation: it travels with the weights, and trajectories acted with them carry it back,
        # so that messages acted under an earlier run's weights (after a restart) are told apart from forged ones.
        self.incarnation = wire.new_incarnation() if ranks is None else ranks.incarnation  # rank 0's, on every rank
        # Rank 0 publishes a version once it has made the update; another rank may finish that same update a moment
        # later (lock step: never more than one behind), so it accepts one version ahead of its own.
        ahead = 0 if self.lead else 1
        self.ingest = Ingest(
            cfg,
            spec,
            self.ring,
            lambda: self.trainer.policy_version + ahead,
            self.incarnation,
            identities=keys is not None,
        )
        self.wall_offset_s = 0.0
        if resumed:
            self._restore(resumed)
        # The curriculum's value follows from ingest.episodes (restored above): it travels with the weights.
        self.curriculum = curriculum.from_config(cfg)
        self.difficulty: float | None = None  # the value sent with the latest weights
        # Flow control: the pace sent with the weights (pacing.py); told of arrivals by ingest, of batches here.
        self.pacer = Pacer(
            cfg.ring.pace_target_batches * cfg.loss.batch_size if cfg.ring.flow_control == "pace" else 0,
            cfg.ring.pace_window_s,
            cfg.ring.max_pace_s_per_trajectory,
            capacity_trajectories=cfg.ring.ring_batches * cfg.loss.batch_size,
            max_tracked_senders=cfg.limits.max_tracked_actors,
            ranks=cfg.ranks.learner_ranks,
        )
        self._waited_s = 0.0  # the training thread's wait for batches, at the last update
        self.ingest.pacer = self.pacer
        self.watch = CollapseWatch.from_config(cfg, spec.num_actions, fresh=not resumed)
        self.loop_lag_s = Histogram()
        self.stage_s = {"receive": 0.0}
        self.reporter = Reporter(self, start_monotonic)
        # Read from the metrics HTTP thread (prom.py): cumulative histograms, the last record, the receive loop's
        # heartbeat (monotonic time it last went round); the HTTP server and the TensorBoard writer, if on.
        self.totals = prom.Totals()
        self.last_record: dict | None = None
        self.receive_beat: float | None = None
        self.http = self.tboard = None
        # Shared with the training thread.
        self._stats_lock = threading.Lock()
        self._stats: list[dict] = []
        self._lags: list[tuple[int, float, int]] = []
        self._last_publish = self._last_checkpoint = time.monotonic()
        self.checkpoint_failures = 0
        self.weights_refused_nonfinite = 0
        self.auth = None
        self.exit_code = 0
        self.exit_reason = ""

    # ------------------------------------------------------------------------------------------------- lifecycle
    async def serve(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._room = asyncio.Event()
        self.ring.on_release = lambda: self._loop.call_soon_threadsafe(self._room.set)
        self._signals = 0
        try:
            self._startup()
            await self._main()
        finally:
            await self._shutdown()
        return self.exit_code

    def _startup(self) -> None:
        cfg = self.cfg
        # Plain (synchronous) sockets: the event loop watches the PULL socket's file descriptor itself (see
        # _receive_loop) and only ever sends non-blocking on PUB; no pyzmq asyncio machinery shares those FDs.
        self.ctx = zmq.Context(1)
        secure = self._start_authentication()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, cfg.network.receive_hwm_messages)
        if cfg.network.receive_buffer_bytes:
            self.pull.setsockopt(zmq.RCVBUF, cfg.network.receive_buffer_bytes)
        self.pull.setsockopt(zmq.MAXMSGSIZE, cfg.limits.max_message_bytes)
        self.pull.setsockopt(zmq.HANDSHAKE_IVL, int(cfg.network.handshake_timeout_s * 1000))
        if (
            cfg.network.peer_timeout_s > 0
        ):  # a peer gone without closing its connection stops counting against the limits
            self.pull.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(cfg.network.peer_timeout_s * 1000 / 3)))
            self.pull.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(cfg.network.peer_timeout_s * 1000))
        self.pull.setsockopt(zmq.LINGER, 0)
        if secure is not None:
            secure(self.pull)
        self.pull_guard = ConnectionGuard(
            "trajectories",
            self.pull,
            max_connections=cfg.limits.max_connections,
            max_unread_bytes=cfg.limits.max_unread_bytes_per_connection,
            max_unread_bytes_total=cfg.limits.max_unread_bytes_total,
        )
        self.publisher = WeightsPublisher(self.ctx, cfg, secure)
        self.pull.bind(cfg.network.listen)
        self.listen_endpoint = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        # Only rank 0 publishes; another rank's publisher is bound where nobody can reach it.
        self.publish_endpoint = self.publisher.bind(
            cfg.network.publish if self.lead else "inproc://unpublished-weights"
        )
        addresses = [self.listen_endpoint] if self.ranks is None else self.ranks.share_address(self.listen_endpoint)
        if self.lead:  # every rank's trajectory address, in rank order (docs/protocol.md, Transport)
            self.run_info["trajectory_addresses"] = addresses
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, self._on_signal, sig)
        self._loop.add_signal_handler(signal.SIGUSR1, self._dump_state)
        if checkpoint.remove_partial(self.logdir):
            log.warning("removed a partial checkpoint left by an interrupted write in %s", self.logdir)
        if self.lead:  # what exists of these tells the shutdown what to do (hasattr(self, "metrics"))
            self.checkpoints = checkpoint.CheckpointWriter(self.logdir, self.cfg.checkpoints.checkpoint_keep)
            self.metrics = MetricsWriter(self.logdir / "metrics.jsonl")
            self.progress = Progress()
            weights = self._encode_weights()
            if weights is None:
                raise RuntimeError("the initial weights are not finite")
            self.publisher.publish(weights)
        if self.ranks is not None:
            self.ranks.watch(self)
        self.trainer.start()
        if not self.lead:
            return
        prom.start(self)  # TensorBoard writer, /metrics and /healthz, if asked for
        log.info(
            "learner: trajectories in on %s, weights out on %s, logdir %s, device %s%s",
            self.listen_endpoint,
            self.publish_endpoint,
            self.logdir,
            self.device,
            ", ingest only" if self.cfg.run.ingest_only else "",
        )
        print(
            f"impala-async learner listening: --learner {self.listen_endpoint} --weights {self.publish_endpoint}"
            + (f" (learner ranks: {' '.join(addresses)})" if len(addresses) > 1 else ""),
            flush=True,
        )
        if self.actors is not None:
            self.actors.start()

    def stopping(self) -> bool:
        """Whether shutdown has begun (read by /healthz from its own thread)."""
        return hasattr(self, "_stop") and self._stop.is_set()

    def _start_authentication(self):
        """With keys: start the ZAP authenticator (before any bind: no window without it) and return the function that
        makes a socket a CurveZMQ server admitting only the allowed keys (see auth.py). Without keys: None."""
        if self.keys is None:
            return None
        from ..ops import auth

        self.auth = auth.start_thread_authenticator(self.ctx, self.keys)
        log.info("CURVE on: %d allowed actor key(s)", len(self.keys.allowed))
        return lambda sock: auth.make_curve_server(sock, self.keys)

    async def _main(self) -> None:
        loops = (
            self._receive_loop(),
            self._republish_loop(),
            self._watch_loop(),
            self._loop_lag_loop(),
            self._guard_loop(),
            *([self._report_loop()] if self.lead else []),
        )
        tasks = [asyncio.create_task(c) for c in loops]
        stop = asyncio.create_task(self._stop.wait())
        done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not stop and t.exception() is not None:
                log.error("learner task failed", exc_info=t.exception())
                self.request_stop(f"internal error: {t.exception()!r}", EXIT_ERROR)
        for t in tasks:
            t.cancel()
        _, stuck = await asyncio.wait(tasks, timeout=2.0)  # bounded: shutdown must go on regardless
        if stuck:
            log.error("tasks that did not end when cancelled: %s", [t.get_coro().__qualname__ for t in stuck])
        stop.cancel()

    def request_stop(self, reason: str, code: int = 0) -> None:
        if not self._stop.is_set():
            self.exit_reason, self.exit_code = reason, code
            self._stop.set()
            if self.ranks is not None:
                self.ranks.announce(reason, code)

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        name = signal.Signals(sig).name
        if self._signals == 1:
            log.info("%s: shutting down (again to force)", name)
            self.request_stop(name, 0)
        else:
            self._force_exit(f"second {name}")

    def _force_exit(self, why: str) -> None:
        log.error("forced exit: %s", why)
        if self.actors is not None:
            self.actors.kill()
        if self.ranks is not None:
            self.ranks.kill_children()
        os._exit(130)

    async def _shutdown(self) -> None:
        if not hasattr(self, "ctx"):
            return
        timer = self._loop.call_later(self.cfg.run.shutdown_timeout_s, self._force_exit, "shutdown timeout")
        try:
            # Intake is already stopped (the receive task is cancelled); mirror the startup from here.
            if self.ranks is None:
                stopped = await self._loop.run_in_executor(None, self.trainer.stop, self.cfg.run.shutdown_timeout_s)
            else:  # every rank after the same update (ranks.py), which needs a batch on each: intake goes on till then
                trained = asyncio.Event()
                intake = asyncio.create_task(self._receive_loop(until=trained))
                stopped = await self._loop.run_in_executor(None, self.ranks.stop_training, self)
                trained.set()
                await asyncio.wait([intake], timeout=1.0)
            # With several ranks a failed (or stuck) training thread failed in the all-reduce, before the optimizer
            # step: the weights are still those of the last update, whole, unless it failed while applying one.
            whole = self.trainer.error is None if self.ranks is None else not self.learner.applying
            if (stopped or self.ranks is not None) and whole and hasattr(self, "metrics"):
                path = await self._loop.run_in_executor(None, self._final_checkpoint)
                if path is not None:
                    log.info("final checkpoint: %s", path)
                elif self.exit_code == 0:
                    self.exit_reason, self.exit_code = "the final checkpoint could not be written", EXIT_NO_CHECKPOINT
            if hasattr(self, "metrics"):
                self._report()
                self.progress.close()
            if self.actors is not None:
                await self._loop.run_in_executor(None, self.actors.stop, max(1.0, self.cfg.run.shutdown_timeout_s / 2))
            if self.ranks is not None:
                await self._loop.run_in_executor(None, self.ranks.finish, self)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                self._loop.remove_signal_handler(sig)
            self.pull_guard.close(self.pull)
            self.pull.close(0)
            self.publisher.close()
            if self.auth is not None:
                from ..ops import auth

                auth.stop_authenticator(self.auth)
            self.ctx.term()
            if hasattr(self, "metrics"):
                self.metrics.close()
                self.checkpoints.close()
            if self.tboard is not None:
                self.tboard.close(min(2.0, self.cfg.run.shutdown_timeout_s / 4))
            if self.http is not None:  # last: /healthz answers 503 all through the shutdown
                self.http.close()
            timer.cancel()
        log.info("learner stopped: %s", self.exit_reason)

    # --------------------------------------------------------------------------------------------------- intake
    async def _receive_loop(self, until: asyncio.Event | None = None) -> None:
        """Drain the PULL socket with non-blocking receives; sleep on its file descriptor only when it is empty.

        ZeroMQ's FD is edge-triggered ("something may have changed"): the loop checks ZMQ_EVENTS before sleeping
        and after every wake-up, so it never sleeps with messages pending. No Future per message."""
        sync, ingest, guard = self.pull, self.ingest, self.pull_guard
        user_ids = self.keys is not None
        readable = asyncio.Event()
        fd = sync.getsockopt(zmq.FD)
        self._loop.add_reader(fd, readable.set)
        recv_s = self.stage_s["receive"]  # cumulative (the loop runs again during a shutdown with ranks)
        until = until or self._stop
        try:
            while not until.is_set():
                self.receive_beat = time.monotonic()  # /healthz: at least every 0.1 s unless the loop is stalled
                if not ingest.continue_pending():
                    self._room.clear()
                    if not self.ring.writable():  # the trainer may have released a slot meanwhile
                        await _wait(self._room, 0.1)
                    continue
                if not sync.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    readable.clear()
                    if not sync.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # re-check: the edge may have come meanwhile
                        await _wait(readable, 0.1)
                        continue
                deadline = time.monotonic() + MAX_DRAIN_S
                for _ in range(MAX_DRAIN_MESSAGES):
                    t0 = time.perf_counter()
                    try:
                        frame = sync.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    recv_s += time.perf_counter() - t0
                    source = guard_source(frame)  # the connection it came from: its bytes are no longer held unread
                    if source is not None:
                        guard.delivered(source, len(frame))
                    if frame.more:
                        self._discard_multipart(sync)
                        continue
                    ingest.handle(frame.buffer, frame.get("User-Id") if user_ids else None)
                    if ingest.pending is not None or time.monotonic() > deadline:
                        break
                self.stage_s["receive"] = recv_s
                await asyncio.sleep(0)  # let the other tasks run between drains
        finally:
            self._loop.remove_reader(fd)

    def _discard_multipart(self, sync: zmq.Socket) -> None:
        """The protocol has one frame per message: drop the rest of a multipart message (already in memory)."""
        parts = 1
        while sync.getsockopt(zmq.RCVMORE):
            frame = sync.recv(copy=False)
            source = guard_source(frame)
            if source is not None:
                self.pull_guard.delivered(source, len(frame))
            parts += 1
        self.ingest.reject_reason("multipart", f"a message of {parts} frames; the protocol allows 1")

    # ------------------------------------------------------------------------------- training-thread callbacks
    def _on_update(self, version: int, stats: dict, lag) -> None:
        with self._stats_lock:
            self._stats.append(stats)
            self._lags.append((int(lag.min()), float(lag.mean()), int(lag.max())))
        self.totals.add(stats, lag)
        waited = self.trainer.stage_s["wait"]
        self.pacer.consumed(len(lag), waited - self._waited_s)
        self._waited_s = waited

    def _after_update(self) -> bool:
        now = time.monotonic()
        if self.cfg.run.ingest_only:
            return False
        if self.lead and now - self._last_publish >= self.cfg.network.publish_interval_s:
            self._last_publish = now
            weights = self._encode_weights()
            if weights is not None:
                self._loop.call_soon_threadsafe(self.publisher.publish, weights)
        if self.lead and now - self._last_checkpoint >= self.cfg.checkpoints.checkpoint_interval_s:
            self._last_checkpoint = now
            if self._try_checkpoint() is None:  # retried sooner than the next regular one; training goes on
                self._last_checkpoint = (
                    now - self.cfg.checkpoints.checkpoint_interval_s + self.cfg.checkpoints.checkpoint_retry_interval_s
                )
        if self.learner.env_steps_trained >= self.cfg.run.total_env_steps:  # with ranks: all after the same update
            self._loop.call_soon_threadsafe(self.request_stop, "total_env_steps reached", 0)
            return True
        return self.learner.stop_agreed  # rank 0 flagged this update as every rank's last (ranks.py)

    def _on_trainer_exit(self, error: BaseException | None) -> None:
        if error is not None:
            reason, code = (
                (f"training failed: {error!r}", EXIT_ERROR) if self.ranks is None else self.ranks.explain(error)
            )
            self._loop.call_soon_threadsafe(self.request_stop, reason, code)

    def _encode_weights(self) -> bytes | None:
        """The current weights as a weights message; None (and an error logged) if any of them is not finite: such
        weights are never published (an update with a non-finite loss is skipped, so this should not happen)."""
        state = {k: v.detach().to("cpu").numpy() for k, v in self.learner.model.state_dict().items()}
        bad = [k for k, a in state.items() if a.dtype.kind == "f" and not np.isfinite(a).all()]
        if bad:
            self.weights_refused_nonfinite += 1
            log.error("not publishing weights with non-finite values in %s", bad[:5])
            return None
        if self.curriculum is not None:
            self.difficulty = self.curriculum.value(totals(self)[0]["episodes"])  # every rank's episodes
        pace = self.pacer.pace(self.ring.waiting_trajectories())
        return wire.encode_weights(
            self.trainer.policy_version,
            state,
            self.run_info,
            self.incarnation,
            difficulty=self.difficulty,
            pace_s_per_trajectory=pace,
        )
