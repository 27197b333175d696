"""The behaviour policy and one unroll: K environments stepped T times with one batched forward pass per step.

``Policy`` holds a copy of the learner's network on the actor's device (``--device``, cpu by default). On the CPU
the forward pass reads the observations where they lie (``torch.from_numpy``, no copy); elsewhere (``staged``)
each step's observations go to the device as one batch through a host buffer, pinned for CUDA, and logits and
values come back as one copy. ``unroll`` is the actor's inner loop, shared with tools/bench_actor.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from ..core import wire
from ..core.models import ModelConfig, build_model
from ..core.spec import TrajectorySpec
from .vec import VecEnv

log = logging.getLogger("impala_async.actors.rollout")


class Policy:
    """The behaviour policy mu: a copy of the learner's network on ``device``, replaced when new weights arrive.
    ``staged`` (default: any device but the CPU) copies observations through a host buffer to the device; with
    device "cpu" it runs that same path on the CPU (tests)."""

    def __init__(self, first: wire.WeightsMessage, device: str | torch.device = "cpu", staged: bool | None = None):
        self.run_info = first.run_info
        self.spec = TrajectorySpec.from_dict(first.run_info["spec"])
        self.device = torch.device(device)
        self.staged = self.device.type != "cpu" if staged is None else bool(staged)
        self.model = build_model(self.spec, ModelConfig.from_dict(first.run_info["model"]))
        self.model.to(self.device).eval()
        self._host: torch.Tensor | None = None  # [K, *obs_shape] staging buffer (staged only)
        self.version, self.incarnation = -1, 0
        self.load(first)

    def load(self, msg: wire.WeightsMessage) -> None:
        """Copy ``msg``'s tensors into the network. ValueError, naming the first difference and changing nothing, if
        they are not exactly this network's parameters (names, shapes, floating point)."""
        state = self.model.state_dict()
        problem = mismatch(state, msg.tensors)
        if problem:
            raise ValueError(f"weights do not match the network of this run: {problem}")
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(torch.from_numpy(msg.tensors[name]).view(t.shape))
        if msg.incarnation != self.incarnation and self.incarnation:
            log.info("the learner restarted (new incarnation): now at policy version %d", msg.version)
        self.version, self.incarnation = msg.version, msg.incarnation

    def initial_state(self, batch_size: int) -> tuple:
        """The recurrent state of ``batch_size`` environments at the start of their episodes (``()`` without a core),
        on the policy's device."""
        if not self.staged:
            return self.model.initial_state(batch_size)
        return self.model.initial_state(batch_size, device=self.device)

    def _stage(self, obs: np.ndarray) -> torch.Tensor:
        """``obs [B, ...]`` on the device: one host copy into the (pinned) buffer, one transfer."""
        n = obs.shape[0]
        if self._host is None or self._host.shape[0] < n or self._host.shape[1:] != obs.shape[1:]:
            self._host = torch.empty(
                obs.shape, dtype=torch.from_numpy(obs[:0]).dtype, pin_memory=self.device.type == "cuda"
            )
        host = self._host[:n]
        host.numpy()[...] = obs
        return host.to(self.device, non_blocking=True)  # ordered before the forward pass; .cpu() below waits

    @torch.inference_mode()
    def step(self, obs: np.ndarray, state: tuple) -> tuple[np.ndarray, np.ndarray, tuple]:
        """``obs [B, *obs_shape]``, ``state`` -> ``(logits [B, A], values [B], next state)``, logits and values as
        numpy on the host, the state on the device."""
        if not self.staged:
            logits, values, state = self.model.step(torch.from_numpy(obs), state)
            return logits.numpy(), values.numpy(), state
        logits, values, state = self.model.step(self._stage(obs), state)
        out = torch.cat([logits, values[:, None]], dim=1).cpu().numpy()  # [B, A+1]: one copy back
        return out[:, :-1], out[:, -1], state

    def state_numpy(self, state: tuple) -> tuple[np.ndarray, np.ndarray]:
        """``(h [B, L], c [B, L])`` of an LSTM state, on the host."""
        return state[0].cpu().numpy(), state[1].cpu().numpy()

    def restart(self, state: tuple, ended: list[int]) -> tuple:
        """``state`` with the rows of ``ended`` zeroed: the next observation there begins an episode."""
        keep = torch.ones(state[0].shape[0], 1, device=state[0].device)
        keep[ended] = 0.0
        return tuple(x * keep for x in state)


def mismatch(state: dict, tensors: dict) -> str:
    """What keeps ``tensors`` (name -> numpy array, from a weights message) from loading into a network whose
    ``state_dict`` is ``state``: ``""`` if nothing does. Every name must be there, none more, each with the
    parameter's shape, as floating point where the parameter is."""
    missing, unknown = sorted(state.keys() - tensors.keys()), sorted(map(str, tensors.keys() - state.keys()))
    if missing or unknown:
        parts = [
            f"{what} {', '.join(n[:60] for n in names[:3])}{' ...' if len(names) > 3 else ''}"
            for what, names in (("missing", missing), ("unknown", unknown))
            if names
        ]
        return "; ".join(parts)
    for name, t in state.items():
        a = tensors[name]
        if tuple(a.shape) != tuple(t.shape):
            return f"{name} has shape {list(a.shape)}, this network's is {list(t.shape)}"
        if t.is_floating_point() and a.dtype.kind != "f":
            return f"{name} has dtype {a.dtype}, this network's is {t.dtype}"
    return ""


def unroll(
    policy: Policy,
    envs: VecEnv,
    state: tuple,
    rng: np.random.Generator,
    buf: dict,
    obs_buf: np.ndarray,
    beat: Callable[[], None] = lambda: None,
) -> tuple:
    """One unroll: fills ``buf`` (the trajectory fields, ``[K, T, ...]``; ``core_state [K, 2, L]``) and ``obs_buf
    [K, T+1, *obs_shape]`` from ``envs`` (whose ``obs`` holds the first observations), sampling each action from
    the policy (Gumbel-max on the logits, ``rng``); returns the recurrent state after the last step (reset where an
    episode ended). ``beat`` is called once a step."""
    T, obs, spec = obs_buf.shape[1] - 1, envs.obs, policy.spec
    obs_buf[:, 0] = obs
    buf["truncation_value"][:] = 0.0
    if spec.core_state_size:  # the state the core processes obs[0] with
        buf["core_state"][:, 0], buf["core_state"][:, 1] = policy.state_numpy(state)
    for t in range(T):
        logits, _, next_state = policy.step(obs, state)
        actions = np.argmax(logits - np.log(-np.log(rng.random(logits.shape))), axis=1)  # Gumbel-max sample
        buf["behaviour_logits"][:, t] = logits
        buf["action"][:, t] = actions
        beat()
        ended, cut = envs.step(actions, buf["reward"][:, t], buf["terminated"][:, t], buf["truncated"][:, t])
        if cut:  # bootstrap value of the final observations that a time limit cut off (their episodes' state)
            rows = [k for k, _ in cut]
            _, v, _ = policy.step(
                np.stack([o for _, o in cut]).astype(spec.obs_dtype), tuple(x[rows] for x in next_state)
            )
            for (k, _), value in zip(cut, v, strict=True):
                buf["truncation_value"][k, t] = value
        if next_state and ended:  # the next observation begins an episode: the core starts from zeros
            next_state = policy.restart(next_state, ended)
        state = next_state
        obs_buf[:, t + 1] = obs
    return state
