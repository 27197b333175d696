"""Ring buffer: slot views, batch hand-off, both full policies, stale drops, and no allocation per trajectory."""

import threading

import numpy as np
import pytest
import torch
from helpers import random_arrays

from impala_async.core import wire
from impala_async.core.decoder import TrajectoryDecoder
from impala_async.core.ring import TrajectoryRing


def fill(ring, version, value=0.0, n=1):
    assert ring.room() >= n
    for a in ring.rows(n).values():
        a[...] = value
    ring.commit(n, version)


def test_batches_are_views_of_preallocated_storage(cartpole_spec):
    ring = TrajectoryRing(cartpole_spec, batch_size=2, num_batches=3)
    ptrs = {name: t.data_ptr() for name, t in ring.tensors.items()}
    arrays = random_arrays(cartpole_spec, 2)
    decoder = TrajectoryDecoder(cartpole_spec)
    msg = decoder.parse(
        wire.encode_trajectories(cartpole_spec, actor_id="a", seq=0, policy_version=4, incarnation=1, arrays=arrays)
    )
    assert ring.room() == 2
    decoder.decode_into(msg, ring.rows(2))
    ring.commit(2, 4)
    batch = ring.get(0.1)
    assert batch is not None and batch.slot == 0
    for name, t in batch.tensors.items():
        assert t.shape == (2, *cartpole_spec.field_map[name].shape)
        assert t.data_ptr() == ptrs[name]  # slot 0 of the storage: no copy, no allocation
        np.testing.assert_array_equal(t.numpy(), arrays[name])
    assert batch.policy_versions.tolist() == [4, 4]
    assert {name: t.data_ptr() for name, t in ring.tensors.items()} == ptrs


def test_drop_oldest_when_full(cartpole_spec):
    ring = TrajectoryRing(cartpole_spec, batch_size=1, num_batches=3, drop_when_full=True)
    for v in range(6):  # nobody trains: the ring keeps accepting and drops the oldest waiting batch
        fill(ring, v)
    assert ring.dropped_full == 4
    got = [ring.get(0.01).policy_versions[0] for _ in range(2)]
    assert got == [4, 5]  # the newest survive, oldest first
    assert ring.get(0.01) is None


def test_wait_when_full(cartpole_spec):
    ring = TrajectoryRing(cartpole_spec, batch_size=1, num_batches=3, drop_when_full=False)
    for v in range(3):
        fill(ring, v)
    assert not ring.writable() and ring.dropped_full == 0
    released = threading.Event()
    ring.on_release = released.set
    b = ring.get(0.01)
    assert b.policy_versions[0] == 0
    ring.release(b)
    assert released.is_set() and ring.writable()
    fill(ring, 3)
    assert [ring.get(0.01).policy_versions[0] for _ in range(3)] == [1, 2, 3]


def test_stale_batches_dropped(cartpole_spec):
    ring = TrajectoryRing(cartpole_spec, batch_size=2, num_batches=4)
    fill(ring, 1)
    fill(ring, 9)  # batch 0 holds versions 1 and 9
    fill(ring, 8)
    fill(ring, 9)
    b = ring.get(0.01, min_policy_version=5)
    assert b.policy_versions.tolist() == [8, 9] and ring.dropped_stale == 2


def test_get_wakes_on_commit_and_close(cartpole_spec):
    ring = TrajectoryRing(cartpole_spec, batch_size=1, num_batches=3)
    got = []
    t = threading.Thread(target=lambda: got.append(ring.get(10.0)))
    t.start()
    fill(ring, 7)
    t.join(5)
    assert not t.is_alive() and got[0].policy_versions[0] == 7
    t = threading.Thread(target=lambda: got.append(ring.get(10.0)))
    t.start()
    ring.close()
    t.join(5)
    assert not t.is_alive() and got[1] is None


def test_rows_are_contiguous_and_room_counts_down(cartpole_spec):
    ring = TrajectoryRing(cartpole_spec, batch_size=4, num_batches=3)
    fill(ring, 1, n=3)
    assert ring.room() == 1
    rows = ring.rows(1)
    assert all(a.flags.c_contiguous and a.shape[0] == 1 for a in rows.values())
    fill(ring, 2)
    assert ring.room() == 4  # a new batch slot
    assert ring.get(0.01).policy_versions.tolist() == [1, 1, 1, 2]


def test_rejects_too_few_batches(cartpole_spec):
    with pytest.raises(ValueError, match="num_batches"):
        TrajectoryRing(cartpole_spec, batch_size=4, num_batches=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned(cartpole_spec):
    ring = TrajectoryRing(cartpole_spec, batch_size=2, num_batches=3, pin_memory=True)
    assert all(t.is_pinned() for t in ring.tensors.values())
