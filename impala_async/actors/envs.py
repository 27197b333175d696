"""Environment construction, and a small Pong-like environment with Atari-shaped observations.

``make_env(env_id)`` is what learner and actors both call. Atari ids (``ALE/Pong-v5``, ``PongNoFrameskip-v4``) get
the standard DeepMind preprocessing: 4 emulator frames per step (max over the last two), up to 30 no-op starts,
84x84 greyscale, 4 frames stacked into uint8 ``[4, 84, 84]``; they need ``pip install "impala-async[atari]"``.
MinAtar ids (``MinAtar/Breakout-v1``, ...) give uint8 planes ``[C, 10, 10]`` (:mod:`impala_async.actors.minatar`;
``pip install "impala-async[minatar]"``). Any other id goes to ``gym.make`` as it is.

The Pong-like environment serves the image path without ALE.

``gym.make("impala_async.actors.envs:PongLike-v0")`` imports this module and registers the environment.
Observations are 4 stacked 84x84 greyscale frames (uint8 ``[4, 84, 84]``), the shape of Atari after the usual
preprocessing; 6 actions as in ALE Pong (NOOP, FIRE, UP, DOWN, UPFIRE, DOWNFIRE). The agent moves the right paddle;
a scripted opponent with a speed limit moves the left one. A point is +1 when the ball passes the opponent, -1 when
it passes the agent; a game ends at ``points_to_win`` points for either side.
"""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from .minatar import is_minatar, make_minatar

ATARI_FRAME_SKIP, ATARI_NOOP_MAX, ATARI_STACK = 4, 30, 4


def is_atari(env_id: str) -> bool:
    return env_id.startswith("ALE/") or env_id.endswith("NoFrameskip-v4")


def make_env(env_id: str, **kwargs) -> gym.Env:
    """One environment; Atari ids wrapped as the module docstring says, MinAtar ids as :mod:`.minatar` says."""
    if is_minatar(env_id):
        return make_minatar(env_id, **kwargs)
    if not is_atari(env_id):
        return gym.make(env_id, **kwargs)
    try:
        import ale_py
    except ImportError:
        raise gym.error.DependencyNotInstalled(
            f"{env_id} needs the Arcade Learning Environment: pip install 'impala-async[atari]'"
        ) from None
    import cv2
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    cv2.setNumThreads(1)  # one actor per core is the parallelism; OpenCV's own pool (a thread per core) only contends
    gym.register_envs(ale_py)
    env = gym.make(env_id, frameskip=1, **kwargs)  # the preprocessing skips frames, taking a max over the last two
    env = AtariPreprocessing(
        env,
        noop_max=ATARI_NOOP_MAX,
        frame_skip=ATARI_FRAME_SKIP,
        screen_size=84,
        terminal_on_life_loss=False,
        grayscale_obs=True,
        scale_obs=False,
    )
    return FrameStackObservation(env, ATARI_STACK)


def frame_stack_of(env: gym.Env) -> int:
    """S if ``env``'s observations are its last S frames stacked oldest first, a new episode's stack repeating its
    first frame (what :mod:`impala_async.core.frames` sends as single frames); 0 if not known to be."""
    from gymnasium.wrappers import FrameStackObservation

    while True:
        if isinstance(env, FrameStackObservation):
            return int(env.stack_size) if isinstance(env.padding_type, str) and env.padding_type == "reset" else 0
        if isinstance(env, PongLike | ImageBandit):
            return int(env.observation_space.shape[0])
        if not isinstance(env, gym.Wrapper):
            return 0
        env = env.env


SIZE = 84
PADDLE_H, PADDLE_W, BALL = 12, 2, 2
BACKGROUND, WALL, PADDLE_AGENT, PADDLE_OPP, BALL_COLOUR = 87, 236, 92, 213, 236
TOP, BOTTOM = 6, SIZE - 6  # playfield rows between the walls
AGENT_X, OPP_X = SIZE - 8, 6


