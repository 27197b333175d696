"""One snapshot of the learner's figures per report, built once and read by every sink: the metrics.jsonl record, the
console line, TensorBoard (through the record), Prometheus /metrics, and the other learner ranks' heartbeats.

Each part of the learner counts its own and answers ``counters()`` (a flat dict under the names metrics.jsonl uses);
:func:`figures` merges them and derives the few figures that combine parts (a trajectory is dropped in the ring or in
ingest). With several learner ranks rank 0's snapshot also holds the sums of :data:`SUMMED` over every rank (the others
as of their latest heartbeat, ranks/) and each rank's :data:`PER_RANK` figures; with one rank the sums are its own.
Counters are read from their owners' threads as they run: each is one read of an int or a float, or a copy of a
container made in one C call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# Figures each rank reports with its heartbeat; rank 0's snapshot holds their sums (and each rank's under "ranks").
SUMMED = (
    "env_steps",
    "episodes",
    "trajectories_received",
    "trajectories_rejected",
    "messages_received",
    "messages_rejected",
    "bytes_received",
    "decoded_bytes",
    "dropped_full",
    "dropped_stale",
    "dropped_incarnation",
    "trajectories_dropped",
    "ring_ready_batches",
    "ring_waiting_trajectories",
)
PER_RANK = (
    "trajectories_received",
    "trajectories_rejected",
    "trajectories_dropped",
    "ring_waiting_trajectories",
    "env_steps",
)


def figures(sources: Iterable[Callable[[], dict]]) -> dict:
    """This rank's figures: every source's counters, and the drops that combine the ring's and ingest's."""
    out: dict = {}
    for counters in sources:
        got = counters()
        overlap = out.keys() & got.keys()
        if overlap:  # a programming error, not a peer's: fail loudly, also under python -O
            raise RuntimeError(f"two parts count {sorted(overlap)}")
        out.update(got)
    out["dropped_stale"] = out.pop("ring_dropped_stale", 0) + out.pop("ingest_dropped_stale", 0)
    out["trajectories_dropped"] = out["dropped_full"] + out["dropped_stale"]  # dropped_incarnation: in messages
    return out


@dataclass(frozen=True)
class Snapshot:
    """The learner's figures at monotonic time ``t``: this rank's own, the sums over the ranks, each rank's."""

    t: float
    own: dict
    summed: dict
    per_rank: dict = field(default_factory=dict)

    def __getitem__(self, key: str):
        """A figure as the whole learner has it: summed over the ranks where it is one of SUMMED, else this rank's."""
        return self.summed[key] if key in self.summed else self.own[key]


def take(
    sources: Iterable[Callable[[], dict]],
    peers: Callable[[], list[tuple[dict, bool]]] | None = None,
    now: float | None = None,
) -> Snapshot:
    """A snapshot of ``sources`` (this rank's parts) and of ``peers()``, the other ranks' latest heartbeat figures
    and whether each is alive (rank 0 of several; None otherwise)."""
    own = figures(sources)
    others = peers() if peers is not None else []
    rows = [own] + [row for row, _ in others]
    summed = {k: sum(int(row.get(k, 0)) for row in rows) for k in SUMMED}
    per_rank = {k: [int(row.get(k, 0)) for row in rows] for k in PER_RANK}
    per_rank["alive"] = [1] + [int(alive) for _, alive in others]
    return Snapshot(time.monotonic() if now is None else now, own, summed, per_rank)


def heartbeat_figures(own: dict) -> dict:
    """What a rank sends with its heartbeat: its SUMMED figures."""
    return {k: own[k] for k in SUMMED}
