"""The learner ranks' rendezvous store as an attack surface (issue 15, class 6; learner/ranks/).

- Values read from the store are parsed, and one of any other shape is ignored and counted by reason: a real store
  on loopback, a real watch thread of rank 0, every malformed heartbeat and stop (the thread ended, or the learner's
  sums raised, before); the snapshot that checkpoints sum stays whole. The startup values (the configuration, the
  addresses, the local actors' key) are checked too.
- Rank 1's watch survives rank 0 going silent (an IndexError ended it: rank 0 has no children there).
- A 2-rank ``train``: a stranger who finds the store's port (MASTER_PORT in a rank's /proc environ) cannot stop it,
  nor find the token in any environment; an insider's garbage (IMPALA_ASYNC_RANK_TOKEN known) is ignored: training
  goes on, SIGTERM ends it with exit 0, a final checkpoint, every rank's state dump 0600.
- Under torchrun (this test plays its agent: it hosts the store), the keys lie under the operator's token, and rank 1
  stops cleanly (exit 6, no traceback) when rank 0 goes silent.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from datetime import timedelta

import attacks_ranks
import pytest
from procutil import CAPPED_ACTORS, cli, stop, tail, wait_for

from impala_async.config import LearnerConfig
from impala_async.learner.ranks import RankGroup
from impala_async.learner.ranks.watch import RankWatch
from impala_async.learner.reports import counters
from impala_async.ops import exitcodes

TOKEN = "test-token-0123456789abcdef"


def _store():
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)


def _watch(rank: int, world: int, **flags):
    """A RankWatch of ``rank`` on a real store (not started): (watch, raw store, the stops it asked for)."""
    from torch.distributed import PrefixStore

    raw = _store()
    group = RankGroup(rank, world, rank, raw, PrefixStore(f"impala-async/0/{TOKEN}", raw))
    group.cfg = LearnerConfig.of(**flags)
    stops: list[tuple[str, int]] = []
    own = dict.fromkeys(counters.SUMMED, 1)
    return RankWatch(group, lambda: own, lambda reason, code: stops.append((reason, code))), raw, stops


def _seq(raw, rank: int) -> int:
    return json.loads(raw.get(f"impala-async/0/{TOKEN}/beat/{rank}"))["seq"]


# ------------------------------------------------------------------------------------------ values from the store
def test_malformed_store_values_are_ignored_counted_and_never_reach_the_sums():
    watch, raw, stops = _watch(0, 2, rank_heartbeat_interval_s=0.05, rank_heartbeat_timeout_s=30.0)
    key = f"impala-async/0/{TOKEN}"
    good = {"seq": 1, **dict.fromkeys(counters.SUMMED, 7)}
    raw.set(f"{key}/beat/1", json.dumps(good))
    watch.start()
    try:
        wait_for(lambda: watch.peers()[0][0].get("env_steps") == 7, 10, "rank 1's good beat")
        for n, make in enumerate(attacks_ranks.MALFORMED_BEATS):
            raw.set(f"{key}/beat/1", make(100 + n))
            seen = _seq(raw, 0)
            wait_for(lambda s=seen: _seq(raw, 0) >= s + 2, 10, "two more rounds of the watch")  # the value was read
            assert watch.peers()[0][0] == good, make(100 + n)  # the last good figures stand
            snap = counters.take([lambda: dict.fromkeys(counters.SUMMED, 1)], watch.peers)  # what checkpoints sum
            assert snap.summed["env_steps"] == 8 and all(type(v) is int for v in snap.summed.values())
        for value in attacks_ranks.MALFORMED_STOPS:
            raw.set(f"{key}/stop", value)
            seen = _seq(raw, 0)
            wait_for(lambda s=seen: _seq(raw, 0) >= s + 2, 10, "two more rounds of the watch")
        assert watch._thread.is_alive() and not stops, stops  # no stop, no "lost the store"
        assert sum(watch.rejected.values()) >= len(attacks_ranks.MALFORMED_BEATS) + len(attacks_ranks.MALFORMED_STOPS)
        assert {r for r, n in watch.rejected.items() if n} >= {"not_json", "not_object", "bad_seq", "bad_figure"}
        assert watch.counters()["rank_values_rejected"] == sum(watch.rejected.values())
        # This rank's own stop replaces a malformed value that held the key (compare_set alone would keep it).
        watch.announce("SIGTERM", 0)
        wait_for(lambda: raw.get(f"{key}/stop").startswith(b'{"rank": 0,'), 10, "rank 0's stop in the store")
    finally:
        watch.halt()


def test_the_parsers_refuse_each_malformed_shape():
    from impala_async.learner.ranks.watch import parse_beat, parse_stop

    good = {"seq": 1, **dict.fromkeys(counters.SUMMED, 7)}
    assert parse_beat(json.dumps({**good, "extra": "ignored"})) == good
    assert parse_beat(json.dumps({**good, "env_steps": True})) == "bad_figure"
    assert parse_beat(json.dumps({**good, "episodes": 2**53})) == "bad_figure"
    assert parse_beat(b"[" * 30_000 + b"]" * 30_000) == "not_json"
    assert parse_beat(b" " * (64 << 10) + b"{}") == "too_large"
    assert parse_stop(json.dumps({"rank": 2, "reason": "x", "code": 0}), 2) == "bad_rank"
    assert parse_stop(json.dumps({"rank": 1, "reason": "x", "code": 256}), 2) == "bad_code"
    assert parse_stop(json.dumps({"rank": 1, "reason": None, "code": 0}), 2) == "bad_reason"
    got = parse_stop(json.dumps({"rank": 1, "reason": "a\x1b[2Jb" + "x" * 5000, "code": 6}), 2)
    assert got["reason"].startswith("a?[2Jb") and len(got["reason"]) == 1000 and got["code"] == 6


def test_startup_values_from_the_store_are_checked():
    from impala_async.learner.ranks.store import checked_address, checked_key, checked_shared

    shared = {"config": {}, "layers": {}, "spec": {}, "env_backend": "gymnasium", "incarnation": 5}
    assert checked_shared(json.dumps(shared).encode()) == shared
    assert checked_shared(b"\xff") == "not JSON"
    assert checked_shared(json.dumps({**shared, "incarnation": "5"}).encode()).startswith("'incarnation'")
    assert checked_shared(json.dumps({**shared, "incarnation": 0}).encode()).startswith("incarnation 0")
    assert checked_shared(json.dumps({**shared, "spec": []}).encode()).startswith("'spec'")
    assert checked_address(b"tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    assert checked_address(b"ipc:///tmp/l.rank1") == "ipc:///tmp/l.rank1"
    for bad in (b"tcp://127.0.0.1:99999", b"tcp://h:1\n", b"http://evil:80", b"ipc://" + b"x" * 2000, b"\xfftcp://"):
        assert checked_address(bad) is None, bad
    assert checked_key(b"rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7")
    assert not checked_key(b"rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf") and not checked_key(b"\x00" * 40)


def test_rank_1s_watch_outlives_a_silent_rank_0():
    """Rank 1 has no children: taking rank 0 for dead indexed ``children[-1]`` (IndexError) and ended the watch,
    heartbeats and all."""
    watch, raw, stops = _watch(1, 2, rank_heartbeat_interval_s=0.05, rank_heartbeat_timeout_s=0.3)
    died: list[BaseException] = []
    hook, threading.excepthook = threading.excepthook, lambda args: died.append(args.exc_value)
    watch.start()
    try:
        wait_for(lambda: stops, 10, "rank 1 to take rank 0 for dead")
        assert stops[0][1] == exitcodes.RANK_FAILED and "learner rank 0 silent" in stops[0][0], stops
        seen = _seq(raw, 1)
        wait_for(lambda: _seq(raw, 1) >= seen + 3, 10, "rank 1 to go on beating")
        assert watch._thread.is_alive() and not died, died
    finally:
        watch.halt()
        threading.excepthook = hook


# ------------------------------------------------------------------------------------------- a real 2-rank train
def _assert_whole(got: dict) -> None:
    """Trained on after the attack, ended by SIGTERM with exit 0, a final checkpoint, every rank's dump 0600."""
    assert got["kept_training"] and got["exited_s"] is None, got
    assert got["exit_code"] == 0, got
    assert got["final_checkpoint_updates"] is not None and got["final_checkpoint_updates"] >= got["updates_after"]
    assert got["rank_state_modes"] == {"rank-0-state.pt": "0o600", "rank-1-state.pt": "0o600"}, got
    assert not got["traceback"], tail(got["log"], 60)


