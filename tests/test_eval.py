"""`impala-async eval`: the real CLI on the checkpoint of a tiny real CartPole run and on one of the image bandit
(uint8 [4, 84, 84] observations), plus the frame and refusal logic in process."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import inprocess
import numpy as np
import pytest
from procutil import cli as start_cli

from impala_async import cli, evaluate
from impala_async.actors.envs import frame_stack_of, make_env
from impala_async.core.models import build_model
from impala_async.core.spec import TrajectorySpec
from impala_async.learner import checkpoint
from impala_async.learner.learn import model_config
from impala_async.ops import video

imageio = pytest.importorskip("imageio.v2", reason="the video tests need imageio: pip install -e '.[video]'")

IMAGE_ENV = "impala_async.actors.envs:ImageBandit-v0"
LEARNER = ["--unroll-length", "10", "--batch-size", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directories: "cartpole" trained for 3000 steps (the learner in this process's loop, a real actor in a
    thread: tests/inprocess.py), and "image", the image bandit's checkpoint in the layout a real run writes: the
    CartPole one with the bandit's configuration, spec and (untrained) network, as the learner builds them (training a
    second run would double this file's time)."""
    root = tmp_path_factory.mktemp("eval-runs")
    flags = ("--total-env-steps", "3000", "--logdir", str(root / "cartpole"))
    cfg, spec = inprocess.configuration(root, *LEARNER, *flags)

    asyncio.run(inprocess.train(cfg, spec))
    state, _ = checkpoint.load_latest(root / "cartpole", validate=checkpoint.validate_learner_state)
    env = make_env(IMAGE_ENV)
    spec = TrajectorySpec.from_spaces(env.observation_space, env.action_space, 10, frame_stack=frame_stack_of(env))
    state["config"]["env"], state["spec"] = IMAGE_ENV, spec.to_dict()
    state["learner"]["model"] = build_model(spec, model_config(evaluate.run_config(state))).state_dict()
    state["learner"]["optimizer"] = {}
    checkpoint.save(root / "image", state, 200)
    return {"cartpole": root / "cartpole", "image": root / "image"}


