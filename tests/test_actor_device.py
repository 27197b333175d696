"""The actor's forward pass on a device (actors/rollout.py ``Policy``; ``--actor-device``, actor ``--device``).

The device path (observations through a host staging buffer, logits and values back as one copy, the LSTM state on
the device) runs here on the CPU with ``staged=True`` and must give the CPU path's numbers bit for bit, over whole
unrolls of real environments. On a machine with CUDA the same unrolls run on the GPU (pinned buffer) and must agree
to float tolerance; without CUDA those tests skip, and asking for cuda is refused in one line.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from procutil import cli, tail

from impala_async.actors.rollout import Policy, unroll
from impala_async.actors.vec import make_vec
from impala_async.core import wire
from impala_async.core.models import ModelConfig, build_model
from impala_async.core.spec import TrajectorySpec

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as an actor runs (two threads on a busy 2-CPU machine made each step 20x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def weights(spec: TrajectorySpec, cfg: ModelConfig) -> wire.WeightsMessage:
    torch.manual_seed(0)
    net = build_model(spec, cfg)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # random weights: logits that vary from step to step
    run_info = {
        "protocol": wire.PROTOCOL_VERSION,
        "env_id": "impala_async.actors.envs:PongLike-v0",
        "env_kwargs": {},
        "spec": spec.to_dict(),
        "model": cfg.to_dict(),
    }
    data = wire.encode_weights(3, {k: v.numpy() for k, v in net.state_dict().items()}, run_info, incarnation=7)
    return wire.decode_weights(data, 1 << 30)


SPEC_LSTM = TrajectorySpec(
    obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=12, core_state_size=16
)
CFG_LSTM = ModelConfig("conv", lstm_size=16)


def run_unrolls(policy: Policy, unrolls: int = 2, K: int = 3) -> list[dict]:
    """``unrolls`` unrolls of K PongLike environments (short episodes: resets and state resets happen)."""
    spec = policy.spec
    envs = make_vec(
        "impala_async.actors.envs:PongLike-v0",
        {"points_to_win": 1, "max_episode_steps": 7},
        K,
        obs_dtype=spec.obs_dtype,
    )
    envs.reset(range(K))
    rng = np.random.default_rng(0)
    state = policy.initial_state(K)
    out = []
    try:
        for _ in range(unrolls):
            buf = {f.name: np.zeros((K, *f.shape), f.dtype) for f in spec.fields}
            state = unroll(policy, envs, state, rng, buf, buf["obs"])
            out.append(buf)
    finally:
        envs.close()
    return out


def test_the_staged_path_on_the_cpu_is_bit_identical():
    msg = weights(SPEC_LSTM, CFG_LSTM)
    plain, staged = Policy(msg), Policy(msg, "cpu", staged=True)
    assert not plain.staged and staged.staged and staged.device.type == "cpu"
    a, b = run_unrolls(plain), run_unrolls(staged)
    assert a[0]["truncated"].any(), "no time limit cut an episode: the bootstrap path was not exercised"
    assert a[1]["core_state"].any(), "the LSTM state was not carried"
    for x, y in zip(a, b, strict=True):
        for name in x:
            np.testing.assert_array_equal(x[name], y[name], err_msg=name)
    # Batches of other sizes reuse the staging buffer (the truncation bootstrap steps a subset).
    obs = np.random.default_rng(1).integers(0, 255, (5, 4, 84, 84), dtype=np.uint8)
    for n in (5, 2, 5):
        la, va, _ = plain.step(obs[:n], plain.initial_state(n))
        lb, vb, _ = staged.step(obs[:n], staged.initial_state(n))
        np.testing.assert_array_equal(la, lb)
        np.testing.assert_array_equal(va, vb)
        assert lb.shape == (n, 6) and vb.shape == (n,)


def test_a_feed_forward_network_goes_the_same_way():
    spec = TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=10)
    msg = weights(spec, ModelConfig("conv"))
    a, b = run_unrolls(Policy(msg), 1), run_unrolls(Policy(msg, "cpu", staged=True), 1)
    for name in a[0]:
        np.testing.assert_array_equal(a[0][name], b[0][name], err_msg=name)


@CUDA
def test_cuda_agrees_with_the_cpu():
    msg = weights(SPEC_LSTM, CFG_LSTM)
    gpu = Policy(msg, "cuda")
    assert gpu.staged and next(gpu.model.parameters()).is_cuda
    assert gpu.initial_state(3)[0].is_cuda
    a, b = run_unrolls(Policy(msg)), run_unrolls(gpu)
    assert gpu._host.is_pinned()
    # The same actions need the same logits to within the sampling; compare the first unroll's first step exactly
    # enough, and the logits of every step to a tolerance (cuDNN may use TF32 and other kernels).
    np.testing.assert_allclose(a[0]["behaviour_logits"][:, 0], b[0]["behaviour_logits"][:, 0], rtol=1e-2, atol=1e-2)
    for x, y in zip(a, b, strict=True):
        same = (x["action"] == y["action"]).all(axis=1)
        assert same.any(), "the GPU policy acted differently in every environment"


@pytest.mark.process
def test_cuda_without_a_device_is_refused_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    log = tmp_path / "log"
    proc = cli(
        "train",
        "--env",
        "CartPole-v1",
        "--actor-device",
        "cuda",
        "--num-actors",
        "1",
        "--logdir",
        str(tmp_path / "run"),
        log=log,
    )
    try:
        assert proc.wait(60) != 0
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert "--actor-device cuda asked for, but torch sees no CUDA device" in log.read_text(), tail(log)
    proc = cli("actor", "--learner", "tcp://127.0.0.1:9", "--device", "cuda", log=log)
    assert proc.wait(60) != 0
    assert "--device cuda asked for, but torch sees no CUDA device" in log.read_text(), tail(log)
