"""The learner rank assembled whole (learner/assembly.py), in the test's own event loop: real sockets bound on
loopback, the real ring, trainer (not started), ingest, checkpoints and reports; no process started."""

from __future__ import annotations

import asyncio
import types

import torch
from inprocess import configuration

from impala_async.learner.assembly import assemble, assemble_outputs
from impala_async.learner.learn import Learner
from impala_async.learner.parts import Outputs
from impala_async.learner.ranks import SingleRank

REQUIRED = ("ctx", "ring", "pacer", "trainer", "ingest", "intake", "publisher", "listen", "publish", "updates")


def test_every_part_is_whole_and_closes_in_the_order_made(tmp_path):
    cfg, spec = configuration(tmp_path)
    closes: list[tuple[str, object]] = []
    made_for: list[tuple[str, str]] = []
    actors = types.SimpleNamespace(counters=dict)  # stands for train's actor processes, which assembly never starts

    async def scenario():
        from impala_async.learner.assembly import run_of

        info = {"env_id": "CartPole-v1"}
        run = run_of(cfg, spec, info, incarnation=7, started_at=0.0, resumed=None, config_layers=None)
        parts = assemble(
            run,
            Learner(cfg, spec, torch.device("cpu")),
            ranks=SingleRank(7),
            keys=None,
            resumed=None,
            closes=lambda name, close: closes.append((name, close)),
            after_update=lambda update: False,
            on_trainer_exit=lambda error: None,
            make_actors=lambda listen, publish: made_for.append((listen, publish)) or actors,
        )
        try:
            for name in REQUIRED:
                assert getattr(parts, name) is not None, name
            assert parts.authenticator is None  # no keys: no CURVE
            # The addresses as bound (ports chosen), given to the actors and listed for them in the run.
            assert parts.listen.startswith("tcp://127.0.0.1:") and not parts.listen.endswith(":*")
            assert made_for == [(parts.listen, parts.publish)] and parts.actors is actors
            assert info["trajectory_addresses"] == [parts.listen]
            # A slot the trainer frees wakes a receive loop waiting for room (the ring was given the room's signal).
            assert parts.ring.on_release == parts.intake.room.freed
            parts.ring.on_release()
            await asyncio.wait_for(parts.intake.room.event.wait(), 5)
            outputs = assemble_outputs(parts, fresh=True, closes=lambda name, close: closes.append((name, close)))
            assert isinstance(outputs, Outputs) and outputs.reports.latest[0]["env_steps"] == 0
            assert [name for name, _ in closes] == ["zeromq context", "sockets", "checkpoint writer", "reports"]
        finally:
            for _, close in reversed(closes):  # the server's shutdown: the mirror of assembly
                close()

    asyncio.run(scenario())
