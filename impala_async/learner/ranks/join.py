"""How a learner process finds its rank: :func:`join`, from its configuration's layers to a :class:`SingleRank` or a
:class:`RankGroup` joined whole, with the configuration it runs (the package's docstring tells the whole story)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from ...actors.procs import die_with_parent
from ...config import Layered, layers
from ...core.address import port_offset
from . import store as rankstore
from .group import RankGroup, SingleRank

log = logging.getLogger("impala_async.learner.ranks")

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PARENT_ENV = "IMPALA_ASYNC_RANK_PARENT"  # set by rank 0 for the ranks it starts: their parent's pid


def launched() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun or rank 0 started this process (the environment says so)."""
    if not all(os.environ.get(k) for k in _ENV):
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def env_rank() -> int:
    got = launched()
    return got[0] if got else 0


def rank_address(listen: str, rank: int) -> str:
    """Where rank ``rank`` binds its trajectory socket, from the learner's --listen (rank 0's): tcp on the same host,
    port P + 1 + rank (P + 1 is the weights port), so N ranks take ports P .. P + N; a wildcard port stays one (each
    rank gets its own); ipc://PATH becomes ipc://PATH.rank<r>."""
    if rank == 0:
        return listen
    if listen.startswith("ipc://"):
        return f"{listen}.rank{rank}"
    return port_offset(listen, 1 + rank, f"rank {rank}'s trajectory address from --listen")


def _log_format(rank: int) -> None:
    for handler in logging.getLogger().handlers:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname).1s rank{rank} %(name)s: %(message)s", datefmt="%H:%M:%S")
        )


def with_torchrun_world(layered: Layered) -> Layered:
    """Under torchrun: ``layered`` with learner_ranks set to WORLD_SIZE (SystemExit if --learner-ranks says
    otherwise); elsewhere ``layered`` itself."""
    got, learner_ranks = launched(), layered.cfg.ranks.learner_ranks
    if got is None or got[1] == learner_ranks:
        return layered
    if learner_ranks != 1:
        raise SystemExit(
            f"impala-async: --learner-ranks {learner_ranks} but WORLD_SIZE={got[1]} (torchrun gives the "
            f"number of ranks: leave --learner-ranks out)"
        )
    return layered.over(layers.COMMAND, {"learner_ranks": got[1]})


def join(
    layered: Layered,
    resumed: dict | None,
    argv: list[str],
    *,
    prepare: Callable[[Any], Any],
    resolve: Callable[[Layered], tuple[Layered, Any, str]],
) -> tuple[SingleRank | RankGroup, Layered, Any, str, Any]:
    """Every learner process's way into its rank: (its rank, whole; the configuration's layers it runs; the trajectory
    spec; the env backend; what ``prepare`` returned). ``prepare(cfg)`` first sees the configuration this process runs
    (its refusals, before anything heavy); a rank > 0 takes rank 0's from the ranks' store (with its own trajectory
    address), rank 0 or a learner of one resolves its own (``resolve(layered)`` -> (layered, spec, env backend)) and
    shares it with the others."""
    from ...core.spec import TrajectorySpec

    worker = join_worker(layered.cfg.ranks.rank_start_timeout_s)
    if worker is not None:
        shared, cfg = worker.shared, worker.cfg
        layered = Layered(cfg, shared["layers"]).over(
            layers.RESOLVED, {"listen": rank_address(cfg.network.listen, worker.rank)}
        )
        prepared = prepare(layered.cfg)
        return worker, layered, TrajectorySpec.from_dict(shared["spec"]), shared["env_backend"], prepared
    prepared = prepare(layered.cfg)
    layered, spec, env_backend = resolve(layered)
    shared = {"config": layered.cfg.flat(), "layers": layered.layers, "spec": spec.to_dict()}
    group = join_lead(layered.cfg, {**shared, "env_backend": env_backend}, resumed, argv)
    return group, layered, spec, env_backend, prepared


