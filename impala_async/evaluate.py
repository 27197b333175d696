"""``impala-async eval``: play a learner checkpoint's policy for a few episodes and report its returns.

The environment is built as actors build it (:func:`impala_async.actors.envs.make_env` with the run's ``env`` and
``env_kwargs``) and the network as the learner builds it (:func:`impala_async.learner.learn.model_config` of the
run's :class:`LearnerConfig`, then :func:`impala_async.core.models.build_model`), so any model kind the learner can
train loads here unchanged. The network is called once per step in :meth:`EvalPolicy.act` only (a recurrent core would
keep its state there, reset by :meth:`EvalPolicy.reset`).

Evaluation ends the way Atari evaluations are bounded: an episode is cut after ``max_episode_steps`` steps (27,000
agent steps: the standard 108,000 emulator frames at 4 a step) or after ``max_steps_without_reward`` steps in a row
that brought no reward (a greedy policy can keep Breakout's ball in play forever without hitting a brick); the report
counts the episodes each cap cut.

With ``--video DIR``: one video per episode (the first ``--video-episodes``; impala_async/ops/video.py).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .actors.envs import frame_stack_of, make_env
from .config import EvalOptions, LearnerConfig, from_flat
from .config.sections import OWN_ENV_MODULES, env_module
from .core.models import build_model
from .core.spec import TrajectorySpec
from .learner import checkpoint
from .learner.learn import model_config
from .ops.video import VIDEO_EXTRA, VideoError, VideoWriter, frame_from_obs, render_frame

log = logging.getLogger("impala_async.evaluate")
CAPS = {"max_steps": "--max-episode-steps", "no_reward": "--max-steps-without-reward"}  # Episode.end of a cut: flag


class EvalError(Exception):
    """A refusal, reported as one line."""


@dataclass
class Episode:
    ret: float
    length: int
    end: str  # "terminated", "truncated" (the environment's time limit), or a cap of CAPS: "max_steps", "no_reward"
    video: str = ""
    frames: int = 0


def load_state(path: str | Path, max_bytes: int) -> tuple[dict, Path]:
    """The learner checkpoint at ``path`` (a file, or a run directory's newest good one), as the checkpoints wing reads
    it for a reader (checkpoint.read: validated but for the optimizer's state, bad files skipped, never renamed)."""
    try:
        return checkpoint.read(path, max_bytes)
    except ValueError as e:
        raise EvalError(str(e)) from None


def run_config(state: dict, allow_env_module: int = 0) -> LearnerConfig:
    """The run's LearnerConfig from the checkpoint (fields this version does not know are left out). EvalError for an
    env id ``module:Name`` (whose module gymnasium would import, running its code) unless the module is the package's
    own test environments' or ``allow_env_module`` (--allow-env-module 1) permits it: a checkpoint cannot run code."""
    cfg = from_flat(state["config"], "the checkpoint's configuration", strict=False)
    module = env_module(cfg.env.env)
    if module and module not in OWN_ENV_MODULES and not allow_env_module:
        raise EvalError(
            f"the checkpoint's env id {cfg.env.env!r} would import module {module!r}, running its code: type "
            f"--allow-env-module 1 to allow that"
        )
    return cfg


def build_network(cfg: LearnerConfig, spec: TrajectorySpec, weights: dict) -> torch.nn.Module:
    """The learner's network (built as :class:`impala_async.learner.learn.Learner` builds it) with ``weights``."""
    model = build_model(spec, model_config(cfg).resolved(spec))
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise EvalError(
            f"the checkpoint's weights do not fit the network its configuration describes: {str(e)[:300]}"
        ) from None
    return model.eval()


class EvalPolicy:
    """The checkpoint's policy on one environment: :meth:`reset` at each episode's start, :meth:`act` each step."""

    def __init__(self, model: torch.nn.Module, spec: TrajectorySpec, greedy: bool, rng: np.random.Generator):
        self.model, self.obs_dtype, self.greedy, self.rng = model, spec.obs_dtype, greedy, rng

        self.state: tuple = ()

    def reset(self) -> None:
        """A new episode begins: a network with a recurrent core (one that has ``initial_state(batch_size)``) starts
        from its initial state."""
        initial_state = getattr(self.model, "initial_state", None)
        self.state = initial_state(1) if initial_state is not None else ()

    @torch.inference_mode()
    def act(self, obs: np.ndarray) -> int:
        """``obs [*obs_shape]`` -> the action: argmax of the logits ``[A]`` if greedy, else a sample (Gumbel-max, as
        actors sample). The network sees a batch of one, ``[1, *obs_shape]``; a recurrent one also its state, through
        ``step(obs, state) -> (logits, values, state)``."""
        x = torch.from_numpy(np.asarray(obs, self.obs_dtype)[None])
        if self.state:
            logits, _, self.state = self.model.step(x, self.state)
        else:
            logits, _ = self.model(x)  # [1, A], [1]
        logits = logits[0].double().numpy()
        if self.greedy:
            return int(np.argmax(logits))
        return int(np.argmax(logits - np.log(-np.log(self.rng.random(logits.shape)))))


def make_eval_env(env_id: str, env_kwargs: dict, render: bool):
    """The environment as actors make it; with ``render``, in ``rgb_array`` render mode where it declares one.
    Returns ``(env, renders)``."""
    try:
        env = make_env(env_id, **env_kwargs)
        if not render or "rgb_array" not in (env.metadata.get("render_modes") or ()):
            return env, False
        env.close()
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame (CartPole's renderer) draws off screen
        os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
        return make_env(env_id, render_mode="rgb_array", **env_kwargs), True
    except Exception as e:  # an unknown id, a missing dependency, an argument the environment does not take
        raise EvalError(f"cannot make {env_id} with {env_kwargs}: {type(e).__name__}: {str(e)[:300]}") from None


def play_episode(env, policy: EvalPolicy, caps: EvalOptions, seed: int | None, on_frame=None) -> Episode:
    """One episode, cut by ``caps.max_episode_steps`` and ``caps.max_steps_without_reward`` (0: not by rewards);
    ``on_frame(obs)`` after the reset and after every step."""
    obs, _ = env.reset(seed=seed)
    policy.reset()
    if on_frame:
        on_frame(obs)
    total, steps, last_reward_step = 0.0, 0, 0
    while steps < caps.max_episode_steps:
        obs, reward, terminated, truncated, _ = env.step(policy.act(obs))
        total += float(reward)
        steps += 1
        if reward != 0:
            last_reward_step = steps
        if on_frame:
            on_frame(obs)
        if terminated or truncated:
            return Episode(total, steps, "terminated" if terminated else "truncated")
        if caps.max_steps_without_reward and steps - last_reward_step >= caps.max_steps_without_reward:
            return Episode(total, steps, "no_reward")
    return Episode(total, steps, "max_steps")


@dataclass
class Report:
    checkpoint: str
    env: str
    env_steps_trained: int
    policy_version: int
    greedy: bool
    seed: int
    episodes: list[Episode] = field(default_factory=list)
    video_format: str = ""
    seconds: float = 0.0

    def summary(self) -> dict:
        r = np.array([e.ret for e in self.episodes])
        n = np.array([e.length for e in self.episodes])
        return {
            "checkpoint": self.checkpoint,
            "env": self.env,
            "env_steps_trained": self.env_steps_trained,
            "policy_version": self.policy_version,
            "greedy": self.greedy,
            "seed": self.seed,
            "episodes": len(self.episodes),
            "return_mean": float(r.mean()),
            "return_std": float(r.std()),
            "return_min": float(r.min()),
            "return_max": float(r.max()),
            "length_mean": float(n.mean()),
            "length_std": float(n.std()),
            "returns": r.tolist(),
            "lengths": n.tolist(),
            "ends": [e.end for e in self.episodes],
            "cut": sum(e.end in CAPS for e in self.episodes),
            "cut_by": {end: sum(e.end == end for e in self.episodes) for end in CAPS},
            "video_format": self.video_format or None,
            "videos": [
                {"episode": i, "path": e.video, "frames": e.frames} for i, e in enumerate(self.episodes) if e.video
            ],
            "seconds": round(self.seconds, 3),
        }

    def line(self) -> str:
        s = self.summary()
        mode = "greedy" if self.greedy else "sampled"
        text = (
            f"{self.env} after {self.env_steps_trained:,} env steps trained ({Path(self.checkpoint).name}), "
            f"{s['episodes']} episodes, {mode}, seed {self.seed}: return mean {s['return_mean']:.2f} "
            f"std {s['return_std']:.2f} (min {s['return_min']:g}, max {s['return_max']:g}); "
            f"length mean {s['length_mean']:.1f} std {s['length_std']:.1f}"
        )
        cuts = [f"{n} at {CAPS[end]}" for end, n in s["cut_by"].items() if n]
        if cuts:
            text += f"; {s['cut']} cut ({', '.join(cuts)})"
        return text


def evaluate(opts: EvalOptions, progress=None) -> Report:
    """Play ``opts.episodes`` episodes; ``progress(i, episode)`` after each."""
    try:
        opts.check()
    except ValueError as e:  # "field must ...": said as its flag
        name, _, rest = str(e).partition(" ")
        raise EvalError(f"--{name.replace('_', '-')} {rest}") from None
    state, path = load_state(opts.checkpoint, opts.max_checkpoint_bytes)
    cfg = run_config(state, opts.allow_env_module)
    spec = TrajectorySpec.from_dict(state["spec"])
    model = build_network(cfg, spec, state["learner"]["model"])
    writer = VideoWriter(opts.video, opts.fps, opts.video_max_frames) if opts.video else None
    env, renders = make_eval_env(cfg.env.env, cfg.env.env_kwargs_dict, render=writer is not None)
    try:
        got = TrajectorySpec.from_spaces(env.observation_space, env.action_space, spec.unroll_length)
        if (got.obs_shape, got.obs_dtype, got.num_actions) != (spec.obs_shape, spec.obs_dtype, spec.num_actions):
            raise EvalError(
                f"{cfg.env.env} now has observations {got.obs_dtype} {list(got.obs_shape)} and "
                f"{got.num_actions} actions; the checkpoint was trained on {spec.obs_dtype} "
                f"{list(spec.obs_shape)} and {spec.num_actions}"
            )
        stacked = frame_stack_of(env) > 0
        policy = EvalPolicy(model, spec, bool(opts.greedy), np.random.default_rng(opts.seed))
        report = Report(
            str(path),
            cfg.env.env,
            int(state["learner"]["env_steps_trained"]),
            int(state["policy_version"]),
            bool(opts.greedy),
            opts.seed,
            video_format=writer.format if writer else "",
        )
        recorded = opts.video_episodes or opts.episodes

        def record(obs: np.ndarray) -> None:
            writer.add(render_frame(env, cfg.env.env) if renders else frame_from_obs(obs, stacked))

        t0 = time.monotonic()
        for i in range(opts.episodes):
            filmed = writer is not None and i < recorded
            if filmed:
                writer.open(i)
            try:
                episode = play_episode(env, policy, opts, opts.seed if i == 0 else None, record if filmed else None)
            finally:
                if filmed:
                    video, frames = writer.close()
            if filmed:
                episode.video, episode.frames = video, frames
            report.episodes.append(episode)
            if progress:
                progress(i, episode)
        report.seconds = time.monotonic() - t0
        return report
    finally:
        env.close()


def main(opts: EvalOptions, as_json: bool = False) -> int:
    """The ``eval`` command: per-episode lines and a summary line, or one JSON object with ``as_json``."""

    def progress(i, e):
        video = f", video {e.video} ({e.frames} frames)" if e.video else ""
        print(f"episode {i + 1}/{opts.episodes}: return {e.ret:.6g}, length {e.length} ({e.end}){video}", flush=True)

    try:
        report = evaluate(opts, None if as_json else progress)
    except VideoError as e:
        raise EvalError(str(e)) from None
    if as_json:
        print(json.dumps(report.summary()))
        return 0
    if report.video_format:
        how = "MP4 (ffmpeg)" if report.video_format == "mp4" else f"GIF (ffmpeg not found; {VIDEO_EXTRA} for MP4)"
        print(f"videos: {sum(bool(e.video) for e in report.episodes)} as {how} in {opts.video}")
    print(report.line())
    return 0
