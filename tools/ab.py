#!/usr/bin/env python3
"""A/B harness: configurations x seeds of `impala-async train` for one budget, one table and one figure.

    python tools/ab.py EXPERIMENT.toml [--parallel 2] [--report] [--dry-run] [--out runs/ab] [--arms A,B] [--seeds 0,1]

EXPERIMENT.toml names the arms and what they share (the configuration layers of `train`: a base ``config`` file, then
``flags`` every arm gets, then each arm's own values, typed as flags so that they win):

    name = "pong-batch"                 # the runs land in OUT/NAME/ARM/sSEED
    seeds = [0, 1]
    total_env_steps = 3_000_000         # every run's budget
    config = "base.toml"                # optional: the --config of every arm (relative to this file)
    flags = { env = "ALE/Pong-v5" }     # optional: flags of every arm, above the config file
    checkpoints = [0.25, 0.5, 0.75]     # optional: fractions of the budget at which the return is tabulated
    threshold = -15.0                   # optional: env steps and wall time to the first report at or above it
    stop_at_threshold = false           # optional: stop a run (SIGINT) once it reaches the threshold
    timeout_s = 0                       # optional: stop a run (SIGINT) after this much training time (0: no limit)
    twice = false                       # optional: make every run twice (with reproducible = 1): the twins must agree

    [arms.b16]                          # an arm with nothing of its own: the shared layers alone
    [arms.b32]
    batch_size = 32
    envs_per_actor = 128
    [arms."entropy-0.003"]              # a name with a dot is quoted (bare, TOML would nest a table "003")
    entropy_cost = 0.003

Before any run, every arm's command line goes through train's own parser and configuration: an unknown flag or a
value train refuses stops the harness at once, one line an arm (exit 2; ``--dry-run`` checks and prints the commands).
Runs go one at a time (``--parallel 2`` runs two at once, for runs that each leave a core idle); seed by seed, the arms
alternating, so that a stopped experiment leaves every arm with as many seeds as the others. A run whose directory
holds ``ab-run.json`` is finished and is not run again (one stopped by ``timeout_s`` too: delete its ``ab-run.json``
to have the next invocation continue it): a rerun of the command completes an experiment. A run that was
cut short (the harness stopped, the machine restarted) continues from its newest checkpoint (``train --resume``, the
same command line), so a Pong A/B of many hours can span sessions; one with no checkpoint yet starts again. A resumed
run's wall time is its training time (the metrics' ``wall_s``, carried by its checkpoints), without the minutes lost
between its last checkpoint and the cut, and the table counts it as resumed; ``timeout_s`` counts that training time
too (a run of ``timeout_s = 9000`` resumed after 7,000 s of it gets 2,000 s more). ``--arms`` and ``--seeds`` run
only those of the file's arms and seeds (a long experiment shared out between sessions or machines); the table and
the figure still cover every run of the experiment that is done. The table
gives, per arm, the median and the range over its seeds of the final return (the mean of the last 100 episodes at the
last report), the return at each checkpoint, the env steps and wall time to the threshold (with how many seeds
reached it), the wall time and the env steps/s; it is printed and written to OUT/NAME/summary.md (and .json), the
curves with their median band to OUT/NAME/curves.png (tools/plot.py). Wall times and steps/s are only comparable
between runs made alone on the machine: the cores busy at each start with work other than the experiment's own runs
(over one second, from /proc) are recorded, and a busy start is flagged.

``twice = true`` checks that an experiment reproduces: each run is made a second time (OUT/NAME/ARM/sSEED-twin, right
after the first), and the table says for how many seeds of each arm the twins' final checkpoints agree (parameters bit
for bit, every counter and the last 100 returns in order). Only with ``reproducible = 1`` in ``flags`` or every arm
(README, Reproducible runs): without it, runs of one seed differ by design.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ab_experiment import Experiment, command, planned, problems, selected
from ab_report import BUSY_CORES, figure, summarise, table

from impala_async.learner.reports.metrics import parse_records, read_metrics

BUSY_WINDOW_S = 1.0
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
POLL_S = 1.0
STOP_GRACE_S = 60.0  # after SIGINT a run gets this long to write its final checkpoint before SIGKILL


class MetricsTail:
    """The records appended to a growing metrics.jsonl since the last call, whole lines only: a poll costs what was
    written since, not the whole file. (A Pong run's file grows to tens of MB; parsed whole every second, it took a
    quarter of a core from the run being measured.) A line still being written is left for the next call."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new_records(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        return parse_records(whole)


