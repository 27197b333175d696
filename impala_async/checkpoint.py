"""Atomic checkpoints: a checkpoint file either exists whole or not at all.

Written to a temporary file in the same directory, fsynced, renamed over the final name, and the directory fsynced.
Loaded with ``torch.load(weights_only=True)``: a checkpoint cannot run code.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("impala_async.checkpoint")
_NAME = re.compile(r"^checkpoint-(\d{12})\.pt$")


def checkpoint_path(directory: Path, env_steps: int) -> Path:
    return Path(directory) / f"checkpoint-{env_steps:012d}.pt"


def save(directory: Path, state: dict, env_steps: int, keep: int = 3) -> Path:
    """Write ``state`` atomically as checkpoint-<env_steps>.pt and keep only the newest ``keep`` checkpoints."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, env_steps)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


def remove_partial(directory: Path) -> int:
    """Delete temporary files a killed writer left behind. Returns how many."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    stale = [p for p in directory.iterdir() if p.name.startswith(".checkpoint-") and p.name.endswith(".tmp")]
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def load_latest(directory: Path, map_location="cpu") -> tuple[dict, Path] | None:
    """Newest checkpoint that loads; unreadable ones are skipped with a warning. None if there is none."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return torch.load(path, map_location=map_location, weights_only=True), path
        except Exception as e:  # truncated or corrupt file: fall back to the previous one
            log.warning("skipping unreadable checkpoint %s: %s: %s", path, type(e).__name__, e)
    return None
