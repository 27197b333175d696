"""The IMPALA update: one step moves the parameters with finite statistics, and bf16 autocast matches fp32.

The bf16 checks run on the CPU (torch's CPU autocast supports bf16), which exercises the same code as on a GPU.
"""

import io
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from helpers import random_arrays

from impala_async.config import LearnerConfig
from impala_async.core.spec import TrajectorySpec
from impala_async.learner.learn import Learner


def _spec(env_id: str, T: int = 12) -> TrajectorySpec:
    if env_id == "image":
        return TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=T)
    env = gym.make(env_id)
    return TrajectorySpec.from_spaces(env.observation_space, env.action_space, T)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _learner(spec: TrajectorySpec, device: str = "cpu", **cfg) -> Learner:
    torch.manual_seed(0)
    return Learner(LearnerConfig.of(**cfg), spec, torch.device(device))


def _batch(spec: TrajectorySpec, B: int = 8, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v).to(device) for k, v in random_arrays(spec, B, seed=3).items()}


def _forward_dtypes(learner: Learner) -> list[torch.dtype]:
    """Record the dtype of every Linear/Conv output during the next forward pass."""
    seen = []
    for m in learner.model.modules():
        if isinstance(m, torch.nn.Linear | torch.nn.Conv2d):
            m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("env_id", ["CartPole-v1", "image"])
@pytest.mark.parametrize("precision,want", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_one_step_updates_parameters(env_id, precision, want, device):
    spec = _spec(env_id)
    learner = _learner(spec, device, precision=precision)
    before = [p.detach().clone() for p in learner.model.parameters()]
    dtypes = _forward_dtypes(learner)
    stats = learner.step(_batch(spec, device=device))
    assert dtypes and set(dtypes) == {want}, dtypes
    for name in ("loss_pg", "loss_baseline", "entropy", "grad_norm", "rho_mean", "rho_clipped_frac"):
        assert np.isfinite(stats[name]), (name, stats[name])
    assert sum(stats["rho_hist"]) == 8 * spec.unroll_length
    assert all(p.dtype == torch.float32 for p in learner.model.parameters()), "master weights stay fp32"
    moved = [not torch.equal(a, p) for a, p in zip(before, learner.model.parameters(), strict=True)]
    assert all(moved), "every parameter should receive a gradient and move"
    assert learner.updates == 1 and learner.env_steps_trained == 8 * spec.unroll_length


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("env_id", ["CartPole-v1", "image"])
def test_the_warm_up_pass_changes_nothing_the_first_update_sees(env_id, device):
    """The learner command warms CUDA up with a pass on zeros before actors may send: the first real update must be
    exactly the one a learner without it makes (no weight, gradient or optimizer state left behind)."""
    spec = _spec(env_id)
    warmed, cold = _learner(spec, device), _learner(spec, device)
    warmed.zero_pass()
    warmed.warm_up()
    assert all(p.grad is None for p in warmed.model.parameters()) and not warmed.optimizer.state
    batch = _batch(spec, device=device)
    a, b = warmed.step(batch), cold.step(batch)
    assert a["loss_pg"] == pytest.approx(b["loss_pg"], rel=1e-5) and a["grad_norm"] == pytest.approx(
        b["grad_norm"], rel=1e-4
    )
    for p, q in zip(warmed.model.parameters(), cold.model.parameters(), strict=True):
        torch.testing.assert_close(p, q)  # exact on a CPU; CUDA's convolution gradients may sum in another order


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("env_id", ["CartPole-v1", "image"])
def test_bf16_gradient_agrees_with_fp32(env_id, device):
    """The same batch and weights: the bf16 gradient points where the fp32 one does (bf16 keeps 8 bits of mantissa,
    so agreement is to a fraction of a percent, not to 1e-5)."""
    spec = _spec(env_id)
    grads = {}
    for precision in ("fp32", "bf16"):
        learner = _learner(spec, device, precision=precision, max_grad_norm=0.0, learning_rate=1e-9)
        learner.step(_batch(spec, device=device))
        grads[precision] = torch.cat([p.grad.flatten() for p in learner.model.parameters()])
    a, b = grads["fp32"], grads["bf16"]
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    assert cosine > 0.999, cosine
    assert abs(b.norm().item() / a.norm().item() - 1) < 0.02


def test_fp16_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="loss scaling"):
        LearnerConfig.of(precision="fp16").check()


