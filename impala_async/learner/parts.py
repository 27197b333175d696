"""The learner server's parts and what they share.

:class:`Parts` holds each part the server's startup creates (None until then) and the run's fixed inputs, and reads
what several consumers need from the parts' own answers (``counters()``, heartbeats): the counters snapshot of a report
(counters.py), the state a checkpoint holds, the view a Prometheus scrape reads, /healthz, the SIGUSR1 summary. No part
reads another through the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import zmq

from ..config import LearnerConfig
from ..core.ring import TrajectoryRing
from ..core.spec import TrajectorySpec
from . import checkpoint, counters, curriculum, prom
from .histograms import Histogram
from .ingest import Ingest
from .intake import Intake
from .learn import Learner
from .metrics import Reports, UpdateLog
from .pacing import Pacer
from .publisher import WeightsPublisher
from .trainer import Trainer
from .watch import CollapseWatch
from .weights import Publication


class Parts:
    def __init__(
        self,
        cfg: LearnerConfig,
        spec: TrajectorySpec,
        learner: Learner,
        *,
        actors,
        ranks,
        incarnation: int,
        started_at: float,
        wall_offset_s: float,
        config_layers: dict,
    ):
        self.cfg, self.spec, self.learner, self.actors, self.ranks = cfg, spec, learner, actors, ranks
        self.incarnation, self.config_layers = incarnation, config_layers
        self.started_at, self.wall_offset_s = started_at, wall_offset_s
        # Created by the server's startup, in this order.
        self.ctx: zmq.Context | None = None
        self.authenticator = None  # with CURVE: the ZAP authenticator (ops/auth.py)
        self.ring: TrajectoryRing | None = None
        self.pacer: Pacer | None = None
        self.trainer: Trainer | None = None
        self.ingest: Ingest | None = None
        self.intake: Intake | None = None
        self.publisher: WeightsPublisher | None = None
        self.listen = self.publish = ""  # the addresses bound
        self.checkpoints: checkpoint.Checkpoints | None = None
        self.publication: Publication | None = None
        self.reports: Reports | None = None
        self.updates = UpdateLog()  # the training thread's updates, for the next report
        self.loop_lag_s = Histogram()  # the event loop's lateness, this report interval

    def create_data_path(self, resumed: dict | None, *, keys, lead: bool, after_update, on_trainer_exit) -> None:
        """The ring, flow control, the training thread (not started) and ingest: the path from decoded bytes to the
        update, none of which needs a socket. ``keys``: the CURVE keys (None without); ``lead``: rank 0."""
        cfg = self.cfg
        self.ring = TrajectoryRing(
            self.spec,
            cfg.loss.batch_size,
            cfg.ring.ring_batches,
            pin_memory=self.learner.device.type == "cuda",
            drop_when_full=cfg.ring.when_full == "drop_oldest",
        )
        self.pacer = Pacer.from_config(cfg)
        self.trainer = Trainer(
            self.learner,
            self.ring,
            max_policy_lag=cfg.ring.max_policy_lag,
            ingest_only=bool(cfg.run.ingest_only),
            overlap_copies=bool(cfg.run.overlap_copies),
            after_update=after_update,
            on_exit=on_trainer_exit,
            policy_version=resumed["policy_version"] if resumed else 0,
            updates_per_batch=cfg.loss.updates_per_batch,
        )
        # Rank 0 publishes a version once it has made the update; another rank may finish that same update a moment
        # later (lock step: never more than one behind), so it accepts one version ahead of its own.
        ahead = 0 if lead else 1
        self.ingest = Ingest(
            cfg.limits,
            cfg.ring.max_policy_lag,
            self.spec,
            self.ring,
            lambda: self.trainer.policy_version + ahead,
            self.incarnation,
            key_names=sorted(keys.allowed.values()) if keys is not None else None,
            pacer=self.pacer,
            resumed=resumed,
            accept_jpeg=cfg.env.obs_codec == "jpeg",
        )

    def create_publication(self, run_info: dict, publish: Callable[[bytes], None]) -> None:
        """Weights out: encoded from the network with the run, the curriculum's difficulty (from the env steps the
        whole learner trained) and the pace; ``publish(data)`` hands a message to the publisher from any thread."""
        schedule = curriculum.from_config(self.cfg)
        self.publication = Publication(
            self.learner.model,
            run_info,
            self.incarnation,
            version=lambda: self.trainer.policy_version,
            difficulty=(lambda: schedule.value(self.learner.env_steps_trained)) if schedule else lambda: None,
            pace=lambda: self.pacer.pace(self.ring.waiting_trajectories()),
            publish=publish,
            interval_s=self.cfg.network.publish_interval_s,
        )

    def create_reports(self, logdir, tboard, *, fresh: bool) -> None:
        """The reports and their sinks (``tboard``: a TensorBoard writer or None); ``fresh``: not a resumed run."""
        cfg = self.cfg
        self.reports = Reports(
            logdir,
            take=self.snapshot,
            updates=self.updates,
            tboard=tboard,
            watch=CollapseWatch.from_config(cfg, self.spec.num_actions, fresh=fresh),
            reset_interval=self.reset_interval,
            wall_s=self.wall_s,
            batch_size=cfg.loss.batch_size,
            learner_ranks=cfg.ranks.learner_ranks,
        )

    def sources(self) -> list[Callable[[], dict]]:
        """Every part's counters (counters.py), this rank's."""
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
        optional = (self.publication, self.checkpoints, self.actors)
        return own + [self.ranks.counters] + [x.counters for x in optional if x is not None]

    def _server_counters(self) -> dict:
        return {
            "incarnation": self.incarnation,
            "loop_lag_p99_ms": self.loop_lag_s.quantile_ms(0.99),
            "histograms": self.updates.totals.snapshot(),
            # CURVE handshakes refused for an unlisted key (ops/auth.py); 0 without CURVE
            "handshakes_refused_key": self.authenticator.handshakes_refused if self.authenticator else 0,
        }

    def own_figures(self) -> dict:
        return counters.figures(self.sources())

    def snapshot(self) -> counters.Snapshot:
        return counters.take(self.sources(), self.ranks.peers if self.ranks.rank == 0 else None)

    def reset_interval(self) -> None:
        """After a report: the interval histograms start again."""
        self.ingest.latency_s.reset()
        self.loop_lag_s.reset()

    def wall_s(self) -> float:
        return self.wall_offset_s + time.monotonic() - self.started_at

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
            config_layers=self.config_layers,
            spec=self.spec.to_dict(),
            torch_rng=torch.get_rng_state(),
        )

    def health(self, stopping: bool, exit_reason: str) -> tuple[bool, str]:
        return prom.health(
            stopping=stopping,
            exit_reason=exit_reason,
            trainer=self.trainer,
            receive_beat=self.intake.beat if self.intake is not None else None,
            stale_s=self.cfg.observe.health_stale_s,
            env_steps=self.ingest.env_steps,
            updates=self.learner.updates,
        )

    def prometheus_view(self, healthy: bool) -> prom.View | None:
        """What a scrape reads (the metrics HTTP thread): the latest report's snapshot and record, live health."""
        if self.reports is None:
            return None
        snap, rec = self.reports.latest
        now = time.monotonic()
        beats = {"trainer": now - self.trainer.heartbeat}
        if self.intake.beat is not None:
            beats["receive"] = now - self.intake.beat
        run = {"env": self.cfg.env.env, "incarnation": str(self.incarnation), "device": str(self.learner.device)}
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
