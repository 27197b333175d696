"""Several learner ranks (learner/ranks/, README "Several learner ranks"): torch.distributed (gloo here), one
trajectory socket and ring per rank, gradients averaged in lock step, rank 0 alone publishing and checkpointing.

- The rank addresses, the actor's connections to every rank (each once) and the configuration checks.
- A 2-rank learner with local actors learns CartPole, both ranks receive trajectories, and after SIGTERM both ranks
  hold bit-identical weights and optimizer state, and no process is left. Meanwhile /metrics is scraped: every scrape
  says what one metrics.jsonl record says, and the records are rank sums that include rank 1's share (before, /metrics
  said rank 0's).
- SIGKILL to rank 1 stops the learner within the shutdown timeout with exit code 6 and a loadable checkpoint; external
  actors given only rank 0's address push to both ranks (they learn rank 1's from the weights message); --resume runs
  both ranks again from rank 0's checkpoint, and they stay identical.
- The CUDA (NCCL) path, skipped without two GPUs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import psutil
import pytest
import torch
import zmq
from procutil import (
    CAPPED_ACTOR,
    TINY,
    actors_under,
    cli,
    descendants,
    finish,
    free_port,
    free_ports,
    get,
    gone,
    read_metrics,
    stop,
    tail,
    value,
    wait_for,
)
from prometheus_client import parser

from impala_async.actors.endpoints import Endpoints, resolve
from impala_async.config import LearnerConfig
from impala_async.core import wire
from impala_async.learner import checkpoint
from impala_async.learner.ranks import rank_address
from impala_async.ops import exitcodes


# ------------------------------------------------------------------------------------------------- addresses
def test_rank_addresses():
    assert [rank_address("tcp://127.0.0.1:5555", r) for r in range(4)] == [
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        "tcp://127.0.0.1:5559",
    ]  # 5556: weights
    assert rank_address("tcp://0.0.0.0:*", 3) == "tcp://0.0.0.0:*"
    assert rank_address("ipc:///tmp/l", 1) == "ipc:///tmp/l.rank1"
    with pytest.raises(ValueError):
        rank_address("tcp://127.0.0.1:65534", 2)


class FakePush:
    def __init__(self):
        self.connected: list[str] = []

    def connect(self, address):
        self.connected.append(address)

    def disconnect(self, address):
        self.connected.remove(address)


def test_an_actor_pushes_to_every_rank_once():
    push = FakePush()
    peers = Endpoints(push, "tcp://127.0.0.1:5555")
    push.connect("tcp://127.0.0.1:5555")  # what the actor does first, with its --learner
    peers.update({"env_id": "CartPole-v1"})  # a learner without the key: nothing changes
    assert push.connected == ["tcp://127.0.0.1:5555"]
    listed = ["tcp://localhost:5555", "tcp://127.0.0.1:5557", "tcp://0.0.0.0:5558", "tcp://127.0.0.1:5557"]
    peers.update({"trajectory_addresses": listed})
    # localhost:5555 is the address given (by another name); 0.0.0.0 (bound to every interface) is reached at the
    # given host; the duplicate is connected once.
    assert sorted(push.connected) == ["tcp://127.0.0.1:5555", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]
    peers.update({"trajectory_addresses": listed})  # every weights message lists them again: no new connection
    assert len(push.connected) == 3
    peers.update({"trajectory_addresses": ["tcp://127.0.0.1:5555", "tcp://127.0.0.1:6000"]})  # restarted elsewhere
    assert sorted(push.connected) == ["tcp://127.0.0.1:5555", "tcp://127.0.0.1:6000"]
    assert resolve("tcp://[::]:7000", "tcp://learner.example:5555") == "tcp://learner.example:7000"
    assert resolve("tcp://10.0.0.5:7000", "tcp://learner.example:5555") == "tcp://10.0.0.5:7000"


def test_rank_settings_are_checked():
    with pytest.raises(ValueError, match="learner_ranks"):
        LearnerConfig.of(learner_ranks=0).check()
    with pytest.raises(ValueError, match="rank_heartbeat_timeout_s"):
        LearnerConfig.of(rank_heartbeat_interval_s=1.0, rank_heartbeat_timeout_s=1.5).check()
    with pytest.raises(ValueError, match="rank_collective_timeout_s"):
        LearnerConfig.of(rank_collective_timeout_s=0).check()


# ---------------------------------------------------------------------------------------------- end to end
def _rank_pids(pid: int, rank: int) -> list[int]:
    found = []
    for p in descendants(pid):
        try:
            if psutil.Process(p).environ().get("RANK") == str(rank):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}[{i}]")


def assert_ranks_identical(logdir, ranks: int = 2) -> dict:
    """Every rank's state at exit (--rank-state-dump 1): the same updates, bit for bit the same weights and optimizer
    state. Returns rank 0's."""
    states = [torch.load(logdir / f"rank-{r}-state.pt", weights_only=True) for r in range(ranks)]
    first = dict(_tensors({"model": states[0]["model"], "optimizer": states[0]["optimizer"]}))
    assert first and any(name.startswith(".optimizer") for name in first)
    for r, st in enumerate(states[1:], start=1):
        assert st["updates"] == states[0]["updates"] and st["batches"] == states[0]["batches"], (r, st["updates"])
        other = dict(_tensors({"model": st["model"], "optimizer": st["optimizer"]}))
        assert other.keys() == first.keys()
        differ = [k for k in first if not torch.equal(first[k], other[k])]
        assert not differ, f"rank {r} differs from rank 0 in {differ[:5]}"
    return states[0]


