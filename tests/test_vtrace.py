"""V-trace against an independent numpy ground truth.

The ground truth evaluates the paper's definition as an explicit double sum, not the backward recursion:

    v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{i=s}^{t-1} gamma_i c_i) * delta_t
"""

import zlib

import numpy as np
import pytest
import torch

from impala_async.core import vtrace


def _clip(x, threshold):
    return x if threshold is None else np.minimum(x, threshold)


def _double_sum(deltas, discounts, cs):
    """sum_{t=s}^{T-1} (prod_{i=s}^{t-1} gamma_i c_i) * delta_t for every s, as an explicit double sum."""
    T = deltas.shape[0]
    out = np.zeros_like(deltas)
    for s in range(T):
        for t in range(s, T):
            weight = np.ones_like(deltas[0])
            for i in range(s, t):
                weight = weight * discounts[i] * cs[i]
            out[s] = out[s] + weight * deltas[t]
    return out


def ground_truth(
    log_rhos, discounts, rewards, values, bootstrap, rho_bar, pg_rho_bar, c_bar, lam=1.0, magnitudes=False
):
    """float64 numpy; arrays [T, ...]; bootstrap [...]. Returns (vs, pg_advantages), each [T, ...].

    With ``magnitudes`` it returns instead the same sums taken over the absolute value of every term: the size of
    what an fp32 computation adds up, which bounds its rounding error (unclipped traces multiply the error of a late
    step by a product of c's, so a result of 3 can carry the error of terms in the hundreds)."""
    log_rhos, discounts, rewards, values, bootstrap = (
        np.asarray(a, dtype=np.float64) for a in (log_rhos, discounts, rewards, values, bootstrap)
    )
    sign = 1.0
    if magnitudes:
        rewards, values, bootstrap, sign = np.abs(rewards), np.abs(values), np.abs(bootstrap), -1.0
    rhos = np.exp(log_rhos)
    clipped_rhos, cs = _clip(rhos, rho_bar), lam * _clip(rhos, c_bar)
    v_next = np.concatenate([values[1:], bootstrap[None]], axis=0)
    deltas = clipped_rhos * (rewards + discounts * v_next - sign * values)
    vs = values + _double_sum(deltas, discounts, cs)
    vs_next = np.concatenate([vs[1:], bootstrap[None]], axis=0)
    pg = _clip(rhos, pg_rho_bar) * (rewards + discounts * vs_next - sign * values)
    return vs, pg


def random_inputs(rng, shape, episode_ends=True):
    T = shape[0]
    log_rhos = rng.normal(0.0, 1.0, shape)  # rhos spread well above and below 1: clipping matters
    discounts = np.full(shape, 0.97)
    if episode_ends:
        discounts = np.where(rng.random(shape) < 0.2, 0.0, discounts)
    rewards = rng.normal(0.0, 1.0, shape)
    values = rng.normal(0.0, 1.0, shape)
    bootstrap = rng.normal(0.0, 1.0, shape[1:])
    assert T == values.shape[0]
    return log_rhos, discounts, rewards, values, bootstrap


def assert_fp32_close(got, want, scale, what):
    """fp32 against the float64 truth, to 1e-5 of the size of the terms that were summed.

    ``scale`` comes from ``ground_truth(..., magnitudes=True)``. A result that is small because large terms cancel
    carries the absolute rounding error of those terms, so a tolerance relative to the result alone would be flaky."""
    got = np.asarray(got, dtype=np.float64)
    bound = 1e-5 * (1.0 + scale)
    worst = np.max(np.abs(got - want) - bound)
    assert worst <= 0, f"{what}: off by {worst:.3g} beyond 1e-5 of the term sizes"


def stable_seed(*parts):
    """hash() of a tuple holding None differs between processes on Python 3.11; crc32 of repr does not."""
    return zlib.crc32(repr(parts).encode())


CLIPS = [(1.0, 1.0, 1.0), (None, None, None), (0.8, 1.2, 0.9), (None, 1.0, 1.0), (1.0, None, None)]


