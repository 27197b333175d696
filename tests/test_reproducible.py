"""--reproducible 1 (issue 29): the same configuration and seed give the same run, bit for bit.

The runs are the real learner server in this test's event loop with two real actors in threads (tests/inprocess.py):
the lockstep is between the learner and the actors' own acting loops and sockets, as in `train`. The ordering of a
round's messages is also tested directly, with real encoded messages delivered in every order.
"""

from __future__ import annotations

import asyncio
import itertools

import inprocess
import numpy as np
import pytest
import torch
from procutil import run_cli

from impala_async.config import LearnerConfig, lockstep
from impala_async.core import wire
from impala_async.core.ring import TrajectoryRing
from impala_async.learner import checkpoint
from impala_async.learner.reports.metrics import read_metrics
from impala_async.learner.transport.ingest import Ingest

FLAGS = ("--unroll-length", "10", "--batch-size", "4", "--total-env-steps", "6000", "--reproducible", "1")
FLAGS += ("--report-interval-rounds", "10")
# What a metrics record may differ in between two runs of one seed: the clock's figures, the incarnation (drawn at
# random by design: docs/protocol.md) and the weights re-sent on a timer.
CLOCK_FIGURES = {"wall_s", "sps", "trajectories_per_s", "batches_per_s", "wire_mb_per_s", "decoded_mb_per_s"}
CLOCK_FIGURES |= {"stage_s_per_trajectory", "latency_p50_ms", "latency_p99_ms", "loop_lag_p99_ms"}
CLOCK_FIGURES |= {"pace_s_per_trajectory", "incarnation", "weights_sends", "weights_resends"}


def _run(tmp_path, seed: int, name: str, *flags: str) -> tuple[dict, list[dict]]:
    """The final checkpoint and the metrics records of a reproducible CartPole run: 2 actors x 4 environments, B 4
    (two batches a round), a report every 10 rounds."""
    cfg, spec = inprocess.configuration(tmp_path / name, *FLAGS, "--seed", str(seed), *flags)
    cfg = cfg.replace(num_actors=2, envs_per_actor=4)
    asyncio.run(inprocess.train(cfg, spec, actors=2, envs_per_actor=4))
    state, _ = checkpoint.load_latest(tmp_path / name / "run", validate=checkpoint.validate_learner_state)
    records = read_metrics(tmp_path / name / "run" / "metrics.jsonl")
    return state, [{k: v for k, v in r.items() if k not in CLOCK_FIGURES} for r in records]


def _same_parameters(a: dict, b: dict) -> bool:
    ma, mb = a["learner"]["model"], b["learner"]["model"]
    return ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def test_the_same_seed_gives_the_same_run_and_another_seed_another(tmp_path):
    (first, lines), (second, again) = _run(tmp_path, 3, "a"), _run(tmp_path, 3, "b")
    assert len(lines) == 6000 // (80 * 10) + 1 and lines == again, "metrics.jsonl differs beyond the clock's figures"
    assert first["policy_version"] == second["policy_version"] >= 6000 // 40
    assert first["env_steps"] == second["env_steps"] and first["episodes"] == second["episodes"] > 20
    assert first["returns"] == second["returns"] and first["lengths"] == second["lengths"]  # in the same order
    assert _same_parameters(first, second), "the final parameters differ between two runs of the same seed"
    other, _ = _run(tmp_path, 4, "c")
    assert not _same_parameters(first, other) and other["returns"] != first["returns"]


def _config(**values) -> LearnerConfig:
    return LearnerConfig.of(reproducible=1, **values)


@pytest.mark.parametrize(
    ("values", "device", "says"),
    [
        ({"num_actors": 0}, "cpu", "remote actors do not follow the lockstep"),
        ({"num_actors": 3, "envs_per_actor": 5, "batch_size": 4}, "cpu", "(3 x 5 = 15) must be a multiple of"),
        ({"num_actors": 1, "learner_ranks": 2}, "cpu", "learner_ranks 2"),
        ({"num_actors": 1}, "cuda", "use device cpu"),
        ({"num_actors": 1, "actor_device": "cuda"}, "cpu", "use device cpu"),
        ({"num_actors": 4, "envs_per_actor": 32, "batch_size": 4, "max_policy_lag": 8}, "cpu", "max_policy_lag 8"),
        ({"num_actors": 4, "envs_per_actor": 32, "batch_size": 4, "ring_batches": 16}, "cpu", "ring_batches 16"),
    ],
)
def test_what_it_cannot_cover_is_refused_in_one_line(values, device, says):
    refused = lockstep.refusals(_config(**values), device)
    assert len(refused) == 1 and says in refused[0] and refused[0].startswith("--reproducible 1: ")


def test_a_coverable_configuration_or_the_mode_off_is_not_refused():
    assert lockstep.refusals(_config(num_actors=2, envs_per_actor=32, batch_size=16), "cpu") == []
    assert lockstep.refusals(LearnerConfig.of(num_actors=0), "cuda") == []


def test_lockstep_actor_ids():
    assert [lockstep.actor_index(lockstep.actor_id(i)) for i in (0, 7, 123)] == [0, 7, 123]
    for other in ("host/12/ab12", "lockstep/", "lockstep/-1", "lockstep/1x", "x/lockstep/1", "lockstep/12345678"):
        assert lockstep.actor_index(other) is None, other