class _Scraper(threading.Thread):
    """Scrapes /metrics every 0.05 s until stopped: (env_steps_total, trajectories_received_total) of each scrape."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.pairs, self.done = port, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            status, body = get(self.port, "/metrics", timeout_s=2.0)
            if status == 200:
                families = {f.name: f for f in parser.text_string_to_metric_families(body)}
                if "impala_async_env_steps" in families:
                    self.pairs.append(tuple(value(families, f"impala_async_{n}_total") for n in _PAIR))
            self.done.wait(0.05)

    def stop(self) -> list[tuple[float, float]]:
        self.done.set()
        self.join(10)
        return self.pairs


_PAIR = ("env_steps", "trajectories_received")


def assert_scrapes_are_records(scraped: list[tuple[float, float]], records: list[dict]) -> None:
    """Prometheus and metrics.jsonl read the same snapshot per report (learner/reports/counters.py), summed over the
    ranks: every scrape is one record's (or the snapshot's before the first), and one saw both ranks' steps."""
    made = {(float(r["env_steps"]), float(r["trajectories_received"])): r for r in records}
    assert len(scraped) >= 5, scraped
    assert set(scraped) <= {(0.0, 0.0), *made}, sorted(set(scraped) - {(0.0, 0.0), *made})[:5]
    for r in records:
        assert r["env_steps"] == sum(r["ranks"]["env_steps"]), r["ranks"]
    both = [made[s]["ranks"]["env_steps"] for s in scraped if s in made and min(made[s]["ranks"]["env_steps"]) > 0]
    assert both, "no scrape saw both ranks' steps"  # each such scrape said rank 0's + rank 1's, not rank 0's alone


@pytest.mark.process
def test_two_ranks_learn_cartpole_in_lock_step(tmp_path):
    logdir, log, mport = tmp_path / "run", tmp_path / "log", free_port()
    proc = cli(
        "train",
        "--env",
        "CartPole-v1",
        "--learner-ranks",
        "2",
        "--num-actors",
        "2",
        "--report-interval-s",
        "0.5",
        "--rank-state-dump",
        "1",
        "--metrics-port",
        str(mport),
        "--logdir",
        str(logdir),
        log=log,
    )
    scraper = _Scraper(mport)
    scraper.start()
    try:
        wait_for(
            lambda: any((r["episode_return_mean"] or 0) >= 475 for r in read_metrics(logdir)),
            240,
            "an average return of 475",
            proc,
            log,
        )
        kids = descendants(proc.pid)
        assert len(_rank_pids(proc.pid, 1)) == 1 and len(actors_under(proc.pid)) == 2, kids  # rank 1, two actors
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, tail(log)
        assert time.monotonic() - t0 < 10
        assert gone(kids, 2.0), "processes left behind"
    finally:
        scraped = scraper.stop()
        stop(proc)
    records = read_metrics(logdir)
    last = records[-1]
    assert last["learner_ranks"] == 2 and last["ranks"]["alive"][0] == 1
    assert min(last["ranks"]["trajectories_received"]) > 0, last["ranks"]
    assert last["trajectories_rejected"] == 0
    assert_scrapes_are_records(scraped, records)
    state = assert_ranks_identical(logdir)
    assert state["updates"] > 100
    # Each update trained one batch on each rank; the dumps are the weights rank 0 checkpointed.
    saved, _ = checkpoint.load_latest(logdir, validate=checkpoint.validate_learner_state)
    assert saved["learner"]["env_steps_trained"] == 2 * 16 * 20 * state["batches"]
    assert all(torch.equal(saved["learner"]["model"][k], v) for k, v in state["model"].items())


