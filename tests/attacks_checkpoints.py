"""Hostile checkpoints (issue 15, class 5): each crafted from a good learner checkpoint, and the attack that puts one
where ``train --resume`` or ``eval`` meets it, measured. No pytest here: tests/test_checkpoint_attacks.py, and
tools/attack_figures.py and tools/soak.py, run the same functions.

Every craft writes the newest checkpoint of a run directory (``checkpoint-<good steps + 10>.pt``), so that the good
one stays the previous: a defended learner sets the crafted file aside (``NAME.bad``) and resumes from the good one,
and ``eval`` refuses it in one line. The crafts:

- ``stride0``: a stride-0 tensor in the optimizer's state, ``STRIDE0_ELEMENTS`` float32 (2 GiB) over a storage of
  one element: the file grows by under 2 KB; whatever reads the tensor whole (a finiteness check) allocates for all.
- ``shared_refs``: a list that holds its child ``SHARED_WIDTH`` times, ``SHARED_DEPTH`` levels deep, in the
  optimizer's state: under 1 KB of pickle, 2^64 paths for a walk without a visited set.
- ``fifo``: a FIFO named as the newest checkpoint: open() blocks until a writer appears (never).
- ``string_int``: ``batch_size`` "16" (a string in an integer field); ``float_rng``: torch's RNG state as float32;
  ``huge_version``: policy version 2^64; ``wide_hidden``: ``hidden_sizes`` "4096,4096,4096" over the 64-wide weights
  (the network is built before its weights are found not to fit); ``huge_hidden``: "65536,65536" (17 GiB of weights:
  refused from the configuration alone, never run against old code).
- ``env_module``: env id ``this:CartPole-v1``: gymnasium imports module ``this`` (which prints the Zen of Python).
- ``inconsistent_spec``: an observation shape of [5] with weights that fit it: every check of the file alone passes,
  and only the environment (CartPole's [4]) tells it apart, when the learner restores it.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
from procutil import cli, run_cli

from impala_async.learner import checkpoint

STRIDE0_ELEMENTS = 1 << 29
SHARED_DEPTH, SHARED_WIDTH = 16, 16  # 16^16 = 2^64 paths; shallower than any nesting limit
ZEN = "Beautiful is better than ugly"
LISTENING = "impala-async learner listening"
STATE_CRAFTS = (
    "stride0",
    "shared_refs",
    "string_int",
    "float_rng",
    "huge_version",
    "wide_hidden",
    "huge_hidden",
    "env_module",
    "inconsistent_spec",
)
CRAFTS = (*STATE_CRAFTS[:2], "fifo", *STATE_CRAFTS[2:])
# Crafts a defended learner sets aside; the others it refuses in one line and leaves in place (env_module: a module
# id is a permission the operator gives, not damage; the file stays for them to judge).
SET_ASIDE = tuple(c for c in CRAFTS if c != "env_module")
TOO_BIG_FOR_OLD_CODE = ("huge_hidden",)  # the old code would try to allocate 17 GiB: not run against it


def _stride0(state: dict) -> None:
    state["learner"]["optimizer"]["state"][0]["padding"] = torch.zeros(1).expand(STRIDE0_ELEMENTS)


def _shared_refs(state: dict) -> None:
    node: list = []
    for _ in range(SHARED_DEPTH):
        node = [node] * SHARED_WIDTH
    state["learner"]["optimizer"]["padding"] = node


def _inconsistent_spec(state: dict) -> None:
    """Observations of [5] for CartPole's [4]: the first layer of both torsos, and its optimizer state, widened."""
    old = state["spec"]["obs_shape"]
    state["spec"] = {**state["spec"], "obs_shape": [old[0] + 1]}
    model, opt_state = state["learner"]["model"], state["learner"]["optimizer"]["state"]
    names = list(model)
    for name in ("policy_torso.0.weight", "value_torso.0.weight"):
        model[name] = torch.nn.functional.pad(model[name], (0, 1))
        for key, value in opt_state[names.index(name)].items():
            if key != "step":
                opt_state[names.index(name)][key] = torch.nn.functional.pad(value, (0, 1))


CONFIG_CRAFTS = {
    "string_int": ("batch_size", "16"),
    "wide_hidden": ("hidden_sizes", "4096,4096,4096"),
    "huge_hidden": ("hidden_sizes", "65536,65536"),
    "env_module": ("env", "this:CartPole-v1"),
}


