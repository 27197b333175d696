"""What an actor builds from a learner's run (the ``run`` of a weights message): the policy, the environments, the
unroll buffers, the codecs, the recurrent state. :func:`build_run` makes a :class:`Run`; :func:`run_changes` says
how two runs differ (docs/protocol.md, "Learner restarts"). No sockets here."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..config.actors import ActorConfig
from ..core import codecs, wire
from .procs import Heartbeat
from .rollout import Policy
from .vec import AUTO, BACKENDS, VecEnv, make_vec

log = logging.getLogger("impala_async.actors.runs")

# What an actor acts by in a weights message's ``run`` (docs/protocol.md, "Learner restarts"): a new incarnation that
# differs in any of these is another run. trajectory_addresses is followed as it changes (endpoints.py); protocol and
# max_message_bytes change nothing here.
RUN_KEYS = (
    "env_id",
    "env_kwargs",
    "env_backend",
    "spec",
    "model",
    "obs_codec",
    "jpeg_quality",
    "max_trajectories_per_message",
)


def image_codec(run_info: dict, codec: str) -> tuple[str, int]:
    """``(codec, JPEG quality)`` for the image field: jpeg at ``run.jpeg_quality`` where the learner's ``run.obs_codec``
    asks for it, else this actor's own ``codec`` (lz4, an absent or unknown value included: the learner accepts lz4
    from any actor). ImportError, one line naming the ``pip install``, if jpeg is asked for and simplejpeg missing."""
    if run_info.get("obs_codec") != wire.CODEC_JPEG:
        return codec, codecs.DEFAULT_QUALITY
    codecs.jpeg_module()
    return wire.CODEC_JPEG, int(run_info.get("jpeg_quality", codecs.DEFAULT_QUALITY))


class RunError(Exception):
    """A learner's run this actor cannot act in; the message is one line naming what and why."""


@dataclass(eq=False)
class Run:
    """Everything an actor builds from one learner run (the ``run`` of a weights message, ``info``) and its
    ActorConfig: the policy (network and spec), the environments, the unroll buffers, the codecs and the per-message
    cap, the recurrent state and the action sampler. :func:`build_run` makes one; a new run replaces it whole."""

    info: dict
    policy: Policy
    envs: VecEnv
    images: str  # the image field's codec, and its JPEG quality
    quality: int
    per_message: int  # trajectories per message (the learner's run.max_trajectories_per_message)
    buf: dict  # the trajectory fields, [K, T, ...]
    obs_buf: np.ndarray  # observations [K, T+1, *obs_shape]; with frame_stack packed into buf["frames"] to send
    state: tuple  # the recurrent state, carried across unrolls; reset where an episode begins
    rng: np.random.Generator  # action sampling
    closed: bool = False  # its environments closed, or handed on to the next run

    @property
    def spec(self):
        return self.policy.spec

    def release_envs(self) -> VecEnv:
        """The environments, handed on to the next run (this one no longer closes them)."""
        self.closed = True
        return self.envs

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.envs.close()


def build_run(cfg: ActorConfig, msg: wire.WeightsMessage, beat=None, envs: VecEnv | None = None) -> Run:
    """The :class:`Run` of ``msg``'s learner run, its policy loaded with ``msg``'s weights, its environments reset
    (seeded as a fresh actor process's would be). ``envs``: environments to keep (the same id, kwargs, backend and
    observation dtype), else they are built. RunError, one line, if this actor cannot act in that run (then the
    environments, kept or built, are closed)."""
    beat = beat or Heartbeat(-1, 0.0)
    info, K = msg.run_info, cfg.options.envs_per_actor
    try:
        policy = _build_policy(msg, cfg.options.device)
        per_message = _per_message(info, K, policy.spec.unroll_length)
        images, quality = _images(info, cfg.options.codec)
    except RunError:
        if envs is not None:
            envs.close()
        raise
    seeds = np.random.SeedSequence([cfg.seed, cfg.index]).generate_state(K + 1)
    if envs is None:
        beat.grace()  # building K environments can take longer than heartbeat_timeout_s (32 ALE games: about 10 s)
        envs = _build_envs(cfg, info, K, policy.spec.obs_dtype, seeds[:K])
    try:
        _start_envs(envs, info, policy.spec, msg.difficulty, seeds[:K])
    except RunError:
        envs.close()
        raise
    beat()
    spec, T = policy.spec, policy.spec.unroll_length
    buf = {f.name: np.zeros((K, *f.shape), f.dtype) for f in spec.fields}
    obs_buf = np.zeros((K, T + 1, *spec.obs_shape), spec.obs_dtype) if spec.frame_stack else buf["obs"]
    return Run(
        info,
        policy,
        envs,
        images,
        quality,
        per_message,
        buf,
        obs_buf,
        policy.initial_state(K),
        np.random.default_rng(seeds[K]),
    )


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _one_line(e: BaseException, max_chars: int = 300) -> str:
    return _cut(" ".join(f"{type(e).__name__}: {e}".split()), max_chars)


