"""Flow control by pace (learner/transport/pacing.py, docs/protocol.md "Flow control").

- The pace formula on hand-computed cases, the adaptive target and the sender window.
- The control loop against an independent discrete-time simulation of a learner and its actors: with pacing, actors
  that act faster than the learner trains lose nothing and the trainer stays fed; without it the surplus is dropped.
- A real actor process keeps the pace a test-side learner publishes (real ZeroMQ sockets, real CartPole).
- The weights message field on the wire.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import zmq
from inprocess import actor_thread
from procutil import free_port_pair

from impala_async.config import ActorOptions
from impala_async.config.actors import ActorConfig
from impala_async.core import wire
from impala_async.core.models import ModelConfig, build_model
from impala_async.core.spec import TrajectorySpec
from impala_async.learner.transport.pacing import FACTOR_HI, FACTOR_LO, Pacer


# ------------------------------------------------------------------------------------------------ the formula
def _fed(pacer: Pacer, batches: int, per_s: float, batch: int = 16, t0: float = 0.0) -> float:
    """Consume ``batches`` batches at ``per_s`` batches a second; return the time of the last."""
    t = t0
    for _ in range(batches):
        pacer.consumed(batch, 0.0, now=t)
        t += 1.0 / per_s
    return t - 1.0 / per_s


def _sending(pacer: Pacer, actors, trajectories: int, every_s: float, until: float) -> None:
    """Each of ``actors`` sends a message of ``trajectories`` every ``every_s`` from 0 to ``until``."""
    t = 0.0
    while t <= until + 1e-9:
        for actor in actors:
            pacer.accepted(actor, trajectories, now=t)
        t += every_s


def test_pace_shares_the_consumption_rate_among_the_senders():
    p = Pacer(target_trajectories=32, window_s=5.0, max_pace_s_per_trajectory=10.0)
    assert p.pace(0, now=0.0) == 0.0, "nothing consumed yet: no pacing"
    _sending(p, ("a", "b"), 16, 0.1, until=1.0)  # each faster than its share: both held to it
    t = _fed(p, 11, per_s=10.0)  # 10 batches of 16 after the first, in 1 s: 160 trajectories a second
    assert p.pace(32, now=t) == pytest.approx(2 / 160, rel=1e-6), "at the target: the rate shared by 2"
    assert p.pace(0, now=t) == pytest.approx(2 / (160 * FACTOR_HI), rel=1e-6), "empty: faster"
    assert p.pace(1000, now=t) == pytest.approx(2 / (160 * FACTOR_LO), rel=1e-6), "far above: slowest factor"


def test_pacing_off_and_the_slowest_pace():
    off = Pacer(target_trajectories=0, window_s=5.0, max_pace_s_per_trajectory=10.0)
    off.accepted("a", 16, now=0.0)
    assert off.pace(0, now=_fed(off, 5, per_s=10.0)) == 0.0
    slow = Pacer(target_trajectories=16, window_s=100.0, max_pace_s_per_trajectory=0.5)
    for i in range(50):
        slow.accepted(str(i), 1, now=0.0)
    t = _fed(slow, 3, per_s=0.1, batch=1)  # 0.1 trajectories a second shared by 50: 500 s each, capped
    assert slow.pace(16, now=t) == 0.5


def test_senders_are_those_of_the_window():
    p = Pacer(target_trajectories=16, window_s=5.0, max_pace_s_per_trajectory=10.0)
    p.accepted("old", 16, now=0.0)
    p.accepted("new", 16, now=8.0)
    t = _fed(p, 10, per_s=10.0, t0=6.0)  # now 6.9: "old" was 6.9 s ago
    p.pace(16, now=t)
    assert p.senders == 1, "an actor silent for longer than the window no longer shares the rate"


def _starved_near_target(p: Pacer, batches: range, dt_s: float) -> None:
    """Batches of 16 the trainer waited for, each after a backlog that had reached the target (late messages)."""
    for i in batches:
        p.pace(int(p.target), now=i * dt_s)
        p.consumed(16, waited_s=0.05, now=i * dt_s)


def test_the_target_grows_when_the_trainer_starves_and_shrinks_back():
    p = Pacer(target_trajectories=32, window_s=5.0, max_pace_s_per_trajectory=10.0, capacity_trajectories=128)
    p.accepted("a", 32, now=0.0)
    _starved_near_target(p, range(20), 0.1)
    assert p.target == 128 - 32 - 16, "starved at every batch: up to a message and a batch below capacity"
    for i in range(20, 20 + 100 * 80):
        p.consumed(16, waited_s=0.0, now=i * 0.1)
    assert p.target == 32, "fed at every batch: back down to the configured target"


def test_a_spell_of_starvation_is_forgotten_within_a_few_hundred_batches():
    # A ring of 64 batches; a spell of 200 starved batches takes the target to its ceiling. Fed again, the backlog
    # it asks for must come down within hundreds of batches, not tens of thousands (a fixed hundredth of a batch a
    # batch: 50 fed batches for each starved one), or the policy lag stays at the ring's size long after the cause
    # has gone.
    p = Pacer(target_trajectories=32, window_s=5.0, max_pace_s_per_trajectory=10.0, capacity_trajectories=1024)
    p.accepted("a", 16, now=0.0)
    _starved_near_target(p, range(200), 0.05)
    assert p.target > 960, "starved at every batch: at its ceiling, near the ring's capacity"
    for i in range(200, 200 + 300):
        p.consumed(16, waited_s=0.0, now=i * 0.05)
    assert p.target < 32 + 3 * 16, p.target
    for i in range(500, 800):
        p.consumed(16, waited_s=0.0, now=i * 0.05)
    assert p.target == 32, p.target


def test_a_trainer_short_of_supply_keeps_its_target():
    # Starved while the backlog stays empty (a receive loop busy with an attack, actors slower than the learner): a
    # larger target cannot mend that, and would only hold a larger backlog, and policy lag, once supply is back
    # (CI: a target of 753 trajectories and a policy lag of 107 updates after an attack).
    p = Pacer(target_trajectories=32, window_s=5.0, max_pace_s_per_trajectory=10.0, capacity_trajectories=1024)
    p.accepted("a", 16, now=0.0)
    for i in range(400):
        p.pace(0, now=i * 0.05)
        p.consumed(16, waited_s=0.05, now=i * 0.05)
    assert p.target == 32
    # Late messages after a backlog at the target: that one the target is for.
    _starved_near_target(p, range(400, 404), 0.05)
    assert p.target == 32 + 4 * 8


def test_a_message_larger_than_the_target_is_the_target():
    p = Pacer(target_trajectories=16, window_s=5.0, max_pace_s_per_trajectory=10.0)
    _sending(p, ("a",), 64, 0.4, until=1.0)
    t = _fed(p, 11, per_s=10.0)
    assert p.pace(64, now=t) == pytest.approx(1 / 160, rel=1e-6), "64 waiting is on target when messages are 64"


# ------------------------------------------------------------------------------------- the loop, simulated
def simulate(
    pace: bool,
    unroll_s: list[float],
    trajectories: int,
    update_s: float,
    batch: int = 16,
    capacity: int = 128,
    seconds: float = 60.0,
    dt: float = 0.001,
    attack: tuple[int, float, float, float] | None = None,
) -> dict:
    """A learner taking ``batch`` trajectories per ``update_s`` from a ring of ``capacity`` (overflow dropped, as
    drop_oldest does) and publishing a pace after every update; actors that act an unroll of ``trajectories`` in
    ``unroll_s[i]`` and, before the next, wait for the pace they last received. Independent of the server's code
    but for the Pacer under test. ``attack`` = (connections, messages per second, start, stall): from ``start`` on,
    one-trajectory messages at that rate in all, each from the next of ``connections`` in turn; for the first
    ``stall`` seconds of it every update takes 10 times as long (the learner's CPU taken by the attack's burst)."""
    pacer = Pacer(2 * batch if pace else 0, 5.0, 10.0, capacity_trajectories=capacity)
    published = 0.0
    waiting = dropped = produced = consumed = 0
    connections, attack_per_s, attack_at, stall_s = attack or (1, 1.0, math.inf, 0.0)
    attacks, actor_rates = 0, [0, 0]  # the actors' trajectories in the 10 s before the attack, and after its start
    busy_until, waited, starved, fed_at = None, 0.0, 0.0, None
    actors = [{"start": 0.0, "done": u} for u in unroll_s]  # acting until "done"; None while waiting for the pace
    t, max_waiting, late_waiting = 0.0, 0, []
    while t < seconds:
        for i, a in enumerate(actors):
            if a["done"] is not None and t >= a["done"]:
                produced += trajectories
                waiting += trajectories
                pacer.accepted(str(i), trajectories, now=t)
                if t >= attack_at - 10.0:
                    actor_rates[t >= attack_at] += trajectories
                if waiting > capacity:
                    dropped += waiting - capacity
                    waiting = capacity
                a["done"] = None
            if a["done"] is None and t >= a["start"] + trajectories * published:
                a["start"], a["done"] = t, t + unroll_s[i]
        if t >= attack_at + attacks / attack_per_s:
            pacer.accepted(f"connection {attacks % connections}", 1, now=t)
            waiting, attacks = min(capacity, waiting + 1), attacks + 1
        max_waiting = max(max_waiting, waiting)
        if t >= seconds / 2:
            late_waiting.append(waiting)
        if busy_until is not None and t >= busy_until:
            busy_until = None
            published = pacer.pace(waiting, now=t)
        if busy_until is None:
            if waiting >= batch:
                waiting -= batch
                consumed += batch
                pacer.consumed(batch, waited, now=t)
                stalled = attack_at <= t < attack_at + stall_s
                waited, busy_until, fed_at = 0.0, t + update_s * (10.0 if stalled else 1.0), t
            else:
                waited += dt
                if fed_at is not None and t > 5.0:  # starved once data had flowed, after a warm-up
                    starved += dt
        t += dt
    return {
        "dropped_fraction": dropped / max(1, produced),
        "starved_fraction": starved / (seconds - 5.0),
        "consumed_per_s": consumed / seconds,
        "max_waiting": max_waiting,
        "late_mean_waiting": float(np.mean(late_waiting)) if late_waiting else 0.0,
        "pace": published,
        "actors_per_s_before_attack": actor_rates[0] / 10.0,
        "actors_per_s_in_attack": actor_rates[1] / max(1e-9, seconds - attack_at),
    }


@pytest.mark.parametrize("unroll_s", [[0.02], [0.01, 0.03], [0.02] * 4])
def test_actors_faster_than_the_learner_lose_nothing_when_paced(unroll_s):
    # 16 trajectories per 20 ms = 800 trajectories/s of training; the actors could deliver 1,600 to 6,400.
    paced = simulate(True, unroll_s, 32, 0.02)
    free = simulate(False, unroll_s, 32, 0.02)
    assert free["dropped_fraction"] > 0.4, free
    assert paced["dropped_fraction"] < 0.02, paced  # the first seconds, before any rate is known
    assert paced["starved_fraction"] < 0.05, paced
    assert paced["consumed_per_s"] >= 0.95 * free["consumed_per_s"], (paced, free)


def test_pacing_costs_nothing_when_the_actors_are_the_bottleneck():
    # One actor delivering 32 trajectories per 100 ms (320/s) to a learner that could train 1,600/s.
    paced = simulate(True, [0.1], 32, 0.01)
    free = simulate(False, [0.1], 32, 0.01)
    assert free["dropped_fraction"] == 0.0
    assert paced["consumed_per_s"] >= 0.98 * free["consumed_per_s"], (paced, free)


@pytest.mark.parametrize("connections", [100, 1_000, 10_000])
def test_slow_senders_on_many_connections_leave_the_actor_its_rate_after_a_stall(connections):
    """Issue 27, row 1, as CI's process test meets it (tests/test_misleading.py): an actor of 2 trajectories per
    10 ms, a learner that trains 200 a second, and from t = 20 s 20 one-trajectory messages a second over
    ``connections`` connections, the learner slowed for the attack's first second. Paced from what the trainer
    consumed, the stall held the actor to a twentieth of its rate for good (consumption followed the pace and the
    pace consumption; each connection that had sent once counted a trajectory a second); paced from what the
    trainer can take, the actor is back to what the attack leaves it (the learner's 200 a second but the attack's
    20) within seconds."""
    run = simulate(True, [0.01], 2, 0.02, batch=4, capacity=64, seconds=30.0, attack=(connections, 20.0, 20.0, 1.0))
    assert run["actors_per_s_in_attack"] >= 0.75 * run["actors_per_s_before_attack"], run


def simulate_ranks(
    ranks: int,
    pacer_ranks: int,
    unroll_s: list[float],
    trajectories: int,
    update_s: float,
    batch: int = 16,
    capacity: int = 128,
    seconds: float = 20.0,
    dt: float = 0.001,
) -> dict:
    """A learner of ``ranks`` ranks in lock step (an update takes ``batch`` from every rank's ring, and waits until each
    has one) whose rank 0 alone paces, from its own ring and arrivals, with ``Pacer(ranks=pacer_ranks)``; actors send
    each unroll as one message to the ranks in turn (ZeroMQ's PUSH round-robin), starting at different ranks."""
    pacer = Pacer(2 * batch, 5.0, 10.0, capacity_trajectories=capacity, ranks=pacer_ranks)
    published = 0.0
    waiting, dropped, produced, consumed = [0] * ranks, 0, 0, 0
    busy_until, waited, starved = None, 0.0, 0.0
    actors = [{"start": 0.0, "done": u, "next": i % ranks} for i, u in enumerate(unroll_s)]
    t, fed, backlog = 0.0, False, []
    while t < seconds:
        for i, a in enumerate(actors):
            if a["done"] is not None and t >= a["done"]:
                r, a["next"] = a["next"], (a["next"] + 1) % ranks
                produced += trajectories
                waiting[r] += trajectories
                if r == 0:
                    pacer.accepted(str(i), trajectories, now=t)
                if waiting[r] > capacity:
                    dropped += waiting[r] - capacity
                    waiting[r] = capacity
                a["done"] = None
            if a["done"] is None and t >= a["start"] + trajectories * published:
                a["start"], a["done"] = t, t + unroll_s[i]
        if busy_until is not None and t >= busy_until:
            busy_until = None
            published = pacer.pace(waiting[0], now=t)
        if busy_until is None:
            if min(waiting) >= batch:
                waiting = [w - batch for w in waiting]
                consumed += ranks * batch
                pacer.consumed(batch, waited, now=t)
                waited, busy_until, fed = 0.0, t + update_s, True
            else:
                waited += dt
                if fed and t > 5.0:
                    starved += dt
        if t > 5.0:
            backlog.append(sum(waiting))
        t += dt
    return {
        "dropped_fraction": dropped / max(1, produced),
        "starved_fraction": starved / (seconds - 5.0),
        "consumed_per_s": consumed / seconds,
        "mean_waiting_per_rank": float(np.mean(backlog)) / ranks,
    }


def test_the_pace_is_right_for_several_learner_ranks():
    # 4 ranks x 16 trajectories per 20 ms = 3,200 trajectories/s of training; 8 actors could deliver 6,400.
    unroll = [0.04] * 8
    right = simulate_ranks(4, 4, unroll, 32, 0.02)
    assert right["dropped_fraction"] < 0.02, right
    assert right["starved_fraction"] < 0.05, right
    assert right["consumed_per_s"] > 0.9 * 3200, right
    # Rank 0 sees a quarter of the data: paced as if it were the whole learner, the actors would be asked for a
    # quarter of what training takes, more than the factor (at most 3x) can make up.
    wrong = simulate_ranks(4, 1, unroll, 32, 0.02)
    assert wrong["starved_fraction"] > 0.15 and wrong["consumed_per_s"] < 0.85 * right["consumed_per_s"], wrong
    # Two ranks (a 2x error is within what the factor and the adaptive target make up, so no contrast here): fed,
    # nothing dropped, about the target (2 batches, 32 trajectories) waiting at each rank.
    right2 = simulate_ranks(2, 2, unroll[:4], 32, 0.02)
    assert right2["dropped_fraction"] < 0.02 and right2["starved_fraction"] < 0.05, right2
    assert 24 <= right2["mean_waiting_per_rank"] <= 64, right2


# --------------------------------------------------------------------------------- a real actor keeps the pace
def _cartpole_weights(pace_s_per_trajectory: float, version: int, k: int) -> bytes:
    spec = TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=5)
    cfg = ModelConfig("mlp", hidden_sizes=(8,), activation="tanh")
    net = build_model(spec, cfg)
    run_info = {
        "protocol": wire.PROTOCOL_VERSION,
        "env_id": "CartPole-v1",
        "env_kwargs": {},
        "spec": spec.to_dict(),
        "model": cfg.to_dict(),
        "max_trajectories_per_message": k,
        "max_message_bytes": 16 << 20,
    }
    tensors = {name: v.detach().numpy() for name, v in net.state_dict().items()}
    return wire.encode_weights(version, tensors, run_info, incarnation=3, pace_s_per_trajectory=pace_s_per_trajectory)