def test_extreme_inputs_are_clipped_and_a_non_finite_update_is_skipped():
    """Values from the wire enter the loss clipped (3e38 rewards, truncation values and logits leave the weights
    finite); an update whose loss is still not finite leaves the weights, the optimizer and the version as they were."""
    spec = _spec("CartPole-v1")
    learner = _learner(spec)
    batch = _batch(spec)
    batch["truncated"][:] = 0
    batch["terminated"][:] = 0
    batch["truncation_value"][:] = 0
    batch["truncated"][0, 1] = 1
    batch["truncation_value"][0, 1] = 3e38
    batch["reward"][1, 2] = -3e38
    batch["behaviour_logits"][2, 3, 0] = 3e38
    stats = learner.step(batch)
    assert not stats["skipped"] and stats["inputs_clipped"] == 3 and learner.inputs_clipped == 3
    assert learner.parameters_finite() and learner.updates == 1

    # A NaN cannot arrive over the wire (the decoder rejects it), which makes it the simplest way to get a loss
    # that is not finite here.
    learner = _learner(spec)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    batch = _batch(spec)
    batch["obs"][0, 0, 0] = float("nan")
    stats = learner.step(batch)
    assert stats["skipped"] and learner.updates_skipped == 1 and learner.updates == 0
    assert learner.parameters_finite()
    for k, v in learner.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not learner.optimizer.state, "the optimizer took a step on a skipped update"
    stats = learner.step(_batch(spec))  # and the next, finite batch trains
    assert not stats["skipped"] and learner.updates == 1 and learner.parameters_finite()


def test_entropy_cost_anneals_linearly_when_asked():
    spec = _spec("CartPole-v1")
    constant = _learner(spec, entropy_cost=0.03, schedule_env_steps=1000)
    annealed = _learner(spec, entropy_cost=0.03, final_entropy_cost=0.003, schedule_env_steps=1000)
    for trained, want in ((0, 0.03), (500, 0.0165), (1000, 0.003), (5000, 0.003)):
        constant.env_steps_trained = annealed.env_steps_trained = trained
        assert constant.entropy_cost() == 0.03
        assert annealed.entropy_cost() == pytest.approx(want)
    annealed.env_steps_trained = 500
    stats = annealed.step(_batch(spec))
    assert stats["entropy_cost"] == pytest.approx(0.0165), "the loss uses the annealed weight"
    # The weight is in the loss: the same batch with another weight moves the parameters differently.
    a, b = (_learner(spec, seed=0, entropy_cost=c) for c in (0.0, 1.0))
    b.model.load_state_dict(a.model.state_dict())
    batch = _batch(spec)
    a.step(batch), b.step(batch)
    assert any(not torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))


