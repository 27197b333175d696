"""One learner per run directory: an advisory lock on ``LOGDIR/learner.lock``.

Two learners in one directory (a second ``train --resume DIR`` beside the live one) interleave metrics.jsonl, fail
each other's checkpoints and prune each other's files. The learner takes an exclusive ``flock`` on the lock file
before it writes anything there and holds it for its life; the kernel releases it when the process ends, however it
ends, so a killed learner never leaves a stale lock behind. The file keeps the holder's PID for the refusal's message.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "learner.lock"
MAX_PID_BYTES = 32


class LogdirInUse(Exception):
    """Another live process holds the run directory's lock."""


class RunDirLock:
    """The lock on ``logdir`` (created, owner-only, if need be), taken at construction; :meth:`release` lets it go."""

    def __init__(self, logdir: str | Path):
        self.path = Path(logdir) / LOCK_FILE
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, MAX_PID_BYTES, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(self.fd)
            raise LogdirInUse(
                f"the logdir {logdir} is in use by another learner (PID {holder}): two would interleave their metrics "
                "and prune each other's checkpoints; stop it first, or choose another --logdir"
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = -1
