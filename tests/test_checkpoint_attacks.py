"""Checkpoints are files a peer may have written (issue 15, class 5): a real `train --resume` and a real `eval` meet
every hostile checkpoint of tests/attacks_checkpoints.py, crafted from the checkpoint of a tiny real CartPole run.

A resume sets each one aside (NAME.bad) and resumes from the good one, in bounded time and memory, with no traceback;
a file whose only fault is an env id that imports a module is refused in one line and left in place, unless the
command line allows the module; eval plays the good checkpoint and renames nothing. Each test fails on the code
before these defences (commit 96757dd), which hangs on the FIFO and on the shared references, allocates gigabytes for
the stride-0 tensor, resumes from (or plays) most of the others, and imports module ``this``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import threading
from pathlib import Path

import inprocess
import pytest
import torch
from attacks_checkpoints import (
    LISTENING,
    SET_ASIDE,
    craft,
    eval_attack,
    eval_dir,
    newest_good,
    resume_attack,
    resume_dir,
    stack_crafts,
)
from procutil import cli as start_cli
from procutil import free_port_pair, stop, wait_for

from impala_async import cli
from impala_async.learner import checkpoint

MAX_RSS_MIB = 1024  # a learner resuming CartPole holds ~320 MiB; the old code peaked at 3.6 GiB on the stride-0 tensor
TIMEOUT_S = 120.0  # the old code hangs for ever on the FIFO and on the shared references
# Caught by the checks of the file alone (inconsistent_spec only when the learner restores it)
FILE_CRAFTS = tuple(name for name in SET_ASIDE if name != "inconsistent_spec")


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """What attacks_checkpoints.train_good_run trains (CartPole, 2 environments, 2000 env steps, one checkpoint), the
    learner in this process's loop and the actor in a thread (tests/inprocess.py)."""
    root = tmp_path_factory.mktemp("good")
    flags = ["--unroll-length", "10", "--batch-size", "4", "--total-env-steps", "2000", "--logdir", str(root / "run")]
    cfg, spec = inprocess.configuration(root, *flags)
    asyncio.run(inprocess.train(cfg, spec, envs_per_actor=2))
    return root / "run"


@pytest.mark.process
def test_resume_sets_every_hostile_checkpoint_aside_and_resumes_the_good_one(good_run, tmp_path):
    """Every craft but env_module at once, each newer than the good checkpoint: the learner skips each (the spec that
    does not fit the environment when it restores it) and gets to its first publish with the good one's state."""
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    _, good_steps = newest_good(run)
    bad = stack_crafts(run)
    log = tmp_path / "resume.log"
    figures = resume_dir(run, good_steps, list(bad.values()), log, TIMEOUT_S)
    text = log.read_text()
    assert figures["outcome"] == "served" and figures["resumed_previous"], (figures, text[-3000:])
    assert figures["set_aside"] and not figures["traceback"], (sorted(p.name for p in run.iterdir()), text[-3000:])
    assert figures["peak_rss_mib"] < MAX_RSS_MIB, figures
    assert [p.name for p in checkpoint.list_checkpoints(run)] == [f"checkpoint-{good_steps:012d}.pt"]
    assert len(re.findall(r"skipping checkpoint|failed to restore", text)) == len(SET_ASIDE), text[-3000:]


def _load_latest_within(directory, timeout_s: float):
    """checkpoint.load_latest as a resume calls it, in a thread: (finished, its answer or exception). The old code
    never returns from the FIFO or the shared references; the thread is left to spin then (a daemon)."""
    box: list = []

    def target():
        try:
            box.append(checkpoint.load_latest(directory, validate=checkpoint.validate_learner_state, quarantine=True))
        except Exception as e:
            box.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(box), (box or [None])[0]


@pytest.mark.parametrize("name", FILE_CRAFTS)
def test_each_hostile_checkpoint_is_refused_by_the_checks_of_the_file(good_run, tmp_path, name):
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    good, _ = newest_good(run)
    bad = craft(name, run)
    finished, found = _load_latest_within(run, 30.0)
    assert finished, f"{name}: still loading after 30 s"
    assert isinstance(found, tuple) and found[1] == good, found
    assert os.path.lexists(bad.with_name(bad.name + ".bad")) and not os.path.lexists(bad)