@pytest.mark.process
def test_a_killed_rank_stops_the_learner_and_resume_goes_on(tmp_path):
    port = free_ports(3)  # rank 0, weights, rank 1
    logdir, llog, alog, llog2 = tmp_path / "run", tmp_path / "learner.log", tmp_path / "actors.log", tmp_path / "l2"
    learner = cli(
        "learner",
        *TINY,
        "--learner-ranks",
        "2",
        "--listen",
        f"tcp://127.0.0.1:{port}",
        "--total-env-steps",
        "100000000",
        "--rank-state-dump",
        "1",
        "--logdir",
        str(logdir),
        log=llog,
    )
    # External actors, given rank 0's address only.
    actors = cli(
        "actor", "--learner", f"tcp://127.0.0.1:{port}", "--num-actors", "2", "--envs-per-actor", "2", *CAPPED_ACTOR,
        log=alog,
    )  # fmt: skip
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port + 1}")
    try:
        addresses = [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 2}"]
        wait_for(lambda: "listening" in llog.read_text(), 120, "the learner to start", learner, llog)
        assert f"(learner ranks: {' '.join(addresses)})" in llog.read_text()
        assert sub.poll(30_000), "no weights"
        assert wire.decode_weights(sub.recv(), 1 << 30).run_info["trajectory_addresses"] == addresses
        wait_for(
            lambda: (
                (r := (read_metrics(logdir) or [{}])[-1]).get("learner_steps", 0) >= 20
                and min(r["ranks"]["trajectories_received"]) > 0
            ),
            120,
            "both ranks to receive and train",
            learner,
            llog,
        )
        [rank1] = _rank_pids(learner.pid, 1)
        t0 = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        code = learner.wait(20)
        assert time.monotonic() - t0 < 10, "not within the shutdown timeout (10 s)"
        assert code == exitcodes.RANK_FAILED, tail(llog)
        assert f"impala-async: stopped: learner rank 1 (pid {rank1}) was killed by SIGKILL" in llog.read_text()
        found = checkpoint.load_latest(logdir, validate=checkpoint.validate_learner_state)
        assert found is not None, "no loadable checkpoint"
        saved, _ = found
        assert saved["learner"]["updates"] >= 20
        for r in range(2):
            (logdir / f"rank-{r}-state.pt").unlink(missing_ok=True)
        # Resume: both ranks from rank 0's checkpoint (its configuration: 2 ranks; the same ports, typed again: a
        # checkpoint cannot set an address), the surviving actors carry on; 30 more updates of 2 x 4 x 10 steps, then
        # the run ends by itself.
        more = saved["learner"]["env_steps_trained"] + 30 * 2 * 4 * 10
        learner = cli(
            "learner", "--resume", str(logdir), "--listen", f"tcp://127.0.0.1:{port}", "--total-env-steps", str(more),
            log=llog2,
        )  # fmt: skip
        try:
            code = learner.wait(120)
        except subprocess.TimeoutExpired:  # once in CI (2026-12-03): no update for 120 s; say where each part was
            code = f"no exit within 120 s; actors {'running' if actors.poll() is None else f'exited {actors.poll()}'}"
        last = (read_metrics(logdir) or [{}])[-1]
        assert code == 0, f"{code}\nper rank: {last.get('ranks')}\n{tail(llog2, 60)}\nactors:\n{tail(alog, 30)}"
        state = assert_ranks_identical(logdir)
        assert state["updates"] == saved["learner"]["updates"] + 30, (state["updates"], saved["learner"]["updates"])
        assert re.search(r"rank1 .*learner rank 1 of 2", llog2.read_text())
    finally:
        sub.close(0)
        ctx.term()
        stop(learner)
        stop(actors)


@pytest.mark.process
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL, rank r on cuda:r)")
def test_two_ranks_on_two_gpus(tmp_path):
    logdir, log = tmp_path / "run", tmp_path / "log"
    proc = cli(
        "train",
        "--env",
        "CartPole-v1",
        "--device",
        "cuda",
        "--learner-ranks",
        "2",
        "--num-actors",
        "2",
        "--total-env-steps",
        "100000",
        "--rank-state-dump",
        "1",
        "--logdir",
        str(logdir),
        log=log,
    )
    finish(proc, log, 300)
    text = log.read_text()
    assert "learner rank 0 of 2: nccl on cuda:0" in text and "learner rank 1 of 2: nccl on cuda:1" in text
    assert assert_ranks_identical(logdir)["updates"] > 0
