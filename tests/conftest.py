import pytest

from impala_async.core.spec import TrajectorySpec


@pytest.fixture
def cartpole_spec():
    return TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=5)


@pytest.fixture
def atari_spec():
    return TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=4)
