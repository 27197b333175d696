"""Frame-stacked observations sent as single frames (impala_async.core.frames): rebuilt exactly, from real environments
and from an independent model of gymnasium's FrameStackObservation, and refused where the stacking differs."""

from collections import deque

import numpy as np
import pytest
import torch
from helpers import random_arrays
from hypothesis import given, settings
from hypothesis import strategies as st

from impala_async.actors.envs import frame_stack_of, make_env
from impala_async.config import LearnerConfig
from impala_async.core import frames
from impala_async.core.spec import TrajectorySpec
from impala_async.learner.learn import Learner


def collect(env_ids, T, seed=0, **kwargs):
    """Step one env per id as an actor does (reset after an end): obs [K, T+1, S, H, W], done [K, T]."""
    envs = [make_env(e, **kwargs) for e in env_ids]
    rng = np.random.default_rng(seed)
    obs = np.stack([env.reset(seed=seed + k)[0] for k, env in enumerate(envs)])
    out = np.zeros((len(envs), T + 1, *obs.shape[1:]), np.uint8)
    done = np.zeros((len(envs), T), np.uint8)
    out[:, 0] = obs
    for t in range(T):
        for k, env in enumerate(envs):
            o, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
            if term or trunc:
                done[k, t] = 1
                o, _ = env.reset()
            out[k, t + 1] = o
    for env in envs:
        env.close()
    return out, done


def roundtrip(obs, done):
    S = obs.shape[2]
    packed = frames.pack(obs, done)
    assert packed.shape == (obs.shape[0], obs.shape[1] - 1 + S, *obs.shape[3:])
    d = torch.from_numpy(done)
    return frames.unstack(torch.from_numpy(packed), d, torch.zeros_like(d), S).numpy()


@pytest.mark.parametrize(
    "env_id,kwargs",
    [
        ("impala_async.actors.envs:PongLike-v0", {"points_to_win": 1}),
        ("impala_async.actors.envs:ImageBandit-v0", {}),
    ],
)
def test_real_environments_roundtrip_exactly(env_id, kwargs):
    obs, done = collect([env_id] * 3, T=120, **kwargs)
    assert done.any(), "the unroll should cross an episode end"
    np.testing.assert_array_equal(roundtrip(obs, done), obs)
    assert frame_stack_of(make_env(env_id)) == 4


def test_ale_pong_roundtrips_exactly():
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    obs, done = collect(["ALE/Pong-v5"] * 2, T=50, max_episode_steps=20)  # time limits cut episodes mid-unroll
    assert done.sum() >= 2
    np.testing.assert_array_equal(roundtrip(obs, done), obs)
    assert frame_stack_of(make_env("ALE/Pong-v5")) == 4


def model_frame_stack(pictures, ends, S):
    """An independent model of FrameStackObservation(padding_type="reset"): a deque refilled at each reset."""
    queue, out = deque(maxlen=S), []
    for t, picture in enumerate(pictures):
        if t == 0 or ends[t - 1]:
            queue.extend([picture] * S)
        else:
            queue.append(picture)
        out.append(np.stack(queue))
    return np.stack(out)


@settings(max_examples=200, deadline=None)
@given(T=st.integers(1, 12), S=st.integers(2, 5), data=st.data())
def test_any_episode_pattern_roundtrips(T, S, data):
    ends = data.draw(st.lists(st.booleans(), min_size=T, max_size=T))
    start_mid_episode = data.draw(st.booleans())
    rng = np.random.default_rng(T * 10 + S)
    pictures = rng.integers(0, 256, (T + 1 + S, 3, 2), dtype=np.uint8)
    if start_mid_episode:  # the unroll starts inside an episode: obs[0] holds frames from before it
        full = model_frame_stack(pictures, [False] * S + ends, S)[S:]
    else:
        full = model_frame_stack(pictures[S:], ends, S)
    obs, done = full[None], np.array(ends, np.uint8)[None]
    np.testing.assert_array_equal(roundtrip(obs, done), obs)


@pytest.mark.parametrize("wrong", ["zero_padding", "newest_first"])
def test_other_stackings_are_refused(wrong):
    obs, done = collect(["impala_async.actors.envs:PongLike-v0"] * 2, T=40, points_to_win=1)
    if wrong == "zero_padding":  # FrameStackObservation(padding_type="zero") at episode starts
        obs = obs.copy()
        obs[:, 0, :-1] = 0
    else:
        obs = obs[:, :, ::-1].copy()
    with pytest.raises(ValueError, match="--frame-dedup 0"):
        frames.pack(obs, done)


def test_learner_trains_the_same_on_frames_as_on_stacks():
    """One update from a batch sent as frames equals one from the same batch sent as whole stacks."""
    obs, done = collect(["impala_async.actors.envs:PongLike-v0"] * 4, T=30, points_to_win=1)
    stacks = TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=30)
    single = TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=30, frame_stack=4)
    batch = {k: torch.from_numpy(v) for k, v in random_arrays(stacks, 4, seed=5).items()}
    batch["obs"], batch["terminated"] = torch.from_numpy(obs), torch.from_numpy(done)
    batch["truncated"] = torch.zeros_like(batch["terminated"])
    as_frames = {k: v for k, v in batch.items() if k != "obs"}
    as_frames["frames"] = torch.from_numpy(frames.pack(obs, done))
    stats = []
    for spec, b in ((stacks, batch), (single, as_frames)):
        torch.manual_seed(0)
        stats.append(Learner(LearnerConfig(), spec, torch.device("cpu")).step(b))
    for name in ("loss_pg", "loss_baseline", "entropy", "grad_norm"):
        assert stats[0][name] == stats[1][name], name


def test_spec_with_frames():
    spec = TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=80, frame_stack=4)
    assert spec.fields[0].name == "frames" and spec.fields[0].shape == (84, 84, 84)
    whole = TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=80)
    assert whole.fields[0].nbytes / spec.fields[0].nbytes == pytest.approx(81 * 4 / 84)
    assert TrajectorySpec.from_dict(spec.to_dict()) == spec
    old = {k: v for k, v in whole.to_dict().items() if k != "frame_stack"}  # a peer from before frame_stack
    assert TrajectorySpec.from_dict(old) == whole
    with pytest.raises(ValueError, match="frame_stack"):
        TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=5, frame_stack=4)
    with pytest.raises(ValueError, match="frame_stack"):
        TrajectorySpec(obs_shape=(3, 84, 84), obs_dtype="uint8", num_actions=2, unroll_length=5, frame_stack=4)
