"""What learner ranks (ranks.py) tell each other besides their gradients, through the rendezvous store.

Every rank's watch thread, every ``rank_heartbeat_interval_s``:
- writes ``beat/<r>``: a sequence number and this rank's counters (rank 0 sums them into its metrics: ``totals``);
- writes ``stop`` once this rank stops (the first stop of any rank wins: rank, reason, exit code) and reads it: a stop
  of another rank stops this one too (exit code 0 if that rank's was 0, else EXIT_RANK_FAILED);
- reads the other ranks' beats: one silent for ``rank_heartbeat_timeout_s`` is taken for dead (a child of rank 0 is
  then killed: hung, it would hold its peers in the all-reduce);
- on rank 0 with ranks it started, polls them: one that exits is noticed at once.
A store that stops answering means the rank hosting it (rank 0, or torchrun's agent) is gone. No asyncio here: the
thread hands stops to the server's event loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import json
import signal
import threading
import time

EXIT_RANK_FAILED = 6  # a learner rank died, failed, or hung (README, "Several learner ranks")
# Counters each rank reports with its heartbeat; rank 0's metrics hold their sums (and each rank's under "ranks").
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


def counters(server) -> dict:
    """This rank's counters (read from any thread: each is one read of an int, or one C-level copy)."""
    ing, ring = server.ingest, server.ring
    c = {
        "env_steps": ing.env_steps,
        "episodes": ing.episodes,
        "trajectories_received": ing.trajectories_received,
        "trajectories_rejected": ing.trajectories_rejected,
        "messages_received": ing.messages_received,
        "messages_rejected": sum(dict(ing.rejected).values()),
        "bytes_received": ing.bytes_received,
        "decoded_bytes": ing.decoded_bytes,
        "dropped_full": ring.dropped_full,
        "dropped_stale": ring.dropped_stale + ing.dropped_stale,
        "dropped_incarnation": ing.dropped_incarnation,
        "ring_ready_batches": ring.ready_batches(),
        "ring_waiting_trajectories": ring.waiting_trajectories(),
    }
    c["trajectories_dropped"] = c["dropped_full"] + c["dropped_stale"] + c["dropped_incarnation"]
    return c


def totals(server) -> tuple[dict, dict]:
    """(sums over the ranks of SUMMED, {name: [rank 0's, rank 1's, ...]} for PER_RANK and ``alive``). The other ranks'
    figures are those of their latest heartbeat (at most rank_heartbeat_interval_s old); one not heard from counts 0.
    On a rank other than 0, and with one rank, this rank's alone."""
    own = counters(server)
    group = getattr(server, "ranks", None)
    watcher = group.watcher if group is not None and group.rank == 0 else None
    rows = [own] + ([watcher.peers.get(r, {}) for r in range(1, group.world)] if watcher is not None else [])
    sums = {k: sum(int(row.get(k, 0)) for row in rows) for k in SUMMED}
    per_rank = {k: [int(row.get(k, 0)) for row in rows] for k in PER_RANK}
    per_rank["alive"] = [1] + [int(watcher.alive(r)) for r in range(1, len(rows))]
    return sums, per_rank


