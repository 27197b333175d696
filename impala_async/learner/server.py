"""The learner server: asyncio (uvloop) for sockets, one thread for training.

Life: startup -> main loop -> shutdown -> forced exit. Startup creates the parts in this order, and shutdown closes
them in the reverse one (each part's close registered as it is created, so only what exists is closed):

1. the ZeroMQ context and the ZAP authenticator (CURVE);
2. the sockets: :class:`~.intake.Intake` (trajectories in: PULL, guard, receive loop, :class:`~.ingest.Ingest` into
   the ring) and :class:`~.publisher.WeightsPublisher` (weights out: XPUB); signal handlers;
3. (rank 0) the metrics HTTP server (/metrics, /healthz: 503 until the receive loop runs, and again from the start
   of the shutdown);
4. (rank 0) checkpoints and reports (metrics.jsonl, console, TensorBoard); the first weights published;
5. the learner ranks' watch (ranks.py; a single rank has none);
6. (rank 0 of train) the local actors;
7. the training thread (:class:`~.trainer.Trainer`).

The main loop runs the receive loop and the periodic tasks (tasks.py) until a stop is requested. The training
thread's own close is the one step that does more than close: it stops training (with several ranks, after the same
update on every rank, intake going on till then), writes the final checkpoint and the final report.

Threads (docs/architecture.md): the event loop owns every socket; the training thread owns the model and optimizer
and hands weights messages to the loop with ``call_soon_threadsafe``; the parts count their own figures, which one
snapshot per report gathers (counters.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from ..config import LearnerConfig
from ..core.spec import TrajectorySpec
from ..ops import exitcodes
from ..ops.console import say
from . import checkpoint, prom, tasks
from .intake import Intake
from .learn import Learner
from .metrics import Update
from .parts import Parts
from .publisher import WeightsPublisher
from .tboard import tensorboard_writer

log = logging.getLogger("impala_async.learner.server")


class StartupError(Exception):
    """What keeps the learner from starting (an address in use, a logdir it cannot write), said in one line."""


def _bind(part, address: str, flag: str) -> str:
    """``part.bind(address)``; StartupError naming the address and its flag if it cannot be bound."""
    try:
        return part.bind(address)
    except zmq.ZMQError as e:
        raise StartupError(f"cannot bind {address} ({flag}): {e.strerror}") from None


class LearnerServer:
    def __init__(
        self,
        cfg: LearnerConfig,
        learner: Learner,
        spec: TrajectorySpec,
        run_info: dict,
        *,
        start_monotonic: float,
        ranks,
        actors=None,
        resumed: dict | None = None,
        keys=None,
        config_layers: dict | None = None,
    ):
        """``ranks``: this learner's rank, a ``SingleRank`` or one of a ``RankGroup`` (ranks.py); only rank 0 (the lead)
        publishes, reports and checkpoints. ``keys``: an ``auth.LearnerKeys`` to run both sockets under CURVE with ZAP
        authentication."""
        self.cfg, self.learner, self.spec, self.run_info = cfg, learner, spec, run_info
        self.actors, self.keys, self.ranks, self.resumed = actors, keys, ranks, resumed
        self.lead = ranks.rank == 0
        # A learner run's incarnation travels with the weights, and trajectories acted with them carry it back, so
        # that messages acted under an earlier run's weights (after a restart) are told apart from forged ones.
        self.incarnation = ranks.incarnation  # rank 0's, on every rank
        self.started_at = start_monotonic
        self.parts = Parts(
            cfg,
            spec,
            learner,
            actors=actors,
            ranks=ranks,
            incarnation=self.incarnation,
            started_at=start_monotonic,
            wall_offset_s=float(resumed["wall_s"]) if resumed else 0.0,
            config_layers=dict(config_layers or {}),
        )
        self.exit_code, self.exit_reason = 0, ""
        self._closers: list[tuple[str, Callable]] = []
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0

    # ------------------------------------------------------------------------------------------------- lifecycle
    async def serve(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            self._startup()
        except StartupError as e:  # one line (the server's caller prints the reason), not a traceback
            self.exit_reason, self.exit_code = str(e), exitcodes.ERROR
        else:
            await self._main()
        finally:
            await self._shutdown()
        return self.exit_code

    @property
    def endpoints(self) -> tuple[str, str]:
        """(trajectory address, weights address) as bound: what local actors connect to."""
        return self.parts.listen, self.parts.publish

    def stopping(self) -> bool:
        """Whether shutdown has begun (read by /healthz from its own thread)."""
        return self._stop is not None and self._stop.is_set()

    def request_stop(self, reason: str, code: int = 0) -> None:
        """Stop the run (event loop only; other threads: :meth:`request_stop_threadsafe`)."""
        if not self._stop.is_set():
            self.exit_reason, self.exit_code = reason, code
            self._stop.set()
            self.ranks.announce(reason, code)

    def request_stop_threadsafe(self, reason: str, code: int = 0) -> None:
        try:
            self._loop.call_soon_threadsafe(self.request_stop, reason, code)
        except RuntimeError:  # the loop is closed: the learner is gone already
            pass

    def _closes(self, name: str, close: Callable) -> None:
        """Register what shutdown does for a part just created (``close`` may be a coroutine function)."""
        self._closers.append((name, close))

    def _startup(self) -> None:
        self._start_sockets()
        if self.lead:
            self._start_http()
            self._start_reports()
        self.ranks.watch(figures=self.parts.own_figures, on_stop=self.request_stop_threadsafe)
        self._closes("learner ranks", self._finish_ranks)
        if self.lead:
            log.info(
                "learner: trajectories in on %s, weights out on %s, logdir %s, device %s%s",
                self.parts.listen,
                self.parts.publish,
                self.cfg.run.logdir,
                self.learner.device,
                ", ingest only" if self.cfg.run.ingest_only else "",
            )
            ranks = self.run_info.get("trajectory_addresses", [])
            say(
                f"impala-async learner listening: --learner {self.parts.listen} --weights {self.parts.publish}"
                + (f" (learner ranks: {' '.join(ranks)})" if len(ranks) > 1 else ""),
                sys.stdout,
            )
        if self.actors is not None:
            self.actors.start()
            self._closes("local actors", self._stop_actors)
        self._start_training()

    def _start_sockets(self) -> None:
        """The context, authentication, both sockets bound, the ring and ingest behind the trajectory socket."""
        cfg, p = self.cfg, self.parts
        p.ctx = zmq.Context(1)
        self._closes("zeromq context", p.ctx.term)
        secure = self._start_authentication()
        p.create_data_path(
            self.resumed,
            keys=self.keys,
            lead=self.lead,
            after_update=self._after_update,
            on_trainer_exit=self._on_trainer_exit,
        )
        p.intake = Intake(p.ctx, cfg.network, cfg.limits, p.ingest, secure)
        p.ring.on_release = p.intake.wake
        p.publisher = WeightsPublisher(p.ctx, cfg.network, cfg.limits, secure)
        self._closes("sockets", lambda: (p.intake.close(), p.publisher.close()))
        p.listen = _bind(p.intake, cfg.network.listen, "--listen")
        # Only rank 0 publishes; another rank's publisher is bound where nobody can reach it.
        p.publish = _bind(
            p.publisher, cfg.network.publish if self.lead else "inproc://unpublished-weights", "--publish"
        )
        addresses = self.ranks.share_address(p.listen)
        if self.lead:  # every rank's trajectory address, in rank order (docs/protocol.md, Transport)
            self.run_info["trajectory_addresses"] = addresses
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, self._on_signal, sig)
        self._loop.add_signal_handler(signal.SIGUSR1, tasks.dump_state, self._loop, self.parts.state_summary)
        self._closes("signal handlers", self._remove_signal_handlers)

    def _start_authentication(self):
        """With keys: start the ZAP authenticator (before any bind: no window without it) and return the function that
        makes a socket a CurveZMQ server admitting only the allowed keys (see auth.py). Without keys: None."""
        if self.keys is None:
            return None
        from ..ops import auth

        authenticator = self.parts.authenticator = auth.start_thread_authenticator(self.parts.ctx, self.keys)
        self._closes("authenticator", lambda: auth.stop_authenticator(authenticator))
        log.info("CURVE on: %d allowed actor key(s)", len(self.keys.allowed))
        return lambda sock: auth.make_curve_server(sock, self.keys)

    def _start_http(self) -> None:
        http = prom.start(
            self.cfg.observe, view=lambda: self.parts.prometheus_view(self._health()[0]), health=self._health
        )
        if http is not None:
            self._closes("metrics HTTP server", http.close)

    def _start_reports(self) -> None:
        """Checkpoints, the reports and their sinks, the first weights published."""
        cfg, p = self.cfg, self.parts
        logdir = Path(cfg.run.logdir)
        try:  # it holds the weights (checkpoints, 0600): only this user may list or enter it
            logdir.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(logdir, 0o700)
            if checkpoint.remove_partial(logdir):
                log.warning("removed a partial checkpoint left by an interrupted write in %s", logdir)
            p.checkpoints = checkpoint.Checkpoints(logdir, cfg.checkpoints, self.learner, collect=p.checkpoint_state)
        except OSError as e:
            raise StartupError(f"cannot use the logdir {logdir} (--logdir): {e.strerror or e}") from None
        self._closes("checkpoint writer", p.checkpoints.close)
        p.create_publication(self.run_info, lambda data: self._loop.call_soon_threadsafe(p.publisher.publish, data))
        weights = p.publication.encode()
        if weights is None:
            raise RuntimeError("the initial weights are not finite")
        p.publisher.publish(weights)
        tboard = tensorboard_writer(cfg, logdir)
        if tboard is not None:
            self._closes("TensorBoard writer", lambda: tboard.close(min(2.0, cfg.run.shutdown_timeout_s / 4)))
        p.create_reports(logdir, tboard, fresh=not self.resumed)
        self._closes("reports", p.reports.close)

    def _start_training(self) -> None:
        self.parts.trainer.start()
        self._closes("training", self._stop_training)

    async def _main(self) -> None:
        cfg, p = self.cfg, self.parts
        loops = [
            p.intake.run(self._stop),
            tasks.republish(p.publisher),
            tasks.probe_loop_lag(p.loop_lag_s),
            tasks.guard_connections([p.intake.guard, p.publisher.guard], cfg.network.connection_check_interval_s),
            tasks.supervise(
                self.actors,
                p.ingest,
                started_at=self.started_at,
                start_timeout_s=cfg.run.actor_start_timeout_s,
                no_data_timeout_s=cfg.run.no_data_timeout_s,
                listen=p.listen,
                stop=self.request_stop,
            ),
        ]
        if self.lead:
            loops.append(tasks.every(cfg.observe.report_interval_s, p.reports.report))
        tasks_ = [asyncio.create_task(c) for c in loops]
        stop = asyncio.create_task(self._stop.wait())
        done, _ = await asyncio.wait([stop, *tasks_], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not stop and t.exception() is not None:
                log.error("learner task failed", exc_info=t.exception())
                self.request_stop(f"internal error: {t.exception()!r}", exitcodes.ERROR)
        for t in tasks_:
            t.cancel()
        _, stuck = await asyncio.wait(tasks_, timeout=2.0)  # bounded: shutdown must go on regardless
        if stuck:
            log.error("tasks that did not end when cancelled: %s", [t.get_coro().__qualname__ for t in stuck])
        stop.cancel()

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
        self.ranks.kill_children()
        os._exit(exitcodes.FORCED)

    async def _shutdown(self) -> None:
        """The startup's mirror: every part created is closed, last created first, within shutdown_timeout_s (then
        the process is ended: forced exit). One part failing to close does not keep the others open."""
        self._stop.set()  # /healthz: 503 from here on (also when startup failed)
        timer = self._loop.call_later(self.cfg.run.shutdown_timeout_s, self._force_exit, "shutdown timeout")
        try:
            while self._closers:
                name, close = self._closers.pop()
                try:
                    result = close()
                    if asyncio.iscoroutine(result):
                        await result
                except Exception:
                    log.exception("closing the %s failed", name)
        finally:
            timer.cancel()
        log.info("learner stopped: %s", self.exit_reason)

    def _remove_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            self._loop.remove_signal_handler(sig)

    async def _in_thread(self, call, *args):
        return await self._loop.run_in_executor(None, call, *args)

    async def _stop_training(self) -> None:
        """Stop the training thread (intake is stopped already: the main loop has ended), then, if the weights are
        whole, the final checkpoint; then the final report."""
        p, cfg = self.parts, self.cfg
        # With several ranks every one stops after the same update (ranks.py), which needs a batch on each: intake
        # goes on till then.
        trained = asyncio.Event()
        intake = asyncio.create_task(p.intake.run(until=trained))
        whole = await self._in_thread(
            self.ranks.stop_training,
            p.trainer,
            self.learner,
            self.exit_code == 0 and not cfg.run.ingest_only,
            cfg.run.shutdown_timeout_s,
        )
        trained.set()
        await asyncio.wait([intake], timeout=1.0)
        if whole and p.checkpoints is not None:
            path = await self._in_thread(p.checkpoints.final, cfg.run.shutdown_timeout_s)
            if path is not None:
                log.info("final checkpoint: %s", path)
            elif self.exit_code == 0:
                self.exit_reason, self.exit_code = "the final checkpoint could not be written", exitcodes.NO_CHECKPOINT
        if p.reports is not None:
            p.reports.report()

    async def _stop_actors(self) -> None:
        await self._in_thread(self.actors.stop, max(1.0, self.cfg.run.shutdown_timeout_s / 2))

    async def _finish_ranks(self) -> None:
        await self._in_thread(self.ranks.finish, self.parts.trainer, self.learner, self.cfg)

    # ------------------------------------------------------------------------------- training-thread callbacks
    def _after_update(self, update: Update | None) -> bool:
        """After each batch (training thread; ``update`` None in ingest-only mode): record it, feed flow control,
        publish and checkpoint when due. True to stop training."""
        p, cfg = self.parts, self.cfg
        if update is None:
            return False
        p.updates.add(update)
        p.pacer.consumed(len(update.lag), update.waited_s)
        if self.lead:
            now = time.monotonic()
            p.publication.after_update(now)
            p.checkpoints.after_update(now)
        if self.learner.env_steps_trained >= cfg.run.total_env_steps:  # with ranks: all after the same update
            self.request_stop_threadsafe("total_env_steps reached", 0)
            return True
        return update.stats.get("last", False)  # rank 0 flagged this update as every rank's last (ranks.py)

    def _on_trainer_exit(self, error: BaseException | None) -> None:
        if error is not None:
            self.request_stop_threadsafe(*self.ranks.explain(error))

    def _health(self) -> tuple[bool, str]:
        """/healthz (the metrics HTTP thread)."""
        return self.parts.health(self.stopping(), self.exit_reason)
