"""Actors follow a new learner incarnation (docs/protocol.md, "Learner restarts"): the same run, new weights; another
run, rebuilt; a run they cannot act in, one line and exit code RUN_CHANGED. Never an uncaught exception, never messages
rejected forever."""

import asyncio
import contextlib
import logging
import time

import inprocess
import numpy as np
import pytest
import zmq
from procutil import free_port_pair

from impala_async.actors import actor
from impala_async.actors.acting import MAX_WEIGHTS_BYTES, Acting
from impala_async.actors.procs import Heartbeat
from impala_async.actors.runs import RunError, build_run
from impala_async.config import ActorOptions
from impala_async.config.actors import ActorConfig
from impala_async.core import wire
from impala_async.core.models import ModelConfig, build_model
from impala_async.core.spec import TrajectorySpec
from impala_async.ops import exitcodes

K = 2


def run_info(env_id="CartPole-v1", obs_shape=(4,), num_actions=2, unroll_length=10, hidden_sizes=(64, 64)) -> dict:
    spec = TrajectorySpec(
        obs_shape=obs_shape, obs_dtype="float32", num_actions=num_actions, unroll_length=unroll_length
    )
    return {
        "protocol": wire.PROTOCOL_VERSION,
        "env_id": env_id,
        "env_kwargs": {},
        "spec": spec.to_dict(),
        "model": ModelConfig("mlp", hidden_sizes=hidden_sizes, activation="tanh").to_dict(),
        "max_trajectories_per_message": 256,
        "max_message_bytes": 16 << 20,
        "obs_codec": "lz4",
        "jpeg_quality": 90,
        "env_backend": "gymnasium",
    }


def weights(info: dict, version=1, incarnation=11, tensors=None) -> wire.WeightsMessage:
    """A weights message as an actor decodes it, for ``info``'s network (or the given ``tensors``)."""
    if tensors is None:
        model = build_model(TrajectorySpec.from_dict(info["spec"]), ModelConfig.from_dict(info["model"]))
        tensors = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    data = wire.encode_weights(version, tensors, info, incarnation)
    return wire.decode_weights(data, MAX_WEIGHTS_BYTES)


def config() -> ActorConfig:
    return ActorConfig(learner="tcp://127.0.0.1:1", weights="tcp://127.0.0.1:2", options=ActorOptions(envs_per_actor=K))


@pytest.fixture
def acting():
    """An Acting loop around a CartPole run (no sockets: only what takes weights is exercised)."""
    first = weights(run_info())
    loop = Acting(
        config(), "test", None, None, actor._Stop(), Heartbeat(-1, 1.0), None, build_run(config(), first), first
    )
    yield loop
    loop.run.close()


# ------------------------------------------------------------------------------------------------ in process
def test_the_same_incarnation_with_mismatched_tensors_is_ignored_with_a_warning(acting, caplog):
    before = {k: v.clone() for k, v in acting.run.policy.model.state_dict().items()}
    good = weights(run_info(), version=2)
    bad = dict(good.tensors, **{"policy_head.weight": np.zeros((2, 32), np.float32)})  # another shape
    with caplog.at_level(logging.WARNING):
        for version in (2, 3, 4):  # a learner re-sending it: one warning, not one per copy
            assert acting.take(good._replace(version=version, tensors=bad)) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "policy_head.weight has shape [2, 32]" in warnings[0].getMessage(), caplog.text
    assert acting.run.policy.version == 1  # nothing loaded, not even the tensors that did fit
    after = acting.run.policy.model.state_dict()
    assert all(np.array_equal(before[k].numpy(), after[k].numpy()) for k in before)
    missing = {k: v for k, v in good.tensors.items() if k != "value_head.bias"}
    assert acting.take(good._replace(version=5, tensors=missing)) is None  # a missing name: ignored too
    assert acting.take(good) is None and acting.run.policy.version == 2  # a good one afterwards is taken


def test_a_new_run_is_rebuilt_and_the_environments_kept_when_they_serve(acting, caplog):
    envs = acting.run.envs
    acting.run.state = "stale"  # the recurrent state must be fresh
    caplog.set_level(logging.INFO)
    # The same network, another unroll length: the spec and the buffers change.
    assert acting.take(weights(run_info(unroll_length=7), version=0, incarnation=12)) is None
    new = acting.run
    assert new.spec.unroll_length == 7 and new.obs_buf.shape == (K, 8, 4) and new.buf["action"].shape == (K, 7)
    assert (new.policy.version, new.policy.incarnation) == (0, 12) and new.state == ()
    assert new.envs is envs and not new.closed  # CartPole still: kept, reset
    assert "with another run (spec.unroll_length 10 -> 7): rebuilding" in caplog.text, caplog.text
    # Another network.
    assert acting.take(weights(run_info(unroll_length=7, hidden_sizes=(32,)), incarnation=13)) is None
    assert acting.run.policy.model.state_dict()["policy_torso.0.weight"].shape == (32, 4)
    assert "with another run (model.hidden_sizes [64, 64] -> [32])" in caplog.text, caplog.text
    # Another environment: the old ones are closed, new ones built.
    assert acting.take(weights(run_info("Acrobot-v1", (6,), 3, 7), incarnation=14)) is None
    assert acting.run.envs is not envs and acting.run.envs.obs.shape == (K, 6)
    # The same run again under a new incarnation: only the weights change.
    kept = acting.run
    assert acting.take(weights(run_info("Acrobot-v1", (6,), 3, 7), version=9, incarnation=15)) is None
    assert acting.run is kept and (kept.policy.version, kept.policy.incarnation) == (9, 15)