@pytest.mark.parametrize("shape", [(1, 3), (5, 4), (20, 7), (1, 2, 3), (6, 3, 2), (12, 2, 5)])
@pytest.mark.parametrize("clips", CLIPS)
def test_matches_double_sum(shape, clips):
    rng = np.random.default_rng(stable_seed(shape, clips))
    inputs = random_inputs(rng, shape)
    want_vs, want_pg = ground_truth(*inputs, *clips)
    got = vtrace.from_importance_weights(
        *(torch.tensor(a, dtype=torch.float32) for a in inputs),
        clip_rho_threshold=clips[0],
        clip_pg_rho_threshold=clips[1],
        clip_c_threshold=clips[2],
    )
    assert got.vs.dtype == torch.float32 and got.pg_advantages.dtype == torch.float32
    assert got.vs.shape == shape and got.pg_advantages.shape == shape
    if clips[2] is not None:  # c clipped: well conditioned, fp32 agrees to 1e-5 outright
        np.testing.assert_allclose(got.vs.numpy(), want_vs, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.pg_advantages.numpy(), want_pg, rtol=1e-5, atol=1e-5)
    else:  # c unclipped: to 1e-5 of the terms' magnitude (see assert_fp32_close)
        vs_scale, pg_scale = ground_truth(*inputs, *clips, magnitudes=True)
        assert_fp32_close(got.vs.numpy(), want_vs, vs_scale, "vs")
        assert_fp32_close(got.pg_advantages.numpy(), want_pg, pg_scale, "pg_advantages")


@pytest.mark.parametrize("seed", range(200))
def test_unclipped_many_seeds(seed):
    """Unclipped traces multiply a late step's rounding error by a product of c's (into the hundreds): the case
    where fp32 cannot agree to 1e-5 outright, only to 1e-5 of the magnitudes summed (worst seen: 5e-7 of them)."""
    inputs = random_inputs(np.random.default_rng(seed), (12, 2, 5))
    want_vs, want_pg = ground_truth(*inputs, None, None, None)
    got = vtrace.from_importance_weights(
        *(torch.tensor(a, dtype=torch.float32) for a in inputs),
        clip_rho_threshold=None,
        clip_pg_rho_threshold=None,
        clip_c_threshold=None,
    )
    vs_scale, pg_scale = ground_truth(*inputs, None, None, None, magnitudes=True)
    assert_fp32_close(got.vs.numpy(), want_vs, vs_scale, "vs")
    assert_fp32_close(got.pg_advantages.numpy(), want_pg, pg_scale, "pg_advantages")


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95])
def test_lambda_matches_double_sum(lam):
    rng = np.random.default_rng(7)
    inputs = random_inputs(rng, (9, 3))
    want_vs, want_pg = ground_truth(*inputs, 1.0, 1.0, 1.0, lam)
    got = vtrace.from_importance_weights(*(torch.tensor(a) for a in inputs), lambda_=lam)
    np.testing.assert_allclose(got.vs.numpy(), want_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.pg_advantages.numpy(), want_pg, rtol=1e-5, atol=1e-5)


def test_discount_zero_cuts_the_trace():
    # An episode end at t=1 means v_0 and v_1 cannot depend on anything after step 1.
    rng = np.random.default_rng(0)
    log_rhos, discounts, rewards, values, bootstrap = random_inputs(rng, (6, 4), episode_ends=False)
    discounts[1] = 0.0
    a = vtrace.from_importance_weights(*(torch.tensor(x) for x in (log_rhos, discounts, rewards, values, bootstrap)))
    rewards2, values2 = rewards.copy(), values.copy()
    rewards2[2:] += 5.0
    values2[2:] -= 3.0
    changed = (log_rhos, discounts, rewards2, values2, bootstrap + 7)
    b = vtrace.from_importance_weights(*(torch.tensor(x) for x in changed))
    np.testing.assert_allclose(a.vs[:2].numpy(), b.vs[:2].numpy(), rtol=1e-6)
    assert not np.allclose(a.vs[2:].numpy(), b.vs[2:].numpy())


