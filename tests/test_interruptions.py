"""What an interrupted learner leaves, and what the next one makes of it: a metrics line torn by a kill, the empty
checkpoint file the writer opens in advance, a Ctrl-C before the learner's own signal handlers are installed."""

from __future__ import annotations

import json
import signal

import pytest
from procutil import ENDLESS, cli, stop, tail, wait_for

from impala_async.learner import checkpoint
from impala_async.learner.reports.metrics import MetricsWriter, read_metrics

SMALL = ENDLESS


def test_a_line_torn_by_a_kill_is_cut_before_the_next_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"env_steps": 10}) + "\n" + '{"env_steps": 20, "wall')  # killed mid-write
    writer = MetricsWriter(path)
    writer.write({"env_steps": 30})
    writer.close()
    assert [r["env_steps"] for r in read_metrics(path)] == [10, 30], "the resumed run's first record was lost"
    fresh = tmp_path / "fresh.jsonl"
    MetricsWriter(fresh).close()
    assert fresh.read_text() == "", "an empty file gains no blank line"


def test_an_empty_pre_opened_checkpoint_file_is_no_partial_checkpoint(tmp_path):
    """The writer opens its next file in advance (checkpoint.CheckpointWriter): a learner killed between checkpoints
    leaves it empty, and every start after a SIGKILL used to warn of a partial checkpoint."""
    empty = tmp_path / ".checkpoint-123-1.tmp"  # as CheckpointWriter names them: pid, number
    empty.touch()
    assert checkpoint.remove_partial(tmp_path) == 0 and not empty.exists()
    part = tmp_path / ".checkpoint-123-0.tmp"
    part.write_bytes(b"PK\x03\x04 half a checkpoint")
    empty.touch()
    assert checkpoint.remove_partial(tmp_path) == 1 and not part.exists() and not empty.exists()


@pytest.mark.process
@pytest.mark.parametrize(
    "moment", ["learner: the update runs on", "configuration (values that differ", "impala-async learner listening"]
)
def test_ctrl_c_at_any_moment_of_startup_ends_in_one_line(tmp_path, moment):
    """SIGINT while the learner starts (before its handlers exist, and after): no traceback, exit 130 (interrupted)
    or 0 (a clean shutdown once its handlers are in)."""
    log = tmp_path / "log"
    proc = cli("train", *SMALL, "--logdir", str(tmp_path / "run"), log=log)
    try:
        wait_for(lambda: moment in log.read_text(), 120, repr(moment), proc, log)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    finally:
        stop(proc)
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, tail(log, 60)
    assert code in (0, 130), (code, tail(log))