@pytest.mark.process
def test_a_stranger_with_the_stores_port_cannot_stop_the_ranks(tmp_path):
    got = attacks_ranks.run_attack("stop", workdir=tmp_path, watch_s=10.0, extra=CAPPED_ACTORS)  # not flat out
    assert got["values_written"] >= 1 and got["tokens_from_environ"] == 0, got
    _assert_whole(got)


@pytest.mark.process
def test_an_insiders_malformed_values_are_ignored(tmp_path):
    """The token known (the operator's IMPALA_ASYNC_RANK_TOKEN): every malformed beat and stop, for 3 s. Rank 1's
    own beats are overwritten meanwhile, so that rank 0 hears none: a heartbeat timeout of 20 s keeps it from being
    taken for dead (what an insider can do, and may)."""
    extra = (*CAPPED_ACTORS, "--rank-heartbeat-timeout-s", "20")
    got = attacks_ranks.run_attack("garbage", workdir=tmp_path, token=TOKEN, attack_s=3.0, watch_s=6.0, extra=extra)
    assert got["values_written"] > 50, got
    _assert_whole(got)
    assert got["rejected_lines"] >= 2, tail(got["log"], 60)
    assert got["rejected_counted"] > 0, got  # and counted in metrics.jsonl (docs/metrics.md, Learner ranks)


