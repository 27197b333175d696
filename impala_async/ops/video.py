"""Videos of evaluation episodes: frames from ``env.render()`` or from image observations, written as MP4 or GIF.

Frames are ``env.render()`` where the environment renders ``rgb_array`` (ALE, CartPole with pygame), else built from
uint8 image observations (:func:`frame_from_obs`), scaled up to at least ``MIN_VIDEO_SIDE`` pixels on the short side.
MP4 goes through imageio's ffmpeg plugin, GIF where ffmpeg is missing.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

VIDEO_EXTRA = "pip install 'impala-async[video]'"
MIN_VIDEO_SIDE = 256  # smaller frames are scaled up by a whole factor (nearest neighbour) to at least this
# Colours of observation planes [C, H, W] that are no frame stack (MinAtar's objects): one per channel, cycled.
PLANE_COLOURS = np.array(
    [
        [230, 25, 75],
        [60, 180, 75],
        [255, 225, 25],
        [0, 130, 200],
        [245, 130, 48],
        [145, 30, 180],
        [70, 240, 240],
        [240, 50, 230],
        [210, 245, 60],
        [250, 190, 212],
    ],
    np.uint8,
)


class VideoError(Exception):
    """A video that cannot be made, reported as one line."""


def upscale(frame: np.ndarray, min_side: int = MIN_VIDEO_SIDE) -> np.ndarray:
    """``[H, W, 3]`` -> ``[kH, kW, 3]`` with the smallest whole ``k`` that makes ``min(kH, kW) >= min_side``."""
    k = max(1, math.ceil(min_side / min(frame.shape[:2])))
    return frame if k == 1 else frame.repeat(k, axis=0).repeat(k, axis=1)


def frame_from_obs(obs: np.ndarray, stacked: bool) -> np.ndarray:
    """An RGB frame ``[H, W, 3]`` uint8 from an image observation: a frame stack ``[S, H, W]`` (``stacked``) shows its
    newest frame in grey; planes of 0 and 1 ``[C, H, W]`` (MinAtar's objects) paint each nonzero cell in its
    channel's colour (``PLANE_COLOURS``), later channels on top; otherwise ``[H, W]`` and ``[1, H, W]`` are grey,
    ``[3, H, W]`` RGB, and other ``[C, H, W]`` are painted as planes."""
    obs = np.asarray(obs)
    if obs.dtype != np.uint8 or obs.ndim not in (2, 3):
        raise VideoError(
            f"observations {obs.dtype} {list(obs.shape)} are no image and the environment renders no "
            f"rgb_array frames: no video"
        )
    planes = obs.ndim == 3 and not stacked and obs.max(initial=0) <= 1
    if not planes and (obs.ndim == 2 or stacked or obs.shape[0] == 1):
        grey = obs if obs.ndim == 2 else obs[-1]
        return np.repeat(grey[:, :, None], 3, axis=2)
    if not planes and obs.shape[0] == 3:
        return np.ascontiguousarray(obs.transpose(1, 2, 0))
    frame = np.zeros((*obs.shape[1:], 3), np.uint8)
    for c, plane in enumerate(obs):
        frame[plane > 0] = PLANE_COLOURS[c % len(PLANE_COLOURS)]
    return frame


def _even(frame: np.ndarray) -> np.ndarray:
    """Pad ``[H, W, 3]`` with black to even sides (H.264 in yuv420p needs them)."""
    h, w = frame.shape[:2]
    return np.pad(frame, ((0, h % 2), (0, w % 2), (0, 0))) if h % 2 or w % 2 else frame


class VideoWriter:
    """Videos of episodes as ``DIR/episode-NNN.mp4`` (ffmpeg) or ``.gif`` (no ffmpeg): :meth:`open` one, then
    :meth:`add` frames ``[H, W, 3]`` uint8 and :meth:`close` it. Raises VideoError without imageio."""

    def __init__(self, directory: str | Path, fps: int, max_frames: int):
        try:
            import imageio.v2 as imageio
        except ImportError:
            raise VideoError(f"--video needs imageio: {VIDEO_EXTRA}") from None
        self.imageio, self.fps, self.max_frames = imageio, fps, max_frames
        try:
            import imageio_ffmpeg

            imageio_ffmpeg.get_ffmpeg_exe()
            self.format = "mp4"
        except (ImportError, RuntimeError):
            self.format = "gif"
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._writer, self.path, self.frames = None, None, 0

    def open(self, episode: int) -> None:
        self.path = self.directory / f"episode-{episode:03d}.{self.format}"
        if self.format == "mp4":
            self._writer = self.imageio.get_writer(
                self.path,
                format="FFMPEG",
                mode="I",
                fps=self.fps,
                codec="libx264",
                macro_block_size=1,
                ffmpeg_log_level="error",
            )
        else:
            self._writer = self.imageio.get_writer(self.path, mode="I", duration=1000 / self.fps, loop=0)
        self.frames = 0

    def add(self, frame: np.ndarray) -> None:
        if self.frames < self.max_frames:
            frame = upscale(np.asarray(frame, np.uint8))
            self._writer.append_data(_even(frame) if self.format == "mp4" else frame)
            self.frames += 1

    def close(self) -> tuple[str, int]:
        self._writer.close()
        self._writer = None
        return str(self.path), self.frames


def render_frame(env, env_id: str) -> np.ndarray:
    try:
        frame = env.render()
    except Exception as e:  # pygame missing (CartPole) and the like
        raise VideoError(
            f"--video: {env_id} cannot render ({type(e).__name__}: {str(e)[:200]}): {VIDEO_EXTRA}"
        ) from None
    if not isinstance(frame, np.ndarray) or frame.ndim != 3 or frame.shape[2] not in (3, 4):
        raise VideoError(f"--video: {env_id}'s render() gave no [H, W, 3] frame")
    return rgb8(frame)


def rgb8(frame: np.ndarray) -> np.ndarray:
    """A rendered frame ``[H, W, 3 or 4]`` as uint8 RGB ``[H, W, 3]``: floats (MinAtar renders float64 in [0, 1])
    scaled to 0..255, alpha dropped."""
    frame = frame[..., :3]
    if frame.dtype == np.uint8:
        return frame
    frame = frame.astype(np.float64)
    if frame.max(initial=0.0) <= 1.0:
        frame = frame * 255.0
    return np.clip(np.rint(frame), 0, 255).astype(np.uint8)
