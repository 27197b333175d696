"""What an interrupted learner leaves, and what the next one makes of it: a metrics line torn by a kill, the empty
checkpoint file the writer opens in advance, a Ctrl-C before the learner's own signal handlers are installed."""

from __future__ import annotations

import json
import signal

import pytest
from procutil import ENDLESS, cli, stop, tail, wait_for

from impala_async.learner import checkpoint
from impala_async.learner.reports.metrics import MetricsWriter, read_metrics
from impala_async.ops import interrupts

SMALL = ENDLESS

# `python SWALLOW MODULE FUNCTION ARGS...`: the learner's command ARGS, with a SIGINT raised at the start of
# impala_async.learner.MODULE.FUNCTION and swallowed there, as a __del__ or a C extension clearing errors swallows one
# (ops/interrupts.py): the Ctrl-C a user pressed, lost on its way.
SWALLOW = """
import signal
import sys

from impala_async.cli import main as cli_main
from impala_async.learner import main, server

module, name = {"main": main, "server": server}[sys.argv[1]], sys.argv[2]
real = getattr(module, name)


def swallowing(*args, **kwargs):
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:
        print("swallowed a KeyboardInterrupt", file=sys.stderr, flush=True)
    return real(*args, **kwargs)


setattr(module, name, swallowing)
sys.exit(cli_main(sys.argv[3:]))
"""


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


def test_a_swallowed_ctrl_c_is_raised_again():
    """In process: the handler counts what it raised, swallowed or not; nothing is raised where none came."""
    before = signal.getsignal(signal.SIGINT)
    interrupts.install()
    try:
        interrupts.reraise_lost()  # none came: nothing
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass
        with pytest.raises(KeyboardInterrupt):
            interrupts.reraise_lost()
        interrupts.install()  # a new start counts afresh
        interrupts.reraise_lost()
    finally:
        interrupts.uninstall()
    assert signal.getsignal(signal.SIGINT) is before, "the handler it replaced is back"


@pytest.mark.process
@pytest.mark.parametrize(
    ("module", "function", "codes", "said"),
    [
        ("main", "_own_logdir", (130,), "impala-async: interrupted"),  # before the event loop: raised again
        ("server", "LearnerServer", (130,), "impala-async: interrupted"),  # the last step before it
        ("server", "assemble", (0,), "SIGINT: shutting down"),  # in it, before the server's handlers: uvloop's pipe
    ],
)
def test_a_ctrl_c_that_start_up_swallows_still_ends_it(tmp_path, module, function, codes, said):
    """The suite's lost SIGINT (BENCHMARKS.md section 20): a KeyboardInterrupt swallowed at start-up left the learner
    training until SIGTERM; it must end the start-up as one not swallowed does."""
    script, log = tmp_path / "swallow.py", tmp_path / "log"
    script.write_text(SWALLOW)
    proc = cli(module, function, "train", *SMALL, "--logdir", str(tmp_path / "run"), log=log, script=script)
    try:
        code = proc.wait(120)
    finally:
        stop(proc)
    text = log.read_text()
    assert "swallowed a KeyboardInterrupt" in text, tail(log)
    assert code in codes and said in text and "Traceback" not in text, (code, tail(log))
