"""The LSTM core end to end: a real actor process carries the recurrent state across unrolls and resets it where an
episode begins; the learner, given the state the actor sent, reproduces every logit the actor acted with (the
network also normalises its input, --obs-norm 1: the actor applies the statistics that came with the weights).

The test process plays the learner's sockets itself (a PULL and an XPUB, real ZeroMQ): it publishes one weights message
for a MinAtar Breakout network with an LSTM core (random weights, so that logits vary), collects the trajectory
messages a real `impala-async actor` sends, and replays them through the learner's code (``learn.recurrent_inputs``
and the network's ``unroll``). It needs the minatar extra."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import zmq
from inprocess import actor_thread
from procutil import free_port_pair

from impala_async.actors.actor import weights_address
from impala_async.config import ActorOptions
from impala_async.config.actors import ActorConfig
from impala_async.core import wire
from impala_async.core.decoder import TrajectoryDecoder
from impala_async.core.models import ModelConfig, build_model
from impala_async.core.spec import TrajectorySpec
from impala_async.learner.loss import recurrent_inputs

pytest.importorskip("minatar", reason="needs the minatar extra: pip install 'impala-async[minatar]'")

T, K, H = 50, 4, 32  # unroll length (the 50-100 the article recommends), environments, LSTM units


def test_the_learner_reproduces_the_actors_logits_from_the_carried_state(tmp_path, caplog):
    spec = TrajectorySpec(obs_shape=(4, 10, 10), obs_dtype="uint8", num_actions=3, unroll_length=T, core_state_size=H)
    cfg = ModelConfig.minatar(input_scale=1.0, lstm_size=H, obs_norm=True)  # the normaliser's buffers travel too
    torch.manual_seed(0)
    net = build_model(spec, cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        net.obs_norm.mean.uniform_(0.0, 0.5)  # statistics a run could have: a set cell stands out, up to the clip
        net.obs_norm.var.uniform_(0.01, 0.3)
    run_info = {
        "protocol": wire.PROTOCOL_VERSION,
        "env_id": "MinAtar/Breakout-v1",
        "env_kwargs": {},
        "spec": spec.to_dict(),
        "model": cfg.to_dict(),
        "max_trajectories_per_message": K,
        "max_message_bytes": 16 << 20,
    }
    weights = wire.encode_weights(0, {k: v.numpy() for k, v in net.state_dict().items()}, run_info, incarnation=7)
    port = free_port_pair()
    ctx = zmq.Context()
    pull, pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    for s in (pull, pub):
        s.setsockopt(zmq.LINGER, 0)
    pull.bind(f"tcp://127.0.0.1:{port}")
    pub.bind(f"tcp://127.0.0.1:{port + 1}")
    address = f"tcp://127.0.0.1:{port}"
    decoder = TrajectoryDecoder(spec)
    messages = []
    try:  # the actor of `impala-async actor` in a thread (tests/inprocess.py), this test its learner
        with actor_thread(ActorConfig(address, weights_address(address), ActorOptions(envs_per_actor=K))) as actor:
            deadline = time.monotonic() + 90
            while len(messages) < 4 and time.monotonic() < deadline:
                pub.send(weights)
                if pull.poll(200):
                    msg = decoder.parse(pull.recv())
                    dest = {f.name: np.empty((msg.n, *f.shape), f.dtype) for f in spec.fields}
                    decoder.decode_into(msg, dest)
                    messages.append((msg.seq, dest))
                assert actor.code is None, caplog.text
    finally:
        ctx.destroy(linger=0)
    assert len(messages) == 4, "the actor sent fewer than 4 unrolls\n" + caplog.text
    assert [seq for seq, _ in messages] == [0, 1, 2, 3]

    boundaries = 0
    for i, (_, arrays) in enumerate(messages):
        batch = {k: torch.from_numpy(v) for k, v in arrays.items()}
        state, starts = recurrent_inputs(batch)
        with torch.no_grad():
            logits, _ = net.unroll(batch["obs"], state, starts)  # [T+1, K, A]
        np.testing.assert_allclose(logits[:T].transpose(0, 1).numpy(), arrays["behaviour_logits"], rtol=1e-5, atol=1e-5)
        boundaries += int(starts[:, 1:T].sum())
        if i + 1 < len(messages):  # the next unroll starts from where this one left off, reset if an episode ended
            h, c = state
            with torch.no_grad():
                for t in range(T):
                    keep = (~starts[:, t]).float().unsqueeze(1) if t else torch.ones(K, 1)
                    _, _, (h, c) = net.step(batch["obs"][:, t], (h * keep, c * keep))
            ended = (batch["terminated"][:, T - 1] | batch["truncated"][:, T - 1]).bool()
            h[ended], c[ended] = 0.0, 0.0
            following = messages[i + 1][1]["core_state"]
            np.testing.assert_allclose(following[:, 0], h.numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(following[:, 1], c.numpy(), rtol=1e-5, atol=1e-5)
    assert boundaries >= 2, "no episode began inside an unroll: the reset was not exercised"
    first_states = messages[0][1]["core_state"]
    assert not first_states.any(), "the first unroll starts from zeros"
    assert np.abs(messages[1][1]["core_state"]).max() > 0.01, "the state was not carried across unrolls"


def test_a_message_without_the_state_is_rejected_with_a_reason():
    spec = TrajectorySpec(obs_shape=(4, 10, 10), obs_dtype="uint8", num_actions=3, unroll_length=5, core_state_size=8)
    plain = TrajectorySpec(obs_shape=(4, 10, 10), obs_dtype="uint8", num_actions=3, unroll_length=5)
    rng = np.random.default_rng(0)
    arrays = {f.name: np.zeros((1, *f.shape), f.dtype) for f in plain.fields}
    arrays["obs"] = rng.integers(0, 2, arrays["obs"].shape, dtype=np.uint8)
    data = wire.encode_trajectories(plain, actor_id="a", seq=0, policy_version=0, incarnation=1, arrays=arrays)
    with pytest.raises(wire.Rejected, match="core_state") as e:
        TrajectoryDecoder(spec).parse(data)
    assert e.value.reason == "bad_field"
    arrays["core_state"] = np.full((1, 2, 8), np.nan, np.float32)
    data = wire.encode_trajectories(spec, actor_id="a", seq=0, policy_version=0, incarnation=1, arrays=arrays)
    decoder = TrajectoryDecoder(spec)
    msg = decoder.parse(data)
    with pytest.raises(wire.Rejected) as e:
        decoder.decode_into(msg, {f.name: np.empty((1, *f.shape), f.dtype) for f in spec.fields})
    assert e.value.reason == "nonfinite"
