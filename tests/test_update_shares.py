"""tools/update_shares.py, its smallest mode (a subprocess: it wraps the learner's functions in its own process): every
stage of a real update is timed, none twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procutil import run_cli

TOOL = Path(__file__).resolve().parent.parent / "tools" / "update_shares.py"


@pytest.mark.process
def test_the_stages_of_a_real_update_add_up_to_it():
    args = ["--updates", "3", "--warmup", "1", "--json", "--", "--env", "CartPole-v1"]
    done = run_cli(*args, script=TOOL, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout)
    assert r["env"] == "CartPole-v1" and r["updates"] == 3 and r["batch_size"] * r["unroll_length"] > 0
    stages = ("inputs", "forward", "targets", "loss", "backward + optimizer", "rest")
    assert set(r["ms"]) == set(stages)
    assert all(r["ms"][s] > 0 for s in stages if s != "rest"), "a stage was not timed: its wrapper missed the call"
    # the stages do not overlap (the targets are inside the loss: counted once) and add up to the update
    assert r["ms"]["rest"] >= 0, "a stage counted twice"
    assert sum(r["share"].values()) == pytest.approx(1.0, abs=0.01)
