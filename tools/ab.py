#!/usr/bin/env python3
"""A/B harness: configurations x seeds of `impala-async train` for one budget, one table and one figure.

    python tools/ab.py EXPERIMENT.toml [--parallel 2] [--report] [--dry-run] [--out runs/ab]

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
    timeout_s = 0                       # optional: stop a run (SIGINT) after this long (0: no limit)
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
between its last checkpoint and the cut, and the table counts it as resumed. The table
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
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from impala_async.learner.reports.metrics import parse_records, read_metrics

try:
    import tomllib
except ImportError:  # Python 3.10: the package's own dependency
    import tomli as tomllib

PLOT = Path(__file__).resolve().parent / "plot.py"
DEFAULT_CHECKPOINTS = (0.25, 0.5, 0.75)
BUSY_CORES = 0.5  # cores busy at a run's start with work other than the experiment's: something else is running
BUSY_WINDOW_S = 1.0
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
POLL_S = 1.0
STOP_GRACE_S = 60.0  # after SIGINT a run gets this long to write its final checkpoint before SIGKILL
FLAG_NAME = re.compile(r"[a-z][a-z0-9_]*")  # a field of train's configuration, as the flag names it
EXPERIMENT_KEYS = {
    "name",
    "seeds",
    "total_env_steps",
    "config",
    "flags",
    "checkpoints",
    "threshold",
    "stop_at_threshold",
    "timeout_s",
    "twice",
    "arms",
}


@dataclass(frozen=True)
class Experiment:
    name: str
    seeds: tuple[int, ...]
    total_env_steps: int
    arms: dict[str, dict]  # arm -> its flags (by flag name)
    config: Path | None = None
    flags: dict = field(default_factory=dict)
    checkpoints: tuple[float, ...] = DEFAULT_CHECKPOINTS
    threshold: float | None = None
    stop_at_threshold: bool = False
    timeout_s: float = 0.0
    twice: bool = False

    @classmethod
    def load(cls, path: Path) -> Experiment:
        """The experiment file, every problem in it reported at once (ValueError)."""
        raw = tomllib.loads(path.read_text())
        errors = [f"unknown key {k!r}" for k in raw if k not in EXPERIMENT_KEYS]
        errors += [f"{k} is required" for k in ("name", "seeds", "total_env_steps", "arms") if k not in raw]
        arms = raw.get("arms", {})
        if not isinstance(arms, dict) or not arms or not all(isinstance(v, dict) for v in arms.values()):
            errors.append("arms must be one table or more: [arms.NAME] with the arm's flags")
        named = [("flags", raw.get("flags", {}))]
        named += [(f"arm {k!r}", v) for k, v in arms.items()] if isinstance(arms, dict) else []
        for where, values in named:
            bad = [n for n in values if not FLAG_NAME.fullmatch(str(n))] if isinstance(values, dict) else []
            errors += [f"{where}: {n!r} is not a flag name (a dot in [arms.NAME] nests a table: quote it)" for n in bad]
        if not all(isinstance(s, int) for s in raw.get("seeds", [])) or not raw.get("seeds"):
            errors.append("seeds must be a non-empty list of integers")
        if not all(0 < f < 1 for f in raw.get("checkpoints", DEFAULT_CHECKPOINTS)):
            errors.append("checkpoints must be fractions of the budget, each in (0, 1)")
        if raw.get("stop_at_threshold") and raw.get("threshold") is None:
            errors.append("stop_at_threshold needs a threshold")
        shared = raw.get("flags", {})
        layered = (
            [{**shared, **arm} for arm in arms.values() if isinstance(arm, dict)] if isinstance(arms, dict) else []
        )
        if raw.get("twice") and not all(int(values.get("reproducible", 0)) for values in layered):
            errors.append("twice needs reproducible = 1 in flags or in every arm: other runs of one seed differ")
        if errors:
            raise ValueError(f"{path}: " + "; ".join(errors))
        config = raw.get("config")
        return cls(
            name=raw["name"],
            seeds=tuple(raw["seeds"]),
            total_env_steps=int(raw["total_env_steps"]),
            arms=arms,
            config=(path.parent / config) if config else None,
            flags=raw.get("flags", {}),
            checkpoints=tuple(raw.get("checkpoints", DEFAULT_CHECKPOINTS)),
            threshold=raw.get("threshold"),
            stop_at_threshold=bool(raw.get("stop_at_threshold", False)),
            timeout_s=float(raw.get("timeout_s", 0.0)),
            twice=bool(raw.get("twice", False)),
        )


def as_flags(values: dict) -> list[str]:
    """``{"batch_size": 32}`` -> ``["--batch-size", "32"]`` (JSON for what is not a plain scalar)."""
    out = []
    for name, value in values.items():
        text = value if isinstance(value, str) else json.dumps(value)
        out += [f"--{name.replace('_', '-')}", text]
    return out


def command(exp: Experiment, arm: str, seed: int, logdir: Path) -> list[str]:
    """The run's command line: the layers in order (config file, shared flags, the arm's flags, the run's own)."""
    cmd = [sys.executable, "-m", "impala_async", "train"]
    if exp.config:
        cmd += ["--config", str(exp.config)]
    cmd += as_flags(exp.flags) + as_flags(exp.arms[arm])
    return cmd + ["--total-env-steps", str(exp.total_env_steps), "--seed", str(seed), "--logdir", str(logdir)]


