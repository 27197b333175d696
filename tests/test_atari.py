"""Real Atari (ALE Pong) through the standard preprocessing, and through the real CLI on a tiny budget.

Skipped, not failed, where the `atari` extra (ale-py, opencv-python-headless) is not installed; the README's test
command installs it, so CI runs these.
"""

import numpy as np
import pytest
import torch
from procutil import TINY_PONG, cli, finish, read_metrics

from impala_async.learner import checkpoint

pytest.importorskip("ale_py")
pytest.importorskip("cv2")

from impala_async.actors.envs import is_atari, make_env  # noqa: E402
from impala_async.core.spec import TrajectorySpec  # noqa: E402


def test_atari_ids_are_recognised():
    assert is_atari("ALE/Pong-v5") and is_atari("PongNoFrameskip-v4")
    assert not is_atari("CartPole-v1") and not is_atari("impala_async.actors.envs:PongLike-v0")


def test_pong_is_preprocessed_to_stacked_84x84_frames():
    import cv2

    cv2.setNumThreads(4)
    env = make_env("ALE/Pong-v5")
    try:
        assert cv2.getNumThreads() == 1, "each actor process should resize on its own thread only"
        spec = TrajectorySpec.from_spaces(env.observation_space, env.action_space, 20)
        assert spec.obs_shape == (4, 84, 84) and spec.obs_dtype == "uint8" and spec.num_actions == 6
        obs, _ = env.reset(seed=1)
        env.action_space.seed(1)  # the same 60 actions every run: the picture's grey levels depend on them
        assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
        frames = [obs]
        for _ in range(60):  # Pong's ball comes into play after about 60 agent steps of 4 frames
            obs, reward, terminated, truncated, _ = env.step(env.action_space.sample())
            assert not (terminated or truncated)
            frames.append(obs)
        # The stack holds the last 4 frames, oldest first: each step shifts it by one.
        np.testing.assert_array_equal(frames[-1][:3], frames[-2][1:])
        # Real pictures: a background with a score, paddles and walls, not a blank or noise.
        latest = frames[-1][-1]
        assert 3 <= len(np.unique(latest)) <= 32, np.unique(latest)
        assert not np.array_equal(frames[-1][-1], frames[-30][-1]), "the picture never changed"
    finally:
        env.close()


@pytest.mark.process
def test_train_pong_end_to_end(tmp_path):
    """`impala-async train --env ALE/Pong-v5` on a tiny budget: the CNN trains on real ALE frames and exits 0."""
    logdir, log = tmp_path / "run", tmp_path / "log"
    proc = cli("train", *TINY_PONG, "--logdir", str(logdir), log=log)
    finish(proc, log, 180)
    rows = read_metrics(logdir)
    last = rows[-1]
    assert last["env_steps_trained"] >= 400 and last["learner_steps"] >= 10
    assert last["trajectories_rejected"] == 0
    # The final report may cover an interval with no update (its statistics are None by design).
    trained = [r for r in rows if r["loss_pg"] is not None]
    assert trained and all(np.isfinite(r["loss_pg"]) and np.isfinite(r["grad_norm"]) for r in trained)
    state = torch.load(checkpoint.list_checkpoints(logdir)[-1], weights_only=True)
    assert state["spec"]["frame_stack"] == 4, "Atari frames should travel one at a time (--frame-dedup 1)"
