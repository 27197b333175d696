import os

import pytest
import zmq

from impala_async.core.spec import TrajectorySpec

# The Docker image sets these for every command it runs; tests start many learners at once, each with ports of its
# own, so a shared default would make them collide (tests that want a metrics port pass --metrics-port themselves).
for _name in ("IMPALA_ASYNC_METRICS_PORT", "IMPALA_ASYNC_METRICS_HOST"):
    os.environ.pop(_name, None)


@pytest.fixture
def cartpole_spec():
    return TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=5)


@pytest.fixture
def atari_spec():
    return TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=4)


@pytest.fixture(scope="module")
def ctx():
    """A ZeroMQ context for a test module's sockets, destroyed (linger 0) after its last test."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)
