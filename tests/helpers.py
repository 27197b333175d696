"""Test helpers shared by several test files."""

import numpy as np

from impala_async.core import wire
from impala_async.core.spec import CHECK_ACTION, CHECK_FINITE, CHECK_FLAG, TrajectorySpec

# The decoder fuzzing of tests/test_fuzz.py and tools/fuzz_decoder.py: a vector-observation spec (float obs, checked
# for finiteness) and a small image spec (uint8 obs, any byte valid), under small limits.
FUZZ_SPECS = {
    "vector": TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=3, unroll_length=5),
    "image": TrajectorySpec(obs_shape=(2, 3, 3), obs_dtype="uint8", num_actions=6, unroll_length=4),
}
FUZZ_LIMITS = wire.WireLimits(
    max_message_bytes=1 << 20, max_trajectories_per_message=8, max_episodes_per_message=16, max_actor_id_bytes=64
)


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


def assert_values_allowed(spec: TrajectorySpec, dest: dict[str, np.ndarray]) -> None:
    """Decoded arrays hold only what the spec allows: floats finite, actions in range, flags 0 or 1."""
    for f in spec.fields:
        a = dest[f.name]
        if f.check == CHECK_FINITE:
            assert np.isfinite(a).all(), f.name
        elif f.check == CHECK_ACTION:
            assert ((a >= 0) & (a < spec.num_actions)).all(), f.name
        elif f.check == CHECK_FLAG:
            assert np.isin(a, (0, 1)).all(), f.name


# The curriculum test's run (tests/test_curriculum.py; tools/curriculum_lag.py measures the same run): one actor of 4
# one-step environments whose reward is the difficulty, a linear ramp over CURRICULUM_ENV_STEPS env steps trained
# (one episode each).
CURRICULUM_ENV_STEPS = 20_000
CURRICULUM_FLAGS = (
    "--env",
    "impala_async.actors.envs:DifficultyProbe-v0",
    "--num-actors",
    "1",
    "--envs-per-actor",
    "4",
    "--unroll-length",
    "5",
    "--batch-size",
    "4",
    "--report-interval-s",
    "0.1",
    "--curriculum",
    "linear",
    "--curriculum-start",
    "0.5",
    "--curriculum-end",
    "2.0",
    "--curriculum-env-steps",
    str(CURRICULUM_ENV_STEPS),
)


def tool(name: str):
    """A script of tools/ imported as a module (tools/ is no package), for tests of its pure parts."""
    import importlib.util
    import sys
    from pathlib import Path

    tools = Path(__file__).resolve().parent.parent / "tools"
    if str(tools) not in sys.path:
        sys.path.append(str(tools))  # as where the script runs: its own folder first on the path, for its imports
    path = tools / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module
