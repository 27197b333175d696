"""V-trace off-policy targets (Espeholt et al. 2018, section 4.1).

Pure torch (and numpy for the recursion on the CPU); no I/O. Everything is time-major: ``[T, ...]`` where ``...`` is
any number of batch dimensions (``[B]``, ``[B, N]``, ...). Computation is done in fp32 whatever the input dtype or
autocast state, and the targets carry no gradient.

Definition (the paper's, not the source article's pseudocode, whose backward loop drops ``V(x_s) + delta_s``)::

    rho_t   = min(rho_bar, pi(a_t|x_t) / mu(a_t|x_t))
    c_t     = lambda * min(c_bar, pi(a_t|x_t) / mu(a_t|x_t))      (lambda = 1 in the paper's main text; its
                                                                    remark 2 allows lambda < 1 for less variance)
    delta_t = rho_t * (r_t + gamma_t * V(x_{t+1}) - V(x_t))
    v_s     = V(x_s) + delta_s + gamma_s * c_s * (v_{s+1} - V(x_{s+1}))          with v_T = V(x_T) = bootstrap
    pg_adv_s = min(rho_pg_bar, pi/mu)_s * (r_s + gamma_s * v_{s+1} - V(x_s))
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F


class VTraceReturns(NamedTuple):
    vs: torch.Tensor  # [T, ...] V-trace value targets
    pg_advantages: torch.Tensor  # [T, ...] policy-gradient advantages


class VTraceFromLogitsReturns(NamedTuple):
    vs: torch.Tensor  # [T, ...]
    pg_advantages: torch.Tensor  # [T, ...]
    log_rhos: torch.Tensor  # [T, ...] log(pi/mu) of the actions taken, no gradient
    behaviour_action_log_probs: torch.Tensor  # [T, ...] log mu(a_t|x_t), no gradient
    target_action_log_probs: torch.Tensor  # [T, ...] log pi(a_t|x_t), fp32, keeps the gradient of the target logits


def action_log_probs(policy_logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """log softmax(policy_logits)[actions] in fp32. logits ``[T, ..., A]``, actions ``[T, ...]`` -> ``[T, ...]``."""
    log_probs = F.log_softmax(policy_logits.float(), dim=-1)
    return log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)


def backward_sums(deltas: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``out[t] = deltas[t] + decay[t] * out[t+1]`` backwards from ``out[T] = 0``; ``[T, ...]`` fp32 in and out.

    A recursion over T: on the CPU it runs in numpy, whose small operations cost a fraction of torch's dispatch (an
    update of MinAtar's B 8 x T 20 spent ~120 torch operations here; BENCHMARKS.md section 19), on other devices in
    torch. Both evaluate the same expression in the same order."""
    T = deltas.shape[0]
    if deltas.device.type == "cpu":
        d, k = deltas.numpy(), decay.numpy()
        out = np.empty_like(d)
        acc = np.zeros_like(d[0])
        for t in range(T - 1, -1, -1):
            acc = d[t] + k[t] * acc
            out[t] = acc
        return torch.from_numpy(out)
    return _torch_backward_sums(deltas, decay)


