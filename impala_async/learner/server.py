"""The learner server: asyncio (uvloop) for sockets, one thread for training.

Life: startup -> main loop -> shutdown -> forced exit. Startup assembles the rank's parts (assembly.py: the ZeroMQ
context and the ZAP authenticator, the data path, both sockets bound, train's local actors, and on rank 0 the
outputs: checkpoints, the weights publication, TensorBoard, the reports), each part's close registered as it is made,
then starts, in this order: signal handlers; (rank 0) the metrics HTTP server (/metrics, /healthz: 503 until the
receive loop runs, and again from the start of the shutdown) and the first weights published; the learner ranks'
watch (learner/ranks/; a single rank has none); (rank 0 of train) the local actors; the training thread
(:class:`~.trainer.Trainer`). Shutdown closes everything in the reverse order, only what exists.

The main loop runs the receive loop and the periodic tasks (tasks.py) until a stop is requested. The training
thread's own close is the one step that does more than close: it stops training (with several ranks, after the same
update on every rank, intake going on till then), writes the final checkpoint and the final report.

Threads (docs/architecture.md): the event loop owns every socket; the training thread owns the model and optimizer
and hands weights messages to the loop with ``call_soon_threadsafe``; the parts count their own figures, which one
snapshot per report gathers (reports/counters.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

from ..config import LearnerConfig
from ..core.spec import TrajectorySpec
from ..ops import exitcodes
from ..ops.console import say
from . import tasks
from .assembly import StartupError, assemble, assemble_outputs, run_of
from .learn import Learner
from .parts import Outputs, Parts
from .reports import prom
from .reports.metrics import Update

log = logging.getLogger("impala_async.learner.server")


class LearnerServer:
    _loop: asyncio.AbstractEventLoop  # the serving loop, from serve() on

    def __init__(
        self,
        cfg: LearnerConfig,
        learner: Learner,
        spec: TrajectorySpec,
        run_info: dict,
        *,
        start_monotonic: float,
        ranks,
        make_actors: Callable[[str, str], object | None] = lambda listen, publish: None,
        resumed: dict | None = None,
        keys=None,
        config_layers: dict | None = None,
    ):
        """``ranks``: this learner's rank, a ``SingleRank`` or one of a ``RankGroup`` (ranks/); only rank 0 (the lead)
        publishes, reports and checkpoints. ``make_actors(listen, publish)``: train's local actors (not started) for
        the addresses bound, or None. ``keys``: an ``auth.LearnerKeys`` to run both sockets under CURVE with ZAP
        authentication."""
        self.cfg, self.learner, self.keys, self.ranks, self.resumed = cfg, learner, keys, ranks, resumed
        # A learner run's incarnation travels with the weights, and trajectories acted with them carry it back, so
        # that messages acted under an earlier run's weights (after a restart) are told apart from forged ones.
        self.run = run_of(
            cfg,
            spec,
            run_info,
            incarnation=ranks.incarnation,  # rank 0's, on every rank
            started_at=start_monotonic,
            resumed=resumed,
            config_layers=config_layers,
        )
        self._make_actors = make_actors
        self.parts: Parts | None = None  # assembled by startup, inside the event loop
        self.outputs: Outputs | None = None  # rank 0's, likewise
        self.exit_code, self.exit_reason = 0, ""
        self._closers: list[tuple[str, Callable]] = []
        self._stop = asyncio.Event()  # set once a stop is requested (bound to the serving loop at its first use)
        self._signals = 0

    # ------------------------------------------------------------------------------------------------- lifecycle
    async def serve(self) -> int:
        self._loop = asyncio.get_running_loop()
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
    def _p(self) -> Parts:
        """The parts (startup has assembled them by the time anything else runs)."""
        assert self.parts is not None, "the parts are used before startup assembled them"
        return self.parts

    def stopping(self) -> bool:
        """Whether shutdown has begun (read by /healthz from its own thread)."""
        return self._stop.is_set()

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
        p = self.parts = assemble(
            self.run,
            self.learner,
            ranks=self.ranks,
            keys=self.keys,
            resumed=self.resumed,
            closes=self._closes,
            after_update=self._after_update,
            on_trainer_exit=self._on_trainer_exit,
            make_actors=self._make_actors,
        )
        self._start_signal_handlers()
        if self.ranks.lead:
            self.outputs = assemble_outputs(p, fresh=not self.resumed, closes=self._closes)
            self._start_http(self.outputs)
            weights = self.outputs.publication.encode()
            if weights is None:
                raise RuntimeError("the initial weights are not finite")
            p.publisher.publish(weights)
            self._say_listening()
        self.ranks.watch(figures=p.own_figures, on_stop=self.request_stop_threadsafe)
        self._closes("learner ranks", self._finish_ranks)
        if p.actors is not None:
            p.actors.start()
            self._closes("local actors", self._stop_actors)
        p.trainer.start()
        self._closes("training", self._stop_training)

    def _start_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, self._on_signal, sig)
        self._loop.add_signal_handler(signal.SIGUSR1, tasks.dump_state, self._loop, self._p.state_summary)
        self._closes("signal handlers", self._remove_signal_handlers)

    def _start_http(self, outputs: Outputs) -> None:
        http = prom.start(
            self.cfg.observe,
            view=lambda: self._p.prometheus_view(outputs.reports, self._health()[0]),
            health=self._health,
        )
        if http is not None:
            self._closes("metrics HTTP server", http.close)

    def _say_listening(self) -> None:
        p = self._p
        log.info(
            "learner: trajectories in on %s, weights out on %s, logdir %s, device %s%s",
            p.listen,
            p.publish,
            self.cfg.run.logdir,
            self.learner.device,
            ", ingest only" if self.cfg.run.ingest_only else "",
        )
        ranks = self.run.info.get("trajectory_addresses", [])
        say(
            f"impala-async learner listening: --learner {p.listen} --weights {p.publish}"
            + (f" (learner ranks: {' '.join(ranks)})" if len(ranks) > 1 else ""),
            sys.stdout,
        )

    async def _main(self) -> None:
        cfg, p = self.cfg, self._p
        loops = [
            p.intake.run(self._stop),
            tasks.republish(p.publisher),
            tasks.probe_loop_lag(p.loop_lag_s),
            tasks.guard_connections([p.intake.guard, p.publisher.guard], cfg.network.connection_check_interval_s),
            tasks.supervise(
                p.actors,
                p.ingest,
                started_at=self.run.started_at,
                start_timeout_s=cfg.run.actor_start_timeout_s,
                no_data_timeout_s=cfg.run.no_data_timeout_s,
                listen=p.listen,
                stop=self.request_stop,
            ),
        ]
        if self.outputs is not None and self.outputs.rounds is None:  # in lockstep, reports come at rounds' ends
            loops.append(tasks.every(cfg.observe.report_interval_s, self.outputs.reports.report))
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
            log.error(
                "tasks that did not end when cancelled: %s", [getattr(t.get_coro(), "__qualname__", t) for t in stuck]
            )
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
        if self.parts is not None and self.parts.actors is not None:
            self.parts.actors.kill()
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
        p, cfg = self._p, self.cfg
        # With several ranks every one stops after the same update (learner/ranks/), which needs a batch on each: intake
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
        out = self.outputs
        if whole and out is not None:
            path = await self._in_thread(out.checkpoints.final, cfg.run.shutdown_timeout_s)
            if path is not None:
                log.info("final checkpoint: %s", path)
            elif self.exit_code == 0:
                self.exit_reason, self.exit_code = "the final checkpoint could not be written", exitcodes.NO_CHECKPOINT
        if out is not None:
            out.reports.report()

    async def _stop_actors(self) -> None:
        await self._in_thread(self._p.actors.stop, max(1.0, self.cfg.run.shutdown_timeout_s / 2))

    async def _finish_ranks(self) -> None:
        await self._in_thread(self.ranks.finish, self._p.trainer, self.learner, self.cfg)

    # ------------------------------------------------------------------------------- training-thread callbacks
    def _after_update(self, update: Update | None) -> bool:
        """After each batch (training thread; ``update`` None in ingest-only mode): record it, feed flow control,
        publish and checkpoint when due. True to stop training."""
        p, cfg = self._p, self.cfg
        if update is None:
            return False
        p.updates.add(update)
        p.pacer.consumed(len(update.lag), update.waited_s)
        if self.learner.env_steps_trained >= cfg.run.total_env_steps:  # with ranks: all after the same update
            # Nothing published after the last update: actors in lockstep would act one more round during shutdown
            # (the final checkpoint holds these weights).
            self.request_stop_threadsafe("total_env_steps reached", 0)
            return True
        if self.outputs is not None:
            self.outputs.after_update(time.monotonic())
        return update.stats.get("last", False)  # rank 0 flagged this update as every rank's last (learner/ranks/)

    def _on_trainer_exit(self, error: BaseException | None) -> None:
        if error is not None:
            self.request_stop_threadsafe(*self.ranks.explain(error))

    def _health(self) -> tuple[bool, str]:
        """/healthz (the metrics HTTP thread)."""
        return self._p.health(self.stopping(), self.exit_reason)
