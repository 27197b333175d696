"""``--tensorboard 1``: every metrics.jsonl record as TensorBoard events under LOGDIR/tensorboard.

Each record's numbers become scalars at step = ``env_steps`` (nested maps flattened with ``/``, e.g.
``stage_s_per_trajectory/train``; ``null`` skipped; the incarnation, an id, left out) and ``rho_hist`` a TensorBoard
histogram ``rho`` over ``rho_hist_edges``. The event loop only hands the record to a queue of
``max_tensorboard_queue_records`` (a full queue drops the record, with a warning): a thread of its own builds the
events and writes them through ``torch.utils.tensorboard.SummaryWriter``, flushed every
``tensorboard_flush_interval_s`` and closed, after a final flush, at shutdown.
"""

from __future__ import annotations

import logging
import math
import queue
import sys
import threading
from pathlib import Path

log = logging.getLogger("impala_async.learner.tboard")

INSTALL_HINT = "pip install 'impala-async[tensorboard]'"
SKIPPED_KEYS = ("incarnation", "rho_hist", "rho_hist_edges")  # an id; the histogram and its edges, written as one
OPEN_BIN_DRAWN_TO = 2.0  # the open top bin [10, inf) of rho_hist is drawn up to this multiple of its lower edge
_STOP = object()


def missing() -> str | None:
    """Why TensorBoard events cannot be written here (a one-line message naming the pip install), or None."""
    try:
        import tensorboard  # noqa: F401 (torch.utils.tensorboard needs it)
    except ImportError:
        return f"--tensorboard 1 needs the tensorboard package, which is not installed: {INSTALL_HINT}"
    return None


def scalars(record: dict, prefix: str = ""):
    """(tag, value) for every finite number of ``record``, nested maps flattened with '/'."""
    for key, value in record.items():
        if not prefix and key in SKIPPED_KEYS:
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from scalars(value, tag + "/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            yield tag, float(value)


def rho_histogram(record: dict) -> dict | None:
    """``add_histogram_raw`` arguments for the record's ``rho_hist`` (None without updates in the interval).

    Bin i of rho_hist is (edge_i, edge_i+1], the last one (edge_last, inf): TensorBoard's bucket limits are the upper
    edges, the top one sys.float_info.max; min and max (the outer edges TensorBoard draws) are the lower edge of the
    first non-empty bin and the upper edge of the last, OPEN_BIN_DRAWN_TO times the top edge for the open bin. The sum
    is rho_mean times the count; the sum of squares is not known (0)."""
    counts, edges = record.get("rho_hist"), record.get("rho_hist_edges")
    if not counts or not edges or not sum(counts):
        return None
    uppers = [*edges[1:], sys.float_info.max]
    full = [i for i, c in enumerate(counts) if c]
    top = uppers[full[-1]] if full[-1] < len(edges) - 1 else edges[-1] * OPEN_BIN_DRAWN_TO
    num = float(sum(counts))
    mean = record.get("rho_mean")
    return {
        "min": float(edges[full[0]]),
        "max": float(top),
        "num": num,
        "sum": float(mean) * num if mean is not None else 0.0,
        "sum_squares": 0.0,
        "bucket_limits": [float(u) for u in uppers[: len(counts)]],
        "bucket_counts": [float(c) for c in counts],
    }


def tensorboard_writer(cfg, logdir) -> TensorBoardWriter | None:
    """The writer ``--tensorboard 1`` asks for (None without it)."""
    if not cfg.observe.tensorboard:
        return None
    return TensorBoardWriter(
        Path(logdir),
        flush_interval_s=cfg.observe.tensorboard_flush_interval_s,
        max_queue_records=cfg.observe.max_tensorboard_queue_records,
    )


class TensorBoardWriter:
    def __init__(self, logdir: Path, *, flush_interval_s: float, max_queue_records: int):
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the tensorboard extra

        self.path = Path(logdir) / "tensorboard"
        self._writer = SummaryWriter(str(self.path), flush_secs=flush_interval_s, max_queue=1000)
        self._queue: queue.Queue = queue.Queue(max_queue_records)
        self.dropped = 0  # records not written: the queue was full
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tensorboard", daemon=True)
        self._thread.start()

    def write(self, record: dict) -> None:
        """Queue ``record`` for writing; never waits."""
        if self.error is not None:
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning(
                    "TensorBoard writer behind: %d metrics records dropped so far (max_tensorboard_queue_records=%d)",
                    self.dropped,
                    self._queue.maxsize,
                )

    def close(self, timeout_s: float) -> None:
        """Write what is queued, flush and close the event file, within ``timeout_s`` (then give up)."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            log.warning("TensorBoard writer did not take the stop request within %g s", timeout_s)
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("TensorBoard writer did not finish within %g s; its last events may be missing", timeout_s)

    def _run(self) -> None:
        try:
            while (record := self._queue.get()) is not _STOP:
                self._write(record)
        except Exception as e:  # a disk error must not stop training: say so, and stop writing
            self.error = e
            log.exception("TensorBoard writer failed; no more TensorBoard events will be written")
        finally:
            self._writer.close()  # flushes

    def _write(self, record: dict) -> None:
        step = int(record["env_steps"])
        for tag, value in scalars(record):
            self._writer.add_scalar(tag, value, step)
        hist = rho_histogram(record)
        if hist is not None:
            self._writer.add_histogram_raw("rho", global_step=step, **hist)