@pytest.mark.parametrize("optimizer", ["adam", "rmsprop"])
def test_the_fused_update_computes_what_the_per_parameter_one_does(optimizer):
    """Adam runs fused and RMSprop foreach on the CPU (learn.py, Learner.switches): five updates move every weight as
    torch's per-parameter loop, the ground truth, moves it (to float rounding)."""
    spec = _spec("CartPole-v1")
    fast = _learner(spec, optimizer=optimizer)
    assert fast.optimizer.param_groups[0]["fused" if optimizer == "adam" else "foreach"] is True
    plain = _learner(spec, optimizer=optimizer)
    plain.optimizer = type(plain.optimizer)(
        plain.model.parameters(), **{k: v for k, v in fast.optimizer.defaults.items() if k not in ("fused", "foreach")}
    )
    for i in range(5):
        batch = {k: torch.from_numpy(v) for k, v in random_arrays(spec, 8, seed=i).items()}
        fast.step(batch)
        plain.step(batch)
    for a, b in zip(fast.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer,switch", [("adam", "fused"), ("rmsprop", "foreach")])
def test_a_checkpoint_of_the_unfused_optimizer_resumes_fused(optimizer, switch):
    """Checkpoints written before the optimizer ran fused (or foreach) hold None there: they pass resume's checks, and
    the resumed optimizer runs fused with the saved moments (the next update equals the saving learner's)."""
    from impala_async.learner.checkpoint.statecheck import optimizer_fits

    spec = _spec("CartPole-v1")
    cfg = LearnerConfig.of(optimizer=optimizer)
    old = _learner(spec, optimizer=optimizer)
    batch = {k: torch.from_numpy(v) for k, v in random_arrays(spec, 8, seed=1).items()}
    old.step(batch)
    saved = io.BytesIO()
    torch.save(old.state_dict(), saved)  # a checkpoint's copy, not the live tensors
    state = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    for g in state["optimizer"]["param_groups"]:
        g[switch] = None  # as an older learner saved it
    optimizer_fits(state["optimizer"], cfg, spec)
    resumed = _learner(spec, optimizer=optimizer)
    resumed.load_state_dict(state)
    assert resumed.optimizer.param_groups[0][switch] is True
    assert set(resumed.optimizer.param_groups[0]) == set(old.optimizer.param_groups[0]), "no key added"
    old.step(batch)
    resumed.step(batch)
    for a, b in zip(old.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_update_takes_a_second_thread_for_images_only():
    """--learner-threads 0 is resolved (and so written to config.json): two threads (where the machine has two) for
    Atari-sized images, one for vectors and for MinAtar's 10x10 planes (a small network's update loses with more:
    BENCHMARKS.md section 13); a number asked for is taken as it is."""
    from impala_async.config import Layered, LearnerConfig
    from impala_async.config.machine import usable_cpus
    from impala_async.config.resolve import Probe, resolve

    def threads(asked: int, image_max, obs_shape) -> tuple[int, str]:
        probe = Probe(image_max=image_max, trajectory_nbytes=1 << 10, obs_values=math.prod(obs_shape))
        layered = Layered(LearnerConfig.of(learner_threads=asked), {"learner_threads": "flag"} if asked else {})
        got = resolve(layered, default_listen="tcp://127.0.0.1:*", probe=probe)
        return got.cfg.run.learner_threads, got.layer("learner_threads")

    assert threads(0, 255.0, (4, 84, 84)) == (min(2, usable_cpus()), "resolved")
    assert threads(0, 1.0, (10, 10, 4)) == (1, "resolved")
    assert threads(0, None, (4,)) == (1, "resolved")
    assert threads(3, 1.0, (10, 10, 4)) == (3, "flag")


def test_entropy_anneal_takes_its_own_horizon_when_given_one():
    """``entropy_schedule_env_steps`` moves the entropy cost's anneal alone: the learning rate keeps
    ``schedule_env_steps``, and 0 (the default) leaves the entropy cost on that horizon too."""
    spec = _spec("CartPole-v1")
    kw = dict(learning_rate=6e-4, entropy_cost=0.01, final_entropy_cost=0.0006, schedule_env_steps=50_000_000)
    own, shared = (_learner(spec, entropy_schedule_env_steps=n, **kw) for n in (5_000_000, 0))
    for trained, entropy_own, entropy_shared in (
        (0, 0.01, 0.01),
        (2_500_000, 0.0053, 0.01 - 0.0094 * 0.05),
        (5_000_000, 0.0006, 0.01 - 0.0094 * 0.1),
        (20_000_000, 0.0006, 0.01 - 0.0094 * 0.4),
    ):
        own.env_steps_trained = shared.env_steps_trained = trained
        assert own.entropy_cost() == pytest.approx(entropy_own)
        assert shared.entropy_cost() == pytest.approx(entropy_shared)
        assert own.learning_rate() == shared.learning_rate() == pytest.approx(6e-4 * (1 - trained / 50_000_000))


def test_schedules_follow_their_own_horizon_not_the_budget():
    """A user who stops at 5M or at 50M gets the same learning rate and entropy cost at step 4M: the linear schedules
    run over ``schedule_env_steps``, and ``total_env_steps`` does not enter them."""
    spec = _spec("CartPole-v1")
    kw = dict(learning_rate=6e-4, entropy_cost=0.01, final_entropy_cost=0.001, schedule_env_steps=50_000_000)
    short, long = (_learner(spec, total_env_steps=n, **kw) for n in (5_000_000, 50_000_000))
    for trained, lr, entropy in (
        (0, 6e-4, 0.01),
        (4_000_000, 6e-4 * 0.92, 0.01 - 0.009 * 0.08),
        (50_000_000, 0, 0.001),
    ):
        short.env_steps_trained = long.env_steps_trained = trained
        assert short.learning_rate() == long.learning_rate() == pytest.approx(lr, abs=1e-12)
        assert short.entropy_cost() == long.entropy_cost() == pytest.approx(entropy)
    constant = _learner(spec, learning_rate=6e-4, lr_schedule="constant", schedule_env_steps=1000)
    constant.env_steps_trained = 10**9
    assert constant.learning_rate() == 6e-4


def test_a_linear_rate_that_would_reach_zero_before_the_budget_is_warned_of():
    assert LearnerConfig.of(total_env_steps=5_000_000, schedule_env_steps=5_000_000).warnings() == []
    assert LearnerConfig.of(total_env_steps=9_000_000, schedule_env_steps=1000, lr_schedule="constant").warnings() == []
    (warning,) = LearnerConfig.of(total_env_steps=9_000_000, schedule_env_steps=5_000_000).warnings()
    assert "5,000,000" in warning and "--schedule-env-steps" in warning and "--lr-schedule constant" in warning
    (warning,) = LearnerConfig.of(entropy_schedule_env_steps=5_000_000).warnings()
    assert "--final-entropy-cost" in warning
    assert LearnerConfig.of(entropy_schedule_env_steps=5_000_000, final_entropy_cost=0.0006).warnings() == []
    for bad in ({"schedule_env_steps": 0}, {"rmsprop_eps": 0.0}, {"adam_eps": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LearnerConfig.of(**bad).check()


def test_value_fc_is_built_from_the_configuration_and_trained():
    """--value-fc 1 reaches the network (run.model says so, for the actors) and an update moves both fully connected
    layers; with an LSTM core or an MLP it is refused by the configuration."""
    spec = TrajectorySpec(obs_shape=(4, 10, 10), obs_dtype="uint8", num_actions=3, unroll_length=5)
    learner = _learner(spec, model="minatar", value_fc=1)
    assert learner.model_config.to_dict()["value_fc"] is True
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    assert not learner.step(_batch(spec))["skipped"]
    for name in ("fc.0.weight", "value_fc.0.weight", "torso.0.weight"):
        assert not torch.equal(learner.model.state_dict()[name], before[name]), name
    for bad, why in (({"use_lstm": 1}, "without an LSTM core"), ({"model": "mlp"}, "needs an image network")):
        with pytest.raises(ValueError, match=why):
            LearnerConfig.of(value_fc=1, **bad).check()


def test_obs_norm_folds_each_batch_in_once_with_the_moments_numpy_gives():
    """--obs-norm 1: the learner keeps per-pixel running moments of its scaled inputs (nets.ObsNorm), updated by a
    batch's first update only, after it (a batch is normalised as its actor normalised it; ``updates_per_batch``'
    repeats see the same statistics). Ground truth: Chan et al.'s
    combination of moments, in float64 numpy, from the prior (mean 0, var 1, weight 1) over every observation."""
    spec = TrajectorySpec(obs_shape=(2, 12, 12), obs_dtype="uint8", num_actions=3, unroll_length=5)
    learner = _learner(spec, model="minatar", obs_norm=1, input_scale=1 / 255)
    norm = learner.model.obs_norm
    mean, var, count = np.zeros((2, 12, 12)), np.ones((2, 12, 12)), 1.0
    for seed in (1, 2):
        arrays = random_arrays(spec, 4, seed=seed)
        arrays["obs"][:, :, 0, :6] = 17  # a constant part of the picture: its variance stays the prior's share
        obs = arrays["obs"].reshape(-1, 2, 12, 12).astype(np.float64) * np.float32(1 / 255)  # [B * (T+1), C, H, W]
        n, bm, bv = len(obs), obs.mean(0), obs.var(0, ddof=1)
        total, delta = count + n, bm - mean
        var = (var * count + bv * n + delta**2 * count * n / total) / total
        mean, count = mean + delta * n / total, total
        batch = {k: torch.from_numpy(v) for k, v in arrays.items()}
        with torch.no_grad():  # the actor's logits at lag 0: the weights, and statistics, before this update
            batch["behaviour_logits"] = learner.model.unroll(batch["obs"], ())[0][:-1].transpose(0, 1).contiguous()
        stats = learner.step(batch)
        assert abs(stats["rho_mean"] - 1) < 1e-5, "the batch was normalised with statistics its actor did not have"
        learner.step(batch, count_steps=False)  # the same batch's second update: no second fold
        assert norm.count.item() == count == 1 + seed * 4 * 6
        np.testing.assert_allclose(norm.mean.numpy(), mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(norm.var.numpy(), var, rtol=1e-4, atol=1e-7)
    assert norm.var[0, :6].max() < 0.03 < norm.var[1].min()  # constant pixels: the prior's share (about 1/49) alone
    assert "obs_norm.mean" in learner.model.state_dict()  # buffers: they travel with the weights and checkpoints
