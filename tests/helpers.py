"""Test helpers shared by several test files."""

import numpy as np

from impala_async.spec import TrajectorySpec


def random_arrays(spec: TrajectorySpec, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Valid trajectories: ``[n, *field.shape]`` per field."""
    rng = np.random.default_rng(seed)
    T, A = spec.unroll_length, spec.num_actions
    if spec.obs_dtype == "uint8":
        obs = rng.integers(0, 256, (n, T + 1, *spec.obs_shape), dtype=np.uint8)
    else:
        obs = rng.normal(size=(n, T + 1, *spec.obs_shape)).astype(np.float32)
    terminated = (rng.random((n, T)) < 0.2).astype(np.uint8)
    truncated = ((rng.random((n, T)) < 0.1) & (terminated == 0)).astype(np.uint8)
    first = {"obs": obs}
    if spec.frame_stack:  # any frames are valid: every stack is rebuilt from them
        S = spec.frame_stack
        first = {"frames": rng.integers(0, 256, (n, T + S, *spec.obs_shape[1:]), dtype=np.uint8)}
    return {
        **first,
        "action": rng.integers(0, A, (n, T)).astype(np.int32),
        "reward": rng.normal(size=(n, T)).astype(np.float32),
        "terminated": terminated,
        "truncated": truncated,
        "truncation_value": (truncated * rng.normal(size=(n, T))).astype(np.float32),
        "behaviour_logits": rng.normal(size=(n, T, A)).astype(np.float32),
    }
