"""One learner is one rank (learner/ranks/): what a :class:`SingleRank` and each rank of a :class:`RankGroup` do where
the learner used to ask which it was, in process on a real rendezvous store (torch's TCPStore on loopback).

A group made to act like a single learner (every rank starting actors, setting checkpoints aside and looking for the
previous one, or rank 1 reporting peers) would start actors twice, race over the run's files and double the sums:
each case below is one such mix-up.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import zmq
from gymnasium.spaces import Box, Discrete

from impala_async.config import Layered, LearnerConfig, layers
from impala_async.core.spec import TrajectorySpec
from impala_async.learner import ranks
from impala_async.learner.ranks import RankGroup, SingleRank
from impala_async.ops.auth import LearnerKeys


@pytest.fixture
def store():
    from torch.distributed import PrefixStore, TCPStore

    raw = TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    return raw, PrefixStore("impala-async/0/test", raw)


def _group(rank: int, store) -> RankGroup:
    raw, prefixed = store
    return RankGroup(rank, 2, rank, raw, prefixed, cfg=LearnerConfig.of(learner_ranks=2))


def _keys() -> LearnerKeys:
    public, secret = zmq.curve_keypair()
    return LearnerKeys(public=public, secret=secret, allowed={})


def _local_key(keys: LearnerKeys) -> tuple[str, LearnerKeys]:
    """What main.py's maker does (auth.local_actor_keys), without the files: a fresh key admitted as 'local'."""
    public, _ = zmq.curve_keypair()
    return "DIR", LearnerKeys(keys.public, keys.secret, {**keys.allowed, public: "local"})


def test_rank_0_alone_makes_the_local_actors_key_and_every_rank_admits_it(store):
    lead_dir, lead_keys = _group(0, store).local_actor_keys(_keys(), _local_key)
    made = next(k for k, name in lead_keys.allowed.items() if name == "local")
    worker_dir, worker_keys = _group(1, store).local_actor_keys(_keys(), lambda keys: pytest.fail("rank 1 made keys"))
    assert (lead_dir, worker_dir) == ("DIR", "")
    assert worker_keys.allowed == {made: "local"}  # rank 0's key, read from the store
    single_dir, single_keys = SingleRank(1).local_actor_keys(_keys(), _local_key)
    assert single_dir == "DIR" and "local" in single_keys.allowed.values()


def test_a_malformed_local_actors_key_in_the_store_is_refused(store):
    store[1].set("local_actor_key", b"not a z85 key")
    with pytest.raises(SystemExit, match="malformed local actors' key"):
        _group(1, store).local_actor_keys(_keys(), _local_key)


def test_only_rank_0_starts_local_actors_and_holds_the_logdir(store):
    assert [_group(r, store).local_actors(3) for r in (0, 1)] == [3, 0]
    assert SingleRank(1).local_actors(3) == 3
    assert [_group(r, store).lead_only(lambda: "lock") for r in (0, 1)] == ["lock", None]
    assert SingleRank(1).lead_only(lambda: "lock") == "lock"


def test_only_rank_0_sums_the_other_ranks(store):
    group = _group(1, store)
    group.watch(figures=lambda: {}, on_stop=lambda reason, code: None)
    try:
        assert group.peers() == []  # rank 1's snapshots are its own: rank 0's would count rank 1 twice
    finally:
        group.watcher.halt()
    assert SingleRank(1).peers() == []


def test_a_bad_checkpoint_is_set_aside_once_and_stops_every_rank(tmp_path, store):
    for name in ("single.pt", "group.pt"):
        (tmp_path / name).write_bytes(b"x")
    SingleRank(1).bad_checkpoint(str(tmp_path / "single.pt"), "KeyError")  # then the previous one is tried
    assert (tmp_path / "single.pt.bad").exists()
    with pytest.raises(SystemExit, match="learner ranks took this one already"):
        _group(1, store).bad_checkpoint(str(tmp_path / "group.pt"), "KeyError")
    assert (tmp_path / "group.pt").exists()  # rank 1 leaves the run's files to rank 0
    with pytest.raises(SystemExit, match="set aside"):
        _group(0, store).bad_checkpoint(str(tmp_path / "group.pt"), "KeyError")
    assert (tmp_path / "group.pt.bad").exists()


def test_exit_says_why_on_the_lead_only(store, capsys):
    assert _group(1, store).exit(3, "no data") == 3
    assert capsys.readouterr().out == ""
    assert _group(0, store).exit(3, "no data") == 3
    assert SingleRank(1).exit(0, "done") == 0
    out = capsys.readouterr()
    assert (out.out + out.err).count("stopped: no data") == 1


def test_join_outside_any_group_prepares_then_resolves_a_single_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    calls: list[str] = []
    layered = layers.load(flags={"env": "CartPole-v1"})
    spec = TrajectorySpec.from_spaces(Box(-1.0, 1.0, (4,)), Discrete(2), 5)

    def resolve(given: Layered):
        calls.append("resolve")
        return given, spec, "gymnasium"

    group, got, got_spec, backend, prepared = ranks.join(
        layered, None, [], prepare=lambda cfg: calls.append("prepare") or "KEYS", resolve=resolve
    )
    assert isinstance(group, SingleRank) and group.resumed is None
    assert (got, got_spec, backend, prepared, calls) == (layered, spec, "gymnasium", "KEYS", ["prepare", "resolve"])


def test_torchrun_world_size_becomes_learner_ranks_and_a_contradiction_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert ranks.with_torchrun_world(layers.load(flags={})).cfg.ranks.learner_ranks == 3
    with pytest.raises(SystemExit, match="--learner-ranks 2 but WORLD_SIZE=3"):
        ranks.with_torchrun_world(layers.load(flags={"learner_ranks": 2}))
