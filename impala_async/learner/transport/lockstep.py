"""The learner's side of the lockstep (``--reproducible 1``; config/lockstep.py): trajectories enter the ring by actor
and sequence number, not by arrival (:class:`Ordered`), and what follows an update goes by rounds, not by the clock
(:class:`Rounds`).

Each local actor in lockstep sends under the id ``lockstep/<index>`` and numbers its messages from 0. :class:`Ordered`
holds every message until all actors' messages of the lowest sequence number not yet handed on have arrived, then
hands them to :class:`~.ingest.Ingest` in actor order, so that the ring's rows, hence every batch, are the same
whichever actor's packets the scheduler delivered first. It stands in for ``Ingest`` in the receive loop
(transport/intake.py): ``handle``, ``pending``, ``continue_pending``, ``has_room``.

What cannot be ordered is refused (counted by ``Ingest``, by reason): a message that does not parse (handed to ingest,
which rejects it), one from an id that is not a lockstep actor's of this run (``bad_identity``), and one whose
sequence number was handed on already or is held already (``replay``: an actor that restarted begins again at 0; the
run then stops for want of data, ``no_data_timeout_s``). At most ``max_held_messages`` are held (``too_large`` past it).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from ...config.lockstep import actor_index
from .ingest import Ingest


class Ordered:
    def __init__(self, ingest: Ingest, actors: int, max_held_messages: int):
        """``actors``: the local actors in lockstep (indices 0 .. actors - 1); ``max_held_messages``: the most messages
        held at once (a round of every actor's unroll, in its parts, fits with room to spare)."""
        self.ingest, self.actors, self.max_held_messages = ingest, actors, max_held_messages
        # (seq, actor index) -> (the message, its key's name, its connection), until its turn
        self.held: dict[tuple[int, int], tuple[bytes, str | None, int | None]] = {}
        self.next_seq = 0  # the lowest sequence number not yet handed on
        self.ready: collections.deque = collections.deque()  # entries handed on, in order, as ingest takes them

    @property
    def pending(self):
        """Not None while something waits for room in the ring: the receive loop then reads nothing new."""
        return self.ingest.pending if self.ingest.pending is not None else (self.ready[0] if self.ready else None)

    def has_room(self) -> bool:
        return self.ingest.has_room()

    def reject_reason(self, reason: str, detail: str) -> None:
        self.ingest.reject_reason(reason, detail)

    def handle(self, buf, user_id: str | None = None, source: int | None = None) -> None:
        """One received message: held for its turn, or refused (module docstring). Never raises for a peer's bytes."""
        try:
            msg = self.ingest.decoder.parse(buf)
        except Exception:  # not parseable (or another incarnation's): ingest rejects or drops it, and counts it
            self.ingest.handle(buf, user_id, source)
            return
        index = actor_index(msg.actor_id)
        key = (msg.seq, index if index is not None else -1)
        if index is None or index >= self.actors:
            self.reject_reason("bad_identity", f"actor id {msg.actor_id[:80]!r} is no lockstep actor of this run")
        elif msg.seq < self.next_seq or key in self.held:
            self.reject_reason("replay", f"actor {index} seq {msg.seq}: handed on or held already (a restarted actor?)")
        elif len(self.held) >= self.max_held_messages:
            self.reject_reason("too_large", f"{len(self.held)} messages held for the lockstep already")
        else:
            self.held[key] = (bytes(buf), user_id, source)
            self._release_rounds()
            self.continue_pending()

    def _release_rounds(self) -> None:
        """Hand on, in actor order, every sequence number whose messages have all arrived."""
        while all((self.next_seq, i) in self.held for i in range(self.actors)):
            self.ready.extend(self.held.pop((self.next_seq, i)) for i in range(self.actors))
            self.next_seq += 1

    def continue_pending(self) -> bool:
        """Go on with what waits for room: ingest's pending message, then the messages handed on. True when nothing
        waits."""
        while self.ingest.continue_pending() and self.ready:
            self.ingest.handle(*self.ready.popleft())
        return self.ingest.pending is None and not self.ready


class Rounds:
    """The lockstep's clock, on the training thread: a round ends every ``round_batches`` batches trained; at the end
    of every ``report_rounds``-th round ``report()``, then at the end of each ``publish()``. Both hand their work to
    the event loop in that order (``call_soon_threadsafe`` keeps it), where nothing can change meanwhile: the ring is
    empty and no actor sends before the weights arrive. So a report's figures, but for the clock's, are the same in
    every run of a seed."""

    def __init__(
        self, round_batches: int, report_rounds: int, *, report: Callable[[], object], publish: Callable[[], None]
    ):
        self.round_batches, self.report_rounds = round_batches, report_rounds
        self._report, self._publish = report, publish
        self.batches = 0  # trained since this process started (a resumed run begins a round with its first batch)

    def after_batch(self) -> None:
        self.batches += 1
        if self.batches % self.round_batches:
            return
        if (self.batches // self.round_batches) % self.report_rounds == 0:
            self._report()
        self._publish()
