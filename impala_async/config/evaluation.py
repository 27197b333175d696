"""What ``impala-async eval`` takes: one section, its flags made by :func:`~.fields.add_arguments` like every other
command's, its defaults and checks written once here."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import Section, at_least, need, opt


@dataclass(frozen=True)
class EvalOptions(Section):
    """Playing a checkpoint's policy: which checkpoint, how many episodes, how they are cut, and the videos."""

    NAME = "eval"
    TITLE = "evaluation"
    checkpoint: str = opt("", "a checkpoint file, or a run directory (its newest good checkpoint)")
    episodes: int = opt(10, "episodes to play")
    greedy: int = opt(0, "1: take the most likely action instead of sampling", choices=(0, 1))
    seed: int = opt(0, "seeds the first reset and the sampling")
    max_episode_steps: int = opt(
        27_000, "cut an episode after this many steps, reported as cut (27000: Atari's 108,000 frames, 4 a step)"
    )
    max_steps_without_reward: int = opt(
        5_000, "cut an episode after this many steps in a row with no reward, reported as cut (0: never)"
    )
    video: str = opt("", "write a video per episode into this directory: MP4, or GIF without ffmpeg (pip install "
                     "'impala-async[video]'); empty: none")  # fmt: skip
    video_episodes: int = opt(0, "film only the first K episodes (0: every one)")
    video_max_frames: int = opt(10_000, "frames per video at most; a GIF holds them in memory until written")
    fps: int = opt(30, "video frame rate")
    max_checkpoint_bytes: int = opt(4 << 30, "refuse a checkpoint larger than this (4 GiB)")
    allow_env_module: int = opt(
        0,
        "1: play a checkpoint whose env id is module:Name, importing module (which runs its code); the package's own "
        "test environments need no such permission (0: refused, a checkpoint cannot run code)",
        choices=(0, 1),
    )

    def check(self) -> None:
        super().check()
        need(bool(self.checkpoint), "checkpoint must name a checkpoint file or a run directory")
        at_least(self, 1, "episodes", "max_episode_steps", "video_max_frames", "fps", "max_checkpoint_bytes")
        at_least(self, 0, "video_episodes", "max_steps_without_reward")
