"""The checkpoints wing: what the learner writes and what a resume and ``eval`` read back, in one place.

- ``files.py``: atomic checkpoint files (written whole or not at all, the newest ``keep`` kept), the newest good one
  found (a bad one skipped, or set aside as ``NAME.bad`` by a resume), and the learner's state put in one;
- ``safeload.py``: a file no one vouches for loaded at a bounded cost, unable to run code;
- ``statecheck.py``: what a learner checkpoint must hold (every field typed and ranged, weights that fit the network
  its own configuration describes) before anything uses it;
- ``resume.py``: a resume, from the newest good checkpoint to the learner it is restored into.

The learner (assembly.py: :class:`Checkpoints`), its resume (main.py) and ``eval`` (evaluate.py: :func:`read`) use the
API below; nothing else reaches into the files.
"""

from __future__ import annotations

import functools
from pathlib import Path

from .files import (
    Checkpoints,
    CheckpointWriter,
    checkpoint_path,
    learner_state,
    list_checkpoints,
    load_latest,
    put_back,
    remove_partial,
    save,
    set_aside,
    validate_learner_state,
)
from .safeload import check_archive, check_tree, load


def read(path: str | Path, max_bytes: int) -> tuple[dict, Path]:
    """(state, path) of the learner checkpoint at ``path``: the file, or a run directory's newest good one, validated
    as a resume validates it but for the optimizer's state (which only a resume reads). Files that fail are skipped,
    never set aside: a reader leaves the run's directory as it is. ValueError (one line) where none is usable."""
    path = Path(path)
    validate = functools.partial(validate_learner_state, max_bytes=max_bytes, optimizer=False)
    if path.is_dir():
        found = load_latest(path, max_bytes=max_bytes, validate=validate)
        if found is None:
            raise ValueError(f"no usable checkpoint in {path} (see the warnings above)")
        return found
    if not path.exists():
        raise ValueError(f"{path}: no such checkpoint file or run directory")
    try:
        state = load(path, max_bytes)
        validate(state)
    except Exception as e:
        raise ValueError(f"{path} is no usable learner checkpoint: {type(e).__name__}: {str(e)[:300]}") from None
    return state, path


__all__ = [
    "CheckpointWriter",
    "Checkpoints",
    "check_archive",
    "check_tree",
    "checkpoint_path",
    "learner_state",
    "list_checkpoints",
    "load",
    "load_latest",
    "put_back",
    "read",
    "remove_partial",
    "save",
    "set_aside",
    "validate_learner_state",
]
