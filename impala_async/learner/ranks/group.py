"""A learner's rank: :class:`SingleRank` (a learner of one) and :class:`RankGroup` (one of several), one interface, so
that the server and its callers ask no question about ranks (the package's docstring tells the whole story)."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from ...ops import exitcodes
from ...ops.console import say
from . import store as rankstore
from .watch import RankWatch

log = logging.getLogger("impala_async.learner.ranks")


def _set_aside(path: str, reason: str) -> None:
    from ..checkpoint.resume import set_aside  # torch: only now, for a resume's checkpoint

    set_aside(path, reason)


class SingleRank:
    """A learner of one rank, with the interface of :class:`RankGroup`: nothing to share, wait for or watch, so the
    server and its callers never ask whether there are ranks. ``incarnation``: the learner's (docs/protocol.md,
    "Learner restarts"); ``resumed``: the checkpoint state this learner starts from (None: a fresh run)."""

    rank, world, local_rank = 0, 1, 0
    stuck = False

    def __init__(self, incarnation: int, resumed: dict | None = None):
        self.incarnation, self.resumed = incarnation, resumed
        self.cfg = None  # as RankGroup's; read by nothing here

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

    def local_actor_keys(self, keys, make):
        return make(keys)

    def local_actors(self, count: int) -> int:
        return count

    def lead_only(self, make):
        return make()

    def bad_checkpoint(self, path: str, reason: str) -> None:
        _set_aside(path, reason)

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

    def exit(self, code: int, reason: str = "") -> int:
        if code and reason:
            say(f"impala-async: stopped: {reason}")
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

    def local_actor_keys(self, keys, make):
        """Under CURVE, train's local actors get a key pair of rank 0's making (``make(keys)`` -> (their key
        directory, ``keys`` with theirs admitted)), and every rank admits its public key; ("", keys) on the others."""
        if self.rank == 0:
            directory, keys = make(keys)
            self.store.set("local_actor_key", next(k for k, name in keys.allowed.items() if name == "local"))
            return directory, keys
        public = self.store.get("local_actor_key")
        if not rankstore.checked_key(public):  # admitted by this rank's CURVE: only a well-formed public key
            raise SystemExit("impala-async: rank 0 shared a malformed local actors' key in the learner ranks' store")
        return "", dataclasses.replace(keys, allowed={**keys.allowed, public: "local"})

    def local_actors(self, count: int) -> int:
        """How many of train's local actors this rank starts: rank 0 all ``count``, the others none."""
        return count if self.rank == 0 else 0

    def lead_only(self, make):
        """``make()`` on rank 0 (what it alone does: the run directory's lock, config.json); None on the others."""
        return make() if self.rank == 0 else None

    def bad_checkpoint(self, path: str, reason: str) -> None:
        """A resumed checkpoint failed to restore, every rank holding it already: rank 0 sets it aside and every rank
        stops (SystemExit), so that the next start takes the previous one on every rank alike."""
        if self.rank == 0:
            _set_aside(path, reason)
        raise SystemExit(
            f"impala-async: checkpoint {path} failed to restore ({reason}); set aside: start the run again to resume "
            f"from the previous checkpoint (learner ranks took this one already)"
        )

    # ------------------------------------------------------------------------------------------- the watch
    def watch(self, *, figures, on_stop) -> None:
        """Start the thread that beats (with ``figures()``, this rank's), reads the others' beats and the stop key, and
        watches rank 0's children; ``on_stop(reason, code)`` stops this rank's learner from that thread."""
        self.watcher = RankWatch(self, figures, on_stop)
        self.watcher.start()

    def peers(self) -> list[tuple[dict, bool]]:
        """Rank 0: every other rank's latest figures and whether it is alive (counters.take's ``peers``); [] on the
        others (their snapshots are their own)."""
        return self.watcher.peers() if self.watcher is not None and self.rank == 0 else []

    def counters(self) -> dict:
        """The store's values this rank ignored, by reason (watch.py); none before the watch starts."""
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

    def exit(self, code: int, reason: str = "") -> int:
        """The process's exit code (rank 0 says why a run stopped with one); a training thread stuck in a collective
        cannot be joined: leave without it."""
        if code and reason and self.rank == 0:
            say(f"impala-async: stopped: {reason}")
        if self.stuck:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