def problems(exp: Experiment, out: Path) -> list[str]:
    """What `train` would refuse in each arm's command line (an unknown flag, a value out of range), found by its own
    parser and configuration before any run starts: one line an arm, all of them at once."""
    from impala_async import cli

    found = []
    for arm in exp.arms:
        argv = command(exp, arm, exp.seeds[0], out / arm / f"s{exp.seeds[0]}")[3:]
        args, unknown = cli.build_parser().parse_known_args(argv)
        if unknown:
            found.append(f"arm {arm!r}: train has no {' '.join(a for a in unknown if a.startswith('--'))}")
            continue
        try:
            cli.load_learner_config(args)
        except SystemExit as e:  # a value train refuses: its one line
            found.append(f"arm {arm!r}: {e}")
    return found


def planned(exp: Experiment, out: Path, twins: bool = False) -> list[tuple[str, int, Path]]:
    """(arm, seed, logdir) in the order runs go: seed by seed, the arms alternating; with ``twins`` (and ``twice``)
    each run followed by its twin."""
    suffixes = ("", "-twin") if twins and exp.twice else ("",)
    return [(arm, seed, out / arm / f"s{seed}{x}") for seed in exp.seeds for arm in exp.arms for x in suffixes]


def twins_agree(first: Path, twin: Path) -> bool:
    """Whether two runs' final checkpoints agree: parameters bit for bit, counters, the last 100 returns in order."""
    import torch

    from impala_async.learner import checkpoint

    a, b = (checkpoint.load_latest(d, validate=checkpoint.validate_learner_state)[0] for d in (first, twin))
    ma, mb = a["learner"]["model"], b["learner"]["model"]
    same = ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    return same and all(a[k] == b[k] for k in ("policy_version", "env_steps", "episodes", "returns", "lengths"))


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
    """One `train` process of the experiment, its output in LOGDIR/train.log, and its record, ab-run.json."""

    def __init__(
        self, exp: Experiment, arm: str, seed: int, logdir: Path, resumes: int = 0, own: set[int] | None = None
    ):
        self.exp, self.arm, self.seed, self.logdir, self.resumes = exp, arm, seed, logdir, resumes
        self.cmd = command(exp, arm, seed, logdir) + (["--resume", str(logdir)] if resumes else [])
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
        exp = self.exp
        if not self.stopped and exp.stop_at_threshold and reached(self.metrics.new_records(), exp.threshold):
            self.stop("threshold reached")
        elif not self.stopped and exp.timeout_s and time.time() - self.started > exp.timeout_s:
            self.stop(f"timeout_s {exp.timeout_s:g}")
        elif self.stopped and time.time() - self.stopped_at > STOP_GRACE_S:
            self.proc.kill()
        return False

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


def return_at(rows: list[dict], steps: float) -> float | None:
    """The return of the last report at or before ``steps`` env steps (None if the run did not get that far)."""
    if not rows or rows[-1]["env_steps"] < steps * 0.99:
        return None
    before = [r["episode_return_mean"] for r in rows if r["env_steps"] <= steps]
    return before[-1] if before else None


def run_figures(exp: Experiment, logdir: Path) -> dict:
    """One run's figures from its metrics.jsonl and ab-run.json."""
    record = json.loads((logdir / "ab-run.json").read_text())
    rows = [r for r in read_metrics(logdir / "metrics.jsonl") if r.get("episode_return_mean") is not None]
    last = read_metrics(logdir / "metrics.jsonl")[-1:] or [{}]
    hit = next((r for r in rows if exp.threshold is not None and r["episode_return_mean"] >= exp.threshold), None)
    wall_s = last[0].get("wall_s")
    twin = logdir.with_name(logdir.name + "-twin")
    return {
        "twin_agrees": twins_agree(logdir, twin) if exp.twice and (twin / "ab-run.json").exists() else None,
        "final": rows[-1]["episode_return_mean"] if rows else None,
        "at": [return_at(rows, f * exp.total_env_steps) for f in exp.checkpoints],
        "steps_to_threshold": hit["env_steps"] if hit else None,
        "wall_to_threshold_s": hit["wall_s"] if hit else None,
        "wall_s": record["wall_s"],
        "env_steps": last[0].get("env_steps"),
        "env_steps_per_s": (last[0].get("env_steps") or 0) / wall_s if wall_s else None,
        "busy": record.get("busy_cores_at_start", record.get("load_at_start", 0)) > BUSY_CORES,  # (older: load)
        "resumed": record.get("resumes", 0) > 0,
        "exit_code": record["exit_code"],
    }


