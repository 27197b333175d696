"""Frame-stacked observations sent as single frames: 4x less to decompress, hold in the ring and copy to the GPU.

Pure numpy and torch. An unroll's observations ``obs [T+1, S, H, W]`` (``S`` frames stacked oldest first, as
gymnasium's ``FrameStackObservation`` with its default ``padding_type="reset"`` makes them) travel as
``frames [T+S, H, W]``: the whole first stack, then the newest frame of each later observation::

    frames[0:S]     = obs[0]
    frames[S-1+t]   = obs[t][S-1]          t = 1..T

The learner rebuilds every stack from ``frames`` and the episode ends (``done[t] = terminated[t] | truncated[t]``:
``obs[t+1]`` is then the first observation of a new episode, whose stack repeats its one frame ``S`` times)::

    obs[t][k] = frames[max(t + k, S-1 + e(t))]      e(t): the last step <= t at which an episode began, else -S

``pack`` checks, step by step, that an unroll really has this structure, so an environment that stacks
differently is refused by the actor rather than trained on wrong pictures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pack is numpy only: processes that never unstack (synthetic actors) skip importing torch
    import torch


def pack(obs: np.ndarray, done: np.ndarray) -> np.ndarray:
    """``obs [K, T+1, S, H, W]`` and ``done [K, T]`` -> ``frames [K, T+S, H, W]``.

    Raises ValueError if ``obs`` cannot be rebuilt from those frames (the environment stacks some other way). The check
    is the rebuild rule step by step: a continuing stack is the previous one shifted by one frame; a new episode's stack
    repeats one frame."""
    K, T1, S = obs.shape[:3]
    frames = np.empty((K, T1 - 1 + S, *obs.shape[3:]), obs.dtype)
    frames[:, :S] = obs[:, 0]
    frames[:, S:] = obs[:, 1:, S - 1]
    ended = done.astype(bool)
    for t in range(1, T1):
        began = ended[:, t - 1]
        if not began.any():
            ok = np.array_equal(obs[:, t, :-1], obs[:, t - 1, 1:])
        else:
            ok = np.array_equal(obs[~began, t, :-1], obs[~began, t - 1, 1:]) and bool(
                (obs[began, t, :-1] == obs[began, t, -1:]).all()
            )
        if not ok:
            raise ValueError(
                f"observation {t} of an unroll is not a stack of the frames before it (oldest first, a new "
                f"episode's stack repeating its first frame): start the learner with --frame-dedup 0 for this "
                f"environment"
            )
    return frames


def unstack(frames: torch.Tensor, terminated: torch.Tensor, truncated: torch.Tensor, S: int) -> torch.Tensor:
    """``frames [B, T+S, H, W]``, ``terminated``/``truncated [B, T]`` -> ``obs [B, T+1, S, H, W]`` on their device."""
    import torch

    B, TS = frames.shape[:2]
    T = TS - S
    done = (terminated != 0) | (truncated != 0)
    t = torch.arange(1, T + 1, device=frames.device)
    began = torch.where(done, t, torch.full_like(t, -S))
    first = torch.full((B, 1), -S, dtype=began.dtype, device=frames.device)
    e = torch.cummax(torch.cat([first, began], dim=1), dim=1).values  # [B, T+1]
    raw = torch.arange(T + 1, device=frames.device)[:, None] + torch.arange(S, device=frames.device)[None, :]
    idx = torch.maximum(raw[None], (S - 1 + e)[..., None])  # [B, T+1, S]
    return frames[torch.arange(B, device=frames.device)[:, None, None], idx]
