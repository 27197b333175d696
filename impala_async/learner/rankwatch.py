"""What learner ranks (ranks.py) tell each other besides their gradients, through the rendezvous store.

Every rank's watch thread, every ``rank_heartbeat_interval_s``:
- writes ``beat/<r>``: a sequence number and this rank's figures (rank 0 sums them into its snapshots: counters.py);
- writes ``stop`` once this rank stops (the first stop of any rank wins: rank, reason, exit code) and reads it: a stop
  of another rank stops this one too (exit code 0 if that rank's was 0, else EXIT_RANK_FAILED);
- reads the other ranks' beats: one silent for ``rank_heartbeat_timeout_s`` is taken for dead (a child of rank 0 is
  then killed: hung, it would hold its peers in the all-reduce);
- on rank 0 with ranks it started, polls them: one that exits is noticed at once.
A store that stops answering means the rank hosting it (rank 0, or torchrun's agent) is gone. No asyncio here: the
thread hands stops to the server (which passes them to its event loop).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable

from ..ops import exitcodes
from .counters import heartbeat_figures

EXIT_RANK_FAILED = exitcodes.RANK_FAILED  # a learner rank died, failed, or hung (README, "Several learner ranks")


class RankWatch:
    def __init__(self, group, figures: Callable[[], dict], on_stop: Callable[[str, int], None]):
        """``figures()``: this rank's figures (counters.py), sent with each heartbeat; ``on_stop(reason, code)``:
        stops this rank's learner, from this thread."""
        self.group, self.cfg = group, group.cfg
        self._figures, self._on_stop = figures, on_stop
        self.peers_seen: dict[int, dict] = {}  # the other ranks' latest figures
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

    def peers(self) -> list[tuple[dict, bool]]:
        """Every other rank's figures as of its latest heartbeat ({} before the first) and whether it is alive."""
        return [(self.peers_seen.get(r, {}), self.alive(r)) for r in range(1, self.group.world)]

    def alive(self, rank: int) -> bool:
        heard = self._heard.get(rank)
        return heard is not None and time.monotonic() - heard[1] <= self.cfg.ranks.rank_heartbeat_timeout_s

    def _stop(self, reason: str, code: int) -> None:
        if self.diagnosis is None:
            self.diagnosis = (reason, code)
            self._found.set()
        self._on_stop(reason, code)

    def _run(self) -> None:
        cfg, group, seq, started = self.cfg, self.group, 0, time.monotonic()
        others = [r for r in range(group.world) if r != group.rank]
        while not self._halt.is_set():
            seq += 1
            try:
                stop, beats = self._exchange(seq, others)
            except Exception as e:  # the store is gone, and with it the rank that hosted it
                if not self._halt.is_set():
                    self._stop(f"lost the learner ranks' store ({str(e)[:200]}): rank 0 is gone", EXIT_RANK_FAILED)
                return
            if stop is not None and stop["rank"] != group.rank:
                self._stop(
                    f"learner rank {stop['rank']} stopped: {stop['reason']}",
                    0 if stop["code"] == 0 else EXIT_RANK_FAILED,
                )
            self._check_children()
            self._check_peers(beats, others, started)
            self._wake.wait(cfg.ranks.rank_heartbeat_interval_s)
            self._wake.clear()

    def _exchange(self, seq: int, others: list[int]) -> tuple[dict | None, dict]:
        """Write this rank's beat (and its stop, once); read the stop key and the others' beats."""
        store, me = self.group.store, self.group.rank
        store.set(f"beat/{me}", json.dumps({"seq": seq, **heartbeat_figures(self._figures())}))
        if self._announce is not None and not self._announced:
            reason, code = self._announce
            store.compare_set("stop", "", json.dumps({"rank": me, "reason": reason, "code": code}))
            self._announced = True  # written, or another rank's came first: either way, once
        stop = json.loads(store.get("stop")) if store.check(["stop"]) else None
        beats = {r: json.loads(store.get(f"beat/{r}")) for r in others if store.check([f"beat/{r}"])}
        return stop, beats

    def _check_children(self) -> None:
        """Rank 0 with ranks it started: one that exits is noticed at once."""
        for r, child in enumerate(self.group.children, start=1):
            if child.poll() is not None:
                code = child.returncode
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                self._stop(f"learner rank {r} (pid {child.pid}) {how}", EXIT_RANK_FAILED)

    def _check_peers(self, beats: dict, others: list[int], started: float) -> None:
        """Keep the others' figures; one silent for rank_heartbeat_timeout_s is taken for dead (a child killed)."""
        now, timeout_s, children = time.monotonic(), self.cfg.ranks.rank_heartbeat_timeout_s, self.group.children
        for r in others:
            if r in beats:
                self.peers_seen[r] = beats[r]
                if self._heard.get(r, (None,))[0] != beats[r]["seq"]:
                    self._heard[r] = (beats[r]["seq"], now)
            last = self._heard.get(r, (None, started))[1]
            if now - last > timeout_s:
                self._stop(
                    f"learner rank {r} silent for {now - last:.1f} s (rank_heartbeat_timeout_s={timeout_s:g}): "
                    "dead or hung",
                    EXIT_RANK_FAILED,
                )
                if r <= len(children) and children[r - 1].poll() is None:
                    children[r - 1].kill()  # hung: it has nothing to save, and its peers wait for it

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
