"""End to end: the real `impala-async` CLI as subprocesses, real sockets, real CartPole, tiny budgets."""

import asyncio
import re
import signal
import subprocess
import sys
import time

import inprocess
import pytest
import torch
from procutil import (
    METRICS_FIELDS,
    TINY,
    actor_pids,
    actors_under,
    cli,
    descendants,
    documented_metrics,
    finish,
    free_port_pair,
    gone,
    read_metrics,
    run_cli,
    stop,
    tail,
    wait_for,
)

from impala_async.learner import checkpoint

SMALL = [
    *TINY,
    "--report-interval-s",
    "0.5",
]


@pytest.mark.process
@pytest.mark.parametrize(
    "command,flags",
    [
        ([], ["train", "learner", "actor"]),
        (
            ["train"],
            [
                "--env",
                "--num-actors",
                "--envs-per-actor",
                "--unroll-length",
                "--batch-size",
                "--total-env-steps",
                "--learning-rate",
                "--entropy-cost",
                "--seed",
                "--logdir",
                "--device",
                "--listen",
                "--publish",
            ],
        ),
        (["learner"], ["--listen", "--publish", "--max-message-bytes", "--max-policy-lag"]),
        (["actor"], ["--learner", "--weights", "--num-actors", "--envs-per-actor", "--seed"]),
    ],
)
def test_help_is_complete(command, flags):
    out = subprocess.run(
        [sys.executable, "-m", "impala_async", *command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for flag in flags:
        assert flag in out.stdout, flag


@pytest.mark.process
def test_train_end_to_end(tmp_path):
    logdir, log = tmp_path / "run", tmp_path / "log"
    proc = cli("train", *SMALL, "--total-env-steps", "4000", "--logdir", str(logdir), log=log)
    finish(proc, log, 120)
    rows = read_metrics(logdir)
    assert rows, tail(log)
    last = rows[-1]
    missing = [f for f in METRICS_FIELDS if f not in last]
    assert not missing, missing
    documented = documented_metrics()
    assert set(last) == documented, (
        f"written, not in docs/metrics.md: {sorted(set(last) - documented)}; "
        f"documented, not written: {sorted(documented - set(last))}"
    )
    assert last["learner_steps"] > 0 and last["env_steps_trained"] >= 4000
    assert last["episodes"] > 0 and last["episode_return_mean"] > 0
    assert last["policy_version"] == last["learner_steps"]
    assert any(r["policy_lag_avg"] is not None and r["loss_pg"] is not None for r in rows)
    assert last["trajectories_rejected"] == 0
    ckpts = checkpoint.list_checkpoints(logdir)
    assert ckpts, "no final checkpoint"
    state = torch.load(ckpts[-1], weights_only=True)
    assert state["learner"]["updates"] == last["learner_steps"]
    address = re.search(r"--learner (tcp://\S+)", log.read_text()).group(1)
    assert not [p for p in actor_pids() if address in " ".join(_cmdline(p))], "an actor outlived the learner"


def _cmdline(pid):
    import psutil

    try:
        return psutil.Process(pid).cmdline()
    except psutil.NoSuchProcess:
        return []


@pytest.mark.process
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_everything_within_10_s(tmp_path, sig):
    logdir, log = tmp_path / "run", tmp_path / "log"
    proc = cli("train", *SMALL, "--num-actors", "2", "--total-env-steps", "10000000", "--logdir", str(logdir), log=log)
    try:
        wait_for(lambda: any(r["learner_steps"] > 0 for r in read_metrics(logdir)), 90, "learner steps", proc, log)
        kids = descendants(proc.pid)
        assert len(actors_under(proc.pid)) == 2, kids
        t0 = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(10) == 0, tail(log)
        assert time.monotonic() - t0 < 10
        assert gone(kids, 2.0), "actor processes left behind"
        assert checkpoint.list_checkpoints(logdir), "no final checkpoint"
    finally:
        stop(proc)


@pytest.mark.process
def test_learner_and_attached_actors(tmp_path):
    port = free_port_pair()
    logdir, llog, alog = tmp_path / "run", tmp_path / "learner.log", tmp_path / "actor.log"
    learner = cli(
        "learner",
        "--env",
        "CartPole-v1",
        "--listen",
        f"tcp://127.0.0.1:{port}",
        "--unroll-length",
        "10",
        "--batch-size",
        "4",
        "--total-env-steps",
        "3000",
        "--logdir",
        str(logdir),
        log=llog,
    )
    actors = None
    try:
        wait_for(lambda: "listening" in llog.read_text(), 60, "learner start", learner, llog)
        assert f"--learner tcp://127.0.0.1:{port} --weights tcp://127.0.0.1:{port + 1}" in llog.read_text()
        # The actor is given only the trajectory address: weights address, env and spec come from the learner.
        actors = cli(
            "actor", "--learner", f"tcp://127.0.0.1:{port}", "--num-actors", "2", "--envs-per-actor", "2", log=alog
        )
        assert learner.wait(120) == 0, tail(llog) + tail(alog)
        last = read_metrics(logdir)[-1]
        assert last["learner_steps"] > 0 and last["trajectories_received"] > 0
        kids = descendants(actors.pid)
        assert len(actors_under(actors.pid)) == 2
        actors.send_signal(signal.SIGTERM)
        assert actors.wait(10) == 0
        assert gone(kids, 2.0)
    finally:
        stop(learner)
        if actors is not None:
            stop(actors)


@pytest.mark.process
def test_env_kwargs_reach_learner_and_actors(tmp_path):
    """`--env-kwargs` travels to the actors with the weights. CartPole cut at 5 steps returns exactly 5 per episode;
    uncut, no CartPole episode is that short (the pole takes about 8 steps to fall even under the worst policy)."""
    logdir, log = tmp_path / "run", tmp_path / "log"
    proc = cli(
        "train",
        *SMALL,
        "--total-env-steps",
        "3000",
        "--env-kwargs",
        '{"max_episode_steps": 5}',
        "--logdir",
        str(logdir),
        log=log,
    )
    finish(proc, log, 120)
    rows = [r for r in read_metrics(logdir) if r["episode_return_mean"] is not None]
    assert rows and rows[-1]["episodes"] >= 3000 // 5 // 2, tail(log)
    assert {r["episode_return_mean"] for r in rows} == {5.0}
    # An argument the environment does not take is refused at the start, naming it.
    bad = run_cli(
        "train", "--env", "CartPole-v1", "--env-kwargs", '{"no_such_argument": 1}', "--logdir", str(tmp_path / "bad"),
        timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "no_such_argument" in bad.stderr, bad.stderr


@pytest.mark.process
@pytest.mark.slow  # ~40 s; the MinAtar result (BENCHMARKS.md, section 10) is the image path's learning proof now
def test_image_path_learns(tmp_path):
    """The conv network, uint8 frames, the ring and V-trace together learn what they see: a visual bandit (random
    play returns 0, reading the picture returns 1) reaches 0.9 with default settings."""
    logdir, log = tmp_path / "run", tmp_path / "log"
    proc = cli(
        "train",
        "--env",
        "impala_async.actors.envs:ImageBandit-v0",
        "--num-actors",
        "1",
        "--total-env-steps",
        "200000",
        "--report-interval-s",
        "0.5",
        "--logdir",
        str(logdir),
        log=log,
    )
    try:
        wait_for(
            lambda: any((r["episode_return_mean"] or 0) >= 0.9 for r in read_metrics(logdir)),
            150,
            "an average return of 0.9",
            proc,
            log,
        )
    finally:
        stop(proc)


def test_the_learner_has_room_for_the_largest_message_it_accepts(tmp_path):
    """An honest actor of 256 environments sends 256 trajectories at once, within the limit the learner advertises
    (max_trajectories_per_message 256). The `learner` command used to size its ring for train's 32-environment actors
    (8 slots of 16: 128 trajectories), so half of every such message was dropped as soon as it arrived. Where the
    actor outruns the learner (16 fast cores and a CUDA learner) it may still lose a few batches in the first second,
    before its first pace arrives (an H200: 224 of 4,608), never half. The learner is configured as the `learner`
    command configures it and serves in this test's loop, the actor in a thread (tests/inprocess.py)."""
    flags = ["--unroll-length", "10", "--total-env-steps", "40000", "--report-interval-s", "0.5"]
    cfg, spec = inprocess.configuration(tmp_path, *flags)
    asyncio.run(inprocess.train(cfg, spec, envs_per_actor=256, timeout_s=180))
    last = read_metrics(tmp_path / "run")[-1]
    assert last["env_steps_trained"] >= 40000 and last["trajectories_received"] >= 16 * 256
    assert last["dropped_full"] < last["trajectories_received"] / 8, (
        last["dropped_full"],
        last["trajectories_received"],
    )
