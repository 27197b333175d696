"""Atomic checkpoints: a checkpoint file either exists whole or not at all, and resume trusts none blindly.

Written to a temporary file in the same directory, fsynced, renamed over the final name, and the directory fsynced.
:class:`CheckpointWriter` keeps what a save needs open in advance (the directory and the next temporary file), so a
learner whose peers have taken every file descriptor can still save; a save that fails anyway raises, and the caller
retries later (training goes on).

Loaded by safeload.py (a checkpoint cannot run code, and what loading it costs is bounded before it is parsed), then
validated (:func:`validate_learner_state`, every field typed and ranged); ``load_latest`` falls back to the previous
checkpoint with a warning, setting a bad one aside (``NAME.bad``) when a run resumes.
"""

from __future__ import annotations

import io
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .safeload import load

log = logging.getLogger("impala_async.learner.checkpoint.files")
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
        assert self._next is not None
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
    """Delete temporary files a killed writer left behind. Returns how many held part of a checkpoint: the writer
    opens its next file in advance, so a learner killed between checkpoints leaves an empty one, which is no news."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    stale = [p for p in directory.iterdir() if p.name.startswith(_TMP_PREFIX) and p.name.endswith(_TMP_SUFFIX)]
    partial = 0
    for p in stale:
        try:
            partial += p.lstat().st_size > 0
        except OSError:
            pass
        p.unlink(missing_ok=True)
    return partial


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def load_latest(
    directory: Path,
    max_bytes: int = 4 << 30,
    validate: Callable[[dict], None] | None = None,
    map_location="cpu",
    quarantine: bool = False,
) -> tuple[dict, Path] | None:
    """Newest checkpoint that passes the file checks, loads and ``validate``s (which raises to refuse it); the
    others are skipped with a warning. None if there is none.

    ``quarantine`` (a run about to resume) sets each skipped file aside (:func:`set_aside`): left in place, a bad
    checkpoint would count among the newest ``keep`` and have the resumed run's good ones pruned instead, and the next
    resume would meet it again. A file that does not load (empty, truncated, corrupt) is damaged, whatever the number
    of them: set aside, and the walk goes on. But two whole files in a row that ``validate`` refuses for the same
    reason are no damage: this version or this machine refuses them all (a check a new version added, a field whose
    default changed), and setting each aside would set aside the whole run. Then the first is put back, and
    ValueError names the reason."""
    refused: tuple[Path, Path | None, str] | None = None  # (path, set aside as, reason) of the last whole file refused
    for path in reversed(list_checkpoints(directory)):
        try:
            state = load(path, max_bytes, map_location)
        except Exception as e:  # truncated, corrupt, oversized or not a checkpoint at all: damaged
            log.warning("skipping checkpoint %s (damaged): %s: %s", path, type(e).__name__, str(e)[:300])
            if quarantine:
                set_aside(path)
            continue
        try:
            if validate is not None:
                validate(state)
            return state, path
        except Exception as e:  # malformed or non-finite, or refused by this version: the previous one
            reason = f"{type(e).__name__}: {str(e)[:300]}"
            log.warning("skipping checkpoint %s: %s", path, reason)
            if quarantine and refused is not None and refused[2] == reason:
                if refused[1] is not None:
                    put_back(refused[0])
                raise ValueError(
                    f"checkpoints {refused[0].name} and {path.name} are whole and refused alike ({reason}): this "
                    f"version or this machine refuses them (written by another version?), no damage to either; none "
                    f"set aside"
                ) from None
            damage = getattr(e, "damage", True)  # False: another version's file, refused by this one (statecheck)
            refused = (path, set_aside(path) if quarantine and damage else None, reason)
    return None


def put_back(path: Path) -> None:
    """Undo :func:`set_aside` of ``path`` (a refusal that turned out to be no fault of the file)."""
    path = Path(path)
    bad = path.with_name(path.name + ".bad")
    if os.path.lexists(bad) and not os.path.lexists(path):
        os.rename(bad, path)
        log.warning("put %s back: no damage to it", path.name)


def set_aside(path: Path) -> Path | None:
    """Rename a checkpoint that must not be resumed from to ``NAME.bad`` (never opened: a FIFO is renamed as it is);
    the new path, or None (logged) where the directory does not allow it."""
    bad = Path(path).with_name(Path(path).name + ".bad")
    try:
        os.rename(path, bad)
    except OSError as e:
        log.error("could not set %s aside (it will be met again at the next resume): %s", path, e)
        return None
    log.warning("set it aside as %s", bad.name)
    return bad


def validate_learner_state(state: dict, max_bytes: int = 4 << 30, optimizer: bool = True) -> None:
    """Raise ValueError unless ``state`` holds what a learner checkpoint must (statecheck.py): every field
    typed and ranged, a configuration this version accepts, a network of at most ``max_bytes`` of weights that its
    configuration and spec describe, weights (and with ``optimizer``, optimizer state) that fit it, every float
    tensor finite (a run that resumed from NaN weights would publish them to every actor)."""
    from . import statecheck

    statecheck.validate(state, max_bytes, optimizer=optimizer)


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
        self._failing = 0  # failures since the last checkpoint written
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
        """save(), with a failure counted, not raised, and said once for a run of failures (a full disk fails every
        retry until space returns), then once when a checkpoint is written again."""
        try:
            path = self.save()
        except Exception as e:
            self.failures += 1
            self._failing += 1
            if self._failing == 1:
                log.error(
                    "checkpoint failed (retrying every %g s, training goes on; the newest good one is kept): %s: %s",
                    self.section.checkpoint_retry_interval_s,
                    type(e).__name__,
                    e,
                )
            return None
        if self._failing:
            log.warning("checkpoint written again after %d failed attempt(s): %s", self._failing, path.name)
            self._failing = 0
        return path

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