def _ordered(actors: int, spec, batch_size: int = 2):
    from impala_async.config.service import Limits
    from impala_async.learner.transport.lockstep import Ordered

    ring = TrajectoryRing(spec, batch_size, 8)
    ingest = Ingest(Limits(max_trajectories_per_message=4), 100, spec, ring, lambda: 0, incarnation=7)
    return Ordered(ingest, actors, max_held_messages=8), ring


def _message(spec, actor: str, seq: int, mark: int) -> bytes:
    """A one-trajectory message whose rewards are all ``mark``: where it lands in the ring says which it was."""
    arrays = {f.name: np.zeros((1, *f.shape), f.dtype) for f in spec.fields}
    arrays["reward"][:] = mark
    return wire.encode_trajectories(
        spec, actor_id=actor, seq=seq, policy_version=0, incarnation=7, arrays=arrays, episodes=[]
    )


@pytest.fixture(scope="module")
def spec():
    from impala_async.core.spec import TrajectorySpec

    return TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=5)


def test_a_round_enters_the_ring_in_actor_order_whatever_the_arrival_order(spec):
    # Two sequence numbers of three actors: marks 10 * seq + actor, delivered in every order of the six.
    messages = [(s, a) for s in range(2) for a in range(3)]
    for arrival in itertools.permutations(messages):
        ordered, ring = _ordered(3, spec)
        for s, a in arrival:
            ordered.handle(_message(spec, lockstep.actor_id(a), s, 10 * s + a))
        marks = []
        while (batch := ring.get(0.0)) is not None:
            marks += [int(r[0]) for r in batch.tensors["reward"].numpy()]
            ring.release(batch)
        assert marks == [0, 1, 2, 10, 11, 12], arrival
        assert ordered.continue_pending() and not ordered.held


def test_what_cannot_be_ordered_is_refused_and_counted(spec):
    ordered, ring = _ordered(2, spec)
    ordered.handle(_message(spec, "host/1/ab", 0, 1))  # not a lockstep id
    ordered.handle(_message(spec, lockstep.actor_id(2), 0, 1))  # no actor 2 in this run
    ordered.handle(_message(spec, lockstep.actor_id(0), 0, 1))
    ordered.handle(_message(spec, lockstep.actor_id(0), 0, 1))  # held already
    ordered.handle(_message(spec, lockstep.actor_id(1), 0, 1))  # completes seq 0: handed on
    ordered.handle(_message(spec, lockstep.actor_id(1), 0, 1))  # handed on already (a restarted actor)
    ordered.handle(b"\x00not msgpack")
    rejected = ordered.ingest.rejected
    assert (rejected["bad_identity"], rejected["replay"], rejected["malformed"]) == (2, 2, 1)
    assert ordered.ingest.trajectories_received == 2 and not ordered.held
    for seq in range(1, 5):  # actor 0 runs ahead: held up to the bound, then refused
        ordered.handle(_message(spec, lockstep.actor_id(0), seq, 1))
    assert len(ordered.held) == 4
    for seq in range(5, 10):
        ordered.handle(_message(spec, lockstep.actor_id(0), seq, 1))
    assert len(ordered.held) == 8 and rejected["too_large"] == 1


def test_cartpole_learns_to_a_bound_deterministically(tmp_path):
    """The learning regression test: one reproducible CartPole run with the defaults (the classic preset), seed 0, to
    30,000 steps. Today's code ends at a mean return of 104-124 over seeds 0-2 on this machine (a uniform policy: ~22);
    a change to the loss, V-trace or the optimiser that breaks learning falls under the bound every time, not
    sometimes. Another CPU may round differently (the run is exact on one machine and software): hence the margin."""
    cfg, spec = inprocess.configuration(tmp_path, "--total-env-steps", "30000", "--reproducible", "1", "--seed", "0")
    cfg = cfg.replace(num_actors=1)
    asyncio.run(inprocess.train(cfg, spec, envs_per_actor=cfg.actors.envs_per_actor))
    state, _ = checkpoint.load_latest(tmp_path / "run", validate=checkpoint.validate_learner_state)
    assert state["env_steps"] >= 30000 and len(state["returns"]) == 100
    assert np.mean(state["returns"]) >= 60.0, f"CartPole's mean return at 30k steps fell to {np.mean(state['returns'])}"


@pytest.mark.process
def test_a_resumed_reproducible_run_says_it_continues_only_from_the_checkpoint(tmp_path):
    """The real `train`, stopped at its budget and resumed with a larger one: the lockstep goes on (the run ends at
    its new budget) and the resumed run says it is not the uninterrupted one."""

    from procutil import TINY

    logdir, said = tmp_path / "run", "continues from the checkpoint's state"
    for budget, resume in ((1000, []), (2000, ["--resume", str(logdir)])):
        argv = [*TINY, "--reproducible", "1", "--total-env-steps", str(budget), "--logdir", str(logdir), *resume]
        out = run_cli("train", *argv, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert (said in out.stderr) == bool(resume), out.stderr[-2000:]
    state, _ = checkpoint.load_latest(logdir, validate=checkpoint.validate_learner_state)
    assert state["env_steps"] >= 2000 and state["config"]["reproducible"] == 1