@pytest.fixture(scope="module")
def evals(runs, tmp_path_factory):
    """name -> (stdout, stderr, exit code) of the eval commands the tests check, run side by side (each one pays for
    importing torch): the same greedy evaluation twice, once filming its first episode and printing JSON, once
    printing lines; and the image bandit filmed."""
    out = tmp_path_factory.mktemp("eval-out")
    greedy = ["--episodes", "3", "--greedy", "1", "--seed", "3"]
    commands = {
        "filmed": [
            "--checkpoint",
            str(checkpoint.list_checkpoints(runs["cartpole"])[-1]),
            *greedy,
            "--json",
            "--video",
            str(out / "cartpole"),
            "--video-episodes",
            "1",
        ],
        "text": ["--checkpoint", str(runs["cartpole"]), *greedy],
        "image": ["--checkpoint", str(runs["image"]), "--episodes", "3", "--json", "--video", str(out / "image")],
    }
    procs = {
        name: start_cli("eval", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, args in commands.items()
    }
    try:
        return {name: (*proc.communicate(timeout=120), proc.returncode) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def stdout(result) -> str:
    out, err, code = result
    assert code == 0, err[-3000:]
    return out


def read_video(path) -> list[np.ndarray]:
    with imageio.get_reader(path) as reader:
        return [np.asarray(f) for f in reader]


@pytest.mark.process
def test_printed_mean_and_std_are_those_of_the_episodes(evals):
    out = stdout(evals["text"])
    episodes = re.findall(r"^episode (\d+)/3: return (\S+), length (\d+) \((terminated|truncated)\)$", out, re.M)
    assert [int(e[0]) for e in episodes] == [1, 2, 3], out
    returns, lengths = np.array([float(e[1]) for e in episodes]), np.array([int(e[2]) for e in episodes])
    summary = re.search(
        r"^CartPole-v1 after 3,000 env steps trained \(checkpoint-0+3000\.pt\), 3 episodes, greedy, "
        r"seed 3: return mean (\S+) std (\S+) \(min (\S+), max (\S+)\); length mean (\S+) std (\S+)$",
        out,
        re.M,
    )
    assert summary, out
    mean, std, low, high, length_mean, length_std = map(float, summary.groups())
    assert mean == pytest.approx(returns.mean(), abs=0.006) and std == pytest.approx(returns.std(), abs=0.006)
    assert (low, high) == (returns.min(), returns.max())
    assert length_mean == pytest.approx(lengths.mean(), abs=0.06)
    assert length_std == pytest.approx(lengths.std(), abs=0.06)
    assert (returns == lengths).all(), "CartPole pays 1 a step"


@pytest.mark.process
def test_greedy_is_deterministic_and_the_video_has_every_frame(evals):
    """The same greedy evaluation twice (once filming its first episode): the same episodes; the MP4 decodes to the
    episode's length + 1 frames of CartPole's 400x600 picture."""
    a = json.loads(stdout(evals["filmed"]))
    text = re.findall(r"^episode \d+/3: return (\S+), length (\d+)", stdout(evals["text"]), re.M)
    assert a["returns"] == [float(r) for r, _ in text] and a["lengths"] == [int(n) for _, n in text], (a, text)
    assert a["greedy"] and a["episodes"] == 3 and a["return_mean"] == pytest.approx(np.mean(a["returns"]))
    assert a["return_std"] == pytest.approx(np.std(a["returns"])) and a["cut"] == 0
    assert a["video_format"] == "mp4" and [v["episode"] for v in a["videos"]] == [0]
    video = a["videos"][0]
    assert video["frames"] == a["lengths"][0] + 1
    assert len(list(Path(video["path"]).parent.iterdir())) == 1
    frames = read_video(video["path"])
    assert len(frames) == a["lengths"][0] + 1
    assert frames[0].shape == (400, 600, 3)
    assert np.abs(frames[0].astype(int) - frames[-1].astype(int)).max() > 100, "the cart and pole never moved"


@pytest.mark.process
def test_image_observations_make_the_frames(evals):
    """The image bandit renders nothing: each frame is the newest observation frame in grey, scaled 4x to 336x336,
    with the bright square on exactly one side."""
    out = json.loads(stdout(evals["image"]))
    assert out["lengths"] == [1, 1, 1] and set(out["returns"]) <= {-1.0, 1.0}
    assert len(out["videos"]) == 3
    for film in out["videos"]:
        frames = read_video(film["path"])
        assert len(frames) == film["frames"] == 2
        for f in frames:
            assert f.shape == (336, 336, 3)
            rows = f[4 * 34 : 4 * 50]  # inside the square's rows (32..52, scaled by 4)
            left, right = rows[:, 4 * 10 : 4 * 22].mean(), rows[:, 4 * 62 : 4 * 74].mean()
            assert sorted([left, right])[0] < 120 < sorted([left, right])[1], (left, right)


def test_a_bad_checkpoint_is_one_line(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as exit:
        cli.main(["eval", "--checkpoint", str(tmp_path / "junk.pt")])
    message = str(exit.value.code)
    assert message.startswith("impala-async eval: ") and "junk.pt" in message and "\n" not in message, message


def test_frames_from_planes_and_stacks():
    planes = np.zeros((4, 10, 10), np.uint8)  # MinAtar-like: object planes of 0 and 1
    planes[0, 2, 3] = planes[3, 7, 7] = planes[1, 7, 7] = 1
    frame = video.frame_from_obs(planes, stacked=False)
    assert frame.shape == (10, 10, 3)
    assert (frame[2, 3] == video.PLANE_COLOURS[0]).all() and (frame[7, 7] == video.PLANE_COLOURS[3]).all()
    assert frame.sum() == video.PLANE_COLOURS[[0, 3]].astype(int).sum()
    big = video.upscale(frame)
    assert big.shape == (260, 260, 3) and (big[2 * 26 : 3 * 26, 3 * 26 : 4 * 26] == video.PLANE_COLOURS[0]).all()
    stack = np.stack([np.full((84, 84), v, np.uint8) for v in (10, 20, 30, 200)])
    assert (video.frame_from_obs(stack, stacked=True) == 200).all()
    assert video.upscale(np.zeros((400, 600, 3), np.uint8)).shape == (400, 600, 3)
    rendered = np.array([[[0.0, 0.5, 1.0, 1.0]]])  # float RGBA in [0, 1], as MinAtar renders
    assert video.rgb8(rendered).tolist() == [[[0, 128, 255]]] and video.rgb8(rendered).dtype == np.uint8
    with pytest.raises(video.VideoError, match="no image"):
        video.frame_from_obs(np.zeros(4, np.float32), stacked=False)


def test_gif_without_ffmpeg_and_one_line_without_imageio(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    writer = video.VideoWriter(tmp_path, fps=10, max_frames=3)
    assert writer.format == "gif"
    writer.open(0)
    for v in range(5):  # two over max_frames: not written
        writer.add(np.full((9, 9, 3), 50 * v, np.uint8))
    path, n = writer.close()
    assert path.endswith("episode-000.gif") and n == 3
    frames = read_video(path)
    assert len(frames) == 3 and frames[0].shape[:2] == (261, 261)  # scaled 29x to at least 256
    assert [int(f[..., :3].mean()) for f in frames] == [0, 50, 100]
    for module in ("imageio", "imageio.v2"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(video.VideoError, match=re.escape("pip install 'impala-async[video]'")):
        video.VideoWriter(tmp_path, fps=10, max_frames=3)


def test_refusals_and_the_step_bound(runs, tmp_path):
    with pytest.raises(evaluate.EvalError, match="no usable checkpoint"):
        evaluate.load_state(tmp_path, 1 << 30)
    with pytest.raises(evaluate.EvalError, match="no such checkpoint"):
        evaluate.load_state(tmp_path / "nothing.pt", 1 << 30)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(evaluate.EvalError, match="no usable learner checkpoint"):
        evaluate.load_state(tmp_path / "junk.pt", 1 << 30)
    with pytest.raises(evaluate.EvalError, match="--episodes must be >= 1"):
        evaluate.evaluate(evaluate.EvalOptions(str(runs["cartpole"]), episodes=0))
    report = evaluate.evaluate(evaluate.EvalOptions(str(runs["cartpole"]), episodes=3, max_episode_steps=5))
    s = report.summary()  # sampled; no CartPole episode ends within 5 steps
    assert not s["greedy"] and s["lengths"] == [5, 5, 5] and s["ends"] == ["max_steps"] * 3 and s["cut"] == 3
    assert s["cut_by"] == {"max_steps": 3, "no_reward": 0}
    assert report.line().endswith("; 3 cut (3 at --max-episode-steps)")
    with pytest.raises(evaluate.EvalError, match="--max-steps-without-reward must be >= 0"):
        evaluate.evaluate(evaluate.EvalOptions(str(runs["cartpole"]), max_steps_without_reward=-1))


class Still:
    """A policy that always takes action 0 (MinAtar Freeway's no-op: the chicken never crosses, never scores)."""

    def reset(self):
        pass

    def act(self, obs):
        return 0


def test_an_episode_without_reward_is_cut_and_counted():
    """Freeway's chicken standing still earns nothing for the game's 2,500 steps: the cap on steps without reward
    ends it, a reward restarts the count (CartPole pays every step: never cut by it), and 0 turns the cap off."""
    pytest.importorskip("minatar", reason="pip install -e '.[minatar]'")
    env = make_env("MinAtar/Freeway-v1")
    caps = evaluate.EvalOptions("unused", max_episode_steps=27_000, max_steps_without_reward=300)
    episode = evaluate.play_episode(env, Still(), caps, seed=0)
    assert (episode.end, episode.length, episode.ret) == ("no_reward", 300, 0.0)
    caps = dataclasses.replace(caps, max_steps_without_reward=0)
    episode = evaluate.play_episode(env, Still(), caps, seed=0)
    assert episode.end == "terminated" and episode.length > 300  # Freeway's own clock ends the game
    cartpole = make_env("CartPole-v1")
    caps = dataclasses.replace(caps, max_steps_without_reward=3)
    assert evaluate.play_episode(cartpole, Still(), caps, seed=0).end == "terminated"  # rewarded every step
    report = evaluate.Report("c.pt", "MinAtar/Freeway-v1", 0, 0, True, 0)
    report.episodes = [evaluate.Episode(0.0, 300, "no_reward"), evaluate.Episode(1.0, 9, "max_steps")]
    report.episodes.append(evaluate.Episode(2.0, 50, "terminated"))
    assert report.summary()["cut_by"] == {"max_steps": 1, "no_reward": 1} and report.summary()["cut"] == 2
    assert report.line().endswith("; 2 cut (1 at --max-episode-steps, 1 at --max-steps-without-reward)")
