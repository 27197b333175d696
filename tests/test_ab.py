"""tools/ab.py, the A/B harness, and its parts tools/ab_experiment.py and tools/ab_report.py: its figures against
metrics written by hand, and the real tool driving real `train` runs (tiny CartPole arms), resumable and with its
table checked against the runs' own metrics."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import tool
from procutil import cli, run_cli, wait_for

from impala_async.learner.reports.metrics import read_metrics

TOOL = Path(__file__).resolve().parent.parent / "tools" / "ab.py"
ab = tool("ab")
ab_report = tool("ab_report")

TINY = {
    "env": "CartPole-v1",
    "num_actors": 1,
    "envs_per_actor": 4,
    "unroll_length": 10,
    "batch_size": 4,
    "report_interval_s": 0.2,
}


def write_experiment(path: Path, seeds=(0, 1), **extra) -> Path:
    lines = [
        'name = "tiny"',
        f"seeds = {list(seeds)}",
        "total_env_steps = 3000",
        "checkpoints = [0.5]",
        "threshold = 15.0",
        "flags = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in TINY.items()) + " }",
        *(f"{k} = {json.dumps(v)}" for k, v in extra.items()),
        "[arms.fast]",
        "learning_rate = 0.003",
        "[arms.slow]",
        "learning_rate = 0.0001",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def fake_run(logdir: Path, returns: list[float | None], steps_each: int = 100, wall_each_s: float = 2.0) -> Path:
    logdir.mkdir(parents=True)
    rows = [
        {"wall_s": wall_each_s * (i + 1), "env_steps": steps_each * (i + 1), "episode_return_mean": r}
        for i, r in enumerate(returns)
    ]
    (logdir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    record = {"wall_s": wall_each_s * len(returns) + 3, "busy_cores_at_start": 0.1, "exit_code": 0}
    (logdir / "ab-run.json").write_text(json.dumps(record))
    return logdir


def test_figures_of_one_run(tmp_path):
    exp = ab.Experiment.load(write_experiment(tmp_path / "e.toml"))  # budget 3000, checkpoint at 1500, threshold 15
    returns = [None, 5.0, 10.0, 16.0, 12.0] + [20.0] * 25  # 30 reports of 100 steps: 3000 steps
    figures = ab_report.run_figures(exp, fake_run(tmp_path / "r", returns))
    assert figures["final"] == 20.0
    assert figures["at"] == [20.0], "the last report at or before 1500 steps (the 15th)"
    assert figures["steps_to_threshold"] == 400 and figures["wall_to_threshold_s"] == 8.0, "the first >= 15"
    assert figures["env_steps_per_s"] == pytest.approx(3000 / 60)
    short = ab_report.run_figures(exp, fake_run(tmp_path / "short", [1.0] * 10))  # stopped at 1000 steps
    assert short["at"] == [None] and short["steps_to_threshold"] is None, "a run never got to 1500 steps or 15"


def test_the_threshold_is_read_from_what_was_appended_since_the_last_poll(tmp_path):
    """The harness polls every second; it reads only what the run appended since (whole lines), not the whole file."""
    path = tmp_path / "metrics.jsonl"
    tail = ab.MetricsTail(path)
    assert tail.new_records() == []  # no file yet
    path.write_text('{"episode_return_mean": 1.0}\n{"episode_return_mean": 2')  # the second line still being written
    assert tail.new_records() == [{"episode_return_mean": 1.0}]
    with open(path, "a") as f:
        f.write("0.0}\n")
    records = tail.new_records()
    assert records == [{"episode_return_mean": 20.0}] and ab.reached(records, 18.0)
    assert tail.new_records() == []  # nothing new, nothing read again
    assert not ab.reached([{"episode_return_mean": None}, {"episode_return_mean": 17.9}], 18.0)
    assert not ab.reached(records, None)


@pytest.mark.process
def test_every_problem_of_an_experiment_file_is_reported_at_once(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nseeds = []\ncheckpoints = [1.5]\nstop_at_threshold = true\ncolour = "red"\n')
    with pytest.raises(ValueError) as e:
        ab.Experiment.load(bad)
    for words in ("unknown key 'colour'", "total_env_steps is required", "arms must be", "seeds must", "checkpoints"):
        assert words in str(e.value), words
    assert "stop_at_threshold needs a threshold" in str(e.value)
    out = run_cli(str(bad), script=TOOL, timeout=60)
    assert out.returncode == 2 and "unknown key 'colour'" in out.stderr and "Traceback" not in out.stderr


def test_a_dotted_arm_name_is_refused_not_run_as_a_nested_flag(tmp_path):
    """``[arms.entropy-0.0006]`` is TOML for arms["entropy-0"]["0006"]: once run as ``--0006 {...}`` (exit 2)."""
    dotted = tmp_path / "dotted.toml"
    dotted.write_text('name = "x"\nseeds = [0]\ntotal_env_steps = 10\n[arms.entropy-0.0006]\nentropy_cost = 0.0006\n')
    with pytest.raises(ValueError, match=r"arm 'entropy-0': '0006' is not a flag name .* quote it"):
        ab.Experiment.load(dotted)
    dotted.write_text(dotted.read_text().replace("[arms.entropy-0.0006]", '[arms."entropy-0.0006"]'))
    exp = ab.Experiment.load(dotted)
    assert ab.command(exp, "entropy-0.0006", 0, tmp_path)[-8:-6] == ["--entropy-cost", "0.0006"]


def test_what_train_would_refuse_is_found_before_any_run(tmp_path):
    """An arm's unknown flag or out-of-range value, by train's own parser and configuration, every arm at once: a
    typo in the fourth arm of an A/B would otherwise surface hours in, when that arm's first run starts."""
    path = write_experiment(tmp_path / "e.toml")
    path.write_text(path.read_text() + "[arms.typo]\nentropy_cots = 0.01\n[arms.negative]\nentropy_cost = -1\n")
    exp = ab.Experiment.load(path)
    found = ab.problems(exp, tmp_path)
    assert len(found) == 2, found
    assert found[0] == "arm 'typo': train has no --entropy-cots", found
    assert found[1].startswith("arm 'negative': ") and "entropy_cost must be a finite number >= 0" in found[1], found
    assert ab.main([str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists(), "nothing run, nothing made"


def test_sigint_stops_the_harness_even_where_its_shell_ignored_it(tmp_path):
    """`python tools/ab.py ... &` in a script starts it with SIGINT ignored; `kill -INT` must still stop it."""
    before, before_term = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.getsignal(signal.SIGTERM)
    try:
        assert ab.main([str(write_experiment(tmp_path / "e.toml")), "--dry-run", "--out", str(tmp_path)]) == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
        signal.signal(signal.SIGTERM, before_term)


def test_arms_and_seeds_run_only_those_of_the_file(tmp_path, capsys):
    """``--arms``/``--seeds``: a long experiment shared out between sessions, without a cut-down copy of its file; a
    name the file lacks is refused with what it has (a copy would run it silently, outside the table)."""
    path, out = write_experiment(tmp_path / "e.toml", seeds=(0, 1, 2)), tmp_path / "out"
    assert ab.main([str(path), "--dry-run", "--out", str(out), "--arms", "slow", "--seeds", "2,0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [(line.split("--seed ")[1].split()[0], line.split("--logdir ")[1]) for line in lines] == [
        ("2", str(out / "tiny" / "slow" / "s2")),
        ("0", str(out / "tiny" / "slow" / "s0")),
    ]
    assert all("--learning-rate 0.0001" in line for line in lines)
    assert ab.main([str(path), "--dry-run", "--out", str(out), "--arms", "slow,quick", "--seeds", "3"]) == 2
    said = capsys.readouterr().err
    assert "no arm 'quick' (the file's arms: fast, slow)" in said and "no seed 3 (the file's seeds: 0, 1, 2)" in said
    assert ab.main([str(path), "--dry-run", "--out", str(out), "--seeds", "one"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_timeout_counts_the_training_time_carried_across_a_resume(tmp_path):
    """A run of ``timeout_s = 9000`` resumed after 7,000 s of training gets 2,000 s more, not 9,000 (the poll's own
    decision, on a stand-in for the Run: its process plays no part in it)."""
    path = write_experiment(tmp_path / "e.toml", timeout_s=9000)
    exp = ab.Experiment.load(path)
    resumed = SimpleNamespace(exp=exp, carried_s=7000.0, started=100.0, metrics=None)
    assert ab.Run.why_stop(resumed, now=100.0 + 1999) == ""
    assert ab.Run.why_stop(resumed, now=100.0 + 2001) == "timeout_s 9000"
    fresh = SimpleNamespace(exp=exp, carried_s=0.0, started=100.0, metrics=None)
    assert ab.Run.why_stop(fresh, now=100.0 + 8999) == "" and ab.Run.why_stop(fresh, now=100.0 + 9001)


@pytest.mark.parametrize("path", sorted((TOOL.parent / "experiments").glob("*.toml")), ids=lambda p: p.stem)
def test_every_experiment_file_in_the_tree_is_one_train_accepts(path, tmp_path):
    exp = ab.Experiment.load(path)
    assert ab.problems(exp, tmp_path) == []


def test_layers_become_the_command_line_in_order(tmp_path):
    (tmp_path / "base.toml").write_text("batch_size = 8\n")
    exp = ab.Experiment.load(write_experiment(tmp_path / "e.toml", config="base.toml"))
    cmd = ab.command(exp, "slow", 1, tmp_path / "slow" / "s1")
    assert cmd[cmd.index("--config") + 1] == str(tmp_path / "base.toml")
    assert cmd.index("--config") < cmd.index("--env") < cmd.index("--learning-rate"), "file, shared flags, arm"
    assert cmd[cmd.index("--learning-rate") + 1] == "0.0001" and cmd[-6:-4] == ["--total-env-steps", "3000"]
    assert [(a, s) for a, s, _ in ab.planned(exp, tmp_path)] == [("fast", 0), ("slow", 0), ("fast", 1), ("slow", 1)]


def test_the_table_gives_median_and_range_over_each_arms_seeds(tmp_path):
    exp = ab.Experiment.load(write_experiment(tmp_path / "e.toml"))
    out = tmp_path / "ab"
    finals = {("fast", 0): 20.0, ("fast", 1): 30.0, ("slow", 0): 4.0}  # slow seed 1 not run yet
    for (arm, seed), final in finals.items():
        fake_run(out / arm / f"s{seed}", [None] + [final] * 29)
    summary = ab_report.summarise(exp, out)
    assert summary["fast"]["final"] == {"median": 25.0, "min": 20.0, "max": 30.0, "n": 2}
    assert summary["fast"]["steps_to_threshold"]["n"] == 2 and summary["slow"]["steps_to_threshold"]["n"] == 0
    text = ab_report.table(exp, summary)
    assert "| fast | 2 | 25.0 [20.0, 30.0] | 25.0 [20.0, 30.0] | 0.00 [0.00, 0.00] (2/2)" in text, text
    assert "| slow | 1 | 4.0 | 4.0 | - (0/1)" in text, text


@pytest.mark.process
def test_the_tool_runs_the_arms_and_reports_what_their_metrics_say(tmp_path):
    """Two real arms side by side (--parallel 2), one seed each; a second invocation runs nothing again."""
    experiment = write_experiment(tmp_path / "tiny.toml", seeds=(3,))
    out = tmp_path / "ab"
    args = [str(experiment), "--out", str(out), "--parallel", "2"]
    done = run_cli(*args, script=TOOL, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = {arm: out / "tiny" / arm / "s3" for arm in ("fast", "slow")}
    summary = json.loads((out / "tiny" / "summary.json").read_text())
    for arm, logdir in runs.items():
        record = json.loads((logdir / "ab-run.json").read_text())
        assert record["exit_code"] == 0 and record["seed"] == 3, (logdir / "train.log").read_text()[-2000:]
        config = json.loads((logdir / "config.json").read_text())
        flat = {k: v for section in config["config"].values() for k, v in section.items()}
        assert flat["learning_rate"] == {"fast": 0.003, "slow": 0.0001}[arm] and flat["seed"] == 3
        rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
        final = [r["episode_return_mean"] for r in rows if r["episode_return_mean"] is not None][-1]
        assert summary[arm]["final"]["median"] == pytest.approx(final), "the table's figure is the run's own"
    table = (out / "tiny" / "summary.md").read_text()
    assert "| fast | 1" in table and "| slow | 1" in table and "final return" in table

    before = {arm: (d / "metrics.jsonl").stat().st_mtime for arm, d in runs.items()}
    again = run_cli(*args, script=TOOL, timeout=120)
    assert again.returncode == 0 and "2 runs done, 0 to go" in again.stdout, again.stdout
    assert before == {arm: (d / "metrics.jsonl").stat().st_mtime for arm, d in runs.items()}, "a run ran again"


@pytest.mark.process
def test_a_run_cut_short_resumes_from_its_checkpoint(tmp_path):
    """The harness stopped (SIGTERM, as a supervisor or a session's end would) mid-run: its run writes a checkpoint and
    stops; the next invocation continues that run from it (train --resume), not from scratch, and says so."""
    experiment = tmp_path / "long.toml"
    flags = {**TINY, "checkpoint_interval_s": 0.5, "lr_schedule": "constant"}
    experiment.write_text(
        'name = "long"\nseeds = [0]\ntotal_env_steps = 30000\n'
        + "flags = { "
        + ", ".join(f"{k} = {json.dumps(v)}" for k, v in flags.items())
        + " }\n[arms.only]\n"
    )
    out, logdir = tmp_path / "ab", tmp_path / "ab" / "long" / "only" / "s0"
    args = [str(experiment), "--out", str(out)]
    first = cli(*args, script=TOOL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(
            lambda: any(logdir.glob("checkpoint-*.pt")) and read_metrics(logdir / "metrics.jsonl"),
            120,
            "a checkpoint",
            first,
        )
    finally:
        first.send_signal(signal.SIGTERM)
        said = first.communicate(timeout=120)[0]
    assert not (logdir / "ab-run.json").exists(), said
    assert first.returncode == 130 and "Traceback" not in said and "the same command continues it" in said, said
    first_rows = read_metrics(logdir / "metrics.jsonl")
    cut_at = max(r["env_steps"] for r in first_rows)
    assert 0 < cut_at < 30_000, "stopped mid-run"
    carried_s = ab.carried_training_s(logdir)  # what timeout_s counts from on the resume: the newest checkpoint's
    assert 0 < carried_s <= max(r["wall_s"] for r in first_rows), (carried_s, first_rows[-1])

    again = run_cli(*args, script=TOOL, timeout=300)
    assert again.returncode == 0 and "resumed from its newest checkpoint (resume 1)" in again.stdout, again.stdout
    record = json.loads((logdir / "ab-run.json").read_text())
    assert record["exit_code"] == 0 and record["resumes"] == 1 and "--resume" in record["command"]
    steps = [r["env_steps"] for r in read_metrics(logdir / "metrics.jsonl")]
    assert steps[-1] >= 30_000 and min(steps) < cut_at, "one curve: the first segment's records, then the rest"
    resumed = steps[len(first_rows) :]
    assert resumed and min(resumed) > 0.5 * cut_at, "the second segment continued from a checkpoint, not from 0"
    assert record["wall_s"] == pytest.approx(max(r["wall_s"] for r in read_metrics(logdir / "metrics.jsonl")), abs=0.1)
    row = next(line for line in (out / "long" / "summary.md").read_text().splitlines() if line.startswith("| only |"))
    assert row.startswith("| only | 1 ") and "(1 resumed) |" in row, row


@pytest.mark.process
def test_a_busy_start_counts_what_others_run_not_the_experiments_own_runs():
    """The cores busy at a run's start (flagged above 0.5): a busy loop counts, unless it is in the tree of one of the
    experiment's running runs. The load average flagged every run that followed another, counting the run that had
    just ended for about a minute after it."""
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        others, without = ab.others_busy_cores(set()), ab.others_busy_cores({loop.pid})
    finally:
        loop.kill()
        loop.wait()
    assert others - without > 0.3, (others, without)  # the loop holds a core (two thirds of one beside a busy worker)


def test_twice_needs_reproducible_runs(tmp_path):
    with pytest.raises(ValueError, match="twice needs reproducible = 1 in flags or in every arm"):
        ab.Experiment.load(write_experiment(tmp_path / "e.toml", twice=True))


@pytest.mark.process
def test_twins_of_a_reproducible_arm_agree(tmp_path):
    """``twice``: every run made again, and the twins' final checkpoints compared (README, Reproducible runs)."""
    experiment = tmp_path / "twice.toml"
    flags = {**TINY, "reproducible": 1}
    experiment.write_text(
        "\n".join(
            [
                'name = "twice"',
                "seeds = [5]",
                "total_env_steps = 2000",
                "twice = true",
                "flags = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in flags.items()) + " }",
                "[arms.only]",
            ]
        )
        + "\n"
    )
    out = tmp_path / "ab"
    done = run_cli(str(experiment), "--out", str(out), script=TOOL, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "twice" / "only" / "s5-twin" / "ab-run.json").exists()
    table = (out / "twice" / "summary.md").read_text()
    assert "twins agree" in table and "| 1/1 |" in table, table
