"""The learner server's parts and what they share.

:class:`Parts` holds one rank's parts, each whole (learner/assembly.py builds them), with the run's fixed inputs
(:class:`Run`), and reads what several consumers need from the parts' own answers (``counters()``, heartbeats): the
counters snapshot of a report (reports/counters.py), the state a checkpoint holds, the view a Prometheus scrape reads,
/healthz, the SIGUSR1 summary. :class:`Outputs` are rank 0's. No part reads another through the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from ..config import LearnerConfig
from ..core.ring import TrajectoryRing
from ..core.spec import TrajectorySpec
from . import checkpoint
from .learn import Learner
from .reports import counters, prom
from .reports.histograms import Histogram
from .reports.metrics import Reports, UpdateLog
from .trainer import Trainer
from .transport.ingest import Ingest
from .transport.intake import Intake
from .transport.lockstep import Rounds
from .transport.pacing import Pacer
from .transport.publisher import WeightsPublisher
from .weights import Publication


@dataclass(frozen=True)
class Run:
    """A learner run's fixed inputs: the resolved configuration, the trajectory spec, the run information actors read
    from every weights message (``info``; rank 0 adds every rank's address when bound), the incarnation, when this
    process started (monotonic) and the wall time of the runs it resumes."""

    cfg: LearnerConfig
    spec: TrajectorySpec
    info: dict
    incarnation: int
    started_at: float
    wall_offset_s: float
    config_layers: dict


@dataclass(frozen=True)
class Outputs:
    """Rank 0's outputs (assembly.assemble_outputs): checkpoints, the weights publication and the reports."""

    checkpoints: checkpoint.Checkpoints
    publication: Publication
    reports: Reports
    rounds: Rounds | None  # in lockstep (--reproducible 1): reports and weights at the end of rounds

    def after_update(self, now: float) -> None:
        """Publish and checkpoint when due (the training thread)."""
        if self.rounds is not None:
            self.rounds.after_batch()
        else:
            self.publication.after_update(now)
        self.checkpoints.after_update(now)


class Parts:
    """One learner rank's parts, each whole (assembly.assemble builds them in dependency order). Optional by
    configuration: ``authenticator`` (CURVE) and ``actors`` (train's local actors, rank 0)."""

    def __init__(
        self,
        run: Run,
        learner: Learner,
        *,
        ranks,
        ctx: zmq.Context,
        authenticator,
        ring: TrajectoryRing,
        pacer: Pacer,
        trainer: Trainer,
        ingest: Ingest,
        intake: Intake,
        publisher: WeightsPublisher,
        listen: str,
        publish: str,
        actors,
    ):
        self.run, self.learner, self.ranks = run, learner, ranks
        self.ctx, self.authenticator, self.ring, self.pacer, self.trainer = ctx, authenticator, ring, pacer, trainer
        self.ingest, self.intake, self.publisher, self.actors = ingest, intake, publisher, actors
        self.listen, self.publish = listen, publish  # the addresses bound
        self.updates = UpdateLog()  # the training thread's updates, for the next report
        self.loop_lag_s = Histogram()  # the event loop's lateness, this report interval

    @property
    def cfg(self) -> LearnerConfig:
        return self.run.cfg

    @property
    def spec(self) -> TrajectorySpec:
        return self.run.spec

    def sources(self) -> list[Callable[[], dict]]:
        """Every part's counters (reports/counters.py), this rank's (rank 0's outputs add theirs to its reports)."""
        own = [
            self.ingest.counters,
            self.ring.counters,
            self.trainer.counters,
            self.learner.counters,
            self.pacer.counters,
            self.intake.counters,
            self.intake.guard.counters,
            self.publisher.counters,
            self._server_counters,
        ]
        return own + [self.ranks.counters] + ([self.actors.counters] if self.actors is not None else [])

    def _server_counters(self) -> dict:
        return {
            "incarnation": self.run.incarnation,
            "loop_lag_p99_ms": self.loop_lag_s.quantile_ms(0.99),
            "histograms": self.updates.totals.snapshot(),
            # CURVE handshakes refused for an unlisted key (ops/auth.py); 0 without CURVE
            "handshakes_refused_key": self.authenticator.handshakes_refused if self.authenticator else 0,
        }

    def own_figures(self) -> dict:
        return counters.figures(self.sources())

    def snapshot(self, more: list[Callable[[], dict]] | None = None) -> counters.Snapshot:
        """The whole learner's figures (rank 0: with every rank's), with ``more`` sources added."""
        return counters.take(self.sources() + (more or []), self.ranks.peers)

    def reset_interval(self) -> None:
        """After a report: the interval histograms start again."""
        self.ingest.latency_s.reset()
        self.loop_lag_s.reset()

    def wall_s(self) -> float:
        return self.run.wall_offset_s + time.monotonic() - self.run.started_at

    def checkpoint_state(self) -> dict:
        snap = self.snapshot()  # every rank's env steps and episodes
        return checkpoint.learner_state(
            self.learner,
            policy_version=self.trainer.policy_version,
            env_steps=snap["env_steps"],
            episodes=snap["episodes"],
            returns=list(self.ingest.returns),
            lengths=list(self.ingest.lengths),
            wall_s=self.wall_s(),
            config=self.cfg.flat(),
            config_layers=self.run.config_layers,
            spec=self.spec.to_dict(),
            torch_rng=torch.get_rng_state(),
        )

    def health(self, stopping: bool, exit_reason: str) -> tuple[bool, str]:
        return prom.health(
            stopping=stopping,
            exit_reason=exit_reason,
            trainer=self.trainer,
            receive_beat=self.intake.beat,
            stale_s=self.cfg.observe.health_stale_s,
            env_steps=self.ingest.env_steps,
            updates=self.learner.updates,
        )

    def prometheus_view(self, reports: Reports, healthy: bool) -> prom.View:
        """What a scrape reads (the metrics HTTP thread): the latest report's snapshot and record, live health."""
        snap, rec = reports.latest
        now = time.monotonic()
        beats = {"trainer": now - self.trainer.heartbeat}
        if self.intake.beat is not None:
            beats["receive"] = now - self.intake.beat
        run = {"env": self.cfg.env.env, "incarnation": str(self.run.incarnation), "device": str(self.learner.device)}
        return prom.View(
            snap,
            rec,
            run=run,
            ring_slots=self.cfg.ring.ring_batches,
            uptime_s=self.wall_s(),
            beats=beats,
            healthy=healthy,
        )

    def state_summary(self) -> str:
        """SIGUSR1: the training thread, the ring and the connections in one line."""
        t = self.trainer
        return (
            f"trainer alive={t.alive()} error={t.error!r} batches={t.batches} ring ready={self.ring.ready_batches()} "
            f"writable={self.ring.writable()} pending={self.ingest.pending is not None} "
            f"connections={len(self.intake.guard.conns)}+{len(self.publisher.guard.conns)}"
        )