def spread(values: list) -> dict:
    """Median, minimum and maximum of the values that exist, and how many do."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def summarise(exp: Experiment, out: Path) -> dict:
    """arm -> {"runs": [per-run figures], figure -> spread over the arm's finished seeds}."""
    summary = {}
    for arm in exp.arms:
        runs = [run_figures(exp, d) for a, _, d in planned(exp, out) if a == arm and (d / "ab-run.json").exists()]
        arm_summary = {"runs": runs}
        for key in ("final", "steps_to_threshold", "wall_to_threshold_s", "wall_s", "env_steps_per_s"):
            arm_summary[key] = spread([r[key] for r in runs])
        arm_summary["at"] = [spread([r["at"][i] for r in runs]) for i in range(len(exp.checkpoints))]
        summary[arm] = arm_summary
    return summary


def fmt(s: dict, digits: int = 1, scale: float = 1.0) -> str:
    if s["median"] is None:
        return "-"
    med, lo, hi = (v / scale for v in (s["median"], s["min"], s["max"]))
    return f"{med:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]" if s["n"] > 1 else f"{med:.{digits}f}"


def table(exp: Experiment, summary: dict) -> str:
    """The summary as a markdown table: median [min, max] over each arm's seeds."""
    budget = exp.total_env_steps
    cols = ["arm", "seeds"] + [f"return at {f * budget / 1e6:g}M" for f in exp.checkpoints] + ["final return"]
    if exp.threshold is not None:
        cols += [f"M steps to {exp.threshold:g} (seeds)", f"minutes to {exp.threshold:g}"]
    cols += ["wall minutes", "env steps/s"] + (["twins agree"] if exp.twice else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for arm, s in summary.items():
        runs = s["runs"]
        seeds = f"{len(runs)}" + (f" ({sum(r['busy'] for r in runs)} busy)" if any(r["busy"] for r in runs) else "")
        seeds += f" ({sum(r['resumed'] for r in runs)} resumed)" if any(r["resumed"] for r in runs) else ""
        seeds += f", {sum(r['exit_code'] != 0 for r in runs)} failed" if any(r["exit_code"] for r in runs) else ""
        cells = [arm, seeds] + [fmt(a) for a in s["at"]] + [fmt(s["final"])]
        if exp.threshold is not None:
            n = s["steps_to_threshold"]["n"]
            cells += [f"{fmt(s['steps_to_threshold'], 2, 1e6)} ({n}/{len(runs)})", fmt(s["wall_to_threshold_s"], 1, 60)]
        cells += [fmt(s["wall_s"], 1, 60), fmt(s["env_steps_per_s"], 0)]
        if exp.twice:
            checked = [r["twin_agrees"] for r in runs if r["twin_agrees"] is not None]
            cells.append(f"{sum(checked)}/{len(checked)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(exp: Experiment, out: Path) -> None:
    done = [(a, d) for a, _, d in planned(exp, out) if (d / "ab-run.json").exists() and (d / "metrics.jsonl").exists()]
    if not done:
        return
    cmd = [sys.executable, str(PLOT), *(str(d) for _, d in done), "--labels", ",".join(a for a, _ in done)]
    cmd += ["--median", "-o", str(out / "curves.png"), "--title", exp.name]
    if exp.threshold is not None:
        cmd += ["--anchor", f"all={exp.threshold}:threshold {exp.threshold:g}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(result.stdout.strip() or result.stderr.strip(), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("experiment", type=Path, help="the experiment's TOML file")
    p.add_argument("--out", type=Path, default=Path("runs/ab"), help="where experiments' runs go (default: runs/ab)")
    p.add_argument("--parallel", type=int, default=1, choices=(1, 2), help="runs at once (default: 1)")
    p.add_argument("--report", action="store_true", help="only the table and the figure of the runs done")
    p.add_argument("--dry-run", action="store_true", help="check and print the commands, run nothing")
    args = p.parse_args(argv)
    try:
        exp = Experiment.load(args.experiment)
    except (OSError, ValueError, tomllib.TOMLDecodeError) as e:
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
        for arm, seed, logdir in planned(exp, out):
            print(" ".join(command(exp, arm, seed, logdir)))
        return 0
    if not args.report:
        try:
            run_all(exp, out, args.parallel)
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
