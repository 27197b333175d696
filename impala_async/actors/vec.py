"""An actor's K environments as one batch: ``reset`` once, then ``step(actions [K])`` with episode bookkeeping.

Two backends (``--env-backend``, the learner's ``run.env_backend``; ``auto``, the default, is envpool for Atari ids
where EnvPool is installed, as it steps Pong about 10% faster per actor core here, and gymnasium otherwise):

- ``gymnasium``: K environments from :func:`.envs.make_env`, stepped one after another in this process; every id.
- ``envpool``: Atari ids only (``ALE/<Game>-v5``, ``<Game>NoFrameskip-v4``), as one EnvPool C++ batch
  (``pip install 'impala-async[envpool]'``) with the options that make its preprocessing that of ``make_env``
  (:func:`envpool_settings`; BENCHMARKS.md, "EnvPool" says where it still differs). Any other id (MinAtar,
  CartPole, ...) goes through gymnasium whatever the backend.

Both keep the same contract, which the actor and the wire rely on: after ``step``, ``obs [K, *obs_shape]`` holds each
environment's next observation, the first one of a new episode where one ended (an ended environment is reset at
once, so every step of the batch is a real step of some episode); ``reward``/``terminated``/``truncated [K]`` are the
step's (``truncated`` only where not ``terminated``); ``cut`` pairs each environment a time limit cut with its final
observation (the truncation bootstrap); finished episodes wait in ``episodes`` as ``(return, length in agent steps)``.
"""

from __future__ import annotations

import math
import re

import gymnasium as gym
import numpy as np

from .envs import ATARI_FRAME_SKIP, ATARI_NOOP_MAX, ATARI_STACK, frame_stack_of, is_atari, make_env, set_difficulty

BACKENDS = ("gymnasium", "envpool")
AUTO = "auto"  # envpool for Atari ids if installed, else gymnasium (resolve_backend)
ENVPOOL_MISSING = "--env-backend envpool needs EnvPool: pip install 'impala-async[envpool]'"
INT_MAX = (1 << 31) - 1
ATARI_FRAME_CAP = 108_000  # the ALE's max_num_frames_per_episode for both kinds of Atari id (docs/protocol.md)


