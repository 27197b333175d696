"""Atomic checkpoints: a checkpoint file either exists whole or not at all, and resume trusts none blindly.

Written to a temporary file in the same directory, fsynced, renamed over the final name, and the directory fsynced.
:class:`CheckpointWriter` keeps what a save needs open in advance (the directory and the next temporary file), so a
learner whose peers have taken every file descriptor can still save; a save that fails anyway raises, and the caller
retries later (training goes on).

Loaded with ``torch.load(weights_only=True)`` (a checkpoint cannot run code), and only after the file passed checks
that bound what loading it costs: a zip archive (torch's format) no larger than ``max_bytes`` whose records are all
stored uncompressed, as torch writes them (so nothing decompresses beyond the file's size). ``load_latest`` then
validates what it loaded and falls back to the previous checkpoint with a warning.
"""

from __future__ import annotations

import io
import logging
import os
import re
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..core.finite import nonfinite

log = logging.getLogger("impala_async.learner.checkpoint")
_NAME = re.compile(r"^checkpoint-(\d{12})\.pt$")
_TMP_PREFIX, _TMP_SUFFIX = ".checkpoint-", ".tmp"


def checkpoint_path(directory: Path, env_steps: int) -> Path:
    return Path(directory) / f"checkpoint-{env_steps:012d}.pt"


class CheckpointWriter:
    """Saves ``checkpoint-<env steps>.pt`` atomically into ``directory`` and keeps the newest ``keep``."""

    def __init__(self, directory: Path, keep: int = 3):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        self._known = list_checkpoints(self.directory)  # ours and earlier runs', oldest first; no listing later
        self._next: tuple[int, str] | None = None
        self._prepare()
        # torch.save imports modules on first use, and an import opens files: do it now, not when none can be opened.
        torch.save({"warm_up": torch.zeros(1), "nested": {"list": [1.0]}}, io.BytesIO())

    def _prepare(self) -> None:
        """Open the next save's temporary file now, while descriptors are available."""
        if self._next is None:
            n = 0
            while True:
                name = f"{_TMP_PREFIX}{os.getpid()}-{n}{_TMP_SUFFIX}"
                try:
                    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=self._dir_fd)
                    break
                except FileExistsError:
                    n += 1
            self._next = (fd, name)

    def save(self, state: dict, env_steps: int) -> Path:
        """Write ``state`` atomically; raises OSError (or whatever torch.save raises) if it could not."""
        if self._next is None:
            self._prepare()  # raises while no descriptor is free
        fd, name = self._next
        self._next = None
        final = checkpoint_path(self.directory, env_steps)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(name, final.name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
            os.fsync(self._dir_fd)
        except BaseException:
            try:
                os.unlink(name, dir_fd=self._dir_fd)
            except OSError:
                pass
            raise
        if final not in self._known:
            self._known.append(final)
        self._known.sort()
        for old in self._known[: -self.keep]:
            try:
                os.unlink(old.name, dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass
        del self._known[: -self.keep]
        try:
            self._prepare()
        except OSError as e:  # no descriptor now: the next save tries again
            log.warning("could not open the next checkpoint's temporary file yet: %s", e)
        return final

    def close(self) -> None:
        if self._next is not None:
            fd, name = self._next
            os.close(fd)
            try:
                os.unlink(name, dir_fd=self._dir_fd)
            except OSError:
                pass
            self._next = None
        os.close(self._dir_fd)


def save(directory: Path, state: dict, env_steps: int, keep: int = 3) -> Path:
    """Write one checkpoint (see :class:`CheckpointWriter`)."""
    writer = CheckpointWriter(directory, keep)
    try:
        return writer.save(state, env_steps)
    finally:
        writer.close()


def remove_partial(directory: Path) -> int:
    """Delete temporary files a killed writer left behind. Returns how many."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    stale = [p for p in directory.iterdir() if p.name.startswith(_TMP_PREFIX) and p.name.endswith(_TMP_SUFFIX)]
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def check_archive(path: Path, max_bytes: int) -> None:
    """Raise ValueError unless ``path`` is a torch zip archive of at most ``max_bytes`` with every record stored."""
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{size} bytes > max_checkpoint_bytes={max_bytes}")
    if not zipfile.is_zipfile(path):
        raise ValueError("not a zip archive (torch.save's format)")
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        if not infos:
            raise ValueError("an empty archive")
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"record {info.filename[:80]!r} is compressed; torch stores records uncompressed")
        claimed = sum(info.file_size for info in infos)
        if claimed > max_bytes:
            raise ValueError(f"records of {claimed} bytes > max_checkpoint_bytes={max_bytes}")


def load(path: Path, max_bytes: int, map_location="cpu") -> dict:
    check_archive(path, max_bytes)
    state = torch.load(path, map_location=map_location, weights_only=True)
    if type(state) is not dict:
        raise ValueError(f"holds a {type(state).__name__}, not a dict")
    return state


def load_latest(
    directory: Path,
    max_bytes: int = 4 << 30,
    validate: Callable[[dict], None] | None = None,
    map_location="cpu",
    quarantine: bool = False,
) -> tuple[dict, Path] | None:
    """Newest checkpoint that passes the archive checks, loads and ``validate``s (which raises to refuse it); the
    others are skipped with a warning. None if there is none.

    ``quarantine`` (a run about to resume) renames each skipped file to ``NAME.bad``: left in place, a bad checkpoint
    would count among the newest ``keep`` and have the resumed run's good ones pruned instead, and the next resume
    would meet it again."""
    for path in reversed(list_checkpoints(directory)):
        try:
            state = load(path, max_bytes, map_location)
            if validate is not None:
                validate(state)
            return state, path
        except Exception as e:  # truncated, corrupt, oversized, malformed or non-finite: the previous one
            log.warning("skipping checkpoint %s: %s: %s", path, type(e).__name__, str(e)[:300])
            if quarantine:
                path.rename(path.with_name(path.name + ".bad"))
                log.warning("renamed it to %s.bad", path.name)
    return None


# What the learner server writes (LearnerServer.checkpoint_state): key -> accepted types.
_LEARNER_STATE = {
    "learner": dict,
    "policy_version": int,
    "env_steps": int,
    "episodes": int,
    "returns": list,
    "lengths": list,
    "wall_s": (float, int),
    "config": dict,
    "spec": dict,
    "torch_rng": torch.Tensor,
}
_LEARNER_INNER = {"model": dict, "optimizer": dict, "env_steps_trained": int, "updates": int}


def validate_learner_state(state: dict) -> None:
    """Raise ValueError unless ``state`` has the learner checkpoint's layout and every float tensor in it (model and
    optimizer state) is finite: a run that resumed from NaN weights would publish them to every actor."""
    for key, kind in _LEARNER_STATE.items():
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise ValueError(f"{key!r} is missing or not a {kind}")
    inner = state["learner"]
    for key, kind in _LEARNER_INNER.items():
        if not isinstance(inner.get(key), kind) or isinstance(inner.get(key), bool):
            raise ValueError(f"learner.{key} is missing or not a {kind}")
    if not inner["model"] or not all(isinstance(t, torch.Tensor) for t in inner["model"].values()):
        raise ValueError("learner.model holds no tensors")
    for where, tensors in (("model", inner["model"].items()), ("optimizer", _tensors(inner["optimizer"]))):
        bad = nonfinite(tensors)
        if bad:
            raise ValueError(f"non-finite values in {where} tensor {bad[0]}")
    if not all(isinstance(x, float | int) and not isinstance(x, bool) for x in state["returns"] + state["lengths"]):
        raise ValueError("returns and lengths must be lists of numbers")


def _tensors(tree, prefix: str = ""):
    """(path, tensor) for every tensor nested in dicts and lists."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}[{i}]")