def join_worker(rank_start_timeout_s: float):
    """Rank r > 0: join rank 0's store and take what rank 0 shared (``group.shared``: its resolved configuration and
    their layers, the trajectory spec, the learner's incarnation). None in any other process."""
    got = launched()
    if got is None or got[0] == 0:
        return None
    rank, world, local = got
    die_with_parent(int(os.environ.get(PARENT_ENV, "0") or 0))  # a rank started by rank 0 ends with it
    _log_format(rank)
    token = rankstore.worker_token()
    try:
        raw, store = rankstore.connect(rank, world, rank_start_timeout_s, token)
        value = store.get("config")  # waits for rank 0 (up to rank_start_timeout_s)
    except Exception as e:
        hint = f" (the same {rankstore.TOKEN_ENV} on every rank?)" if token else ""
        raise SystemExit(
            f"impala-async: learner rank {rank}: no configuration from rank 0 at "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}{hint}: {e}"
        ) from None
    shared = rankstore.checked_shared(value)
    if isinstance(shared, str):
        raise SystemExit(f"impala-async: learner rank {rank}: rank 0's configuration in the ranks' store: {shared}")
    from ...config import from_flat

    cfg = from_flat(shared["config"], "rank 0's configuration")
    return RankGroup(rank, world, local, raw, store, cfg=cfg, shared=shared, incarnation=shared["incarnation"])


def join_lead(cfg, shared: dict, resumed: dict | None, argv: list[str]):
    """Rank 0: under torchrun join its rendezvous; with --learner-ranks N > 1 host one and start ranks 1..N-1 (the same
    command line). Shares ``shared`` (the resolved configuration, its layers, the spec) and the learner's incarnation.
    A learner of one rank gets a :class:`SingleRank`."""
    from ...core import wire

    world = cfg.ranks.learner_ranks
    incarnation = wire.new_incarnation()  # one for the whole learner: trajectories carry it to any rank
    if world == 1:
        return SingleRank(incarnation, resumed)
    got = launched()
    _log_format(0)
    token = rankstore.lead_token(hosting=got is None)
    whole = dict(cfg=cfg, resumed=resumed, incarnation=incarnation)
    if got is not None:  # torchrun (with_torchrun_world made learner_ranks its WORLD_SIZE)
        raw, store = rankstore.connect(0, world, cfg.ranks.rank_start_timeout_s, token)
        group = RankGroup(0, world, got[2], raw, store, **whole)
    else:
        listener, raw = rankstore.host_store(world, cfg.ranks.rank_start_timeout_s)
        children = _start_ranks(world, listener.getsockname()[1], argv, token)
        group = RankGroup(0, world, 0, raw, rankstore.prefix(raw, token), children, listener=listener, **whole)
    group.store.set("config", json.dumps({**shared, "incarnation": incarnation}))
    return group


def _start_ranks(world: int, port: int, argv: list[str], token: str) -> list[subprocess.Popen]:
    """Ranks 1..world-1 as children running the same command line, each in its own session (a Ctrl-C in the terminal
    reaches rank 0 only, which stops the others in order) and dying with rank 0. Each reads ``token`` from a pipe it
    inherits (its environment, which /proc shows, does not hold it)."""
    env = dict(
        {k: v for k, v in os.environ.items() if k != rankstore.TOKEN_ENV},
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
        **{PARENT_ENV: str(os.getpid())},
    )
    if "GLOO_SOCKET_IFNAME" not in env and "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ["GLOO_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pairs on loopback too
    children = []
    for r in range(1, world):
        read_fd, write_fd = os.pipe()  # the token fits the pipe's buffer: written whole before the child starts
        try:
            try:
                os.write(write_fd, token.encode("ascii"))
            finally:
                os.close(write_fd)
            children.append(
                subprocess.Popen(
                    [sys.executable, "-m", "impala_async", *argv],
                    stdin=subprocess.DEVNULL,
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r), rankstore.TOKEN_FD_ENV: str(read_fd)},
                    start_new_session=True,
                    pass_fds=(read_fd,),
                )
            )
        finally:
            os.close(read_fd)
        log.info("learner rank %d: pid %d", r, children[-1].pid)
    return children
