"""The IMPALA loss as pure functions: no state, no I/O, no optimizer (Acme's ``impala_loss`` shape).

:func:`inputs` turns a ring batch (batch-major, as actors sent it) into what the network and the loss take: frames
unstacked, values from the wire clipped into their documented ranges (counted), rewards clipped and scaled, the
time-limit bootstrap folded into the rewards, time-major tensors. :func:`impala_loss` is V-trace's policy gradient,
the baseline regression and the entropy bonus; it returns ``(loss, metrics)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config.sections import Loss
from ..core import frames, vtrace
from ..core.spec import TrajectorySpec
from .reports.histograms import RHO_BIN_EDGES


class Inputs(NamedTuple):
    """One batch as the network and the loss take it (``T`` steps, ``B`` trajectories)."""

    obs: torch.Tensor  # [B, T+1, ...] observations (frames unstacked), batch-major as the network unrolls them
    core_state: tuple  # (h, c) each [B, H] the actor's LSTM state at obs[0]; () without a core
    starts: torch.Tensor | None  # [B, T+1] True where an observation begins an episode; None without a core
    actions: torch.Tensor  # [T, B]
    rewards: torch.Tensor  # [T, B] fp32: clipped, scaled, and with the time-limit bootstrap added
    discounts: torch.Tensor  # [T, B] fp32: gamma, 0 where an episode ended (terminated or cut)
    behaviour_logits: torch.Tensor  # [T, B, A] fp32, clipped
    clipped: torch.Tensor  # [] values from the wire clipped into their range


def recurrent_inputs(batch: dict[str, torch.Tensor]) -> tuple[tuple, torch.Tensor]:
    """What the LSTM core unrolls from: the state the actor had at ``obs[0]`` (``core_state [B, 2, H]`` -> ``(h, c)``,
    each ``[B, H]``) and ``starts [B, T+1]``, True where an observation begins an episode (the core is reset there)."""
    core_state = batch["core_state"].float()
    done = (batch["terminated"] != 0) | (batch["truncated"] != 0)  # [B, T]
    starts = torch.cat([torch.zeros_like(done[:, :1]), done], dim=1)  # obs[0]: the actor already reset it
    return (core_state[:, 0], core_state[:, 1]), starts


def inputs(batch: dict[str, torch.Tensor], spec: TrajectorySpec, hp: Loss, recurrent: bool) -> Inputs:
    """``batch`` as the ring holds it: ``obs [B, T+1, ...]`` (or ``frames [B, T+S, H, W]`` with a frame-stacking
    spec), ``action``/``reward``/``terminated``/``truncated``/``truncation_value`` ``[B, T]``, ``behaviour_logits
    [B, T, A]``, ``core_state [B, 2, H]`` with a core."""
    clipped = []

    def bounded(x: torch.Tensor, bound: float) -> torch.Tensor:
        clipped.append((x.abs() > bound).sum())
        return x.clamp(-bound, bound)

    def tm(name: str) -> torch.Tensor:  # time-major [T, B, ...]
        return batch[name].transpose(0, 1)

    if spec.frame_stack:
        obs = frames.unstack(batch["frames"], batch["terminated"], batch["truncated"], spec.frame_stack)
    else:
        obs = batch["obs"]
        if obs.is_floating_point():
            obs = bounded(obs, hp.max_abs_obs)
    core_state, starts = recurrent_inputs(batch) if recurrent else ((), None)
    rewards = bounded(tm("reward").float(), hp.max_abs_reward)
    if hp.reward_clip > 0:
        rewards = rewards.clamp(-hp.reward_clip, hp.reward_clip)
    rewards = rewards * hp.reward_scale
    truncated = tm("truncated").float()
    done = torch.maximum(tm("terminated").float(), truncated)
    # A time-limit cut is not a terminal state: bootstrap from the value the actor computed for the final observation
    # (the next slot already holds the reset observation).
    rewards = rewards + hp.discount * truncated * bounded(tm("truncation_value").float(), hp.max_abs_truncation_value)
    behaviour_logits = bounded(tm("behaviour_logits").float(), hp.max_abs_logit)
    return Inputs(
        obs,
        core_state,
        starts,
        tm("action"),
        rewards,
        hp.discount * (1.0 - done),
        behaviour_logits,
        torch.stack(clipped).sum(),
    )


def impala_loss(
    logits: torch.Tensor, values: torch.Tensor, x: Inputs, hp: Loss, entropy_cost: float, rho_edges: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """V-trace policy gradient + ``baseline_cost`` x baseline loss - ``entropy_cost`` x entropy, all in fp32.

    ``logits [T+1, B, A]`` and ``values [T+1, B]`` are the network's over ``x.obs`` (the last step bootstraps);
    ``rho_edges``: the importance-weight histogram's upper bin edges, on the logits' device. Returns the loss and
    its metrics as tensors, none holding a gradient: ``loss_pg``, ``loss_baseline``, ``entropy``,
    ``advantage_abs_mean`` (the policy gradient's advantages before any normalisation: the scale the entropy bonus
    competes with), ``value_explained_variance`` (1 - Var(v_s - V) / Var(v_s) over the batch's ``T x B`` steps; 0
    where the targets do not vary), ``rho_mean``, ``rho_clipped_frac``, ``rho_far_frac`` (the share outside
    [1/2, 2]: learner/watch.py) and ``rho_hist``."""
    logits, values = logits.float(), values.float()
    T = x.rewards.shape[0]
    vt = vtrace.from_logits(
        behaviour_policy_logits=x.behaviour_logits,
        target_policy_logits=logits[:T],
        actions=x.actions,
        discounts=x.discounts,
        rewards=x.rewards,
        values=values[:T],
        bootstrap_value=values[T],
        clip_rho_threshold=Loss.threshold(hp.clip_rho_threshold),
        clip_pg_rho_threshold=Loss.threshold(hp.clip_pg_rho_threshold),
        clip_c_threshold=Loss.threshold(hp.clip_c_threshold),
        lambda_=hp.vtrace_lambda,
    )
    advantages = vt.pg_advantages
    if hp.normalize_advantages:
        advantages = advantages / (advantages.std() + 1e-8)
    pg_loss = -(vt.target_action_log_probs * advantages).mean()
    baseline_loss = 0.5 * (vt.vs - values[:T]).pow(2).mean()
    log_probs = F.log_softmax(logits[:T], dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
    loss = pg_loss + hp.baseline_cost * baseline_loss - entropy_cost * entropy
    with torch.no_grad():
        rhos = vt.log_rhos.exp()
        target_var = vt.vs.var()
        unexplained = (vt.vs - values[:T]).var() / target_var.clamp_min(1e-12)
        rho_bar = hp.clip_rho_threshold if hp.clip_rho_threshold > 0 else float("inf")
        metrics = {
            "loss_pg": pg_loss.detach(),
            "loss_baseline": baseline_loss.detach(),
            "entropy": entropy.detach(),
            "advantage_abs_mean": vt.pg_advantages.abs().mean(),
            "value_explained_variance": torch.where(target_var > 1e-12, 1.0 - unexplained, 0.0),
            "rho_mean": rhos.mean(),
            "rho_clipped_frac": (rhos > rho_bar).float().mean(),
            "rho_far_frac": ((rhos < 0.5) | (rhos > 2.0)).float().mean(),
            "rho_hist": torch.bincount(torch.bucketize(rhos.flatten(), rho_edges), minlength=len(RHO_BIN_EDGES)),
        }
    return loss, metrics