def test_two_checkpoints_refused_alike_are_not_set_aside(good_run, tmp_path):
    """A refusal that every checkpoint meets is this version's (a check added, a default changed), not damage: setting
    each aside would set aside the whole run. Both stay, and the refusal says why."""
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    good, steps = newest_good(run)
    first, second = craft("string_int", run, good, steps + 20), craft("string_int", run, good, steps + 10)
    with pytest.raises(ValueError, match="refused alike"):
        checkpoint.load_latest(run, validate=checkpoint.validate_learner_state, quarantine=True)
    assert first.exists() and second.exists() and not list(run.glob("*.bad"))


def damage(run: Path, how: str, count: int) -> list[Path]:
    """``count`` copies of ``run``'s good checkpoint, each newer than it, truncated to half or emptied, as a disk
    that filled up or a killed copy leaves them; their paths, newest first."""
    good, steps = newest_good(run)
    data = good.read_bytes()
    paths = [checkpoint.checkpoint_path(run, steps + 10 * (count - i)) for i in range(count)]
    for path in paths:
        path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"")
    return paths


@pytest.mark.parametrize("how,count", [("truncated", 2), ("emptied", 2), ("truncated", 3)])
def test_any_number_of_damaged_checkpoints_are_set_aside(good_run, tmp_path, how, count):
    """Damage is damage however often it repeats: two (or three of four) truncated or emptied newest checkpoints
    used to be taken for a version change ("refused alike") and stopped the resume."""
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    good, _ = newest_good(run)
    damaged = damage(run, how, count)
    found = checkpoint.load_latest(run, validate=checkpoint.validate_learner_state, quarantine=True)
    assert found is not None and found[1] == good
    assert sorted(p.name for p in run.glob("*.bad")) == sorted(p.name + ".bad" for p in damaged)