def _message_times(pace: float, k: int, count: int, **options) -> list[float]:
    """When each of ``count`` messages of ``impala-async actor``'s actor (in a thread: tests/inprocess.py; ``options``:
    its ActorOptions) arrived, this test its learner sending CartPole weights with ``pace``."""
    port = free_port_pair()
    ctx = zmq.Context()
    pull, pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    for s in (pull, pub):
        s.setsockopt(zmq.LINGER, 0)
    pull.bind(f"tcp://127.0.0.1:{port}")
    pub.bind(f"tcp://127.0.0.1:{port + 1}")
    weights = _cartpole_weights(pace, 1, k)
    times: list[float] = []
    opts = ActorOptions(envs_per_actor=k, **options)
    cfg = ActorConfig(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", opts)
    try:
        with actor_thread(cfg) as actor:
            deadline = time.monotonic() + 60
            last_pub = 0.0
            while len(times) < count and time.monotonic() < deadline:
                if time.monotonic() - last_pub > 0.05:  # the same weights again and again, as a learner re-sends them
                    pub.send(weights)
                    last_pub = time.monotonic()
                if pull.poll(10):
                    pull.recv()
                    times.append(time.monotonic())
                assert actor.code is None, f"the actor ended with {actor.code}"
    finally:
        ctx.destroy(linger=0)
    assert len(times) == count, "the actor sent too few messages"
    return times


def test_a_real_actor_keeps_the_pace_it_is_sent():
    k, pace = 4, 0.1  # 4 trajectories per unroll: at least 0.4 s from one unroll's start to the next
    # Arrivals, not starts: the first unroll's warm-up (first forward pass, resets) makes it longer than the next, so
    # the gap after it can be short by that much on a loaded machine (0.26 s, beside a Pong run).
    paced = np.diff(_message_times(pace, k, 6)[1:])
    assert paced.min() >= 0.9 * k * pace, paced
    free = np.diff(_message_times(0.0, k, 5))
    assert np.median(free) < 0.5 * k * pace, f"unpaced, an unroll of 4 x 5 CartPole steps is fast: {free}"


def test_an_actor_keeps_the_users_cap_on_its_env_steps():
    """--max-env-steps-per-s: with no pace from the learner, unrolls of 4 x 5 CartPole steps at most 100 steps a second
    start at least 0.2 s apart (unpaced and uncapped they take under 0.2 s: the test above); where the learner's pace
    asks for more (0.1 s a trajectory: 0.4 s an unroll), the pace holds."""
    k, T, cap = 4, 5, 100.0
    capped = np.diff(_message_times(0.0, k, 6, max_env_steps_per_s=cap)[1:])
    assert capped.min() >= 0.9 * k * T / cap, capped
    paced = np.diff(_message_times(0.1, k, 5, max_env_steps_per_s=cap)[1:])
    assert paced.min() >= 0.9 * k * 0.1, paced
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="max_env_steps_per_s"):
            ActorOptions(max_env_steps_per_s=bad).check()