def _short(value, max_chars: int = 60) -> str:
    return _cut(repr(value), max_chars)


def _build_policy(msg: wire.WeightsMessage, device: str) -> Policy:
    """The policy of ``msg``'s run.spec and run.model, loaded with its weights; RunError if it cannot be built."""
    try:
        return Policy(msg, device)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, OverflowError, MemoryError) as e:
        model = msg.run_info.get("model")
        raise RunError(f"cannot build the network of run.model {_short(model)}: {_one_line(e)}") from None


def _per_message(info: dict, K: int, T: int) -> int:
    """Trajectories per message: the learner's cap (absent or 0: none, all K in one), and few enough that the episodes
    their T steps each can end stay within run.max_episodes_per_message (a message may claim no more)."""
    cap = info.get("max_trajectories_per_message", K)
    if type(cap) is not int or cap < 0:
        raise RunError(f"run.max_trajectories_per_message is {_short(cap)}, not an integer >= 0")
    most = info.get("max_episodes_per_message", wire.WireLimits.max_episodes_per_message)
    if type(most) is not int or most < T:
        raise RunError(
            f"run.max_episodes_per_message is {_short(most)}: one trajectory of {T} steps may end more episodes"
        )
    return min(cap or K, most // T)


def check_actor_id(info: dict, actor_id: str) -> None:
    """RunError unless ``actor_id`` fits the learner's run.max_actor_id_bytes (absent: the default, 64)."""
    most = info.get("max_actor_id_bytes", wire.WireLimits.max_actor_id_bytes)
    if type(most) is not int or len(actor_id.encode()) > most:
        raise RunError(f"actor id {actor_id!r} is longer than run.max_actor_id_bytes {_short(most)}")


def _images(info: dict, codec: str) -> tuple[str, int]:
    try:
        return image_codec(info, codec)
    except ImportError as e:
        raise RunError(f"the learner asks for JPEG images (run.obs_codec): {e}") from None
    except (TypeError, ValueError) as e:
        raise RunError(f"run.jpeg_quality {_short(info.get('jpeg_quality'))}: {_one_line(e)}") from None


def _start_envs(envs: VecEnv, info: dict, spec, difficulty: float | None, seeds) -> None:
    """Check that ``envs`` give what the learner's spec says, then reset them all: every episode starts afresh
    (episode counts and returns too), seeded with ``seeds``; the curriculum's ``difficulty`` taken at that reset."""
    shape, n = tuple(envs.single_observation_space.shape), getattr(envs.single_action_space, "n", None)
    if shape != tuple(spec.obs_shape) or n is None or int(n) != spec.num_actions:
        raise RunError(
            f"{info.get('env_id')} here gives observations {list(shape)} and {n} actions; the learner's run.spec "
            f"says {list(spec.obs_shape)} and {spec.num_actions} (other versions of the environment's package?)"
        )
    envs.pop_episodes()  # kept environments: episodes of the previous run end here, uncounted
    envs.ep_return[:], envs.ep_length[:] = 0.0, 0
    envs.set_difficulty(difficulty)  # the curriculum's value (None: none); each env takes it at its reset
    try:
        envs.reset(seeds)
    except Exception as e:  # noqa: BLE001 (the environment's own code, with the learner's env_kwargs)
        raise RunError(f"cannot reset {info.get('env_id')}: {_one_line(e)}") from None


def _env_backend(cfg: ActorConfig, run_info: dict) -> tuple[str, str]:
    """``(backend, who asked for it)``: ``cfg.env_backend``, else the learner's ``run.env_backend`` (informational:
    an unknown one is gymnasium, with a warning)."""
    if cfg.env_backend:
        return cfg.env_backend, "--env-backend"
    backend = str(run_info.get("env_backend") or "gymnasium")
    if backend not in (AUTO, *BACKENDS):
        log.warning("actor %d: unknown env backend %s from the learner: using gymnasium", cfg.index, _short(backend))
        backend = "gymnasium"
    return backend, "the learner's run.env_backend"


def _build_envs(cfg: ActorConfig, run_info: dict, K: int, obs_dtype: str, seeds) -> VecEnv:
    """The actor's K environments on its backend (:func:`_env_backend`); where the learner's backend cannot be used
    here (EnvPool not installed), gymnasium, with a warning. RunError if they cannot be built."""
    backend, asked = _env_backend(cfg, run_info)
    env_id, env_kwargs = run_info.get("env_id"), run_info.get("env_kwargs", {})
    if type(env_id) is not str or type(env_kwargs) is not dict:
        raise RunError(f"run.env_id {_short(env_id)} and run.env_kwargs {_short(env_kwargs)}: not a string and a map")
    try:
        return make_vec(env_id, env_kwargs, K, backend, obs_dtype, seeds=seeds)
    except Exception as e:  # noqa: BLE001 (gym.make runs the id's own code: whatever fails, it cannot be built here)
        if cfg.env_backend or backend == "gymnasium":
            raise RunError(f"cannot build {env_id} ({asked}): {_one_line(e)}") from None
        log.warning("actor %d: %s (%s asks for envpool): using gymnasium", cfg.index, e, asked)
    try:
        return make_vec(env_id, env_kwargs, K, "gymnasium", obs_dtype)
    except Exception as e:  # noqa: BLE001 (as above)
        raise RunError(f"cannot build {env_id}: {_one_line(e)}") from None


def _make_envs(cfg: ActorConfig, run_info: dict, K: int, obs_dtype: str, seeds) -> VecEnv | None:
    """:func:`_build_envs`, or None with the reason logged."""
    try:
        return _build_envs(cfg, run_info, K, obs_dtype, seeds)
    except RunError as e:
        log.error("actor %d: %s", cfg.index, e)
        return None


def run_changes(old: dict, new: dict) -> list[str]:
    """What differs between two runs' ``run`` maps among :data:`RUN_KEYS`, each as ``"key old -> new"`` (a map,
    such as ``spec`` or ``model``, key by key: ``"spec.unroll_length 10 -> 7"``); empty for the same run."""
    changes = []
    for key in RUN_KEYS:
        a, b = old.get(key), new.get(key)
        if type(a) is dict and type(b) is dict:
            keys = sorted(a.keys() | b.keys(), key=str)
            changes += [
                f"{key}.{k} {_short(a.get(k), 40)} -> {_short(b.get(k), 40)}" for k in keys if a.get(k) != b.get(k)
            ]
        elif a != b:
            changes.append(f"{key} {_short(a, 40)} -> {_short(b, 40)}")
    return changes


def same_envs(cfg: ActorConfig, old: dict, new: dict) -> bool:
    """Whether environments built for run ``old`` serve run ``new``: the same id, kwargs, observation dtype and
    (unless this actor's own --env-backend decides it) backend."""
    keys = ("env_id", "env_kwargs") if cfg.env_backend else ("env_id", "env_kwargs", "env_backend")
    return all(old.get(k) == new.get(k) for k in keys) and _obs_dtype(old) == _obs_dtype(new)


def _obs_dtype(info: dict):
    spec = info.get("spec")
    return spec.get("obs_dtype") if type(spec) is dict else None