@pytest.mark.process
def test_resume_falls_back_past_damaged_checkpoints(good_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    _, good_steps = newest_good(run)
    damaged = damage(run, "truncated", 2)
    log = tmp_path / "resume.log"
    figures = resume_dir(run, good_steps, damaged, log, TIMEOUT_S)
    assert figures["outcome"] == "served" and figures["resumed_previous"], (figures, log.read_text()[-3000:])
    assert figures["set_aside"] and not figures["traceback"], figures


def test_a_checkpoint_of_an_older_version_is_skipped_not_set_aside(good_run, tmp_path):
    """A configuration that fails a check while it lacks a field this version added (which took its default) may be
    refused for this version's sake, not the file's: skipped, kept. The same value with every field: set aside."""
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    good, steps = newest_good(run)
    state = torch.load(good, weights_only=True)
    state["config"]["batch_size"] = 0
    torch.save(state, checkpoint.checkpoint_path(run, steps + 10))
    del state["config"]["jpeg_quality"]  # as if written before that field existed
    older = checkpoint.checkpoint_path(run, steps + 20)
    torch.save(state, older)
    found = checkpoint.load_latest(run, validate=checkpoint.validate_learner_state, quarantine=True)
    assert found is not None and found[1] == good
    assert older.exists() and [p.name for p in run.glob("*.bad")] == [f"checkpoint-{steps + 10:012d}.pt.bad"]


@pytest.mark.process
def test_a_module_env_id_from_a_checkpoint_is_refused_in_one_line_and_kept(good_run, tmp_path):
    figures = resume_attack("env_module", good_run, tmp_path, TIMEOUT_S)
    assert figures["outcome"] == "exited" and figures["exit_code"] == 1, figures
    assert not figures["ran_module_code"] and not figures["traceback"], figures
    assert "--allow-env-module 1" in figures["last_line"] and not figures["set_aside"], figures
    assert checkpoint.list_checkpoints(tmp_path / "resume-env_module")[-1].name.endswith("2010.pt")
    figures = eval_attack("env_module", good_run, tmp_path, TIMEOUT_S)
    assert figures["exit_code"] == 1 and not figures["ran_module_code"] and not figures["traceback"], figures
    assert "--allow-env-module 1" in figures["last_line"], figures


def _configure(*argv: str):
    return cli.load_learner_config(cli.build_parser().parse_args(["train", *argv]))[0]


def test_a_module_env_id_needs_the_command_line(good_run, tmp_path):
    """From a --config file (or a checkpoint) only with --allow-env-module 1 typed; the same permission from the file
    does not count; typed with --env it is the user's own; the package's own environments always pass."""
    file = tmp_path / "run.toml"
    file.write_text('env = "this:CartPole-v1"\nallow_env_module = 1\n')
    with pytest.raises(SystemExit, match="would import module 'this'") as refused:
        _configure("--config", str(file))
    assert "\n" not in str(refused.value.code)
    assert _configure("--config", str(file), "--allow-env-module", "1").cfg.env.env == "this:CartPole-v1"
    assert _configure("--env", "this:CartPole-v1").cfg.env.env == "this:CartPole-v1"
    file.write_text('env = "impala_async.actors.envs:PongLike-v0"\n')
    assert _configure("--config", str(file)).cfg.env.env == "impala_async.actors.envs:PongLike-v0"
    # and resumed: the checkpoint's module id, allowed by the flag typed on this command line
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    craft("env_module", run)
    layered = _configure("--resume", str(run), "--allow-env-module", "1")
    assert layered.cfg.env.env == "this:CartPole-v1" and layered.layer("env") == "resumed"


@pytest.mark.process
def test_eval_plays_the_good_checkpoint_past_every_hostile_one_and_renames_nothing(good_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    _, good_steps = newest_good(run)
    stack_crafts(run, tuple(n for n in SET_ASIDE if n != "inconsistent_spec"))  # eval refuses that one: its spec
    figures = eval_dir(run, tmp_path / "eval.log", TIMEOUT_S)
    assert figures["exit_code"] == 0 and figures["played_steps"] == good_steps, figures
    assert figures["peak_rss_mib"] < MAX_RSS_MIB and not figures["traceback"], figures
    assert not list(run.glob("*.bad"))


def test_restore_sets_aside_a_checkpoint_whose_state_does_not_load_and_takes_the_previous(good_run, tmp_path):
    """Past the checks of the file, restoring can still fail (here: the spec the environment gives); with this run's
    configuration the checkpoint's own, that is the file's fault. Changing a field that shapes the network is the
    run's: refused in one line, the file kept."""
    from impala_async.core.spec import TrajectorySpec
    from impala_async.learner.checkpoint import resume
    from impala_async.learner.main import build_learner

    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    good, _ = newest_good(run)
    bad = craft("inconsistent_spec", run)
    state, path = resume.load_newest(run, 1 << 30)
    assert path == bad
    cfg = _configure("--resume", str(run)).cfg
    spec = TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=10)
    wider = cfg.replace(hidden_sizes="32,32")
    with pytest.raises(SystemExit, match="this run changed hidden_sizes"):
        resume.restore(lambda: build_learner(wider, spec, torch.device("cpu")), wider, spec, state)
    assert bad.exists()
    build = functools.partial(build_learner, cfg, spec, torch.device("cpu"))
    learner, restored = resume.restore(build, cfg, spec, state)
    assert restored[resume.RESUMED_FROM] == str(good) and not bad.exists()
    assert learner.env_steps_trained == restored["learner"]["env_steps_trained"]
    # Two in a row whose spec this environment does not give: the environment changed, not the files; both stay.
    put = bad.with_name(bad.name + ".bad")
    put.rename(bad)
    older = craft("inconsistent_spec", run, good, int(good.name[len("checkpoint-") : -len(".pt")]) + 5)
    state, _ = resume.load_newest(run, 1 << 30)
    with pytest.raises(SystemExit, match="the environment changed"):
        resume.restore(build, cfg, spec, state)
    assert bad.exists() and older.exists() and not list(run.glob("*.bad"))


def test_the_walk_refuses_what_no_learner_writes(good_run):
    """check_tree, on the parts of a real state each attack bends: budgets, sharing, nesting, and dense tensors."""
    state = torch.load(newest_good(good_run)[0], weights_only=True)
    checkpoint.check_tree(state, 1 << 30)  # the good one passes
    shared = [torch.zeros(1)]
    cases = {
        "a container held twice": {"a": [shared, shared]},
        "nested more than": functools.reduce(lambda inner, _: [inner], range(40), []),
        "not dense": {"w": torch.zeros(1).expand(1 << 20)},
        "strides (1, 1)": {"w": torch.zeros(2048).as_strided((1024, 1024), (1, 1))},
        "only dense CPU tensors": {"w": torch.zeros(4, 4).to_sparse()},
        "beyond int64": {"version": 1 << 64},
        "a set": {"s": {1, 2}},
        "max_checkpoint_nodes": {"x": list(range(100))},
        "max_checkpoint_bytes=1000": {"w": torch.zeros(1000)},
    }
    for expected, tree in cases.items():
        with pytest.raises(ValueError, match=re.escape(expected)):
            checkpoint.check_tree(tree, 1000, max_nodes=50)
    checkpoint.check_tree({"tied": [shared[0], shared[0]]}, 1000)  # one tensor held twice (tied weights) is no DAG


def test_the_archive_is_bounded_before_it_is_parsed(good_run, tmp_path):
    """The zip directory (records, bytes) from the end record alone, and the pickle record's size."""
    good, _ = newest_good(good_run)
    checkpoint.check_archive(good, 1 << 30)
    with pytest.raises(ValueError, match="zip directory of"):
        checkpoint.check_archive(good, 1 << 30, max_nodes=4)
    with pytest.raises(ValueError, match="a pickle of"):
        checkpoint.check_archive(good, 1 << 30, max_pickle_bytes=8000)
    fifo = tmp_path / "checkpoint-000000000001.pt"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="a FIFO"):
        checkpoint.check_archive(fifo, 1 << 30)  # refused from its stat: open() would block here for ever
    link = tmp_path / "link.pt"
    link.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="a character device"):
        checkpoint.load(link, 1 << 30)