def test_a_new_run_this_actor_cannot_act_in_ends_it_with_run_changed(acting, caplog):
    msg = weights(run_info("NoSuchEnvironment-v0"), incarnation=12)
    with pytest.raises(RunError) as e:
        build_run(config(), msg)
    assert "NoSuchEnvironment-v0" in str(e.value) and "\n" not in str(e.value)
    with caplog.at_level(logging.INFO):
        assert acting.take(msg) == exitcodes.RUN_CHANGED == exitcodes.RUN_CHANGED == 9
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "NoSuchEnvironment-v0" in errors[0] and "\n" not in errors[0], errors
    assert acting.run.closed  # its environments closed: the caller exits
    # A network this actor cannot build, and tensors unlike the network the run names: RunError too.
    for bad in (
        weights(run_info(), tensors={}),
        weights(run_info())._replace(run_info=dict(run_info(), model={"kind": "transformer"})),
    ):
        with pytest.raises(RunError, match="run.model"):
            build_run(config(), bad)
    # An environment unlike the learner's spec (other versions of its package): refused before a message is sent.
    with pytest.raises(RunError, match=r"CartPole-v1 here gives observations \[4\] and 2 actions.*\[5\] and 2"):
        build_run(config(), weights(run_info(obs_shape=(5,))))
    assert (exitcodes.NO_WEIGHTS, exitcodes.REFUSED) == (exitcodes.NO_WEIGHTS, exitcodes.REFUSED)


# --------------------------------------------------------------------------------------------- real processes
def test_an_actor_that_cannot_follow_a_restart_exits_with_run_changed(caplog):
    """A fake learner (sockets in this test) runs CartPole, then restarts as a run the actor cannot build: the actor
    (``impala-async actor``'s, in a thread: tests/inprocess.py) ends with RUN_CHANGED and one ERROR line, no
    traceback."""
    port = free_port_pair()
    ctx = zmq.Context()
    pub, pull = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    pub.bind(f"tcp://127.0.0.1:{port + 1}")
    pull.bind(f"tcp://127.0.0.1:{port}")
    good = wire.encode_weights(1, weights(run_info()).tensors, run_info(), 21)
    bad = wire.encode_weights(1, weights(run_info()).tensors, run_info("NoSuchEnvironment-v0"), 22)
    cfg = ActorConfig(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", ActorOptions(envs_per_actor=K))
    try:
        with inprocess.actor_thread(cfg) as acting_actor:
            deadline = time.monotonic() + 45
            while not pull.poll(200):  # a trajectory from the actor
                pub.send(good)
                assert time.monotonic() < deadline and acting_actor.code is None, caplog.text
            deadline = time.monotonic() + 30
            while acting_actor.code is None and time.monotonic() < deadline:
                pub.send(bad)
                pull.poll(200) and pull.recv()
        assert acting_actor.code == exitcodes.RUN_CHANGED, caplog.text
        assert "Traceback" not in caplog.text, caplog.text
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("impala_async")]
        assert len(errors) == 1 and "NoSuchEnvironment-v0" in errors[0].getMessage(), caplog.text
    finally:
        ctx.destroy(0)


def test_an_actor_follows_a_restarted_learner_with_another_network_and_unroll_length(tmp_path, caplog):
    """The learner is stopped and a fresh one started at the same address with another network and unroll length:
    the same actor acts in the new run, and the new learner rejects none of its messages. Both learners serve in this
    test's loop, the actor in a thread (tests/inprocess.py)."""
    port = free_port_pair()
    common = ["--listen", f"tcp://127.0.0.1:{port}", "--publish", f"tcp://127.0.0.1:{port + 1}"]
    common += ["--batch-size", "2", "--report-interval-s", "0.3"]
    caplog.set_level(logging.INFO, logger="impala_async.actors")

    async def scenario():
        with contextlib.ExitStack() as stack:  # the actor outlives learner a
            cfg, spec = inprocess.configuration(tmp_path / "a", *common, "--unroll-length", "10")
            async with inprocess.serving(cfg, spec) as a:
                actor = stack.enter_context(inprocess.acting(a, envs_per_actor=K))
                received = a.parts.ingest.counters
                await inprocess.until(lambda: received()["trajectories_received"] > 0, "learner a's trajectories")
            changed = ("--unroll-length", "7", "--hidden-sizes", "32")
            cfg, spec = inprocess.configuration(tmp_path / "b", *common, *changed)
            async with inprocess.serving(cfg, spec) as b:
                # Ten messages in (what the actor had queued from the old run would have come first): none rejected.
                received = b.parts.ingest.counters
                await inprocess.until(lambda: received()["messages_received"] >= 10, "10 messages for learner b")
                counts = received()
                assert actor.code is None  # the same actor all along
        assert counts["trajectories_received"] > 0 and counts["messages_rejected"] == 0, counts

    asyncio.run(scenario())
    text = caplog.text
    assert "with another run (spec.unroll_length 10 -> 7; model.hidden_sizes [64, 64] -> [32])" in text, text
    assert text.count("actor 0 (") == 1 and "Traceback" not in text, text
