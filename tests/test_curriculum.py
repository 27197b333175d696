"""Curriculum (learner/curriculum.py): the schedule, its value in the weights message, the environment hook, and a
real run whose environments follow the schedule across a resume."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest
from helpers import CURRICULUM_ENV_STEPS, CURRICULUM_FLAGS, tool
from inprocess import configuration, resumed, train
from procutil import read_metrics

from impala_async.actors.envs import make_env, set_difficulty
from impala_async.config import LearnerConfig
from impala_async.config import sections as config
from impala_async.core import wire
from impala_async.learner import curriculum


def test_linear_schedule():
    s = curriculum.Linear(0.5, 2.0, 10_000)  # the source article's 0.5 -> 2.0, over 10,000 env steps
    assert [s.value(e) for e in (0, 2_500, 5_000, 10_000, 10**9)] == [0.5, 0.875, 1.25, 2.0, 2.0]
    assert s.value(-5) == 0.5
    assert curriculum.Linear(1.0, 0.0, 4).value(1) == 0.75  # falling works too
    with pytest.raises(ValueError):
        curriculum.Linear(0.5, float("nan"), 10)
    with pytest.raises(ValueError):
        curriculum.Linear(0.5, 1.0, 0)


def test_config_names_the_schedules():
    assert set(config.CURRICULA) == {"none", *curriculum.SCHEDULES}
    assert curriculum.from_config(LearnerConfig()) is None
    cfg = LearnerConfig.of(curriculum="linear", curriculum_start=1.0, curriculum_end=3.0, curriculum_env_steps=100)
    assert curriculum.from_config(cfg).value(50) == 2.0
    for bad in ({"curriculum": "cosine"}, {"curriculum_env_steps": 0}, {"curriculum_end": float("inf")}):
        with pytest.raises(ValueError, match="curriculum"):
            LearnerConfig.of(**bad).check()


def test_weights_message_carries_the_difficulty():
    tensors = {"w": np.arange(3, dtype=np.float32)}
    plain = wire.encode_weights(7, tensors, {"env_id": "x"}, 5)
    assert wire.decode_weights(plain, 1 << 20).difficulty is None  # absent: no curriculum
    data = wire.encode_weights(7, tensors, {"env_id": "x"}, 5, difficulty=1.25)
    msg = wire.decode_weights(data, 1 << 20)
    assert msg.difficulty == 1.25 and msg.version == 7 and msg.incarnation == 5
    assert wire.weights_header(data) == (7, 5)  # a re-sent copy is still told by version and incarnation
    import msgpack

    assert list(msgpack.unpackb(data))[:6] == ["v", "type", "version", "incarnation", "difficulty", "run"]
    bad = msgpack.packb({**msgpack.unpackb(data), "difficulty": "hard"})
    with pytest.raises(wire.Rejected, match="difficulty"):
        wire.decode_weights(bad, 1 << 20)


def test_the_hook_applies_at_the_next_reset():
    env = make_env("impala_async.actors.envs:DifficultyProbe-v0")
    env.reset(seed=0)
    assert env.step(0)[1] == 0.0  # never set
    assert set_difficulty(env, 1.5) == 1.5  # through the gymnasium wrappers to env.unwrapped
    assert env.step(0)[1] == 0.0  # not mid-episode
    env.reset()
    assert env.step(0)[1] == 1.5
    assert set_difficulty(env, None) is None
    env.reset()
    assert env.step(0)[1] == 1.5  # no curriculum: unchanged
    cartpole = make_env("CartPole-v1")
    assert set_difficulty(cartpole, 2.0) == 2.0  # an environment without the hook ignores it


CURRICULUM_ENV = CURRICULUM_FLAGS[CURRICULUM_FLAGS.index("--env") + 1]
N_STEPS = CURRICULUM_ENV_STEPS  # the ramp, in env steps trained: one one-step episode each
LAG = 2_000  # env steps (see the test's docstring)
WINDOW = 100  # episode_return_mean: the last 100 episodes
BATCH_STEPS = 4 * 5  # one update's env steps (CURRICULUM_FLAGS: batch 4 x unroll 5)


def schedule(trained: float) -> float:
    return 0.5 + 1.5 * min(1.0, max(0.0, trained) / N_STEPS)


def test_environments_follow_the_schedule_across_a_resume(tmp_path, monkeypatch, capsys):
    """DifficultyProbe's reward is the difficulty its episode ran at, so ``episode_return_mean`` (the last 100
    episodes) is the schedule seen through the actors. The schedule's clock is ``env_steps_trained`` (T, the
    learner's own count; each step here is an episode). Bounds for a record at T:

    - never ahead: at most schedule(T). The value an environment plays with was computed from the learner's count
      when it encoded those weights, and the count only grows. The record's ``difficulty`` (the value last sent) may
      be one update ahead of its T: a report reads the parts' counters one after the other while training goes on,
      the trained count before the weights' value (seen on a loaded machine: exactly one batch, 20 steps).
    - at most LAG behind: at least schedule(T - 100 - LAG). Between the encoding and the training of the episodes
      played with it lie the episodes in flight: the unroll being played when the weights arrive (an actor reads
      weights between unrolls), messages queued at the actor and at the learner (ZeroMQ marks of 4 and 8 messages,
      and the kernel's socket buffers, sized to about as many by default), what waits in the ring, and the next
      unroll, 20 episodes each here (4 one-step environments x 5 steps). Before the learner sets a pace (its first
      seconds, and again after the resume) an actor runs at most its send mark ahead of the weights
      (docs/protocol.md, Flow control). LAG = 2,000 allows for a loaded machine, still within 0.16 of the 1.5 the
      ramp climbs.

    The run stops early on the ramp and resumes from its checkpoint: the trained count, and with it the schedule,
    continues.
    """
    flags = _learner_flags()
    logdir = tmp_path / "run"

    async def scenario() -> int:
        cfg, spec = configuration(tmp_path, *flags, "--total-env-steps", "3000", env=CURRICULUM_ENV)
        await train(cfg, spec)
        first_run = len(read_metrics(logdir))
        cfg, spec, state = resumed(logdir, "--total-env-steps", str(N_STEPS + WINDOW + LAG))
        await train(cfg, spec, state=state)
        return first_run

    first_run = asyncio.run(scenario())
    rows = [r for r in read_metrics(logdir) if r["episode_return_mean"] is not None]
    assert rows
    ramp = [r for r in rows if r["env_steps_trained"] < N_STEPS]
    assert len(ramp) >= 4, [(r["env_steps_trained"], r["episode_return_mean"]) for r in rows]
    for r in rows:
        t, seen, sent = r["env_steps_trained"], r["episode_return_mean"], r["difficulty"]
        assert schedule(t - WINDOW - LAG) - 1e-9 <= seen <= schedule(t) + 1e-9, (t, seen, schedule(t))
        assert sent is not None and schedule(t - LAG) - 1e-9 <= sent <= schedule(t + BATCH_STEPS) + 1e-9, (t, sent)
        if t >= N_STEPS + WINDOW + LAG:
            assert seen == 2.0, (t, seen)
    assert rows[-1]["env_steps_trained"] >= N_STEPS + WINDOW + LAG
    after = read_metrics(logdir)[first_run:]
    before = read_metrics(logdir)[first_run - 1]
    assert before["difficulty"] > 0.6  # stopped on the way up (or past it) ...
    assert after[0]["env_steps_trained"] >= before["env_steps_trained"]  # ... and resumed the count,
    assert after[0]["difficulty"] >= before["difficulty"]  # and the schedule with it, not from its start
    # tools/curriculum_lag.py in its smallest mode (in this process): the lag it reports for this run is within the
    # bound held above
    monkeypatch.setattr(sys, "argv", ["curriculum_lag.py", "--logdir", str(logdir)])
    assert tool("curriculum_lag").main() == 0
    measured = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 <= measured["worst_lag_steps"] <= LAG + WINDOW / 2 and measured["worst_policy_lag_versions"] >= 0, measured


def _learner_flags() -> list[str]:
    """CURRICULUM_FLAGS for the learner alone: the environment and the actors' options are the test's to give."""
    flags, skip = [], {"--env", "--num-actors", "--envs-per-actor"}
    it = iter(CURRICULUM_FLAGS)
    for flag in it:
        value = next(it)
        if flag not in skip:
            flags += [flag, value]
    return flags
