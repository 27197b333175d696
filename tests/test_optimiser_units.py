"""The optimiser's gradient-scale settings mean what the IMPALA paper's values mean, whatever B and T.

The paper (and torchbeast, scalable_agent, Cleanba) sums its losses over the batch's B x T steps and clips the global
gradient norm of that sum at 40, under RMSprop with epsilon 0.01. This learner's loss is the mean over the same steps,
whose gradient is 1 / (B x T) of the sum's: a clip of 40 on it would never fire (its norm on a real Pong batch at
initialisation is about 2.6) and an epsilon of 0.01 would damp every step. The reference here is computed from
scratch: the loss summed over the batch, its gradient clipped at the paper's 40 by torch, torch's RMSprop with the
paper's epsilon 0.01; one learner update must land on the same weights.
"""

import numpy as np
import pytest
import torch
from helpers import random_arrays

from impala_async.config import LearnerConfig
from impala_async.config.presets import ATARI
from impala_async.core.spec import TrajectorySpec
from impala_async.learner import loss
from impala_async.learner.learn import Learner

pytest.importorskip("ale_py")
pytest.importorskip("cv2")

B, T = 32, 20  # the paper's batch: 640 steps an update
UNROLLS_PER_GAME = 4  # consecutive unrolls of one game, as an actor's environment gives them
PAPER = dict(ATARI, optimizer="rmsprop", max_grad_norm=40.0, rmsprop_eps=0.01, batch_size=B, unroll_length=T)
SPEC = TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=T)


def pong_batch(seed: int = 0, n: int = B) -> dict[str, torch.Tensor]:
    """``n`` real ALE/Pong-v5 unrolls of ``T`` steps under a uniform random policy, in the ring's layout (whole
    4-frame stacks; behaviour logits the uniform policy's): games played for ``UNROLLS_PER_GAME`` unrolls each."""
    from impala_async.actors.envs import make_env

    batch = random_arrays(SPEC, n, seed=seed)
    batch["truncation_value"][:] = 0
    batch["behaviour_logits"][:] = 0
    rng = np.random.default_rng(seed)
    for e in range(n // UNROLLS_PER_GAME):
        env = make_env("ALE/Pong-v5")
        obs, _ = env.reset(seed=seed + e)
        for k in range(e * UNROLLS_PER_GAME, (e + 1) * UNROLLS_PER_GAME):
            batch["obs"][k, 0] = obs
            for t in range(T):
                action = int(rng.integers(6))
                obs, reward, term, trunc, _ = env.step(action)
                if term or trunc:
                    obs, _ = env.reset()
                batch["obs"][k, t + 1], batch["action"][k, t], batch["reward"][k, t] = obs, action, reward
                batch["terminated"][k, t], batch["truncated"][k, t] = term, trunc and not term
        env.close()
    return {k: torch.from_numpy(v) for k, v in batch.items()}


def learner(**changes) -> Learner:
    torch.manual_seed(0)
    cfg = LearnerConfig.of(**{**PAPER, **changes})
    return Learner(cfg, SPEC, torch.device("cpu"))


def paper_update(model: torch.nn.Module, batch: dict, hp) -> tuple[float, list[torch.Tensor]]:
    """The paper's update from scratch: the loss summed over the B x T steps, the global norm of its gradient clipped
    at ``hp.max_grad_norm``, one torch RMSprop step with ``hp.rmsprop_eps``. Returns (the norm before clipping, the
    parameters after)."""
    x = loss.inputs(batch, SPEC, hp, recurrent=False)
    logits, values = model.unroll(x.obs, x.core_state, x.starts)
    mean_loss, _ = loss.impala_loss(logits, values, x, hp, hp.entropy_cost, torch.ones(1))
    (mean_loss * x.rewards.numel()).backward()  # the sum over the batch's B x T steps of the per-step loss
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp.max_grad_norm)
    opt = torch.optim.RMSprop(model.parameters(), lr=hp.learning_rate, alpha=hp.rmsprop_alpha, eps=hp.rmsprop_eps)
    opt.step()
    return float(norm), [p.detach().clone() for p in model.parameters()]


def assert_same_update(before: list[torch.Tensor], got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Each parameter tensor moved by the same step, to float rounding (relative to the step's own size: a bias
    initialised at 0 is all step)."""
    for p0, a, b in zip(before, got, want, strict=True):
        step_a, step_b = a.detach() - p0, b.detach() - p0
        assert step_b.norm() > 0
        assert (step_a - step_b).norm() / step_b.norm() < 1e-3


@pytest.mark.parametrize("n", [B, B // 4])
def test_the_update_is_the_papers_and_its_clip_fires_on_a_real_pong_batch(n):
    """At the paper's batch (B 32) the clip fires at initialisation; at B 8 it does not (the summed gradient is a
    quarter as large), and the update is the paper's at both, RMSprop's epsilon scaled with the batch."""
    batch = pong_batch(n=n)
    ours = learner(batch_size=n)
    reference = learner(batch_size=n)
    reference.model.load_state_dict(ours.model.state_dict())
    before = [p.detach().clone() for p in ours.model.parameters()]
    norm, want = paper_update(reference.model, batch, ours.hp)
    stats = ours.step(batch)
    if n == B:
        assert norm > 40, f"at initialisation the summed loss's gradient ({norm:.1f}) should exceed the paper's clip"
    assert stats["grad_norm"] == pytest.approx(norm, rel=1e-4), "grad_norm is reported in the clip's unit"
    assert_same_update(before, list(ours.model.parameters()), want)