def reached(records: list[dict], threshold: float | None) -> bool:
    """Whether any record's return (the mean of the last 100 episodes) is at or above the threshold."""
    if threshold is None:
        return False
    return any((r.get("episode_return_mean") or -float("inf")) >= threshold for r in records)


def _busy_s() -> float:
    """CPU seconds the machine has been busy since boot: /proc/stat's user, nice, system, irq and softirq."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / CLOCK_TICKS_PER_S


def _tree_cpu_s(roots: set[int]) -> float:
    """CPU seconds (user + system) of the live processes in the trees rooted at ``roots`` (from /proc/PID/stat)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()  # after the name: state, ppid, ...
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(d.name))
        ticks[int(d.name)] = int(fields[11]) + int(fields[12])  # utime, stime
    todo, seen = list(roots), set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += children.get(pid, [])
    return sum(ticks.get(pid, 0) for pid in seen) / CLOCK_TICKS_PER_S


def others_busy_cores(own: set[int], window_s: float = BUSY_WINDOW_S) -> float:
    """Cores busy over ``window_s`` with work other than the process trees of ``own`` (the experiment's running
    runs): the machine's busy time less theirs. The load average would count a run that has just ended for a minute
    after it, flagging every run that follows another. Where /proc is missing: the load average."""
    try:
        busy, theirs = _busy_s(), _tree_cpu_s(own)
        time.sleep(window_s)
        return max(0.0, (_busy_s() - busy) - (_tree_cpu_s(own) - theirs)) / window_s
    except OSError:
        return os.getloadavg()[0]


class Run:
    """One `train` process of the experiment, its output in LOGDIR/train.log, and its record, ab-run.json. A resumed
    run starts with the training time its newest checkpoint carries (``carried_s``), which ``timeout_s`` counts."""

    def __init__(
        self, exp: Experiment, arm: str, seed: int, logdir: Path, resumes: int = 0, own: set[int] | None = None
    ):
        self.exp, self.arm, self.seed, self.logdir, self.resumes = exp, arm, seed, logdir, resumes
        self.cmd = command(exp, arm, seed, logdir) + (["--resume", str(logdir)] if resumes else [])
        self.carried_s = carried_training_s(logdir) if resumes else 0.0
        self.busy_cores = others_busy_cores(own or set())
        logdir.mkdir(parents=True, exist_ok=True)
        self.log = open(logdir / "train.log", "a" if resumes else "w")  # noqa: SIM115 (closed in finish())
        self.started = time.time()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.stopped = ""
        self.metrics = MetricsTail(logdir / "metrics.jsonl")

    def poll(self) -> bool:
        """True once the process has ended; stops it (SIGINT, as a user would) at the threshold or the time limit."""
        if self.proc.poll() is not None:
            return True
        if not self.stopped:
            why = self.why_stop(time.time())
            if why:
                self.stop(why)
        elif time.time() - self.stopped_at > STOP_GRACE_S:
            self.proc.kill()
        return False

    def why_stop(self, now: float) -> str:
        """Why the run is to stop at ``now`` ("": it goes on): its threshold reached, or ``timeout_s`` of training time
        spent, what it carried from before a resume included."""
        exp = self.exp
        if exp.stop_at_threshold and reached(self.metrics.new_records(), exp.threshold):
            return "threshold reached"
        if exp.timeout_s and self.carried_s + now - self.started > exp.timeout_s:
            return f"timeout_s {exp.timeout_s:g}"
        return ""

    def stop(self, why: str) -> None:
        self.stopped, self.stopped_at = why, time.time()
        self.proc.send_signal(signal.SIGINT)

    def finish(self) -> dict:
        self.log.close()
        wall_s = time.time() - self.started
        if self.resumes:  # the training time its checkpoints carried across the cuts
            wall_s = max([r["wall_s"] for r in read_metrics(self.logdir / "metrics.jsonl")] or [wall_s])
        record = {
            "arm": self.arm,
            "seed": self.seed,
            "command": self.cmd,
            "exit_code": self.proc.returncode,
            "wall_s": round(wall_s, 1),
            "busy_cores_at_start": round(self.busy_cores, 2),
            "stopped": self.stopped,
            "resumes": self.resumes,
        }
        (self.logdir / "ab-run.json").write_text(json.dumps(record, indent=1))
        return record