class VecEnv:
    """K environments. ``obs [K, *obs_shape]`` (``obs_dtype``) is updated in place by :meth:`reset` and
    :meth:`step`; ``frame_stack`` is S if observations are S frames stacked by :mod:`impala_async.core.frames`'
    rule (oldest first, a new episode's stack repeating its first frame), else 0."""

    backend = ""
    frame_stack = 0
    single_observation_space: gym.Space
    single_action_space: gym.Space

    def __init__(self, num_envs: int, obs_dtype: str | None):
        self.num_envs = num_envs
        self.obs_dtype = obs_dtype or self.single_observation_space.dtype
        self.obs = np.zeros((num_envs, *self.single_observation_space.shape), self.obs_dtype)
        self.ep_return, self.ep_length = np.zeros(num_envs), np.zeros(num_envs, np.int64)
        self.episodes: list[tuple[float, int]] = []
        self.episode_envs: list[int] = []  # the environment each of ``episodes`` ended in
        self.difficulty: float | None = None  # the curriculum's value; an environment takes a new one at its reset

    def pop_episodes(self) -> list[tuple[float, int]]:
        """The ``(return, length)`` of the episodes finished since the last call."""
        return [episode for _, episode in self.pop_episodes_by_env()]

    def pop_episodes_by_env(self) -> list[tuple[int, tuple[float, int]]]:
        """``(environment index, (return, length))`` of the episodes finished since the last call."""
        done = list(zip(self.episode_envs, self.episodes, strict=True))
        self.episodes, self.episode_envs = [], []
        return done

    def _ended(self, k: int) -> None:
        self.episodes.append((float(self.ep_return[k]), int(self.ep_length[k])))
        self.episode_envs.append(k)
        self.ep_return[k], self.ep_length[k] = 0.0, 0

    def set_difficulty(self, value: float | None) -> None:
        """The curriculum's value (None: none); each environment takes it at its next reset."""
        self.difficulty = value

    def reset(self, seeds) -> np.ndarray:
        """First reset of every environment, environment k seeded with ``seeds[k]``; returns ``obs [K, ...]``."""
        raise NotImplementedError

    def step(
        self, actions: np.ndarray, reward: np.ndarray, terminated: np.ndarray, truncated: np.ndarray
    ) -> tuple[list[int], list[tuple[int, np.ndarray]]]:
        """``actions [K]`` -> ``(ended, cut)``: the environments whose episode ended (reset since; ``obs`` holds their
        first observation), and ``(k, final observation)`` of those a time limit cut. Writes the step's
        ``reward``/``terminated``/``truncated [K]`` (any arrays, e.g. strided views into an unroll buffer)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class GymnasiumEnvs(VecEnv):
    """K :func:`make_env` environments stepped in turn; calls the curriculum hook just before each reset."""

    backend = "gymnasium"

    def __init__(self, env_id: str, env_kwargs: dict, num_envs: int, obs_dtype: str | None = None):
        self.envs = [make_env(env_id, **env_kwargs) for _ in range(num_envs)]
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.frame_stack = frame_stack_of(self.envs[0])
        super().__init__(num_envs, obs_dtype)
        self.applied: list[float | None] = [None] * num_envs

    def reset(self, seeds) -> np.ndarray:
        self.applied = [set_difficulty(env, self.difficulty) for env in self.envs]
        self.obs[:] = np.stack([env.reset(seed=int(seeds[k]))[0] for k, env in enumerate(self.envs)]).astype(
            self.obs_dtype
        )
        return self.obs

    def step(self, actions, reward, terminated, truncated):
        cut, ended = [], []
        for k, env in enumerate(self.envs):
            o, r, term, trunc, _ = env.step(int(actions[k]))
            self.ep_return[k] += r
            self.ep_length[k] += 1
            reward[k] = r
            terminated[k] = term
            truncated[k] = trunc and not term
            if term or trunc:
                ended.append(k)
                if not term:
                    cut.append((k, o))
                self._ended(k)
                if self.applied[k] != self.difficulty:
                    self.applied[k] = set_difficulty(env, self.difficulty)
                o, _ = env.reset()
            self.obs[k] = o
        return ended, cut

    def close(self) -> None:
        for env in self.envs:
            env.close()


def envpool_settings(env_id: str, env_kwargs: dict) -> tuple[str, dict]:
    """``(EnvPool task id, options)`` that give ``env_id`` (``ALE/<Game>-v5`` or ``<Game>NoFrameskip-v4``) the
    preprocessing of :func:`.envs.make_env` as far as EnvPool allows: no FIRE at reset (EnvPool presses it by
    default), sticky actions 0.25 for v5 ids (EnvPool's default is 0), 1 to 30 no-ops, 4 frames a step with a max over
    the last two, 84x84 grey by INTER_AREA, 4 frames stacked, no life loss as episode end, no reward clipping. The
    frame cap (``max_num_frames_per_episode``, 108000, and a ``max_episode_steps`` TimeLimit, both counted in emulator
    frames by make_env) becomes ``max_episode_steps`` in agent steps, its quarter rounded up: EnvPool counts steps
    after the no-ops. ``env_kwargs`` may also set ``repeat_action_probability``, ``full_action_space``, ``mode``
    and ``difficulty``; ValueError for anything else, or for another kind of id."""
    v5, v4 = re.fullmatch(r"ALE/(\w+)-v5", env_id), re.fullmatch(r"(\w+)NoFrameskip-v4", env_id)
    if not (v5 or v4):
        raise ValueError(f"--env-backend envpool takes ALE/<Game>-v5 and <Game>NoFrameskip-v4 ids, not {env_id!r}")
    options = dict(
        stack_num=ATARI_STACK,
        frame_skip=ATARI_FRAME_SKIP,
        noop_max=ATARI_NOOP_MAX,
        img_height=84,
        img_width=84,
        gray_scale=True,
        use_inter_area_resize=True,
        use_fire_reset=False,
        episodic_life=False,
        zero_discount_on_life_loss=False,
        reward_clip=False,
        repeat_action_probability=0.25 if v5 else 0.0,
    )
    frames: float = ATARI_FRAME_CAP
    for key, value in env_kwargs.items():
        if key in ("repeat_action_probability", "full_action_space", "mode", "difficulty"):
            if value is not None:
                options[key] = value
        elif key == "max_num_frames_per_episode":
            frames = int(value) or math.inf  # the ALE's 0: no cap
        elif key != "max_episode_steps":
            raise ValueError(
                f"--env-backend envpool: env_kwargs {key!r} has no EnvPool equivalent (it takes "
                f"repeat_action_probability, full_action_space, mode, difficulty, "
                f"max_num_frames_per_episode, max_episode_steps); use --env-backend gymnasium"
            )
    if env_kwargs.get("max_episode_steps"):
        frames = min(frames, int(env_kwargs["max_episode_steps"]))
    steps = math.ceil(frames / ATARI_FRAME_SKIP) if math.isfinite(frames) else INT_MAX
    options["max_episode_steps"] = min(steps, INT_MAX)
    return f"{(v5 or v4).group(1)}-v5", options


def import_envpool():
    """The envpool module; DependencyNotInstalled naming the pip install if it is missing."""
    try:
        import envpool
    except ImportError:
        raise gym.error.DependencyNotInstalled(ENVPOOL_MISSING) from None
    return envpool


class EnvPoolEnvs(VecEnv):
    """An Atari id as one synchronous EnvPool batch (``batch_size = num_envs``, one worker thread: one actor per
    core is the parallelism). EnvPool resets an ended environment on the step after its end, ignoring that step's
    action and returning reward 0; here each ended environment is reset at once, in the same call, so that no step is
    spent (or counted, or sent) on a reset. EnvPool seeds each environment when it builds the batch (its ALE
    ``random_seed``, hence the sticky-action draws, and its no-op generator): ``reset(seeds)`` rebuilds the batch
    unless it was built with those seeds."""

    backend = "envpool"

    def __init__(
        self, env_id: str, env_kwargs: dict, num_envs: int, obs_dtype: str | None = None, seeds=None, **overrides
    ):
        self._envpool = import_envpool()
        self.task_id, self.options = envpool_settings(env_id, env_kwargs)
        self.options.update(overrides)  # tests only (noop_max=1 pins the no-op count)
        self._seeds = self._c_ints(seeds if seeds is not None else range(num_envs))
        self.pool = self._make(num_envs)
        self.single_observation_space = self.pool.observation_space
        self.single_action_space = self.pool.action_space
        self.frame_stack = int(self.options["stack_num"])
        super().__init__(num_envs, obs_dtype)
        self._ids = np.arange(num_envs, dtype=np.int32)

    @staticmethod
    def _c_ints(seeds) -> list[int]:
        return [int(s) & INT_MAX for s in seeds]  # EnvPool's seeds are C ints

    def _make(self, num_envs: int):
        if self.task_id not in self._envpool.list_all_envs():
            raise ValueError(f"EnvPool has no {self.task_id}: use --env-backend gymnasium")
        version = tuple(int(x) for x in re.findall(r"\d+", self._envpool.__version__)[:3])
        # EnvPool takes one seed per environment from 0.9.1 on; before, environment i gets seed + i.
        seed = self._seeds if version >= (0, 9, 1) else self._seeds[0]
        return self._envpool.make_gymnasium(
            self.task_id, num_envs=num_envs, batch_size=num_envs, num_threads=1, seed=seed, **self.options
        )

    def reset(self, seeds) -> np.ndarray:
        if self._c_ints(seeds) != self._seeds:
            self.pool.close()
            self._seeds = self._c_ints(seeds)
            self.pool = self._make(self.num_envs)
        obs, info = self.pool.reset()
        self.obs[np.asarray(info["env_id"])] = obs
        return self.obs

    def step(self, actions, reward, terminated, truncated):
        o, r, _, trunc, info = self.pool.step(np.asarray(actions, np.int32))
        term = np.asarray(info["terminated"], bool)  # the ROM's game over, even on the time limit's last step
        trunc = np.asarray(trunc, bool)
        ids = np.asarray(info["env_id"])
        if not np.array_equal(ids, self._ids):  # a synchronous batch answers in order; never trust it blindly
            order = np.argsort(ids)
            o, r, term, trunc = o[order], r[order], term[order], trunc[order]
        trunc &= ~term
        reward[:] = r
        terminated[:] = term
        truncated[:] = trunc
        self.ep_return += r
        self.ep_length += 1
        ended: list[int] = np.flatnonzero(term | trunc).tolist()
        cut = [(k, o[k].copy()) for k in ended if trunc[k]]
        for k in ended:
            self._ended(k)
        self.obs[:] = o
        if ended:
            first, info = self.pool.reset(np.asarray(ended, np.int32))
            self.obs[np.asarray(info["env_id"])] = first
        return ended, cut

    def close(self) -> None:
        self.pool.close()


def envpool_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("envpool") is not None


def resolve_backend(env_id: str, backend: str) -> str:
    """The backend ``env_id`` runs on when ``backend`` is asked for: envpool for Atari ids only, and for ``auto``
    only where EnvPool is installed."""
    if backend == AUTO:
        backend = "envpool" if is_atari(env_id) and envpool_installed() else "gymnasium"
    if backend not in BACKENDS:
        raise ValueError(f"env backend must be one of {AUTO}, {', '.join(BACKENDS)}, got {backend!r}")
    return "envpool" if backend == "envpool" and is_atari(env_id) else "gymnasium"


def make_vec(
    env_id: str, env_kwargs: dict, num_envs: int, backend: str = "gymnasium", obs_dtype: str | None = None, seeds=None
) -> VecEnv:
    """K environments of ``env_id`` on ``backend`` (:func:`resolve_backend`); call ``reset(seeds)`` before
    stepping (``seeds`` here too spares EnvPool a rebuild). DependencyNotInstalled (one line naming the pip
    install) if the backend's package is missing; ValueError for what EnvPool cannot build."""
    if resolve_backend(env_id, backend) == "envpool":
        return EnvPoolEnvs(env_id, env_kwargs, num_envs, obs_dtype, seeds=seeds)
    return GymnasiumEnvs(env_id, env_kwargs, num_envs, obs_dtype)
