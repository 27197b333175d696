"""A learner rank assembled whole: each part built once, in dependency order, given its collaborators at
construction, its close registered as it is made (uvicorn's startup; Acme's builder). Nothing is assigned into a part
afterwards, and no part is ``None`` once :func:`assemble` returns: what a configuration leaves out (CURVE's
authenticator, train's local actors) or what only rank 0 has (:class:`~.parts.Outputs`) is said by its type.

Order (the server's shutdown closes in reverse):

1. the ZeroMQ context; with keys, the ZAP authenticator (before any socket, so that there is no window without it);
2. the data path, none of which needs a socket: the ring, flow control (transport/pacing.py), the training thread (not
   started), ingest;
3. the sockets: intake (trajectories in) and the weights publisher, both bound; every rank's address shared;
4. train's local actors (not started), given the addresses bound;
5. on rank 0, :func:`assemble_outputs`: checkpoints, the weights publication, TensorBoard and the reports.

Starting things (the HTTP server, the first weights, the ranks' watch, the actors, training) is the server's.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

import zmq

from ..config import LearnerConfig, lockstep
from ..core.ring import TrajectoryRing
from ..core.spec import TrajectorySpec
from . import checkpoint, curriculum
from .learn import Learner
from .parts import Outputs, Parts, Run
from .reports.metrics import Reports
from .reports.tboard import tensorboard_writer
from .reports.watch import CollapseWatch
from .trainer import Trainer
from .transport.ingest import Ingest
from .transport.intake import Intake, Room
from .transport.lockstep import Ordered, Rounds
from .transport.pacing import Pacer
from .transport.publisher import WeightsPublisher
from .weights import Publication

log = logging.getLogger("impala_async.learner.assembly")

Closes = Callable[[str, Callable], None]  # register what shutdown does for a part just made: closes(name, close)


class StartupError(Exception):
    """What keeps the learner from starting (an address in use, a logdir it cannot write), said in one line."""


def _bind(part, address: str, flag: str) -> str:
    """``part.bind(address)``; StartupError naming the address and its flag if it cannot be bound."""
    try:
        return part.bind(address)
    except zmq.ZMQError as e:
        raise StartupError(f"cannot bind {address} ({flag}): {e.strerror}") from None


def assemble(
    run: Run,
    learner: Learner,
    *,
    ranks,
    keys,
    resumed: dict | None,
    closes: Closes,
    after_update,
    on_trainer_exit,
    make_actors: Callable[[str, str], object | None],
) -> Parts:
    """This rank's parts, whole (the module's steps 1-4). ``keys``: the CURVE keys (None without); ``after_update``
    and ``on_trainer_exit``: the training thread's callbacks (trainer.py); ``make_actors(listen, publish)``: train's
    local actors for the addresses bound, or None. Runs inside the event loop that will serve."""
    cfg = run.cfg
    ctx = zmq.Context(1)
    closes("zeromq context", ctx.term)
    authenticator, secure = _authentication(ctx, keys, closes)
    room = Room(asyncio.get_running_loop())
    ring, pacer, trainer, ingest = _data_path(
        run,
        learner,
        room,
        ahead=ranks.versions_ahead,
        keys=keys,
        resumed=resumed,
        after_update=after_update,
        on_exit=on_trainer_exit,
    )
    intake = Intake(ctx, cfg.network, cfg.limits, _in_order(cfg, ingest), room, secure)
    publisher = WeightsPublisher(ctx, cfg.network, cfg.limits, secure)

    def close_sockets() -> None:
        intake.close()
        publisher.close()

    closes("sockets", close_sockets)
    listen = _bind(intake, cfg.network.listen, "--listen")
    publish = _bind(publisher, ranks.publish_address(cfg.network.publish), "--publish")
    addresses = ranks.share_address(listen)  # rank 0: every rank's trajectory address, in rank order
    if addresses is not None:  # for actors (docs/protocol.md, Transport)
        run.info["trajectory_addresses"] = addresses
    return Parts(
        run,
        learner,
        ranks=ranks,
        ctx=ctx,
        authenticator=authenticator,
        ring=ring,
        pacer=pacer,
        trainer=trainer,
        ingest=ingest,
        intake=intake,
        publisher=publisher,
        listen=listen,
        publish=publish,
        actors=make_actors(listen, publish),
    )


def _data_path(run: Run, learner: Learner, room: Room, *, ahead: int, keys, resumed, after_update, on_exit):
    """(ring, pacer, training thread not started, ingest): the path from decoded bytes to the update, none of which
    needs a socket. The ring tells ``room`` when the trainer frees a slot."""
    cfg = run.cfg
    ring = TrajectoryRing(
        run.spec,
        cfg.loss.batch_size,
        cfg.ring.ring_batches,
        pin_memory=learner.device.type == "cuda",
        drop_when_full=cfg.ring.when_full == "drop_oldest",
        on_release=room.freed,
    )
    pacer = Pacer.from_config(cfg)
    trainer = Trainer(
        learner,
        ring,
        max_policy_lag=cfg.ring.max_policy_lag,
        ingest_only=bool(cfg.run.ingest_only),
        overlap_copies=bool(cfg.run.overlap_copies),
        after_update=after_update,
        on_exit=on_exit,
        policy_version=resumed["policy_version"] if resumed else 0,
        updates_per_batch=cfg.loss.updates_per_batch,
    )
    # ``ahead``: the versions past its own a trajectory may carry on this rank (learner/ranks/group.py, versions_ahead)
    ingest = Ingest(
        cfg.limits,
        cfg.ring.max_policy_lag,
        run.spec,
        ring,
        lambda: trainer.policy_version + ahead,
        run.incarnation,
        key_names=sorted(keys.allowed.values()) if keys is not None else None,
        pacer=pacer,
        resumed=resumed,
        accept_jpeg=cfg.env.obs_codec == "jpeg",
    )
    return ring, pacer, trainer, ingest


def _in_order(cfg: LearnerConfig, ingest: Ingest):
    """What the receive loop hands messages to: ingest, or in lockstep (``--reproducible 1``) ingest behind the
    order of actors and sequence numbers (transport/lockstep.py)."""
    if not cfg.run.reproducible:
        return ingest
    return Ordered(ingest, cfg.local_actors, lockstep.max_held_messages(cfg))


def _authentication(ctx: zmq.Context, keys, closes: Closes):
    """With keys: the ZAP authenticator started (before any bind: no window without it) and the function that makes
    a socket a CurveZMQ server admitting only the allowed keys (ops/auth.py). Without keys: (None, None)."""
    if keys is None:
        return None, None
    from ..ops import auth

    authenticator = auth.start_thread_authenticator(ctx, keys)
    closes("authenticator", lambda: auth.stop_authenticator(authenticator))
    log.info("CURVE on: %d allowed actor key(s)", len(keys.allowed))
    return authenticator, lambda sock: auth.make_curve_server(sock, keys)


def assemble_outputs(parts: Parts, *, fresh: bool, closes: Closes) -> Outputs:
    """Rank 0's outputs (the module's step 5): checkpoints, the weights publication (handing messages to the
    publisher on the event loop), TensorBoard and the reports. ``fresh``: not a resumed run."""
    cfg, run = parts.cfg, parts.run
    logdir = Path(cfg.run.logdir)
    try:  # it holds the weights (checkpoints, 0600): only this user may list or enter it
        logdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(logdir, 0o700)
        if checkpoint.remove_partial(logdir):
            log.warning("removed a partial checkpoint left by an interrupted write in %s", logdir)
        checkpoints = checkpoint.Checkpoints(logdir, cfg.checkpoints, parts.learner, collect=parts.checkpoint_state)
    except OSError as e:
        raise StartupError(f"cannot use the logdir {logdir} (--logdir): {e.strerror or e}") from None
    closes("checkpoint writer", checkpoints.close)
    loop, publisher = asyncio.get_running_loop(), parts.publisher
    schedule, trainer, pacer, ring = curriculum.from_config(cfg), parts.trainer, parts.pacer, parts.ring
    learner = parts.learner

    def publish(data: bytes) -> None:  # from the training thread: the publisher is the event loop's
        loop.call_soon_threadsafe(publisher.publish, data)

    publication = Publication(
        learner.model,
        run.info,
        run.incarnation,
        version=lambda: trainer.policy_version,
        difficulty=(lambda: schedule.value(learner.env_steps_trained)) if schedule else lambda: None,
        pace=lambda: pacer.pace(ring.waiting_trajectories()),
        publish=publish,
        interval_s=cfg.network.publish_interval_s,
    )
    tboard = tensorboard_writer(cfg, logdir)
    if tboard is not None:
        closes("TensorBoard writer", lambda: tboard.close(min(2.0, cfg.run.shutdown_timeout_s / 4)))
    outputs_counters = [publication.counters, checkpoints.counters]
    reports = Reports(
        logdir,
        take=lambda: parts.snapshot(outputs_counters),
        updates=parts.updates,
        tboard=tboard,
        watch=CollapseWatch.from_config(cfg, run.spec.num_actions, fresh=fresh),
        reset_interval=parts.reset_interval,
        wall_s=parts.wall_s,
        batch_size=cfg.loss.batch_size,
        learner_ranks=cfg.ranks.learner_ranks,
    )
    closes("reports", reports.close)
    rounds = None
    if cfg.run.reproducible:  # reports and weights at the end of rounds, the report first (transport/lockstep.py)
        rounds = Rounds(
            lockstep.round_batches(cfg),
            cfg.observe.report_interval_rounds,
            report=lambda: loop.call_soon_threadsafe(reports.report),
            publish=publication.publish,
        )
    return Outputs(checkpoints, publication, reports, rounds)


def run_of(
    cfg: LearnerConfig,
    spec: TrajectorySpec,
    info: dict,
    *,
    incarnation: int,
    started_at: float,
    resumed: dict | None,
    config_layers: dict | None,
) -> Run:
    """The run's fixed inputs, gathered once."""
    return Run(
        cfg,
        spec,
        info,
        incarnation=incarnation,
        started_at=started_at,
        wall_offset_s=float(resumed["wall_s"]) if resumed else 0.0,
        config_layers=dict(config_layers or {}),
    )
