"""The real learner server inside the test's own event loop (as uvicorn's tests/utils.py runs its server): its
configuration resolved as the `learner` command resolves it, real sockets on loopback, the real training thread; no
process started. For behaviour that needs no second process: a test pushes trajectories and subscribes to weights
itself, or attaches real actors in threads of its own (:func:`acting`: the acting loop of ``impala-async actor``, its
own sockets, without the process around it)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time

import torch

from impala_async import cli
from impala_async.actors import actor
from impala_async.config.actors import ActorConfig
from impala_async.config.resolve import resolve
from impala_async.core import wire
from impala_async.learner import main as learner_main
from impala_async.learner.checkpoint import resume
from impala_async.learner.learn import Learner
from impala_async.learner.ranks import SingleRank
from impala_async.learner.server import LearnerServer

LOOPBACK = "tcp://127.0.0.1:*"  # a free port, chosen at bind


def configuration(tmp_path, *flags: str, env: str = "CartPole-v1"):
    """(configuration, trajectory spec) of `impala-async learner --env ENV FLAGS` on loopback ports that the bind
    chooses, its logdir ``tmp_path/run``."""
    cfg, spec, _ = _configured(["--env", env, "--logdir", str(tmp_path / "run"), *flags])
    return cfg, spec


def resumed(logdir, *flags: str):
    """(configuration, trajectory spec, checkpoint state) of `impala-async learner --resume LOGDIR FLAGS`: the
    checkpoint's configuration with ``flags`` over it, its newest good state (those that fail set aside)."""
    return _configured(["--resume", str(logdir), *flags])


def _configured(argv: list[str]):
    """Both sockets on loopback ports the bind chooses, unless ``argv`` gives --listen (--publish then defaults to
    its port + 1, as for the command)."""
    ports = [] if "--listen" in argv else ["--listen", LOOPBACK, "--publish", LOOPBACK]
    args = cli.build_parser().parse_args(["learner", *ports, *argv])
    layered, state = cli.load_learner_config(args)
    spec, probe, _ = learner_main.probe_environment(layered.cfg)
    return resolve(layered, default_listen=LOOPBACK, probe=probe).cfg, spec, state


@contextlib.asynccontextmanager
async def serving(cfg, spec, *, state: dict | None = None, timeout_s: float = 30.0):
    """A LearnerServer serving in this loop until the block ends (then stopped and awaited, exit code in
    ``server.exit_code``), restored from a checkpoint's ``state`` (:func:`resumed`) if given; entered once its receive
    loop runs."""
    learner_main.seed_generators(cfg)  # as the learner process does before it builds the network
    learner, state = resume.restore(lambda: Learner(cfg, spec, torch.device("cpu")), cfg, spec, state)
    server = LearnerServer(
        cfg,
        learner,
        spec,
        learner_main.run_info(cfg, spec, learner, "gymnasium"),
        start_monotonic=time.monotonic(),
        resumed=state,
        ranks=SingleRank(wire.new_incarnation(), state),
    )
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + timeout_s
    while server.parts is None or server.parts.intake.beat is None:  # assembled, and the receive loop runs
        assert not task.done(), f"the server ended at startup: {server.exit_reason}"
        assert time.monotonic() < deadline, "the server did not start"
        await asyncio.sleep(0.01)
    try:
        yield server
    finally:
        if not task.done():
            server.request_stop("the test is over")
        await asyncio.wait_for(task, timeout_s)


async def until(condition, what: str, timeout_s: float = 30.0) -> None:
    """Wait (yielding to the server) until ``condition()``; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class _Actor:
    def __init__(self):
        self.requested = False  # actor.attach's stop
        self.code: int | None = None  # its exit code, once it ended


@contextlib.contextmanager
def acting(server, *, index: int = 0, seed: int = 0, join_timeout_s: float = 30.0, **options):
    """An actor attached to ``server`` in a thread of this process (actors/actor.py ``attach``, with the learner's
    actor options and ``options`` over them), stopped and joined when the block ends; ``.code`` its exit code."""
    p = server.parts
    opts = dataclasses.replace(server.cfg.actors.options(), **options)
    with actor_thread(ActorConfig(p.listen, p.publish, opts, index=index, seed=seed), join_timeout_s) as handle:
        yield handle


@contextlib.contextmanager
def actor_thread(cfg: ActorConfig, join_timeout_s: float = 30.0):
    """``impala-async actor``'s actor (``attach``) for ``cfg`` in a thread of this process, attached to whatever
    listens at ``cfg.learner``; stopped and joined when the block ends, ``.code`` its exit code (None while it acts)."""
    handle = _Actor()

    def main() -> None:
        handle.code = actor.attach(cfg, handle)

    thread = threading.Thread(target=main, name=f"actor-{cfg.index}", daemon=True)
    thread.start()
    try:
        yield handle
    finally:
        handle.requested = True
        thread.join(join_timeout_s)
        assert not thread.is_alive(), f"actor {cfg.index} did not stop within {join_timeout_s} s"


async def train(
    cfg, spec, *, state: dict | None = None, envs_per_actor: int = 4, actors: int = 1, timeout_s: float = 120.0
):
    """What `impala-async train` does with ``actors`` local actors, in this loop: serve (from a checkpoint's ``state``
    if given) with real actors in threads (seeded from the run's seed) until the run ends at its budget; the server,
    stopped (exit code 0)."""
    async with serving(cfg, spec, state=state) as server:
        with contextlib.ExitStack() as stack:
            handles = [
                stack.enter_context(acting(server, index=i, seed=cfg.run.seed, envs_per_actor=envs_per_actor))
                for i in range(actors)
            ]
            await until(server.stopping, "the run to end at its budget", timeout_s=timeout_s)
    assert server.exit_code == 0 and all(h.code == 0 for h in handles), server.exit_reason
    return server