def carried_training_s(logdir: Path) -> float:
    """The training time (s) the newest checkpoint in ``logdir`` carries: where `train --resume` starts its clock."""
    from impala_async.learner import checkpoint

    newest = checkpoint.load_latest(logdir, validate=checkpoint.validate_learner_state)
    return float(newest[0]["wall_s"]) if newest else 0.0


def cut_short(logdir: Path) -> int:
    """How many times the run in ``logdir`` was resumed, counting the resume about to be made; 0 when it starts afresh
    (no directory, or one without a checkpoint: removed)."""
    if not logdir.exists():
        return 0
    if not any(logdir.glob("checkpoint-*.pt")):
        print(f"ab: {logdir} was cut short before its first checkpoint: started again", flush=True)
        subprocess.run(["rm", "-rf", str(logdir)], check=True)
        return 0
    marker = logdir / "ab-resumes"
    resumes = int(marker.read_text() or 0) + 1 if marker.exists() else 1
    marker.write_text(str(resumes))
    print(f"ab: {logdir} was cut short: resumed from its newest checkpoint (resume {resumes})", flush=True)
    return resumes


def run_all(exp: Experiment, out: Path, parallel: int) -> None:
    every = planned(exp, out, twins=True)
    todo = [(a, s, d) for a, s, d in every if not (d / "ab-run.json").exists()]
    print(f"ab: {exp.name}: {len(every) - len(todo)} runs done, {len(todo)} to go", flush=True)
    running: list[Run] = []
    try:
        while todo or running:
            while todo and len(running) < parallel:
                arm, seed, logdir = todo.pop(0)
                own = {r.proc.pid for r in running}
                run = Run(exp, arm, seed, logdir, resumes=cut_short(logdir), own=own)
                busy = f" (busy: {run.busy_cores:.2f} cores)" if run.busy_cores > BUSY_CORES else ""
                print(f"ab: start {arm} seed {seed}{busy}: {' '.join(run.cmd[1:])}", flush=True)
                running.append(run)
            time.sleep(POLL_S)
            for run in [r for r in running if r.poll()]:
                running.remove(run)
                rec = run.finish()
                print(
                    f"ab: end {rec['arm']} seed {rec['seed']}: exit {rec['exit_code']}, {rec['wall_s']} s", flush=True
                )
    finally:
        for run in running:  # the experiment itself was stopped: its runs stop too, and count as interrupted
            run.proc.send_signal(signal.SIGINT)
            run.proc.wait(timeout=STOP_GRACE_S)
            run.log.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("experiment", type=Path, help="the experiment's TOML file")
    p.add_argument("--out", type=Path, default=Path("runs/ab"), help="where experiments' runs go (default: runs/ab)")
    p.add_argument("--parallel", type=int, default=1, choices=(1, 2), help="runs at once (default: 1)")
    p.add_argument("--report", action="store_true", help="only the table and the figure of the runs done")
    p.add_argument("--dry-run", action="store_true", help="check and print the commands, run nothing")
    p.add_argument("--arms", help="run only these of the file's arms (comma-separated; the table covers every arm)")
    p.add_argument("--seeds", help="run only these of the file's seeds (comma-separated)")
    args = p.parse_args(argv)
    try:
        exp = Experiment.load(args.experiment)
        chosen = selected(exp, args.arms, args.seeds)
    except (OSError, ValueError) as e:  # tomllib.TOMLDecodeError is a ValueError
        print(f"ab: {e}", file=sys.stderr)
        return 2
    out = args.out / exp.name
    refused = [] if args.report else problems(exp, out)
    if refused:
        print(f"ab: {args.experiment}: " + "; ".join(refused), file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped by a supervisor: its runs stop, resumable
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also where a shell started it in the background, SIGINT
    # ignored (as `cmd &` leaves it in a script): `kill -INT` stops it as Ctrl-C does
    if args.dry_run:
        for arm, seed, logdir in planned(chosen, out):
            print(" ".join(command(chosen, arm, seed, logdir)))
        return 0
    if not args.report:
        try:
            run_all(chosen, out, args.parallel)
        except KeyboardInterrupt:
            print("ab: stopped; the same command continues it (a run cut short resumes from its checkpoint)")
            return 130
    summary = summarise(exp, out)
    text = table(exp, summary)
    print(text)
    (out / "summary.md").write_text(f"# {exp.name}\n\n{text}\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    figure(exp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