def craft_state(name: str, state: dict) -> dict:
    """The good learner ``state`` (as torch.load gives it) made hostile in place by craft ``name``; returned."""
    if name in CONFIG_CRAFTS:
        key, value = CONFIG_CRAFTS[name]
        state["config"][key] = value
    elif name == "float_rng":
        state["torch_rng"] = state["torch_rng"].float()
    elif name == "huge_version":
        state["policy_version"] = 1 << 64
    else:
        {"stride0": _stride0, "shared_refs": _shared_refs, "inconsistent_spec": _inconsistent_spec}[name](state)
    return state


def newest_good(run: Path) -> tuple[Path, int]:
    """(the newest checkpoint of ``run``, its env steps)."""
    path = checkpoint.list_checkpoints(run)[-1]
    return path, int(path.name[len("checkpoint-") : -len(".pt")])


def craft(name: str, run: Path, good: Path | None = None, steps: int = 0) -> Path:
    """Write craft ``name`` of the good checkpoint ``good`` (default: ``run``'s newest) into ``run`` as the checkpoint
    of ``steps`` env steps (default: 10 after the good one's); its path. The crafted state claims those steps, so that
    a resume (or eval) names the file it took."""
    if good is None:
        good, good_steps = newest_good(run)
        steps = steps or good_steps + 10
    bad = checkpoint.checkpoint_path(run, steps)
    if name == "fifo":
        os.mkfifo(bad)
        return bad
    state = craft_state(name, torch.load(good, map_location="cpu", weights_only=True))
    state["env_steps"] = state["learner"]["env_steps_trained"] = steps
    torch.save(state, bad)
    return bad


def stack_crafts(run: Path, names=SET_ASIDE) -> dict[str, Path]:
    """Crafts ``names`` of ``run``'s newest (good) checkpoint, all at once, each newer than the good one (the first
    the newest): name -> path."""
    good, steps = newest_good(run)
    return {name: craft(name, run, good, steps + 10 * (len(names) - i)) for i, name in enumerate(names)}