class RankWatch:
    def __init__(self, group, server):
        self.group, self.server, self.cfg = group, server, group.cfg
        self.peers: dict[int, dict] = {}  # the other ranks' latest counters
        self._heard: dict[int, tuple[int, float]] = {}  # rank -> (heartbeat sequence, monotonic time it changed)
        self._announce: tuple[str, int] | None = None
        self._announced = False
        self.diagnosis: tuple[str, int] | None = None  # why the learner must stop, as this thread found it
        self._found = threading.Event()
        self._wake, self._halt = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="ranks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def halt(self) -> None:
        self._halt.set()
        self._wake.set()
        self._thread.join(2 * self.cfg.ranks.rank_heartbeat_interval_s + 1.0)

    def announce(self, reason: str, code: int) -> None:
        """This rank stops: the thread writes it as the stop key at once."""
        if self._announce is None:
            self._announce = (reason, code)
            self._wake.set()

    def alive(self, rank: int) -> bool:
        heard = self._heard.get(rank)
        return heard is not None and time.monotonic() - heard[1] <= self.cfg.ranks.rank_heartbeat_timeout_s

    def _stop(self, reason: str, code: int) -> None:
        if self.diagnosis is None:
            self.diagnosis = (reason, code)
            self._found.set()
        try:
            self.server._loop.call_soon_threadsafe(self.server.request_stop, reason, code)
        except RuntimeError:  # the loop is closed: the learner is gone already
            pass

    def _run(self) -> None:
        cfg, group, seq, started = self.cfg, self.group, 0, time.monotonic()
        store, me = group.store, group.rank
        others = [r for r in range(group.world) if r != me]
        while not self._halt.is_set():
            seq += 1
            try:
                store.set(f"beat/{me}", json.dumps({"seq": seq, **counters(self.server)}))
                if self._announce is not None and not self._announced:
                    reason, code = self._announce
                    store.compare_set("stop", "", json.dumps({"rank": me, "reason": reason, "code": code}))
                    self._announced = True  # written, or another rank's came first: either way, once
                stop = json.loads(store.get("stop")) if store.check(["stop"]) else None
                beats = {r: json.loads(store.get(f"beat/{r}")) for r in others if store.check([f"beat/{r}"])}
            except Exception as e:  # the store is gone, and with it the rank that hosted it
                if not self._halt.is_set():
                    self._stop(f"lost the learner ranks' store ({str(e)[:200]}): rank 0 is gone", EXIT_RANK_FAILED)
                return
            now = time.monotonic()
            if stop is not None and stop["rank"] != me:
                self._stop(
                    f"learner rank {stop['rank']} stopped: {stop['reason']}",
                    0 if stop["code"] == 0 else EXIT_RANK_FAILED,
                )
            for r, child in enumerate(group.children, start=1):
                if child.poll() is not None:
                    code = child.returncode
                    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                    self._stop(f"learner rank {r} (pid {child.pid}) {how}", EXIT_RANK_FAILED)
            for r in others:
                if r in beats:
                    self.peers[r] = beats[r]
                    if self._heard.get(r, (None,))[0] != beats[r]["seq"]:
                        self._heard[r] = (beats[r]["seq"], now)
                last = self._heard.get(r, (None, started))[1]
                if now - last > cfg.ranks.rank_heartbeat_timeout_s:
                    self._stop(
                        f"learner rank {r} silent for {now - last:.1f} s (rank_heartbeat_timeout_s="
                        f"{cfg.ranks.rank_heartbeat_timeout_s:g}): dead or hung",
                        EXIT_RANK_FAILED,
                    )
                    if r <= len(group.children) and group.children[r - 1].poll() is None:
                        group.children[r - 1].kill()  # hung: it has nothing to save, and its peers wait for it
            self._wake.wait(cfg.ranks.rank_heartbeat_interval_s)
            self._wake.clear()

    def explain(self, error: BaseException) -> tuple[str, int]:
        """Why the training thread failed: a peer that died or stopped (found by this thread, given a moment), or the
        failed collective itself, or this rank's own error."""
        from .learn import CollectiveError

        if not isinstance(error, CollectiveError):
            return f"training failed: {error!r}", 1
        self._wake.set()
        self._found.wait(3 * self.cfg.ranks.rank_heartbeat_interval_s)
        if self.diagnosis is not None:
            return self.diagnosis
        return (
            f"the learner ranks' gradient all-reduce failed (a rank left, or waited more than "
            f"rank_collective_timeout_s={self.cfg.ranks.rank_collective_timeout_s:g} s for another's batch): "
            f"{str(error)[:200]}",
            EXIT_RANK_FAILED,
        )
