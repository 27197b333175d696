"""The learner server in the test's own event loop (tests/inprocess.py): trajectories pushed over a real socket are
trained on, newer weights are published, and the run ends by itself at its budget with a final checkpoint."""

from __future__ import annotations

import asyncio
import time

import zmq
from helpers import random_arrays
from inprocess import acting, configuration, serving, until
from loopback import pusher, subscriber

from impala_async.core import wire
from impala_async.learner import checkpoint


def test_pushed_trajectories_are_trained_on_and_newer_weights_published(tmp_path):
    # B 4 x T 10: 40 env steps an update; the budget is 12 updates' worth.
    cfg, spec = configuration(tmp_path, "--unroll-length", "10", "--batch-size", "4", "--total-env-steps", "480")
    ctx = zmq.Context()

    async def scenario():
        async with serving(cfg, spec) as server:
            p = server.parts
            push, sub = pusher(ctx, p.listen), subscriber(ctx, p.publish)
            try:
                first = wire.decode_weights(await _receive(sub), 1 << 30)
                assert first.version == 0 and first.run_info["trajectory_addresses"] == [p.listen]
                for seq in range(16):  # 16 messages of 4 trajectories: more than the budget needs
                    push.send(
                        wire.encode_trajectories(
                            spec,
                            actor_id="in-process",
                            seq=seq,
                            policy_version=0,
                            incarnation=first.incarnation,
                            arrays=random_arrays(spec, 4, seed=seq),
                            sent_at_ns=time.time_ns(),
                        )
                    )
                await until(lambda: p.trainer.policy_version >= 4, "4 updates")
                newer = wire.decode_weights(await _receive(sub, newer_than=0), 1 << 30)
                assert newer.version >= 1 and newer.incarnation == first.incarnation
                await until(lambda: server.stopping(), "the run to end at its budget")
            finally:
                push.close(0)
                sub.close(0)
        assert server.exit_code == 0 and server.exit_reason == "total_env_steps reached"
        assert p.ingest.counters()["trajectories_rejected"] == 0
        saved, _ = checkpoint.load_latest(tmp_path / "run", validate=checkpoint.validate_learner_state)
        assert saved["learner"]["env_steps_trained"] >= 480

    try:
        asyncio.run(scenario())
    finally:
        ctx.term()


def test_a_real_actor_in_a_thread_trains_the_run_to_its_budget(tmp_path):
    """tests/inprocess.py's acting: the actor's own loop and sockets against the server in this loop, no process."""
    cfg, spec = configuration(tmp_path, "--unroll-length", "10", "--batch-size", "4", "--total-env-steps", "2000")

    async def scenario():
        async with serving(cfg, spec) as server:
            with acting(server, envs_per_actor=4) as actor:
                await until(lambda: server.stopping(), "the run to end at its budget")
            p = server.parts
        assert actor.code == 0
        assert server.exit_code == 0 and server.exit_reason == "total_env_steps reached"
        counts = p.ingest.counters()
        assert counts["trajectories_rejected"] == 0 and counts["episodes"] > 0
        assert p.trainer.policy_version >= 2000 // 40
        # One trajectory connection for the whole run: the actor once connected, then connected again to size its
        # send buffer, and its first message could go down with the first connection (a lockstep run then waited
        # for it for ever: 1 start in 5 on a loaded machine).
        assert p.intake.guard.accepted == 1, p.intake.guard.accepted

    asyncio.run(scenario())


async def _receive(sub: zmq.Socket, newer_than: int = -1, timeout_s: float = 30.0) -> bytes:
    """The next weights message whose version is above ``newer_than`` (re-sends of older ones are skipped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sub.poll(0):
            data = sub.recv()
            header = wire.weights_header(data)
            if header is not None and header[0] > newer_than:
                return data
        await asyncio.sleep(0.01)
    raise AssertionError(f"no weights message newer than version {newer_than} within {timeout_s:g} s")
