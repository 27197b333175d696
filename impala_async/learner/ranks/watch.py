"""What learner ranks (learner/ranks/) tell each other besides their gradients, through the rendezvous store.

Every rank's watch thread, every ``rank_heartbeat_interval_s``:
- writes ``beat/<r>``: a sequence number and this rank's figures (rank 0 sums them into its snapshots: counters.py);
- writes ``stop`` once this rank stops (the first stop of any rank wins: rank, reason, exit code) and reads it: a stop
  of another rank stops this one too (exit code 0 if that rank's was 0, else exitcodes.RANK_FAILED);
- reads the other ranks' beats: one silent for ``rank_heartbeat_timeout_s`` is taken for dead (a child of rank 0 is
  then killed: hung, it would hold its peers in the all-reduce);
- on rank 0 with ranks it started, polls them: one that exits is noticed at once.
A store that stops answering means the rank hosting it (rank 0, or torchrun's agent) is gone. No asyncio here: the
thread hands stops to the server (which passes them to its event loop).

Values read from the store are another rank's bytes (or anyone's who holds the store's token, store.py): each is
parsed by :func:`parse_beat` or :func:`parse_stop`, and one of any other shape is ignored, counted by reason
(:data:`REJECT_REASONS`, ``RankWatch.rejected``) and logged (once per reason every ``REJECT_LOG_INTERVAL_S``). So
the figures rank 0 sums (counters.take, in every report and checkpoint) are ints in range, a malformed stop stops
nothing, and nothing a peer writes raises out of this thread.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable

from ...ops import exitcodes
from ..reports.counters import SUMMED, heartbeat_figures

log = logging.getLogger("impala_async.learner.ranks.watch")

# Bounds on what a peer's values may hold (a rank's own never come near them): a beat is about 500 bytes.
MAX_STORE_VALUE_BYTES = 64 << 10  # larger values are not parsed
MAX_FIGURE = (1 << 53) - 1  # largest count (and heartbeat sequence number) taken: beyond it a float loses units
MAX_STOP_REASON_CHARS = 1000  # a stop's reason is cut to this many characters (written so, and read so)
REJECT_REASONS = ("too_large", "not_json", "not_object", "bad_seq", "bad_figure", "bad_rank", "bad_code", "bad_reason")
REJECTED_RANK_VALUES = ("rank_values_rejected", *(f"rank_values_rejected_{r}" for r in REJECT_REASONS))  # counters()
REJECT_LOG_INTERVAL_S = 10.0  # the least time between two log lines on one reason


def _json_object(value) -> dict | str:
    """``value`` (bytes) as a JSON object, or the reason it is none."""
    if not isinstance(value, bytes | str) or len(value) > MAX_STORE_VALUE_BYTES:
        return "too_large"
    try:
        got = json.loads(value)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return "not_json"
    return got if isinstance(got, dict) else "not_object"


def _count(value, most: int = MAX_FIGURE) -> bool:
    """An int (not a bool, not a float) in [0, most]."""
    return type(value) is int and 0 <= value <= most


def parse_beat(value) -> dict | str:
    """A peer's heartbeat: JSON ``{"seq": n, <each of counters.SUMMED>: n}``, every n an int in [0, MAX_FIGURE], as a
    dict of those keys alone; else the reason it is refused. What this prevents: rank 0 sums the figures with int()
    in every snapshot (a string made every report and every checkpoint, the final one included, raise), and a float
    or a huge int broke the rates."""
    got = _json_object(value)
    if isinstance(got, str):
        return got
    if not _count(got.get("seq")):
        return "bad_seq"
    if not all(_count(got.get(k)) for k in SUMMED):
        return "bad_figure"
    return {"seq": got["seq"], **{k: got[k] for k in SUMMED}}


def parse_stop(value, world: int) -> dict | str:
    """A stop: JSON ``{"rank": r, "reason": text, "code": c}`` with r a rank (an int in [0, world)), c an exit code
    (an int in [0, 255]) and text a string (cut to MAX_STOP_REASON_CHARS, unprintable characters replaced); else the
    reason it is refused. What this prevents: a stop that names no rank (KeyError, the watch thread gone) or any."""
    got = _json_object(value)
    if isinstance(got, str):
        return got
    if not _count(got.get("rank"), world - 1):
        return "bad_rank"
    if not _count(got.get("code"), 255):
        return "bad_code"
    reason = got.get("reason")
    if not isinstance(reason, str):
        return "bad_reason"
    text = "".join(c if c.isprintable() else "?" for c in reason[:MAX_STOP_REASON_CHARS])
    return {"rank": got["rank"], "reason": text, "code": got["code"]}


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
        self.rejected = dict.fromkeys(REJECT_REASONS, 0)  # values read from the store and ignored, by reason
        self._logged_at: dict[str, float] = {}  # reason -> monotonic time of its latest log line
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

    def counters(self) -> dict:
        """``rank_values_rejected`` and ``rank_values_rejected_<reason>``: values this rank read from the store and
        ignored."""
        rejected = dict(self.rejected)
        return {
            "rank_values_rejected": sum(rejected.values()),
            **{f"rank_values_rejected_{k}": n for k, n in rejected.items()},
        }

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
                    self._stop(f"lost the learner ranks' store ({str(e)[:200]}): rank 0 is gone", exitcodes.RANK_FAILED)
                return
            try:
                self._judge(stop, beats, others, started)
            except Exception:  # a bug here must not end the heartbeats (the others would take this rank for dead)
                log.exception("rank %d: the learner ranks' watch failed on one round; it goes on", group.rank)
            self._wake.wait(cfg.ranks.rank_heartbeat_interval_s)
            self._wake.clear()

    def _judge(
        self, stop_value: bytes | None, beat_values: dict[int, bytes], others: list[int], started: float
    ) -> None:
        """One round on what was read: a valid stop of another rank stops this one; the beats, the children."""
        stop = None if stop_value is None else self._parsed("stop", parse_stop(stop_value, self.group.world))
        if stop is not None and stop["rank"] != self.group.rank:
            self._stop(
                f"learner rank {stop['rank']} stopped: {stop['reason']}",
                0 if stop["code"] == 0 else exitcodes.RANK_FAILED,
            )
        beats = {}
        for r, value in beat_values.items():
            beat = self._parsed(f"beat/{r}", parse_beat(value))
            if beat is not None:
                beats[r] = beat
        self._check_children()
        self._check_peers(beats, others, started)

    def _parsed(self, key: str, got: dict | str) -> dict | None:
        """``got`` if a parser accepted it; else None, the reason counted and logged (rate-limited)."""
        if not isinstance(got, str):
            return got
        self.rejected[got] += 1
        now = time.monotonic()
        if now - self._logged_at.get(got, -REJECT_LOG_INTERVAL_S) >= REJECT_LOG_INTERVAL_S:
            self._logged_at[got] = now
            log.warning(
                "rank %d: ignored a malformed value of %s in the learner ranks' store (%s; %d ignored so far)",
                self.group.rank,
                key,
                got,
                sum(self.rejected.values()),
            )
        return None

    def _exchange(self, seq: int, others: list[int]) -> tuple[bytes | None, dict[int, bytes]]:
        """Write this rank's beat (and its stop, once); read the stop key and the others' beats, as bytes."""
        store, me = self.group.store, self.group.rank
        store.set(f"beat/{me}", json.dumps({"seq": seq, **heartbeat_figures(self._figures())}))
        if self._announce is not None and not self._announced:
            reason, code = self._announce
            ours = json.dumps({"rank": me, "reason": reason[:MAX_STOP_REASON_CHARS], "code": code}).encode()
            held = store.compare_set("stop", "", ours)
            if held != ours and isinstance(parse_stop(held, self.group.world), str):
                store.compare_set("stop", held, ours)  # a malformed value held the key: a stop of no rank's
            self._announced = True  # written, or another rank's came first: either way, once
        stop = store.get("stop") if store.check(["stop"]) else None
        beats = {r: store.get(f"beat/{r}") for r in others if store.check([f"beat/{r}"])}
        return stop, beats

    def _check_children(self) -> None:
        """Rank 0 with ranks it started: one that exits is noticed at once."""
        for r, child in enumerate(self.group.children, start=1):
            if child.poll() is not None:
                code = child.returncode
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                self._stop(f"learner rank {r} (pid {child.pid}) {how}", exitcodes.RANK_FAILED)

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
                    exitcodes.RANK_FAILED,
                )
                if 1 <= r <= len(children) and children[r - 1].poll() is None:  # rank 0's children: 1..N-1
                    children[r - 1].kill()  # hung: it has nothing to save, and its peers wait for it

    def explain(self, error: BaseException) -> tuple[str, int]:
        """Why the training thread failed: a peer that died or stopped (found by this thread, given a moment), or the
        failed collective itself, or this rank's own error."""
        from ..learn import CollectiveError

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
            exitcodes.RANK_FAILED,
        )
