"""The training thread: full batches from the ring -> (device) -> learner update -> slot released.

On CUDA the copy of batch k+1 runs on a dedicated stream while batch k trains, and a ring slot is released only once
the event recorded after its copy has completed (refilling a pinned buffer mid-copy would corrupt the batch). On the
CPU the update reads the ring slot in place and the slot is released after the update. ``ingest_only`` skips the update
(the load-test mode): batches are copied to the device, if any, and released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..core.ring import Batch, TrajectoryRing
from .learn import CollectiveError, Learner
from .reports.metrics import Update

log = logging.getLogger("impala_async.learner.trainer")


class Staged(NamedTuple):
    batch: Batch
    tensors: dict  # name -> tensor on the learner's device
    copied: torch.cuda.Event | None  # recorded after the host-to-device copy (CUDA only)
    started: torch.cuda.Event | None  # recorded before it, for timing


class Trainer:
    def __init__(
        self,
        learner: Learner,
        ring: TrajectoryRing,
        *,
        max_policy_lag: int,
        ingest_only: bool = False,
        overlap_copies: bool = True,
        after_update: Callable[[Update | None], bool],
        on_exit: Callable[[BaseException | None], None],
        policy_version: int = 0,
        updates_per_batch: int = 1,
    ):
        """``after_update(update)`` runs on this thread after each batch (``update`` is None in ingest-only mode:
        nothing was trained) and returns True to stop; ``on_exit(error)`` runs when the thread ends."""
        self.learner, self.ring = learner, ring
        self.device = learner.device
        self.cuda = self.device.type == "cuda"
        self.max_policy_lag = max_policy_lag
        self.ingest_only = ingest_only
        self.overlap = overlap_copies
        self._after_update, self._on_exit = after_update, on_exit
        self.policy_version = policy_version
        self.updates_per_batch = updates_per_batch
        self.batches = 0
        self.stage_s = {"h2d": 0.0, "train": 0.0, "wait": 0.0}  # cumulative seconds; wait: for a batch (starved)
        self._waited_s = 0.0  # stage_s["wait"] at the last update
        self.error: BaseException | None = None
        # Monotonic time the thread last went round its loop (at least every 0.1 s while it waits for a batch, once
        # per update while it trains): /healthz tells a hung thread from a waiting one by it.
        self.heartbeat = time.monotonic()
        self._stop = threading.Event()
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._thread = threading.Thread(target=self._run, name="trainer", daemon=True)

    def counters(self) -> dict:
        return {
            "batches": self.batches,
            "policy_version": self.policy_version,
            **{f"stage_{k}_s": v for k, v in self.stage_s.items()},
        }

    def start(self) -> None:
        self.heartbeat = time.monotonic()
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to end by itself (it goes on training meanwhile). True if it did within timeout_s."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self, timeout_s: float) -> bool:
        """Ask the thread to finish its current update and exit. True if it did within timeout_s."""
        self._stop.set()
        self.ring.close()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _next(self, timeout_s: float) -> Staged | None:
        t0 = time.perf_counter()
        batch = self.ring.get(timeout_s, min_policy_version=self.policy_version - self.max_policy_lag)
        if timeout_s:
            self.stage_s["wait"] += time.perf_counter() - t0
        if batch is None:
            return None
        if not self.cuda:
            return Staged(batch, batch.tensors, None, None)
        stream = self._copy_stream if self.overlap else torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            started = torch.cuda.Event(enable_timing=True)
            started.record(stream)
            tensors = {k: v.to(self.device, non_blocking=True) for k, v in batch.tensors.items()}
            copied = torch.cuda.Event(enable_timing=True)
            copied.record(stream)
        if self.overlap:
            for t in tensors.values():  # allocated on the copy stream, used on the compute stream
                t.record_stream(torch.cuda.current_stream(self.device))
        return Staged(batch, tensors, copied, started)

    def _finish_copy(self, staged: Staged) -> None:
        """Wait for the copy (if any), account its time, release the ring slot."""
        if staged.copied is not None and staged.started is not None:  # both recorded, on CUDA
            staged.copied.synchronize()  # the slot may be refilled only once its copy is complete
            self.stage_s["h2d"] += staged.started.elapsed_time(staged.copied) / 1000.0
        self.ring.release(staged.batch)

    def _run(self) -> None:
        try:
            staged = None
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                if staged is None:
                    staged = self._next(0.1)
                    if staged is None:
                        continue
                # Start the next batch's copy now so that it overlaps this batch's update.
                upcoming = self._next(0.0) if self.cuda and self.overlap else None
                update: Update | None = None
                if self.ingest_only:
                    self._release_all(staged)
                else:
                    update = self._train(staged)
                staged = upcoming
                if self._after_update(update):
                    break
            if staged is not None:
                self._finish_copy(staged)
        except BaseException as e:  # reported by the server; the run exits non-zero
            self.error = e
            if self._stop.is_set() and isinstance(e, CollectiveError):
                # Stopping while this rank waited in a collective for one that stopped first: the shutdown's own
                # doing, said in a line (a traceback here read as a crash in every 2-rank run stopped mid-update).
                log.warning("training thread: %s, while stopping (another rank stopped first)", e)
            else:
                log.exception("training thread failed")
        finally:
            log.info(
                "training thread ends after %d batches (policy version %d)%s",
                self.batches,
                self.policy_version,
                f": {self.error!r}" if self.error else "",
            )
            self._on_exit(self.error)

    def _train(self, staged: Staged) -> Update:
        """The updates on a staged batch; its slot is released once the batch is no longer needed."""
        if staged.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(staged.copied)
        lag = self.policy_version - staged.batch.policy_versions
        t0 = time.perf_counter()
        stats = self._updates(staged.tensors)
        self.stage_s["train"] += time.perf_counter() - t0
        self._finish_copy(staged)
        self.batches += 1
        if not stats["skipped"]:  # a skipped update (non-finite loss) leaves the weights as they were
            self.policy_version += 1
        waited = self.stage_s["wait"]
        update = Update(self.policy_version, stats, lag, waited - self._waited_s)
        self._waited_s = waited
        return update

    def _updates(self, tensors: dict) -> dict:
        """``updates_per_batch`` updates on one batch (fewer once one asks to stop). Returns the first applied one's
        statistics (the first's losses are on data the policy has not learnt from yet) with ``rho_hist`` summed over
        every applied one; ``skipped`` if all were, ``last`` if one asked to stop."""
        stats = self.learner.step(tensors)  # its .tolist() waits for the GPU, if any
        for _ in range(self.updates_per_batch - 1):
            if stats["last"]:
                break
            more = self.learner.step(tensors, count_steps=False)
            if stats["skipped"]:
                stats = more
            elif not more["skipped"]:
                stats = {**stats, "rho_hist": [a + b for a, b in zip(stats["rho_hist"], more["rho_hist"], strict=True)]}
            stats = {**stats, "last": more["last"]}
        return stats

    def _release_all(self, staged: Staged) -> None:
        """Ingest-only mode: release this batch and every ready one (copied to the device, if any), untrained."""
        self._finish_copy(staged)
        self.batches += 1
        while (more := self._next(0.0)) is not None:  # take every ready batch per wake-up
            self._finish_copy(more)
            self.batches += 1
        return None