class PongLike(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, points_to_win: int = 5, opponent_speed: float = 1.5, max_episode_steps: int = 5000):
        self.observation_space = spaces.Box(0, 255, (4, SIZE, SIZE), np.uint8)
        self.action_space = spaces.Discrete(6)
        self.points_to_win = points_to_win
        self.opponent_speed = opponent_speed
        self.max_episode_steps = max_episode_steps
        self._background = np.full((SIZE, SIZE), BACKGROUND, np.uint8)
        self._background[:TOP] = WALL
        self._background[BOTTOM:] = WALL
        self._frames = np.zeros((4, SIZE, SIZE), np.uint8)

    def _serve(self, direction: float) -> None:
        self.ball = np.array([SIZE / 2, SIZE / 2], np.float64)
        angle = self.np_random.uniform(-0.6, 0.6)
        self.velocity = np.array([np.sin(angle) * 1.5, direction * np.cos(angle) * 1.5])

    def _draw(self) -> np.ndarray:
        f = self._background.copy()
        a, o = int(self.agent_y), int(self.opp_y)
        f[a : a + PADDLE_H, AGENT_X : AGENT_X + PADDLE_W] = PADDLE_AGENT
        f[o : o + PADDLE_H, OPP_X : OPP_X + PADDLE_W] = PADDLE_OPP
        by, bx = int(self.ball[0]), int(self.ball[1])
        f[by : by + BALL, bx : bx + BALL] = BALL_COLOUR
        return f

    def _push(self, frame: np.ndarray) -> np.ndarray:
        self._frames[:-1] = self._frames[1:]
        self._frames[-1] = frame
        return self._frames.copy()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.agent_y = self.opp_y = (TOP + BOTTOM - PADDLE_H) / 2
        self.score = [0, 0]
        self.steps = 0
        self._serve(self.np_random.choice([-1.0, 1.0]))
        frame = self._draw()
        self._frames[:] = frame
        return self._frames.copy(), {}

    def step(self, action):
        move = {2: -2.0, 3: 2.0, 4: -2.0, 5: 2.0}.get(int(action), 0.0)
        self.agent_y = float(np.clip(self.agent_y + move, TOP, BOTTOM - PADDLE_H))
        target = self.ball[0] - PADDLE_H / 2
        self.opp_y = float(
            np.clip(
                self.opp_y + np.clip(target - self.opp_y, -self.opponent_speed, self.opponent_speed),
                TOP,
                BOTTOM - PADDLE_H,
            )
        )
        self.ball += self.velocity
        if self.ball[0] < TOP or self.ball[0] > BOTTOM - BALL:
            self.velocity[0] = -self.velocity[0]
            self.ball[0] = np.clip(self.ball[0], TOP, BOTTOM - BALL)
        reward = 0.0
        for paddle_x, paddle_y, side in ((AGENT_X, self.agent_y, 1.0), (OPP_X, self.opp_y, -1.0)):
            crossing = (side > 0 and self.velocity[1] > 0 and self.ball[1] + BALL >= paddle_x) or (
                side < 0 and self.velocity[1] < 0 and self.ball[1] <= paddle_x + PADDLE_W
            )
            if crossing and paddle_y - BALL <= self.ball[0] <= paddle_y + PADDLE_H:
                offset = (self.ball[0] + BALL / 2 - paddle_y - PADDLE_H / 2) / (PADDLE_H / 2)
                speed = min(3.0, np.hypot(*self.velocity) * 1.05)
                along = np.sqrt(max(0.2, 1 - 0.49 * offset**2))
                self.velocity = np.array([offset * speed * 0.7, -side * speed * along])
        if self.ball[1] < 0:
            reward, self.score[0] = 1.0, self.score[0] + 1
            self._serve(1.0)
        elif self.ball[1] > SIZE - BALL:
            reward, self.score[1] = -1.0, self.score[1] + 1
            self._serve(-1.0)
        self.steps += 1
        terminated = max(self.score) >= self.points_to_win
        truncated = self.steps >= self.max_episode_steps and not terminated
        return self._push(self._draw()), reward, terminated, truncated, {}


class ImageBandit(gym.Env):
    """A diagnostic for the image path: one-step episodes showing a bright square on the left or the right of a uint8
    ``[4, 84, 84]`` picture; action 0 (left) or 1 (right) scores +1 when it names the side, -1 otherwise. Random play
    returns 0 on average; a network that sees its observation, paired with the action taken on it, returns 1."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = spaces.Box(0, 255, (4, SIZE, SIZE), np.uint8)
        self.action_space = spaces.Discrete(2)
        self.side = 0

    def _observe(self) -> np.ndarray:
        obs = np.full((4, SIZE, SIZE), BACKGROUND, np.uint8)
        x = 8 if self.side == 0 else SIZE - 24
        obs[:, 32:52, x : x + 16] = BALL_COLOUR
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.side = int(self.np_random.integers(2))
        return self._observe(), {}

    def step(self, action):
        reward = 1.0 if int(action) == self.side else -1.0
        self.side = int(self.np_random.integers(2))  # the next episode's picture (the actor resets anyway)
        return self._observe(), reward, True, False, {}


def set_difficulty(env: gym.Env, value: float | None) -> float | None:
    """The curriculum's one hook (learner/curriculum.py, docs/protocol.md): calls
    ``env.unwrapped.set_difficulty(value)`` if the environment has that method; nothing for None (no curriculum) or an
    environment without it. The actor calls it just before an environment's reset whenever the learner's value has
    changed, so an episode runs at one difficulty. Returns ``value``."""
    hook = getattr(env.unwrapped, "set_difficulty", None)
    if value is not None and hook is not None:
        hook(float(value))
    return value


class DifficultyProbe(gym.Env):
    """A diagnostic for the curriculum: one-step episodes whose reward is the difficulty in force (the last value
    ``set_difficulty`` gave before the episode's reset; 0 if never set). The observation is that difficulty too;
    actions do nothing. ``episode_return_mean`` in metrics.jsonl then shows what the environments were set to."""

    metadata = {"render_modes": []}

    def __init__(self, build_delay_s: float = 0.0):
        time.sleep(build_delay_s)  # a slow-to-build environment (32 ALE games take ~10 s), for the supervisor's tests
        self.observation_space = spaces.Box(-np.inf, np.inf, (1,), np.float32)
        self.action_space = spaces.Discrete(2)
        self._next = self.difficulty = 0.0

    def set_difficulty(self, value: float) -> None:
        self._next = float(value)  # takes effect at the next reset: an episode runs at one difficulty

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.difficulty = self._next
        return np.array([self.difficulty], np.float32), {}

    def step(self, action):
        return np.array([self.difficulty], np.float32), self.difficulty, True, False, {}


gym.register(id="PongLike-v0", entry_point=PongLike)
gym.register(id="ImageBandit-v0", entry_point=ImageBandit)
gym.register(id="DifficultyProbe-v0", entry_point=DifficultyProbe)
