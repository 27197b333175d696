"""Several learner ranks: torch.distributed between learner processes (README, "Several learner ranks").

Each rank is a whole learner server (its own trajectory socket, ring, ingest, receive loop and training thread) that
trains on its own batches; the gradients are averaged over the ranks by DistributedDataParallel (learn.py,
``Learner.distribute``: gloo on CPU, NCCL on CUDA with rank r on cuda:LOCAL_RANK), so every rank holds the same weights
after every update. An update takes one batch from every rank, in lock step. Rank 0 alone publishes weights, writes
metrics.jsonl and checkpoints, and starts train's local actors.

Started two ways, one code path: ``--learner-ranks N`` makes this process rank 0, which hosts the rendezvous store (a
TCPStore on a free loopback port) and starts ranks 1..N-1 as children running the same command line with RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (each in its own session, dying with it); under ``torchrun``
every process finds those variables set already. Besides the gradients, the ranks share, in that store:
- ``config``: rank 0's configuration (JSON), so that every rank runs the same one (a checkpoint's, with --resume), and
  the learner's incarnation (docs/protocol.md, "Learner restarts"); the checkpoint state itself goes to the others by
  a broadcast (broadcast_object_list): the same weights and optimizer state on every rank;
- ``ready/<r>``, ``address/<r>``: rank r joined; the trajectory address it bound (rank 0 sends them all in
  ``run.trajectory_addresses``);
- ``beat/<r>`` and ``stop``: heartbeats with counters, and the first stop of any rank (rankwatch.py).

The store is reached under a token, and every value read from it is checked (rankstore.py).

Stopping. A normal stop ends every rank after the same update: rank 0 marks the next update (its gradients carry a
flag through the same all-reduce, learn.py), and every rank stops after it. A rank that dies or fails stops the others:
its peers' all-reduce fails (gloo notices a closed connection at once; a hung peer after rank_collective_timeout_s),
rank 0 sees its child exit or its heartbeat stop, and rank 0 writes a checkpoint of the last whole update and exits
with exitcodes.RANK_FAILED (6, rankwatch.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from ..actors.procs import die_with_parent
from ..core.address import port_offset
from ..ops import exitcodes
from . import rankstore
from .rankwatch import RankWatch

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


def torchrun_world(learner_ranks: int) -> int | None:
    """Under torchrun: WORLD_SIZE (the number of ranks; SystemExit if --learner-ranks says otherwise). Else None."""
    got = launched()
    if got is None:
        return None
    world = got[1]
    if learner_ranks not in (1, world):
        raise SystemExit(
            f"impala-async: --learner-ranks {learner_ranks} but WORLD_SIZE={world} (torchrun gives the "
            f"number of ranks: leave --learner-ranks out)"
        )
    return world


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
    from ..config import from_flat

    cfg = from_flat(shared["config"], "rank 0's configuration")
    return RankGroup(rank, world, local, raw, store, cfg=cfg, shared=shared, incarnation=shared["incarnation"])


def join_lead(cfg, shared: dict, resumed: dict | None, argv: list[str]):
    """Rank 0: under torchrun join its rendezvous; with --learner-ranks N > 1 host one and start ranks 1..N-1 (the same
    command line). Shares ``shared`` (the resolved configuration, its layers, the spec) and the learner's incarnation.
    A learner of one rank gets a :class:`SingleRank`."""
    from ..core import wire

    world = cfg.ranks.learner_ranks
    incarnation = wire.new_incarnation()  # one for the whole learner: trajectories carry it to any rank
    if world == 1:
        return SingleRank(incarnation, resumed)
    got = launched()
    _log_format(0)
    token = rankstore.lead_token(hosting=got is None)
    whole = dict(cfg=cfg, resumed=resumed, incarnation=incarnation)
    if got is not None:  # torchrun (torchrun_world made learner_ranks its WORLD_SIZE)
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


class SingleRank:
    """A learner of one rank, with the interface of :class:`RankGroup`: nothing to share, wait for or watch, so the
    server and its callers never ask whether there are ranks. ``incarnation``: the learner's (docs/protocol.md,
    "Learner restarts"); ``resumed``: the checkpoint state this learner starts from (None: a fresh run)."""

    rank, world, local_rank = 0, 1, 0
    stuck = False

    def __init__(self, incarnation: int, resumed: dict | None = None):
        self.incarnation, self.resumed = incarnation, resumed
        self.cfg = None  # as RankGroup's (main.run sets the final configuration); read by nothing here

    def start(self, device):
        return device

    def distribute(self, learner) -> None:
        pass

    lead = True  # rank 0: publishes, reports, checkpoints
    versions_ahead = 0  # of its own policy version, what a trajectory may carry (RankGroup: lock step)

    def publish_address(self, address: str) -> str:
        return address

    def share_address(self, endpoint: str) -> list[str]:
        return [endpoint]

    def share_local_actor_key(self, keys):
        return keys

    def watch(self, *, figures, on_stop) -> None:
        pass

    def peers(self) -> list[tuple[dict, bool]]:
        return []

    def counters(self) -> dict:
        return {}

    def announce(self, reason: str, code: int) -> None:
        pass

    def explain(self, error: BaseException) -> tuple[str, int]:
        return f"training failed: {error!r}", exitcodes.ERROR

    def stop_training(self, trainer, learner, normal: bool, shutdown_timeout_s: float) -> bool:
        """Stop the training thread at once; True if the weights are whole (it ended, and not by an error)."""
        return trainer.stop(shutdown_timeout_s) and trainer.error is None

    def finish(self, trainer, learner, cfg) -> None:
        pass

    def kill_children(self) -> None:
        pass

    def exit(self, code: int) -> int:
        return code


class RankGroup:
    def __init__(
        self,
        rank: int,
        world: int,
        local_rank: int,
        raw_store,
        store,
        children=(),
        *,
        listener=None,
        cfg=None,
        shared: dict | None = None,
        resumed: dict | None = None,
        incarnation: int = 0,
    ):
        """Made whole by the call that joins the group (:func:`join_lead`, :func:`join_worker`): rank 0 with its
        ``cfg``, ``resumed`` state and started ``children`` (and the store's ``listener`` where it hosts it), a worker
        with rank 0's ``shared`` configuration; both with the learner's ``incarnation``."""
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.raw_store, self.store = raw_store, store
        self.children: list[subprocess.Popen] = list(children)
        self.listener = listener
        self.cfg = cfg
        self.shared: dict = shared or {}
        self.resumed: dict | None = resumed
        self.incarnation = incarnation
        self.watcher: RankWatch | None = None
        self.stuck = False  # at exit: the training thread did not end (stuck in a collective)

    # ---------------------------------------------------------------------------------------------- startup
    def start(self, device):
        """Join the process group (gloo, or NCCL on cuda:LOCAL_RANK) and take rank 0's checkpoint state; returns the
        device this rank trains on. Rank 0 first waits until every rank is ready (a rank that exits first is named)."""
        import torch
        import torch.distributed as dist

        cfg = self.cfg
        if device.type == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
            # A failed or timed-out collective raises in the training thread (which then stops the learner with a
            # whole checkpoint) instead of the watchdog tearing the process down.
            os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
            os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
        self.store.set(f"ready/{self.rank}", str(os.getpid()))
        if self.rank == 0:
            self._wait_for([f"ready/{r}" for r in range(self.world)], cfg.ranks.rank_start_timeout_s, "to start")
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.PrefixStore("pg", self.store),
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=cfg.ranks.rank_collective_timeout_s),
        )
        box = [self.resumed]
        dist.broadcast_object_list(box, src=0)
        resumed = box[0]
        if resumed is not None and self.rank:  # rank 0 alone keeps the run's counters (the metrics sum the rest)
            resumed = {**resumed, "env_steps": 0, "episodes": 0, "returns": [], "lengths": []}
        self.resumed = resumed
        self.device = device
        log.info("learner rank %d of %d: %s on %s", self.rank, self.world, dist.get_backend(), device)
        return device

    def distribute(self, learner) -> None:
        self.learner = learner
        learner.distribute([self.local_rank] if learner.device.type == "cuda" else None)

    def _wait_for(self, keys: list[str], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            for r, child in enumerate(self.children, start=1):
                if child.poll() is not None:
                    raise SystemExit(
                        f"impala-async: learner rank {r} (pid {child.pid}) exited with code "
                        f"{child.returncode} before the ranks could start"
                    )
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"impala-async: the learner ranks did not all get ready {what} within "
                    f"rank_start_timeout_s={timeout_s:g} s"
                )
            time.sleep(0.05)

    @property
    def lead(self) -> bool:
        """Rank 0: publishes, reports, checkpoints."""
        return self.rank == 0

    @property
    def versions_ahead(self) -> int:
        """Of its own policy version, what a trajectory may carry: rank 0 publishes a version once it has made the
        update; another rank may finish that same update a moment later (lock step: never more than one behind)."""
        return 0 if self.rank == 0 else 1

    def publish_address(self, address: str) -> str:
        """Where this rank's weights socket binds: rank 0 alone publishes; another rank's publisher is bound where
        nobody can reach it."""
        return address if self.rank == 0 else "inproc://unpublished-weights"

    def share_address(self, endpoint: str) -> list[str] | None:
        """Publish the trajectory address this rank bound; rank 0 gets every rank's, in rank order (None elsewhere)."""
        self.store.set(f"address/{self.rank}", endpoint)
        if self.rank:
            return None
        keys = [f"address/{r}" for r in range(self.world)]
        self._wait_for(keys, self.cfg.ranks.rank_start_timeout_s, "their trajectory sockets")
        addresses = []
        for r, k in enumerate(keys):
            address = rankstore.checked_address(self.store.get(k))
            if address is None:  # actors would be told to connect to it
                raise SystemExit(f"impala-async: learner rank {r} shared a malformed trajectory address in the store")
            addresses.append(address)
        return addresses

    def share_local_actor_key(self, keys):
        """Under CURVE, train's local actors get a key pair of rank 0's making: every rank admits its public key."""
        if self.rank == 0:
            self.store.set("local_actor_key", next(k for k, name in keys.allowed.items() if name == "local"))
            return keys
        public = self.store.get("local_actor_key")
        if not rankstore.checked_key(public):  # admitted by this rank's CURVE: only a well-formed public key
            raise SystemExit("impala-async: rank 0 shared a malformed local actors' key in the learner ranks' store")
        return dataclasses.replace(keys, allowed={**keys.allowed, public: "local"})

    # ------------------------------------------------------------------------------------------- the watch
    def watch(self, *, figures, on_stop) -> None:
        """Start the thread that beats (with ``figures()``, this rank's), reads the others' beats and the stop key, and
        watches rank 0's children; ``on_stop(reason, code)`` stops this rank's learner from that thread."""
        self.watcher = RankWatch(self, figures, on_stop)
        self.watcher.start()

    def peers(self) -> list[tuple[dict, bool]]:
        """Rank 0: every other rank's latest figures and whether it is alive (counters.take's ``peers``)."""
        return self.watcher.peers() if self.watcher is not None else []

    def counters(self) -> dict:
        """The store's values this rank ignored, by reason (rankwatch.py); none before the watch starts."""
        return self.watcher.counters() if self.watcher is not None else {}

    def announce(self, reason: str, code: int) -> None:
        """This rank stops (server.request_stop): tell the others."""
        if self.watcher is not None:
            self.watcher.announce(reason, code)

    def explain(self, error: BaseException) -> tuple[str, int]:
        if self.watcher is None:  # the training thread failed before the watch started
            return f"training failed: {error!r}", exitcodes.ERROR
        return self.watcher.explain(error)

    # -------------------------------------------------------------------------------------------- shutdown
    def stop_training(self, trainer, learner, normal: bool, shutdown_timeout_s: float) -> bool:
        """Stop the training thread. A normal stop ends every rank after the same update: rank 0 asks for it
        (``learner.stop_requested``: learn.py all-reduces it with that update) and every rank stops after it; any
        other stop (a failure, no data: ``normal`` False) stops at once. True if the weights are whole: a thread that
        failed (or is stuck) in a collective failed before the optimizer step, so the weights are those of the last
        update unless it failed while applying one."""
        timeout_s = shutdown_timeout_s / 2
        if normal and trainer.alive():
            if self.rank == 0:
                learner.stop_requested = True
            if trainer.join(timeout_s):
                return not learner.applying
            log.warning(
                "rank %d: no update in step with the other ranks within %.1f s; stopping now", self.rank, timeout_s
            )
        trainer.stop(timeout_s / 2)
        return not learner.applying

    def finish(self, trainer, learner, cfg) -> None:
        """After this rank's shutdown: the state dump (rank_state_dump), then rank 0 waits for the ranks it started
        (they stop on their own; shutdown_timeout_s / 2 at most, then they are killed)."""
        if self.watcher is not None:
            self.watcher.halt()
        whole = not trainer.alive() and not learner.applying
        if cfg.ranks.rank_state_dump and whole:
            self._dump(trainer, learner, cfg.run.logdir)
        deadline = time.monotonic() + cfg.run.shutdown_timeout_s / 2
        for r, child in enumerate(self.children, start=1):
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("learner rank %d (pid %d) did not stop; killing it", r, child.pid)
                child.kill()
                child.wait()
        if whole:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        self.stuck = not whole

    def kill_children(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()

    def _dump(self, trainer, learner, logdir: str) -> None:
        import torch

        path = Path(logdir) / f"rank-{self.rank}-state.pt"
        state = {
            "model": learner.model.state_dict(),
            "optimizer": learner.optimizer.state_dict(),
            "updates": learner.updates,
            "batches": trainer.batches,
            "policy_version": trainer.policy_version,
        }
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)  # a leftover's mode would stay
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # weights: 0600, as checkpoints are
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)
        log.info("rank %d: state after %d updates written to %s", self.rank, learner.updates, path)

    def exit(self, code: int) -> int:
        """The process's exit code; a training thread stuck in a collective cannot be joined: leave without it."""
        if self.stuck:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
