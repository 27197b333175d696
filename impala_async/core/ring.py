"""Preallocated ring of trajectory slots, filled a message (one or more trajectories) at a time and consumed one
batch at a time.

Pure: torch, numpy and threading only. Storage is allocated once: for every field of the spec one tensor
``[num_batches, batch_size, *field.shape]`` (pinned when asked, for asynchronous host-to-device copies). A *batch slot*
``k`` is the contiguous block ``storage[k]``, ``[B, *field.shape]`` per field, so a full batch goes to training as a
view, with no gather and no allocation.

Life of a batch slot: FREE -> FILLING (the receiver decodes messages into its next free rows) -> READY (queued
for training) -> TRAINING (handed out by :meth:`get`) -> FREE (after :meth:`release`). One thread writes (the
receiver), one thread reads (the trainer).

When the learner falls behind and no FREE slot is left, the ring either drops its oldest READY batch
(``drop_when_full=True``: bounded memory, freshest data, every drop counted) or reports itself not writable until the
trainer releases a slot (``False``: the receiver stops reading and the sockets' high-water marks push back on actors).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from .spec import TrajectorySpec


class Batch(NamedTuple):
    slot: int  # batch slot in the ring
    tensors: dict  # field name -> tensor [B, *field.shape], a view of ring storage
    policy_versions: np.ndarray  # [B] int64, behaviour policy version of each trajectory


class TrajectoryRing:
    def __init__(
        self,
        spec: TrajectorySpec,
        batch_size: int,
        num_batches: int,
        *,
        pin_memory: bool = False,
        drop_when_full: bool = True,
        on_release: Callable[[], None] | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_batches < 3:
            raise ValueError(f"num_batches must be >= 3 (one filling, one training, one ready), got {num_batches}")
        self.spec = spec
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.drop_when_full = drop_when_full
        self.tensors = {
            f.name: torch.empty(
                (num_batches, batch_size, *f.shape),
                dtype=torch.from_numpy(np.empty(0, f.dtype)).dtype,
                pin_memory=pin_memory,
            )
            for f in spec.fields
        }
        arrays = {name: t.numpy() for name, t in self.tensors.items()}
        # numpy views [B, *shape] of each batch slot, made once: the hot path only slices them.
        self._views = [{name: a[k] for name, a in arrays.items()} for k in range(num_batches)]
        self._versions = np.zeros((num_batches, batch_size), np.int64)
        self._cond = threading.Condition()
        self._free = deque(range(1, num_batches))
        self._ready: deque[int] = deque()
        self._filling: int | None = 0
        self._row = 0
        self._closed = False
        self.on_release = on_release  # called (from the trainer thread) after a release
        # Counters (trajectories), read by the server's metrics.
        self.dropped_full = 0
        self.dropped_stale = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    # ----------------------------------------------------------------------------------------------- writer side
    def writable(self) -> bool:
        """True if rows can be filled now."""
        if self._filling is None:
            with self._cond:
                if self._free:
                    self._filling, self._row = self._free.popleft(), 0
        return self._filling is not None

    def room(self) -> int:
        """Rows that can be written now, all in the current batch slot (0 when not writable)."""
        return self.batch_size - self._row if self.writable() else 0

    def rows(self, n: int) -> dict[str, np.ndarray]:
        """numpy views ``[n, *field.shape]`` (contiguous) of the next ``n`` free rows; ``n <= room()``. Fill them and
        :meth:`commit`, or leave them (a rejected message): the next call returns the same rows."""
        r, k = self._row, self._filling
        assert k is not None, "rows() without room (has_room() said no)"
        return {name: a[r : r + n] for name, a in self._views[k].items()}

    def commit(self, n: int, policy_version: int) -> None:
        """The ``n`` rows returned by :meth:`rows` now hold valid trajectories."""
        k, r = self._filling, self._row
        assert k is not None, "commit() without room (has_room() said no)"
        self._versions[k, r : r + n] = policy_version
        self._row = r + n
        if self._row < self.batch_size:
            return
        with self._cond:
            self._ready.append(k)
            self._row = 0
            if self._free:
                self._filling = self._free.popleft()
            elif self.drop_when_full:
                self._filling = self._ready.popleft()  # the oldest READY batch makes room
                self.dropped_full += self.batch_size
            else:
                self._filling = None
            self._cond.notify_all()

    # ----------------------------------------------------------------------------------------------- reader side
    def get(self, timeout_s: float, min_policy_version: int | None = None) -> Batch | None:
        """Oldest READY batch, or None after ``timeout_s`` or :meth:`close`. Batches holding a trajectory older than
        ``min_policy_version`` are dropped (counted in ``dropped_stale``) instead of returned."""
        with self._cond:
            while True:
                while self._ready:
                    k = self._ready.popleft()
                    if min_policy_version is not None and self._versions[k].min() < min_policy_version:
                        self.dropped_stale += self.batch_size
                        self._return_slot(k)
                        continue
                    return Batch(
                        k,
                        {name: t[k] for name, t in self.tensors.items()},
                        self._versions[k].copy(),
                    )
                if self._closed or not self._cond.wait(timeout_s):
                    return None

    def release(self, batch: Batch) -> None:
        """The trainer is done with ``batch`` (and any asynchronous copy from it has completed)."""
        with self._cond:
            self._return_slot(batch.slot)
        if self.on_release is not None:
            self.on_release()

    def _return_slot(self, k: int) -> None:
        self._free.append(k)  # the writer picks it up in writable()
        self._cond.notify_all()

    def ready_batches(self) -> int:
        with self._cond:
            return len(self._ready)

    def waiting_trajectories(self) -> int:
        """Trajectories committed and not yet handed to the reader: READY batches and the rows of the one filling."""
        with self._cond:
            return len(self._ready) * self.batch_size + (self._row if self._filling is not None else 0)

    def counters(self) -> dict:
        """The ring's figures (learner/reports/counters.py): drops by cause, what waits, its size."""
        return {
            "dropped_full": self.dropped_full,
            "ring_dropped_stale": self.dropped_stale,
            "ring_ready_batches": self.ready_batches(),
            "ring_waiting_trajectories": self.waiting_trajectories(),
            "ring_bytes": self.nbytes,
        }

    def close(self) -> None:
        """Wake any reader blocked in :meth:`get`; it returns None from now on once READY batches run out."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
