"""The one check that weights (or any named arrays) are finite, for numpy arrays and torch tensors alike: weights
with a NaN or an infinity are never published, saved or resumed from."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


def nonfinite(named: Iterable[tuple[str, object]]) -> list[str]:
    """The names of the floating-point arrays or tensors that hold a NaN or an infinity (others are skipped)."""
    bad = []
    for name, value in named:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                bad.append(name)
        elif isinstance(value, np.ndarray) and value.dtype.kind == "f" and not bool(np.isfinite(value).all()):
            bad.append(name)
    return bad
