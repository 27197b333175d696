"""A full or read-only logdir is weather, not death (issue 27, row 2): a real learner on a real small filesystem (a
tmpfs this test mounts; skipped where it may not mount one) says so once, trains on, keeps its last good checkpoint,
writes the next when space returns, and leaves no metrics.jsonl line that does not parse; starting on a full or
read-only disk is a one-line refusal. Every failed write takes one path (an OSError, whatever its errno)."""

from __future__ import annotations

import errno
import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
from procutil import ENDLESS, cli, free_port, run_cli, stop, tail, wait_for

from impala_async.learner import checkpoint

FS_BYTES = 16 << 20
SMALL = [*ENDLESS, "--report-interval-s", "0.2", "--checkpoint-interval-s", "1", "--checkpoint-retry-interval-s", "1"]


@pytest.fixture
def small_fs(tmp_path):
    """A 16 MiB tmpfs at tmp_path/fs, unmounted afterwards."""
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(directory: Path) -> Path:
    """Fill ``directory``'s filesystem to the last byte; the filler's path."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    return filler


def updates(log: Path) -> int:
    """The learner's updates, from its latest progress line on the console (what a user watches)."""
    found = re.findall(r"updates\s+([\d,]+)", log.read_text())
    return int(found[-1].replace(",", "")) if found else 0


def strict_lines(path: Path) -> list[dict]:
    """Every line of a metrics.jsonl, each of which must parse."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def weather(tmp_path: Path, logdir: Path, spoil, mend) -> None:
    """A learner writing into ``logdir``; ``spoil()`` its disk once a checkpoint is there, ``mend()`` it after it
    trained on through the spell; then stopped. Checks everything the class promises."""
    log = tmp_path / "learner.log"
    proc = cli("train", *SMALL, "--logdir", str(logdir), log=log)
    try:
        wait_for(lambda: checkpoint.list_checkpoints(logdir), 120, "a first checkpoint", proc, log)
        spoil()
        said = ("metrics.jsonl cannot be written", "checkpoint failed")
        wait_for(lambda: all(s in log.read_text() for s in said), 60, "the faults said", proc, log)
        before = updates(log)
        wait_for(lambda: updates(log) > before + 20, 60, "training through the fault", proc, log)
        kept = checkpoint.list_checkpoints(logdir)
        mend()
        again = ("metrics.jsonl is written again", "checkpoint written again")
        wait_for(lambda: all(s in log.read_text() for s in again), 60, "the disk taken up again", proc, log)
        stop(proc)
    finally:
        stop(proc)
    text = log.read_text()
    assert proc.returncode == 0 and "Traceback" not in text, tail(log, 60)
    for s in (*said, *again):
        assert text.count(s) == 1, (s, text.count(s))
    rows = strict_lines(logdir / "metrics.jsonl")
    assert [r["env_steps"] for r in rows] == sorted(r["env_steps"] for r in rows)
    assert kept and all(p.exists() or p in kept for p in kept), "the newest good checkpoint was kept"
    newest = checkpoint.list_checkpoints(logdir)[-1]
    assert checkpoint.load(newest, 1 << 30)["learner"]["env_steps_trained"] > 0


@pytest.mark.process
def test_a_full_disk_is_weather(small_fs, tmp_path):
    box = {}
    weather(
        tmp_path,
        small_fs / "run",
        spoil=lambda: box.update(filler=fill(small_fs)),
        mend=lambda: box["filler"].unlink(),
    )


def scraped(port: int, name: str = "learner_steps") -> int:
    """A counter of the learner's /metrics (for when its console cannot be written either)."""
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return -1  # not (or no longer) serving: wait_for names the learner's exit, if that is why
    return int(float(re.search(rf"^impala_async_{name}_total (\S+)$", body, re.M).group(1)))


@pytest.mark.process
def test_a_full_disk_under_the_console_too(small_fs, tmp_path):
    """`train > LOGDIR/train.log 2>&1` (nohup, a soak): the console's own file is on the full disk. Nothing the
    learner writes there may end it; it trains through the spell (seen on /metrics), says the faults once space is
    back, and exits 0 with a checkpoint written after the spell."""
    logdir, log, port = small_fs / "run", small_fs / "train.log", free_port()
    proc = cli("train", *SMALL, "--logdir", str(logdir), "--metrics-port", str(port), log=log)
    try:
        wait_for(lambda: checkpoint.list_checkpoints(logdir), 120, "a first checkpoint", proc, log)
        wait_for(lambda: scraped(port) > 0, 60, "updates on /metrics", proc, log)
        filler = fill(small_fs)
        before = scraped(port)
        wait_for(lambda: scraped(port, "checkpoint_failures") > 0, 60, "a checkpoint failed", proc, log)
        wait_for(lambda: scraped(port) > before + 50, 60, "training with the console's disk full", proc, log)
        filler.unlink()
        wait_for(lambda: "checkpoint written again" in log.read_text(), 60, "the disk taken up again", proc, log)
        stop(proc)
    finally:
        stop(proc)
    assert proc.returncode == 0 and "Traceback" not in log.read_text(), tail(log, 60)
    strict_lines(logdir / "metrics.jsonl")


@pytest.mark.process
@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_starting_on_a_full_or_read_only_disk_is_refused_in_one_line(small_fs, tmp_path, fault):
    """A mount cannot turn read-only under a learner's open files (the kernel refuses: "mount point is busy"), so a
    read-only logdir meets a learner at its start; mid-run, any failed write takes the full disk's path above."""
    if fault == "full":
        fill(small_fs)
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    out = run_cli("train", *SMALL, "--logdir", str(small_fs / "run"), timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    reason = "No space left on device" if fault == "full" else "Read-only file system"
    assert last.startswith("impala-async: ") and reason in last, last
