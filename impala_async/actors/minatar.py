"""MinAtar (Young & Tian 2019): five Atari-like games on a 10x10 grid, as gymnasium environments with uint8 planes.

``make_minatar("MinAtar/Breakout-v1", **kwargs)`` (ids ``MinAtar/<Game>-v0`` with all 6 actions, ``-v1`` with the
game's minimal action set; games Asterix, Breakout, Freeway, Seaquest, SpaceInvaders). It registers the package's ids
(``minatar.gym.register_envs``, which importing ``minatar`` alone does not do) and wraps the environment so that an
observation is ``uint8 [C, 10, 10]``, one plane per object channel, 0 or 1 (the package gives ``bool [10, 10, C]``,
channels last). ``kwargs`` reach ``minatar.Environment``: ``sticky_action_prob`` (0.1 by default, as in the paper) and
``difficulty_ramping`` (True). The games have no time limit; pass ``max_episode_steps`` to add one.

Needs ``pip install "impala-async[minatar]"``.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

GAMES = ("Asterix", "Breakout", "Freeway", "Seaquest", "SpaceInvaders")


def is_minatar(env_id: str) -> bool:
    return env_id.startswith("MinAtar/")


class Planes(gym.ObservationWrapper):
    """``bool [H, W, C]`` -> ``uint8 [C, H, W]`` (0 or 1)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        h, w, c = env.observation_space.shape
        self.observation_space = spaces.Box(0, 1, (c, h, w), np.uint8)

    def observation(self, observation):
        return np.ascontiguousarray(np.asarray(observation, dtype=np.uint8).transpose(2, 0, 1))


def make_minatar(env_id: str, **kwargs) -> gym.Env:
    try:
        import minatar.gym
    except ImportError:
        raise gym.error.DependencyNotInstalled(f"{env_id} needs MinAtar: pip install 'impala-async[minatar]'") from None
    if env_id not in gym.registry:
        minatar.gym.register_envs()
    return Planes(gym.make(env_id, **kwargs))