def learner_state(
    learner,
    *,
    policy_version: int,
    env_steps: int,
    episodes: int,
    returns: list,
    lengths: list,
    wall_s: float,
    config: dict,
    config_layers: dict,
    spec: dict,
    torch_rng,
) -> dict:
    """What a learner checkpoint holds (validate_learner_state checks it at resume): the network and optimizer, the
    run's counters, its configuration (by flag name) with the layer of each value, the trajectory spec, torch's RNG."""
    return {
        "learner": learner.state_dict(),
        "policy_version": policy_version,
        "env_steps": env_steps,
        "episodes": episodes,
        "returns": returns,
        "lengths": lengths,
        "wall_s": wall_s,
        "config": config,
        "config_layers": config_layers,
        "spec": spec,
        "torch_rng": torch_rng,
    }


class Checkpoints:
    """The learner's checkpoints: every ``checkpoint_interval_s`` (from the training thread, between updates) and a
    final one, never with non-finite weights; a failure (disk full, no file descriptor) is reported, counted and
    retried after ``checkpoint_retry_interval_s`` while training goes on. ``collect()`` gives the state to save."""

    def __init__(self, directory: Path, section, learner, *, collect: Callable[[], dict]):
        self.section, self.learner, self._collect = section, learner, collect
        self.writer = CheckpointWriter(directory, section.checkpoint_keep)
        self.failures = 0
        self._last = time.monotonic()

    def counters(self) -> dict:
        return {"checkpoint_failures": self.failures}

    def save(self) -> Path:
        """Write a checkpoint; raises if the weights are not finite (such a checkpoint is never written) or the write
        fails."""
        with self.learner.apply_lock:  # never while an update is applied (a training thread stuck in a collective)
            if not self.learner.parameters_finite():
                raise ValueError("the weights are not finite")
            return self.writer.save(self._collect(), self.learner.env_steps_trained)

    def try_save(self) -> Path | None:
        """save(), with a failure reported and counted, not raised."""
        try:
            return self.save()
        except Exception as e:
            self.failures += 1
            log.error(
                "checkpoint failed (%d so far; retrying in %g s, training goes on): %s: %s",
                self.failures,
                self.section.checkpoint_retry_interval_s,
                type(e).__name__,
                e,
            )
            return None

    def after_update(self, now: float) -> None:
        """A checkpoint if one is due (training thread); after a failure, the next try comes sooner."""
        interval_s = self.section.checkpoint_interval_s
        if now - self._last < interval_s:
            return
        self._last = now
        if self.try_save() is None:  # retried sooner than the next regular one; training goes on
            self._last = now - interval_s + self.section.checkpoint_retry_interval_s

    def final(self, shutdown_timeout_s: float, attempts: int = 3) -> Path | None:
        for i in range(attempts):
            path = self.try_save()
            if path is not None:
                return path
            if i + 1 < attempts:
                time.sleep(min(1.0, shutdown_timeout_s / 10))
        return None

    def close(self) -> None:
        self.writer.close()
