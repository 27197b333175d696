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
- ``beat/<r>`` and ``stop``: heartbeats with counters, and the first stop of any rank (watch.py).

The store is reached under a token, and every value read from it is checked (store.py).

Stopping. A normal stop ends every rank after the same update: rank 0 marks the next update (its gradients carry a
flag through the same all-reduce, learn.py), and every rank stops after it. A rank that dies or fails stops the others:
its peers' all-reduce fails (gloo notices a closed connection at once; a hung peer after rank_collective_timeout_s),
rank 0 sees its child exit or its heartbeat stop, and rank 0 writes a checkpoint of the last whole update and exits
with exitcodes.RANK_FAILED (6, watch.py).

The rooms: ``join.py`` how a process finds its rank (:func:`join`), ``group.py`` the rank itself (:class:`SingleRank`
for a learner of one, :class:`RankGroup` for one of several: one interface, so nothing outside this package asks
which), ``store.py`` the rendezvous store and its checks, ``watch.py`` the heartbeats and the stop.
"""

from .group import RankGroup, SingleRank
from .join import PARENT_ENV, env_rank, join, join_lead, join_worker, launched, rank_address, with_torchrun_world

__all__ = [
    "PARENT_ENV",
    "RankGroup",
    "SingleRank",
    "env_rank",
    "join",
    "join_lead",
    "join_worker",
    "launched",
    "rank_address",
    "with_torchrun_world",
]
