"""The training thread against a real ring and a real learner: every batch reaches the update whole and in order.

A producer thread refills ring slots as soon as they are released, so a slot released before its host-to-device copy
completed (the CUDA path's hazard) would show up as a torn batch on the device. The CUDA cases are skipped without a
GPU; on the CPU the same test covers the in-place path.
"""

import threading
import time

import pytest
import torch

from impala_async.config import LearnerConfig
from impala_async.core.ring import TrajectoryRing
from impala_async.core.spec import TrajectorySpec
from impala_async.learner.learn import CollectiveError, Learner
from impala_async.learner.trainer import Trainer

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
B, BATCHES = 4, 60
SPEC = TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=5)  # CartPole's, T 5


class CheckingLearner(Learner):
    """A real learner that first records, on the device, which trajectories its batch holds and whether it is torn."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[tuple[list[float], bool, str]] = []

    def step(self, batch, **kw):
        obs = batch["obs"]  # [B, T+1, 4]: every element of trajectory i holds i
        ids = obs[:, 0, 0]
        torn = (obs != ids.view(-1, 1, 1)).any() | (batch["reward"] != ids.view(-1, 1)).any()
        self.seen.append((ids.tolist(), bool(torn), obs.device.type))
        return super().step(batch, **kw)


def produce(ring: TrajectoryRing, n: int, stop: threading.Event) -> None:
    for i in range(n):
        deadline = time.monotonic() + 30
        while ring.room() == 0:  # waits for the trainer to release a slot
            if stop.is_set() or time.monotonic() > deadline:
                return
            time.sleep(0.0005)
        rows = ring.rows(1)
        for a in rows.values():
            a[...] = 0
        rows["obs"][...] = i
        rows["reward"][...] = i
        ring.commit(1, 0)


def train(learner: Learner, ring: TrajectoryRing, batches: int, **trainer_kw) -> tuple[Trainer, list]:
    """Run a Trainer on ``ring`` (a producer thread refilling it) until it has trained ``batches`` batches; returns
    the trainer, stopped, and the updates it handed over."""
    updates, done, exited = [], threading.Event(), []
    trainer = Trainer(
        learner,
        ring,
        max_policy_lag=10**9,
        after_update=lambda update: updates.append(update) or len(updates) >= batches,
        on_exit=lambda error: (exited.append(error), done.set()),
        **trainer_kw,
    )
    stop = threading.Event()
    producer = threading.Thread(target=produce, args=(ring, B * batches, stop), daemon=True)
    trainer.start()
    producer.start()
    try:
        assert done.wait(60), f"trainer did not finish: {len(updates)} batches"
    finally:
        stop.set()
        trainer.stop(10)
        producer.join(10)
    assert exited == [None]
    return trainer, updates


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_every_batch_arrives_whole_and_in_order(device, overlap):
    ring = TrajectoryRing(SPEC, batch_size=B, num_batches=3, pin_memory=device == "cuda", drop_when_full=False)
    learner = CheckingLearner(LearnerConfig(), SPEC, torch.device(device))
    train(learner, ring, BATCHES, overlap_copies=overlap)
    assert all(dev == device for _, _, dev in learner.seen)
    assert not [ids for ids, torn, _ in learner.seen if torn], "a batch changed under its copy"
    got = [int(i) for ids, _, _ in learner.seen for i in ids]
    assert got == list(range(B * BATCHES)), "trajectories lost, repeated or out of order"
    assert learner.updates == BATCHES


def test_updates_per_batch_learns_each_batch_again_and_counts_its_steps_once():
    """``--updates-per-batch 2``: each batch is trained twice in a row before its slot is freed; the env steps count
    once (they decide the schedules and the stop), the updates twice, the policy version once per batch, and the
    report's importance-weight histogram holds both updates' weights."""
    ring = TrajectoryRing(SPEC, batch_size=B, num_batches=3, pin_memory=False, drop_when_full=False)
    cfg = LearnerConfig.of(batch_size=B, updates_per_batch=2).check()
    learner = CheckingLearner(cfg, SPEC, torch.device("cpu"))
    batches = 10
    trainer, updates = train(learner, ring, batches, updates_per_batch=cfg.loss.updates_per_batch)
    seen = [ids for ids, _, _ in learner.seen]
    assert seen[0::2] == seen[1::2], "a batch's two updates saw different trajectories"
    assert [int(i) for ids in seen[0::2] for i in ids] == list(range(B * batches))
    assert learner.updates == 2 * batches and trainer.policy_version == batches
    assert learner.env_steps_trained == batches * B * SPEC.unroll_length
    assert [u.version for u in updates] == list(range(1, batches + 1))
    assert all(sum(u.stats["rho_hist"]) == 2 * B * SPEC.unroll_length for u in updates)
    with pytest.raises(ValueError, match="updates_per_batch"):
        LearnerConfig.of(updates_per_batch=0).check()


def test_a_collective_cut_by_the_shutdown_is_said_in_a_line(caplog):
    """A rank stopping while it waits in a collective for a rank that stopped first (2-rank runs stopped mid-update
    when one rank has no batch): the collective fails, and that is the shutdown's doing: one warning, no traceback
    (CI read one as a crash). The error still reaches ``on_exit``; any other failure keeps its traceback."""
    entered = threading.Event()

    class WaitingLearner(Learner):
        def step(self, batch, **kw):
            entered.set()
            while not trainer._stop.is_set():  # in the all-reduce until the other rank is gone
                time.sleep(0.001)
            raise CollectiveError("collective between learner ranks failed: Connection closed by peer")

    ring = TrajectoryRing(SPEC, batch_size=B, num_batches=3, pin_memory=False, drop_when_full=False)
    exited = []
    trainer = Trainer(
        WaitingLearner(LearnerConfig(), SPEC, torch.device("cpu")), ring, max_policy_lag=10**9,
        after_update=lambda update: False, on_exit=exited.append,
    )  # fmt: skip
    producer = threading.Thread(target=produce, args=(ring, B, threading.Event()), daemon=True)
    with caplog.at_level("INFO", logger="impala_async.learner.trainer"):
        trainer.start()
        producer.start()
        assert entered.wait(30), "no update began"
        assert trainer.stop(10)
        producer.join(10)
    assert len(exited) == 1 and isinstance(exited[0], CollectiveError)
    said = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "while stopping" in said[0].getMessage() and said[0].exc_info is None
    assert not [r for r in caplog.records if r.exc_info], "a traceback for the shutdown's own doing"
