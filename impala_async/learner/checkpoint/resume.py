"""A resume's checkpoint, from loading to the first publish: whatever fails is set aside (``NAME.bad``) and the previous
good checkpoint tried instead, so that no restart meets the same bad file again.

:func:`load_newest` (``configure`` in learner/main.py) takes the newest checkpoint that passes the file checks and
validation (files.load_latest: every field typed and ranged, weights that fit the network the checkpoint's own
configuration describes); those that fail are set aside on the way. What can still fail is restoring it into the
learner this run builds (:func:`restore`, from ``_serve``): its spec against the one the environment gives, its
weights and optimizer state into the network this run's configuration describes. A failure there while every field
that shapes the spec, the network and the optimizer (``SHAPING``) has the checkpoint's own value is the file's: it is
set aside and the previous good checkpoint restored instead, until one fits. A failure where this run's flags or
--config changed one of those fields is the run's: refused in one line, the file left alone. So is a spec that the
previous checkpoint records too: the environment changed, not the files (the first is put back). With learner ranks,
which all took the same state already, the file is set aside and the run stops: the next start takes the previous.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path

from ...config import LearnerConfig, from_flat
from . import files

log = logging.getLogger("impala_async.learner.resume")
RESUMED_FROM = "resumed_from"  # key of a resumed state: the path of the checkpoint it was loaded from
# Fields that decide the trajectory spec, the network and the optimizer's state: a run that changes one cannot take
# the checkpoint's state, through no fault of the file.
SHAPING = (
    "env",
    "env_kwargs",
    "env_backend",
    "unroll_length",
    "model",
    "hidden_sizes",
    "activation",
    "use_lstm",
    "lstm_size",
    "obs_norm",
    "value_fc",
    "optimizer",
)


def load_newest(directory: str | Path, max_bytes: int) -> tuple[dict, Path] | None:
    """The newest checkpoint in ``directory`` that loads and validates (the others set aside), as (state, path), with
    the path also under ``RESUMED_FROM`` in the state; None if there is none."""
    found = files.load_latest(
        Path(directory),
        max_bytes=max_bytes,
        validate=functools.partial(files.validate_learner_state, max_bytes=max_bytes),
        quarantine=True,
    )
    if found is not None:
        found[0][RESUMED_FROM] = str(found[1])
    return found


def restore(build: Callable, cfg: LearnerConfig, spec, resumed: dict | None, bad_checkpoint: Callable | None = None):
    """(the learner ``build()`` gives with the resumed state restored into it, the state restored: ``resumed`` or a
    previous good checkpoint's). SystemExit (one line) where no checkpoint fits (module docstring).
    ``bad_checkpoint(path, reason)``: what this learner's rank does with a checkpoint that failed to restore (the
    rank's own, learner/ranks/group.py: a learner of one sets it aside and looks for the previous; learner ranks,
    which all took it already, set it aside on rank 0 and stop); by default, set it aside."""
    failed = None  # (path, spec) of the checkpoint just set aside for a spec this environment does not give
    while True:
        learner = build()  # a fresh network and optimizer each time: a failed restore may have half-loaded one
        if resumed is None:
            return learner, None
        if failed is not None and resumed["spec"] == failed[1]:  # refused alike: the environment's doing
            files.put_back(Path(failed[0]))
            raise SystemExit(
                f"impala-async: {resumed.get(RESUMED_FROM)} and {failed[0]} record the trajectory spec {failed[1]}, "
                f"which this run's environment does not give ({spec.to_dict()}): the environment changed, not the "
                f"files (none set aside); resume where it gives that spec"
            )
        try:
            restore_into(learner, spec, resumed)
            return learner, resumed
        except Exception as e:
            failed = (resumed.get(RESUMED_FROM, ""), resumed["spec"]) if isinstance(e, SpecMismatch) else None
            resumed = _after_failure(cfg, resumed, e, bad_checkpoint or set_aside)


class SpecMismatch(ValueError):
    """The checkpoint's trajectory spec is not the one this run's environment gives."""


def restore_into(learner, spec, resumed: dict) -> None:
    """Load a checkpoint's learner state into ``learner``; SpecMismatch where its spec (how frames travel aside) is
    not ``spec``, whatever torch raises where its state does not load."""
    from ...core.spec import TrajectorySpec

    saved = TrajectorySpec.from_dict(resumed["spec"])
    if dataclasses.replace(saved, frame_stack=0) != dataclasses.replace(spec, frame_stack=0):
        raise SpecMismatch(f"the checkpoint's trajectory spec {resumed['spec']} is not this run's {spec.to_dict()}")
    learner.load_state_dict(resumed["learner"])
    log.info("resumed at %d env steps, policy version %d", learner.env_steps_trained, resumed["policy_version"])


def changed(cfg: LearnerConfig, saved: dict) -> list[str]:
    """The fields of ``SHAPING`` whose value in ``cfg`` is not the one the checkpoint's configuration ``saved`` has."""
    before = from_flat(saved, "the checkpoint's configuration", strict=False).flat()
    now = cfg.flat()
    return [name for name in SHAPING if now[name] != before[name]]


def set_aside(path: str, reason: str = "") -> None:
    """A checkpoint that failed to restore (``reason``) set aside as ``NAME.bad``; nothing for an empty path."""
    if path:
        files.set_aside(Path(path))


def _after_failure(cfg: LearnerConfig, resumed: dict, error: Exception, bad_checkpoint: Callable) -> dict:
    """The state to try next after ``resumed`` failed to restore with ``error``; SystemExit where there is none."""
    path = resumed.get(RESUMED_FROM, "")
    reason = f"{type(error).__name__}: {str(error)[:300]}"
    differ = changed(cfg, resumed["config"])
    if differ:
        raise SystemExit(
            f"impala-async: checkpoint {path} does not fit this run ({reason}); this run changed "
            f"{', '.join(differ)}: resume with the checkpoint's values"
        )
    log.warning("checkpoint %s failed to restore: %s", path, reason)
    bad_checkpoint(path, reason)
    directory = Path(path).parent if path else Path(cfg.run.logdir)
    try:
        found = load_newest(directory, cfg.checkpoints.max_checkpoint_bytes)
    except ValueError as e:  # the previous ones refused alike: not set aside
        raise SystemExit(f"impala-async: {e}") from None
    if found is None:
        raise SystemExit(f"impala-async: no usable checkpoint left in {directory} (the bad ones are set aside as .bad)")
    log.warning("resuming from the previous good checkpoint, %s", found[1])
    return found[0]
