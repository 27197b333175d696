"""learner/loss.py's impala_loss against the IMPALA loss computed from scratch, as torchbeast tests its pieces: a small
batch (T 4, B 3, A 3) with off-policy behaviour, episode ends and clipped importance weights, and the loss, its
metrics and its gradient recomputed in float64 numpy with loops that follow the paper's equations (Espeholt et al.
2018, section 4), sharing no code with core/vtrace.py or loss.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from impala_async.config import LearnerConfig
from impala_async.learner import loss
from impala_async.learner.reports.histograms import RHO_BIN_EDGES

T, B, A = 4, 3, 3


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def reference(logits, values, behaviour, actions, rewards, discounts, hp, entropy_cost):
    """(loss, pg loss, baseline loss, entropy, d loss / d values [T+1, B], mean |advantage| before normalisation,
    explained variance): the paper's V-trace targets by their recursion, v_s - V(x_s) = delta_s + gamma_s c_s
    (v_{s+1} - V(x_{s+1})), and the three losses as batch means."""
    logp = _log_softmax(logits[:T])  # [T, B, A]
    logmu = _log_softmax(behaviour)
    taken = np.take_along_axis(logp, actions[..., None], -1)[..., 0]  # [T, B]
    rho = np.exp(taken - np.take_along_axis(logmu, actions[..., None], -1)[..., 0])
    rho_bar, c = np.minimum(hp.clip_rho_threshold, rho), hp.vtrace_lambda * np.minimum(hp.clip_c_threshold, rho)
    v, bootstrap = values[:T], values[T]
    vs = np.zeros((T, B))
    for b in range(B):
        acc = 0.0  # v_{s+1} - V(x_{s+1}), zero past the end
        for s in reversed(range(T)):
            v_next = bootstrap[b] if s == T - 1 else v[s + 1, b]
            delta = rho_bar[s, b] * (rewards[s, b] + discounts[s, b] * v_next - v[s, b])
            acc = delta + discounts[s, b] * c[s, b] * acc
            vs[s, b] = v[s, b] + acc
    vs_next = np.concatenate([vs[1:], bootstrap[None]])
    advantage = np.minimum(hp.clip_pg_rho_threshold, rho) * (rewards + discounts * vs_next - v)
    advantage_abs = np.abs(advantage).mean()
    explained = 1.0 - np.var(vs - v) / np.var(vs)
    if hp.normalize_advantages:
        advantage = advantage / (advantage.std(ddof=1) + 1e-8)
    pg = -(taken * advantage).mean()
    baseline = 0.5 * ((vs - v) ** 2).mean()
    entropy = -(np.exp(logp) * logp).sum(-1).mean()
    grad_values = np.zeros((T + 1, B))
    grad_values[:T] = hp.baseline_cost * (v - vs) / (T * B)  # the targets vs and the advantages carry no gradient
    loss = pg + hp.baseline_cost * baseline - entropy_cost * entropy
    return loss, pg, baseline, entropy, grad_values, advantage_abs, explained


@pytest.mark.parametrize("normalize", [0, 1])
def test_impala_loss_is_the_papers(normalize):
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 1.5, (T + 1, B, A))
    values = rng.normal(0, 1, (T + 1, B))
    behaviour = rng.normal(0, 1.5, (T, B, A))  # far from the target: rhos above and below 1, some clipped
    actions = rng.integers(0, A, (T, B))
    rewards = rng.normal(0, 1, (T, B))
    discounts = np.full((T, B), 0.99)
    discounts[1, 0] = discounts[2, 2] = 0.0  # episodes end
    hp = LearnerConfig.of(normalize_advantages=normalize, clip_c_threshold=0.9, vtrace_lambda=0.95).loss
    want, pg, baseline, entropy, grad_values, advantage_abs, explained = reference(
        logits, values, behaviour, actions, rewards, discounts, hp, entropy_cost=0.01
    )

    t_logits = torch.tensor(logits, dtype=torch.float32, requires_grad=True)
    t_values = torch.tensor(values, dtype=torch.float32, requires_grad=True)
    x = loss.Inputs(
        obs=torch.zeros(B, T + 1, 1),
        core_state=(),
        starts=None,
        actions=torch.tensor(actions),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        discounts=torch.tensor(discounts, dtype=torch.float32),
        behaviour_logits=torch.tensor(behaviour, dtype=torch.float32),
        clipped=torch.tensor(0),
    )
    got, metrics = loss.impala_loss(t_logits, t_values, x, hp, 0.01, torch.tensor(RHO_BIN_EDGES[1:]))
    got.backward()

    assert got.item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert metrics["loss_pg"].item() == pytest.approx(pg, rel=1e-5, abs=1e-6)
    assert metrics["loss_baseline"].item() == pytest.approx(baseline, rel=1e-5, abs=1e-6)
    assert metrics["entropy"].item() == pytest.approx(entropy, rel=1e-5)
    assert metrics["advantage_abs_mean"].item() == pytest.approx(advantage_abs, rel=1e-5)
    assert metrics["value_explained_variance"].item() == pytest.approx(explained, rel=1e-4, abs=1e-6)
    np.testing.assert_allclose(t_values.grad.numpy(), grad_values, rtol=1e-4, atol=1e-6)
    assert int(metrics["rho_hist"].sum()) == T * B and 0 < metrics["rho_clipped_frac"].item() < 1


def test_explained_variance_is_1_for_a_perfect_value_and_0_for_constant_targets():
    """A value head that equals its targets explains all of them; targets that do not vary are given 0, not NaN."""
    hp = LearnerConfig.of(clip_c_threshold=1.0).loss
    x = loss.Inputs(
        obs=torch.zeros(B, T + 1, 1),
        core_state=(),
        starts=None,
        actions=torch.zeros(T, B, dtype=torch.long),
        rewards=torch.zeros(T, B),
        discounts=torch.zeros(T, B),  # every step ends an episode: v_s = r_s = 0 whatever V is
        behaviour_logits=torch.zeros(T, B, A),
        clipped=torch.tensor(0),
    )
    edges = torch.tensor(RHO_BIN_EDGES[1:])
    _, constant = loss.impala_loss(torch.zeros(T + 1, B, A), torch.randn(T + 1, B), x, hp, 0.01, edges)
    assert constant["value_explained_variance"].item() == 0.0
    rewards = torch.randn(T, B)
    perfect = torch.cat([rewards, torch.zeros(1, B)])  # V = r: each step's target is its reward
    _, m = loss.impala_loss(torch.zeros(T + 1, B, A), perfect, x._replace(rewards=rewards), hp, 0.01, edges)
    assert m["value_explained_variance"].item() == pytest.approx(1.0, abs=1e-6)
    assert m["advantage_abs_mean"].item() == pytest.approx(0.0, abs=1e-6)