# ---------------------------------------------------------------------------------------------- under torchrun
@pytest.mark.process
def test_under_torchrun_keys_carry_the_token_and_rank_1_survives_rank_0_going_silent(tmp_path):
    """The test plays torchrun's agent: it hosts the store and starts two learner ranks with the variables torchrun
    sets, and the operator's token."""
    from torch.distributed import TCPStore

    agent = TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    env = dict(os.environ, PYTHONUNBUFFERED="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(agent.port), TORCHELASTIC_USE_AGENT_STORE="True", GLOO_SOCKET_IFNAME="lo")
    env[attacks_ranks.TOKEN_ENV] = TOKEN
    flags = ["--env", "CartPole-v1", "--listen", "tcp://127.0.0.1:*", "--logdir", str(tmp_path / "run")]
    flags += ["--rank-heartbeat-interval-s", "0.2", "--rank-heartbeat-timeout-s", "2"]
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    for r in range(2):
        procs.append(cli("learner", *flags, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, log=logs[r]))
    under = {p: [f"{p}/beat/0", f"{p}/beat/1"] for p in (f"impala-async/0/{TOKEN}", "impala-async/0")}
    try:
        beating = wait_for(
            lambda: [p for p, keys in under.items() if agent.check(keys)],
            180,
            "both ranks' heartbeats",
            procs[1],
            logs[1],
        )
        procs[0].send_signal(signal.SIGSTOP)  # rank 0 hangs: no heartbeat, and the agent's store still answers
        t0 = time.monotonic()
        code = procs[1].wait(30)
        assert code == exitcodes.RANK_FAILED, tail(logs[1])
        assert time.monotonic() - t0 < 15
        text = logs[1].read_text()
        assert "learner rank 0 silent" in text and "Traceback" not in text, tail(logs[1], 80)
        assert beating == [f"impala-async/0/{TOKEN}"], beating  # no key where a stranger would guess it
    finally:
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGCONT)
        for p in procs:
            stop(p, 10)