# ----------------------------------------------------------------------------------------------- the wire
def test_the_weights_message_carries_the_pace():
    w = wire.decode_weights(_cartpole_weights(0.25, 1, 4), 1 << 20)
    assert w.pace_s_per_trajectory == 0.25
    assert wire.decode_weights(_cartpole_weights(0.0, 1, 4), 1 << 20).pace_s_per_trajectory == 0.0
    assert wire.weights_header(_cartpole_weights(0.25, 7, 4))[0] == 7, "version and incarnation still come first"
    import msgpack

    msg = msgpack.unpackb(_cartpole_weights(0.25, 1, 4))
    assert "pace_s_per_trajectory" in msg and "pace_s_per_trajectory" not in msgpack.unpackb(
        _cartpole_weights(0.0, 1, 4)
    ), "left out when 0"
    for bad in (-1.0, math.nan, math.inf, True, "0.1"):
        msg["pace_s_per_trajectory"] = bad
        with pytest.raises(wire.Rejected, match="pace_s_per_trajectory"):
            wire.decode_weights(msgpack.packb(msg, use_bin_type=True), 1 << 20)


def test_a_slow_learner_paces_an_actor_of_large_messages():
    """Pong on two slow cores, as measured: one actor of 128 environments (an unroll of 128 trajectories in 5.5 s,
    twice what the learner takes) and a learner taking a batch of 32 every 2.5 s. Messages come further apart than
    the 5-s window, and so do batches: the actor must still count as a sender between its messages, and the rate
    must still be known between batches, or the pace falls to 0 and the surplus is acted only to be dropped."""
    paced = simulate(True, [5.5], 128, 2.5, batch=32, capacity=416, seconds=600.0, dt=0.005)
    free = simulate(False, [5.5], 128, 2.5, batch=32, capacity=416, seconds=600.0, dt=0.005)
    assert free["dropped_fraction"] > 0.3, free
    assert paced["dropped_fraction"] < 0.03, paced
    assert paced["starved_fraction"] < 0.05, paced


@pytest.mark.parametrize("unroll_s", [0.5, 0.7, 1.0])
def test_an_actor_held_back_by_the_pace_is_not_taken_for_a_slow_one(unroll_s):
    """Pong on these two cores as run with the Atari preset: one actor of 32 environments acting an unroll in a
    second or less, a learner taking a batch of 16 a second from a ring of 38 batches. While more than the target
    wait, the pace holds the actor to a quarter of its share; measured over its own horizon it then sends under half
    its share, which is what marks a slow sender (one that does not use its share). Taken for one, it got no pace at
    all, and the backlog filled the ring: 608 trajectories waiting, a policy lag of 36 updates in a real run. Held,
    it stays near the target."""
    paced = simulate(True, [unroll_s], 32, 1.0, batch=16, capacity=608, seconds=600.0, dt=0.005)
    assert paced["late_mean_waiting"] < 4 * 32, paced  # the target: 2 batches, and never below a message (32)
    assert paced["dropped_fraction"] == 0.0 and paced["starved_fraction"] < 0.05, paced