class _Peak(threading.Thread):
    """A process's peak resident memory, sampled every 10 ms."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.proc, self.peak, self.halt = psutil.Process(pid), 0, threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.01):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return


def _run(argv: list[str], log: Path, timeout_s: float, pythonpath: str, until: str) -> dict:
    """Run ``python -m impala_async *argv`` until it exits, ``until`` appears in its output, or ``timeout_s``."""
    env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else None
    t0 = time.monotonic()
    # run where ``-m`` finds no package in the working directory, only ``pythonpath``'s
    proc = cli(*argv, log=log, env=env, cwd=log.parent)
    peak = _Peak(proc.pid)
    peak.start()
    outcome = "hung"
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            outcome = "exited"
            break
        if until and until in log.read_text(errors="replace"):
            outcome = "served"
            break
        time.sleep(0.05)
    seconds = time.monotonic() - t0
    peak.halt.set()
    peak.join(2)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    text = log.read_text(errors="replace")
    return {
        "outcome": outcome,
        "exit_code": proc.returncode if outcome == "exited" else None,
        "seconds": round(seconds, 2),
        "peak_rss_mib": round(peak.peak / 2**20, 1),
        "traceback": "Traceback (most recent call last)" in text,
        "ran_module_code": ZEN in text,
        "last_line": (text.strip().splitlines() or [""])[-1][:300],
    }


def resume_attack(name: str, good_run: Path, workdir: Path, timeout_s: float = 60.0, pythonpath: str = "") -> dict:
    """``train --resume`` (no actors) of a copy of ``good_run`` whose newest checkpoint is craft ``name``
    (:func:`resume_dir`'s figures). ``pythonpath``: another checkout of the package to run (the code before a
    change)."""
    run = Path(workdir) / f"resume-{name}"
    shutil.copytree(good_run, run)
    _, good_steps = newest_good(run)
    bad = craft(name, run)
    figures = resume_dir(run, good_steps, [bad], Path(workdir) / f"resume-{name}.log", timeout_s, pythonpath)
    return {"attack": f"resume:{name}", **figures}


def resume_dir(run: Path, good_steps: int, bad: list[Path], log: Path, timeout_s: float, pythonpath: str = "") -> dict:
    """``train --resume run`` (no actors), whose good checkpoint is at ``good_steps`` and whose ``bad`` ones are newer.
    Figures: ``outcome`` (served: it got as far as listening, past its first publish; exited; hung: still starting
    at ``timeout_s``), exit code, seconds, peak RSS, whether every bad file was set aside (``NAME.bad``), the env steps
    it resumed at and whether those are the good checkpoint's, whether a traceback was printed and whether module
    ``this`` ran."""
    argv = ["train", "--resume", str(run), "--num-actors", "0", "--actor-start-timeout-s", "600"]
    figures = _run(argv, log, timeout_s, pythonpath, LISTENING)
    resumed = re.findall(r"resumed at (\d+) env steps", log.read_text(errors="replace"))
    figures.update(
        set_aside=all(os.path.lexists(p.with_name(p.name + ".bad")) for p in bad),
        resumed_steps=int(resumed[-1]) if resumed else None,
        resumed_previous=bool(resumed) and int(resumed[-1]) == good_steps and figures["outcome"] == "served",
    )
    return figures


def eval_attack(name: str, good_run: Path, workdir: Path, timeout_s: float = 60.0, pythonpath: str = "") -> dict:
    """``eval --checkpoint DIR`` of a copy of ``good_run`` whose newest checkpoint is craft ``name``
    (:func:`eval_dir`'s figures)."""
    run = Path(workdir) / f"eval-{name}"
    shutil.copytree(good_run, run)
    craft(name, run)
    return {"attack": f"eval:{name}", **eval_dir(run, Path(workdir) / f"eval-{name}.log", timeout_s, pythonpath)}


def eval_dir(run: Path, log: Path, timeout_s: float, pythonpath: str = "") -> dict:
    """``eval --checkpoint run`` (one episode of at most 20 steps): a defended eval plays the newest good checkpoint
    or refuses in one line, and never runs module code. Figures as :func:`resume_dir`'s, with ``played_steps`` (the
    env steps trained of the checkpoint it played)."""
    argv = ["eval", "--checkpoint", str(run), "--episodes", "1", "--max-episode-steps", "20"]
    figures = _run(argv, log, timeout_s, pythonpath, "")
    played = re.findall(r"after ([\d,]+) env steps trained", log.read_text(errors="replace"))
    figures["played_steps"] = int(played[-1].replace(",", "")) if played else None
    return figures


def train_good_run(directory: Path, timeout_s: float = 120.0, pythonpath: str = "") -> Path:
    """A tiny real CartPole run (one actor, 2000 env steps) with one checkpoint: what the crafts start from."""
    argv = ["train", "--env", "CartPole-v1", "--num-actors", "1", "--envs-per-actor", "2", "--unroll-length", "10"]
    argv += ["--batch-size", "4", "--total-env-steps", "2000", "--logdir", str(directory)]
    env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else None
    Path(directory).parent.mkdir(parents=True, exist_ok=True)
    out = run_cli(*argv, timeout=timeout_s, env=env, cwd=Path(directory).parent)
    if out.returncode != 0 or not checkpoint.list_checkpoints(directory):
        raise RuntimeError(f"the good run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return Path(directory)


def all_figures(workdir: Path, pythonpath: str = "", timeout_s: float = 60.0) -> list[dict]:
    """Every craft against ``train --resume`` and ``eval``, one process each (the huge_hidden craft only against the
    defended code, whose ``pythonpath`` is empty)."""
    workdir = Path(workdir)
    good = train_good_run(workdir / "good", pythonpath=pythonpath)
    rows = []
    for name in CRAFTS:
        if pythonpath and name in TOO_BIG_FOR_OLD_CODE:
            continue
        rows.append(resume_attack(name, good, workdir, timeout_s, pythonpath))
        rows.append(eval_attack(name, good, workdir, timeout_s, pythonpath))
    return rows


if __name__ == "__main__":  # python tests/attacks_checkpoints.py WORKDIR [a checkout's root, to attack its code]
    import json
    import tempfile

    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="checkpoint-attacks-"))
    for row in all_figures(where, sys.argv[2] if len(sys.argv) > 2 else ""):
        print(json.dumps(row), flush=True)