def test_on_policy_is_n_step_return():
    # With pi == mu and no clipping active, v_s is the discounted n-step return bootstrapped at T.
    T, B = 7, 3
    rng = np.random.default_rng(1)
    rewards, values, bootstrap = rng.normal(size=(T, B)), rng.normal(size=(T, B)), rng.normal(size=B)
    discounts = np.full((T, B), 0.9)
    got = vtrace.from_importance_weights(
        torch.zeros(T, B), torch.tensor(discounts), torch.tensor(rewards), torch.tensor(values), torch.tensor(bootstrap)
    )
    ret = bootstrap.copy()
    want = np.empty((T, B))
    for t in reversed(range(T)):
        ret = rewards[t] + 0.9 * ret
        want[t] = ret
    np.testing.assert_allclose(got.vs.numpy(), want, rtol=1e-5, atol=1e-5)


def test_article_pseudocode_bug_is_not_reproduced():
    # The source article's loop sets vs[t] = gamma * c * (vs[t+1] - V[t+1]) only, dropping V(x_t) + delta_t.
    T, B = 4, 2
    rng = np.random.default_rng(2)
    inputs = random_inputs(rng, (T, B), episode_ends=False)
    got = vtrace.from_importance_weights(*(torch.tensor(a) for a in inputs))
    log_rhos, discounts, rewards, values, bootstrap = inputs
    cs = np.minimum(np.exp(log_rhos), 1.0)
    buggy = np.empty((T, B))
    nxt, v_next = bootstrap, bootstrap
    for t in reversed(range(T)):
        buggy[t] = discounts[t] * cs[t] * (nxt - v_next)
        nxt, v_next = buggy[t], values[t]
    assert not np.allclose(got.vs.numpy(), buggy, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_computed_in_fp32(dtype):
    T, B = 9, 5
    rng = np.random.default_rng(3)
    inputs = random_inputs(rng, (T, B))
    low = [torch.tensor(a, dtype=torch.float32).to(dtype) for a in inputs]
    # Ground truth on exactly the values the low-precision tensors hold.
    want_vs, want_pg = ground_truth(*(t.double().numpy() for t in low), 1.0, 1.0, 1.0)
    got = vtrace.from_importance_weights(*low)
    assert got.vs.dtype == torch.float32 and got.pg_advantages.dtype == torch.float32
    np.testing.assert_allclose(got.vs.numpy(), want_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.pg_advantages.numpy(), want_pg, rtol=1e-5, atol=1e-5)


def test_autocast_does_not_lower_precision():
    T, B = 8, 4
    rng = np.random.default_rng(4)
    inputs = [torch.tensor(a, dtype=torch.float32) for a in random_inputs(rng, (T, B))]
    want_vs, _ = ground_truth(*(t.numpy() for t in inputs), 1.0, 1.0, 1.0)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        got = vtrace.from_importance_weights(*inputs)
    assert got.vs.dtype == torch.float32
    np.testing.assert_allclose(got.vs.numpy(), want_vs, rtol=1e-5, atol=1e-5)


def test_outputs_carry_no_gradient():
    T, B = 5, 3
    rng = np.random.default_rng(5)
    inputs = [torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in random_inputs(rng, (T, B))]
    got = vtrace.from_importance_weights(*inputs)
    assert not got.vs.requires_grad and not got.pg_advantages.requires_grad


@pytest.mark.parametrize("batch_shape", [(4,), (3, 2)])
def test_from_logits(batch_shape):
    T, A = 6, 5
    rng = np.random.default_rng(6)
    shape = (T, *batch_shape)
    behaviour = rng.normal(size=shape + (A,))
    target = rng.normal(size=shape + (A,))
    actions = rng.integers(0, A, size=shape)
    _, discounts, rewards, values, bootstrap = random_inputs(rng, shape)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    def taken(logits):
        return np.take_along_axis(log_softmax(logits), actions[..., None], axis=-1)[..., 0]

    want_log_rhos = taken(target) - taken(behaviour)
    want_vs, want_pg = ground_truth(want_log_rhos, discounts, rewards, values, bootstrap, 1.0, 1.0, 1.0)

    target_t = torch.tensor(target, dtype=torch.float32, requires_grad=True)
    got = vtrace.from_logits(
        torch.tensor(behaviour, dtype=torch.float32),
        target_t,
        torch.tensor(actions),
        *(torch.tensor(a, dtype=torch.float32) for a in (discounts, rewards, values, bootstrap)),
    )
    np.testing.assert_allclose(got.log_rhos.numpy(), want_log_rhos, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.behaviour_action_log_probs.numpy(), taken(behaviour), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.target_action_log_probs.detach().numpy(), taken(target), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.vs.numpy(), want_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.pg_advantages.numpy(), want_pg, rtol=1e-5, atol=1e-5)
    assert got.target_action_log_probs.requires_grad and not got.log_rhos.requires_grad
    assert not got.vs.requires_grad and not got.pg_advantages.requires_grad


def test_bf16_logits_from_logits_in_fp32():
    T, B, A = 5, 3, 4
    g = torch.Generator().manual_seed(0)
    behaviour = torch.randn(T, B, A, generator=g).bfloat16()
    target = torch.randn(T, B, A, generator=g).bfloat16()
    actions = torch.randint(0, A, (T, B), generator=g)
    rest = [torch.randn(T, B, generator=g).bfloat16() for _ in range(3)]
    got = vtrace.from_logits(
        behaviour, target, actions, rest[0].abs(), rest[1], rest[2], torch.randn(B, generator=g).bfloat16()
    )
    for field in got:
        assert field.dtype == torch.float32


def test_shape_errors_are_explained():
    with pytest.raises(ValueError, match="bootstrap_value"):
        vtrace.from_importance_weights(*(torch.zeros(3, 2) for _ in range(4)), torch.zeros(3))
    with pytest.raises(ValueError, match="rewards"):
        vtrace.from_importance_weights(
            torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3, 1), torch.zeros(3, 2), torch.zeros(2)
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("clips", CLIPS)
def test_cuda_matches_double_sum(clips):
    """On the GPU, under bf16 autocast as the learner may run it: fp32 results that match the ground truth."""
    inputs = random_inputs(np.random.default_rng(stable_seed("cuda", clips)), (20, 7))
    want_vs, want_pg = ground_truth(*inputs, *clips)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        got = vtrace.from_importance_weights(
            *(torch.tensor(a, dtype=torch.float32, device="cuda") for a in inputs),
            clip_rho_threshold=clips[0],
            clip_pg_rho_threshold=clips[1],
            clip_c_threshold=clips[2],
        )
    assert got.vs.device.type == "cuda" and got.vs.dtype == torch.float32
    vs_scale, pg_scale = ground_truth(*inputs, *clips, magnitudes=True)
    assert_fp32_close(got.vs.cpu().numpy(), want_vs, vs_scale, "vs")
    assert_fp32_close(got.pg_advantages.cpu().numpy(), want_pg, pg_scale, "pg_advantages")


@pytest.mark.parametrize("shape", [(1, 3), (20, 8), (7, 4, 5)])
def test_backward_sums_numpy_and_torch_paths_agree_bit_for_bit(shape):
    """The CPU's numpy recursion and the torch one (every other device's) evaluate the same expression in the same
    order; against a from-scratch sum, and with a zero decay cutting the sum where an episode ended."""
    g = torch.Generator().manual_seed(7)
    deltas, decay = torch.randn(*shape, generator=g), torch.rand(*shape, generator=g)
    decay[shape[0] // 2] = 0.0
    fast, plain = vtrace.backward_sums(deltas, decay), vtrace._torch_backward_sums(deltas, decay)
    assert fast.dtype == torch.float32 and torch.equal(fast, plain)
    d, k = deltas.double().numpy(), decay.double().numpy()
    truth = [sum(d[j] * np.prod(k[t:j], axis=0) for j in range(t, shape[0])) for t in range(shape[0])]
    np.testing.assert_allclose(fast.numpy(), np.stack(truth), rtol=1e-5, atol=1e-6)