@pytest.mark.process
def test_a_resume_takes_no_address_permission_or_process_count_from_the_checkpoint(good_run, tmp_path):
    """A checkpoint (a file anyone with the run directory may have written) that sets the learner's addresses to every
    interface, `insecure` and a number of local actors: a plain `train --resume` used to bind 0.0.0.0 without CURVE
    and start those actors. It now takes them from the command line only, and says what it ignored."""
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    good, steps = newest_good(run)
    state = torch.load(good, map_location="cpu", weights_only=True)
    port = free_port_pair()
    hostile = {"listen": f"tcp://0.0.0.0:{port}", "publish": f"tcp://0.0.0.0:{port + 1}", "insecure": 1}
    hostile["num_actors"] = 3
    state["config"].update(hostile)
    state.setdefault("config_layers", {}).update({k: "flag" for k in hostile})
    torch.save(state, checkpoint.checkpoint_path(run, steps + 10))
    log = tmp_path / "resume.log"
    proc = start_cli("train", "--resume", str(run), "--actor-start-timeout-s", "600", log=log)
    try:
        wait_for(lambda: LISTENING in log.read_text(), TIMEOUT_S, "the resumed learner listening", proc, log)
        text = log.read_text()
    finally:
        stop(proc)
    listening = next(line for line in text.splitlines() if LISTENING in line)
    assert "0.0.0.0" not in listening and "--learner tcp://127.0.0.1:" in listening, listening
    assert re.search(r"actors\.num_actors = 1 +\(resolved\)", text), "the actor count is this machine's, resolved"
    warning = next(line for line in text.splitlines() if "only the command line or --config sets" in line)
    for name in hostile:
        assert f"{name} = " in warning, (name, warning)