def _torch_backward_sums(deltas: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """:func:`backward_sums` in torch, for tensors off the CPU."""
    T = deltas.shape[0]
    out = torch.empty_like(deltas)
    acc = torch.zeros_like(deltas[0])
    for t in range(T - 1, -1, -1):
        acc = deltas[t] + decay[t] * acc
        out[t] = acc
    return out


def _clip(x: torch.Tensor, threshold: float | None) -> torch.Tensor:
    return x if threshold is None else torch.clamp(x, max=threshold)


@torch.no_grad()
def from_importance_weights(
    log_rhos: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    clip_c_threshold: float | None = 1.0,
    lambda_: float = 1.0,
) -> VTraceReturns:
    """V-trace targets from log importance weights.

    Args:
        log_rhos: ``[T, ...]`` log(pi(a_t|x_t) / mu(a_t|x_t)).
        discounts: ``[T, ...]`` gamma_t; 0 where the episode ended after step t.
        rewards: ``[T, ...]`` r_t.
        values: ``[T, ...]`` V(x_t) under the target policy.
        bootstrap_value: ``[...]`` V(x_T).
        clip_rho_threshold: rho_bar; ``None`` disables clipping.
        clip_pg_rho_threshold: clip for the importance weight of the policy-gradient advantage; ``None`` disables.
        clip_c_threshold: c_bar (the trace-cutting coefficient); ``None`` disables.
        lambda_: extra trace discount in [0, 1] (TD(lambda)-style bias-variance trade-off); 1 is plain V-trace.

    Returns:
        ``VTraceReturns(vs, pg_advantages)``, both ``[T, ...]`` fp32 without gradient.
    """
    if log_rhos.dim() < 1 or log_rhos.shape[0] < 1:
        raise ValueError(f"log_rhos must be [T, ...] with T >= 1, got shape {tuple(log_rhos.shape)}")
    for name, t in (("discounts", discounts), ("rewards", rewards), ("values", values)):
        if t.shape != log_rhos.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(log_rhos.shape)} like log_rhos")
    if bootstrap_value.shape != log_rhos.shape[1:]:
        raise ValueError(
            f"bootstrap_value has shape {tuple(bootstrap_value.shape)}, expected {tuple(log_rhos.shape[1:])}"
        )
    with torch.autocast(device_type=log_rhos.device.type, enabled=False):
        log_rhos, discounts, rewards, values, bootstrap_value = (
            t.float() for t in (log_rhos, discounts, rewards, values, bootstrap_value)
        )
        rhos = torch.exp(log_rhos)
        clipped_rhos = _clip(rhos, clip_rho_threshold)
        cs = lambda_ * _clip(rhos, clip_c_threshold)
        values_t_plus_1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)
        deltas = clipped_rhos * (rewards + discounts * values_t_plus_1 - values)

        # v_s - V(x_s) = delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1})), backwards from 0 at s = T.
        vs = backward_sums(deltas, discounts * cs) + values

        vs_t_plus_1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], dim=0)
        pg_advantages = _clip(rhos, clip_pg_rho_threshold) * (rewards + discounts * vs_t_plus_1 - values)
    return VTraceReturns(vs=vs, pg_advantages=pg_advantages)


def from_logits(
    behaviour_policy_logits: torch.Tensor,
    target_policy_logits: torch.Tensor,
    actions: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    clip_c_threshold: float | None = 1.0,
    lambda_: float = 1.0,
) -> VTraceFromLogitsReturns:
    """V-trace for softmax policies.

    Args:
        behaviour_policy_logits: ``[T, ..., A]`` logits of mu, as the actor computed them.
        target_policy_logits: ``[T, ..., A]`` logits of pi (the learner's current policy).
        actions: ``[T, ...]`` integer actions taken.
        discounts, rewards, values, bootstrap_value, clip_*, lambda_: as in :func:`from_importance_weights`.
    """
    target_action_log_probs = action_log_probs(target_policy_logits, actions)
    with torch.no_grad():
        behaviour_action_log_probs = action_log_probs(behaviour_policy_logits, actions)
        log_rhos = target_action_log_probs.detach() - behaviour_action_log_probs
    vtrace = from_importance_weights(
        log_rhos=log_rhos,
        discounts=discounts,
        rewards=rewards,
        values=values,
        bootstrap_value=bootstrap_value,
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
        clip_c_threshold=clip_c_threshold,
        lambda_=lambda_,
    )
    return VTraceFromLogitsReturns(
        vs=vtrace.vs,
        pg_advantages=vtrace.pg_advantages,
        log_rhos=log_rhos,
        behaviour_action_log_probs=behaviour_action_log_probs,
        target_action_log_probs=target_action_log_probs,
    )
