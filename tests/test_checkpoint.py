"""Checkpoints when the process has no file descriptor left, and a failed checkpoint as an error to retry.

Real files and a real descriptor table: the test process fills its own until open() fails with EMFILE."""

from __future__ import annotations

import errno
import os
import resource

import pytest
import torch

from impala_async.config import Layered, LearnerConfig
from impala_async.config.resolve import Probe, resolve
from impala_async.core.spec import TrajectorySpec
from impala_async.learner import checkpoint
from impala_async.learner.learn import Learner
from impala_async.learner.weights import Publication


class Exhausted:
    """Every free file descriptor taken (the soft limit lowered first so that this stays cheap)."""

    def __init__(self, limit: int = 512):
        self.limit = limit

    def __enter__(self):
        self.saved = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.limit, self.saved[1]))
        self.fds = []
        try:
            while True:
                self.fds.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as e:
            assert e.errno == errno.EMFILE
        return self

    def __exit__(self, *exc):
        for fd in self.fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, self.saved)


def _parts(tmp_path):
    """The learner's checkpoints and weights publication, built as the server builds them (server.py)."""
    spec = TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=5)
    cfg = LearnerConfig.of(checkpoint_interval_s=600, checkpoint_retry_interval_s=10).check()
    cfg = resolve(Layered(cfg), default_listen="tcp://127.0.0.1:*", probe=Probe(None, spec.trajectory_nbytes)).cfg
    learner = Learner(cfg, spec, torch.device("cpu"))

    def state():
        return checkpoint.learner_state(
            learner,
            policy_version=0,
            env_steps=learner.env_steps_trained,
            episodes=0,
            returns=[],
            lengths=[],
            wall_s=0.0,
            config=cfg.flat(),
            config_layers={},
            spec=spec.to_dict(),
            torch_rng=torch.get_rng_state(),
        )

    checkpoints = checkpoint.Checkpoints(tmp_path, cfg.checkpoints, learner, collect=state)
    publication = Publication(
        learner.model,
        {},
        1,
        version=lambda: 0,
        difficulty=lambda: None,
        pace=lambda: 0.0,
        publish=lambda data: None,
        interval_s=0.0,
    )
    return learner, checkpoints, publication


def test_a_checkpoint_is_written_with_no_descriptor_free_and_a_failure_is_reported_not_raised(tmp_path):
    learner, checkpoints, _ = _parts(tmp_path)
    try:
        with Exhausted() as ex:
            with pytest.raises(OSError):
                open(tmp_path / "anything", "w")  # noqa: SIM115 (the point: nothing can be opened)
            first = checkpoints.try_save()  # the descriptors it needs were opened in advance
            assert first is not None and first.exists()
            assert checkpoints.failures == 0
            # It freed its temporary file's descriptor and took it again for the next one: the reserve holds.
            learner.env_steps_trained += 5
            assert checkpoints.try_save() is not None
            # Without that reserve (say a descriptor-hungry library grabbed the free slot) the save fails:
            # reported and counted, not raised.
            fd, name = checkpoints.writer._next
            os.close(fd)
            os.unlink(tmp_path / name)
            checkpoints.writer._next = None
            ex.fds.append(os.open(os.devnull, os.O_RDONLY))  # the slot just freed
            learner.env_steps_trained += 5
            second = checkpoints.try_save()
            assert second is None and checkpoints.failures == 1
        learner.env_steps_trained += 5
        third = checkpoints.try_save()  # descriptors again: the retry succeeds
        assert third is not None and checkpoints.failures == 1
        state, path = checkpoint.load_latest(tmp_path, validate=checkpoint.validate_learner_state)
        assert path == third and state["learner"]["env_steps_trained"] == 15
    finally:
        checkpoints.close()
    assert not list(tmp_path.glob(".checkpoint-*.tmp")), "a temporary file outlived the writer"


def test_non_finite_weights_are_never_saved(tmp_path):
    learner, checkpoints, publication = _parts(tmp_path)
    try:
        with torch.no_grad():
            next(learner.model.parameters()).fill_(float("nan"))
        assert checkpoints.try_save() is None and checkpoints.failures == 1
        assert checkpoint.list_checkpoints(tmp_path) == []
        assert publication.encode() is None and publication.refused_nonfinite == 1
    finally:
        checkpoints.close()


def test_archive_checks(tmp_path):
    import zipfile

    good = checkpoint.save(tmp_path, {"x": torch.arange(4)}, 1)
    checkpoint.check_archive(good, 1 << 20)
    with pytest.raises(ValueError, match="max_checkpoint_bytes"):
        checkpoint.check_archive(good, 100)
    bomb = tmp_path / "checkpoint-000000000002.pt"  # a deflated record: decompresses beyond the file's size
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\0" * (8 << 20))
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(ValueError, match="compressed"):
        checkpoint.check_archive(bomb, 1 << 20)
    (tmp_path / "checkpoint-000000000003.pt").write_bytes(b"")
    state, path = checkpoint.load_latest(tmp_path, max_bytes=1 << 20)
    assert path == good and state["x"].tolist() == [0, 1, 2, 3]
