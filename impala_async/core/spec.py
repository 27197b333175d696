"""What one trajectory holds: field names, dtypes and per-trajectory shapes.

Pure: numpy only. The learner sizes its ring buffer from a :class:`TrajectorySpec`, the wire decoder checks every
incoming array against it, and actors fill arrays of exactly these shapes. Shapes are per trajectory; ``T`` is the
unroll length and ``obs`` holds ``T + 1`` observations (the last one bootstraps the value of the unroll's end).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

# How each field's values are checked after decoding (see decoder.TrajectoryDecoder).
CHECK_NONE = "none"  # any bit pattern is valid (uint8 pixels)
CHECK_FINITE = "finite"  # float: no NaN, no +-inf
CHECK_ACTION = "action"  # integer in [0, num_actions)
CHECK_FLAG = "flag"  # 0 or 1

OBS_DTYPES = ("float32", "uint8")


@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: np.dtype  # always little-endian
    shape: tuple[int, ...]  # per trajectory
    check: str

    @cached_property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def wire_dtype(self) -> str:
        """numpy-style dtype string with explicit byte order, as it appears on the wire: '<f4', '|u1', '<i4'."""
        return self.dtype.str


@dataclass(frozen=True)
class TrajectorySpec:
    """Spec of one unroll of ``unroll_length`` steps from one environment.

    Fields (``T`` = unroll_length, ``A`` = num_actions):
        obs               [T+1, *obs_shape]  obs_dtype   x_0 .. x_T
        action            [T]                int32       a_t in [0, A)
        reward            [T]                float32     r_t (unclipped)
        terminated        [T]                uint8       1 if the episode terminated after step t
        truncated         [T]                uint8       1 if the episode was cut by a time limit after step t
        truncation_value  [T]                float32     V_mu(final observation) where truncated, else 0
        behaviour_logits  [T, A]             float32     logits of mu at x_t
    After a terminated or truncated step, ``obs[t+1]`` is the first observation of the next episode.

    With ``frame_stack = S`` (uint8 observations ``[S, H, W]`` that stack consecutive frames), ``obs`` is replaced by
        frames            [T+S, H, W]        uint8       the first stack, then each later observation's newest frame
    from which :func:`impala_async.core.frames.unstack` rebuilds ``obs``.

    With ``core_state_size = H`` (a network with an LSTM core of H units) one more field:
        core_state        [2, H]             float32     (h, c) the core processed x_0 with (after any reset)
    """

    obs_shape: tuple[int, ...]
    obs_dtype: str
    num_actions: int
    unroll_length: int
    frame_stack: int = 0
    core_state_size: int = 0

    def __post_init__(self):
        if self.obs_dtype not in OBS_DTYPES:
            raise ValueError(f"obs_dtype must be one of {OBS_DTYPES}, got {self.obs_dtype!r}")
        if self.num_actions < 2:
            raise ValueError(f"num_actions must be >= 2 (a discrete action space), got {self.num_actions}")
        if self.unroll_length < 1:
            raise ValueError(f"unroll_length must be >= 1, got {self.unroll_length}")
        if any(d < 1 for d in self.obs_shape):
            raise ValueError(f"obs_shape must have positive dimensions, got {self.obs_shape}")
        if self.core_state_size < 0:
            raise ValueError(f"core_state_size must be >= 0, got {self.core_state_size}")
        if self.frame_stack and not (
            self.frame_stack >= 2
            and self.obs_dtype == "uint8"
            and len(self.obs_shape) == 3
            and self.obs_shape[0] == self.frame_stack
        ):
            raise ValueError(
                f"frame_stack={self.frame_stack} needs uint8 observations [frame_stack, H, W] with "
                f"frame_stack >= 2, got {self.obs_dtype} {self.obs_shape}"
            )

    @cached_property
    def fields(self) -> tuple[FieldSpec, ...]:
        T, A = self.unroll_length, self.num_actions
        obs_check = CHECK_FINITE if self.obs_dtype == "float32" else CHECK_NONE
        le = np.dtype(self.obs_dtype).newbyteorder("<")
        S = self.frame_stack
        first = (
            FieldSpec("frames", le, (T + S, *self.obs_shape[1:]), CHECK_NONE)
            if S
            else FieldSpec("obs", le, (T + 1, *self.obs_shape), obs_check)
        )
        return (
            first,
            FieldSpec("action", np.dtype("<i4"), (T,), CHECK_ACTION),
            FieldSpec("reward", np.dtype("<f4"), (T,), CHECK_FINITE),
            FieldSpec("terminated", np.dtype("u1"), (T,), CHECK_FLAG),
            FieldSpec("truncated", np.dtype("u1"), (T,), CHECK_FLAG),
            FieldSpec("truncation_value", np.dtype("<f4"), (T,), CHECK_FINITE),
            FieldSpec("behaviour_logits", np.dtype("<f4"), (T, A), CHECK_FINITE),
        ) + (
            (FieldSpec("core_state", np.dtype("<f4"), (2, self.core_state_size), CHECK_FINITE),)
            if self.core_state_size
            else ()
        )

    @cached_property
    def field_map(self) -> dict[str, FieldSpec]:
        return {f.name: f for f in self.fields}

    @cached_property
    def trajectory_nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    def to_dict(self) -> dict:
        return {
            "obs_shape": list(self.obs_shape),
            "obs_dtype": self.obs_dtype,
            "num_actions": self.num_actions,
            "unroll_length": self.unroll_length,
            "frame_stack": self.frame_stack,
            "core_state_size": self.core_state_size,
        }

    @classmethod
    def from_dict(cls, d: dict) -> TrajectorySpec:
        return cls(
            obs_shape=tuple(int(x) for x in d["obs_shape"]),
            obs_dtype=str(d["obs_dtype"]),
            num_actions=int(d["num_actions"]),
            unroll_length=int(d["unroll_length"]),
            frame_stack=int(d.get("frame_stack", 0)),
            core_state_size=int(d.get("core_state_size", 0)),
        )

    @classmethod
    def from_spaces(
        cls, observation_space, action_space, unroll_length: int, frame_stack: int = 0, core_state_size: int = 0
    ) -> TrajectorySpec:
        """From gymnasium spaces: a Box observation (float or uint8) and a Discrete action space."""
        n = getattr(action_space, "n", None)
        if n is None:
            raise ValueError(f"only Discrete action spaces are supported, got {action_space}")
        dtype = np.dtype(observation_space.dtype)
        obs_dtype = "uint8" if dtype == np.uint8 else "float32"
        return cls(
            obs_shape=tuple(observation_space.shape),
            obs_dtype=obs_dtype,
            num_actions=int(n),
            unroll_length=unroll_length,
            frame_stack=frame_stack,
            core_state_size=core_state_size,
        )
