"""Every measurement tool in its smallest mode: the real script as a subprocess, its figures read back and checked for
what a broken tool would get wrong (a count that does not add up, an error reported with exit 0, a key gone).

Tools with tests of their own, and the tools not run, are listed in OWN_TEST and NOT_RUN (with the reason); the shell
scripts, which need podman, a GPU or the network, are checked for syntax (``bash -n``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from procutil import TINY, run_cli

ROOT = Path(__file__).resolve().parent.parent


def _last_json(out: str):
    """The tool's JSON: the whole output (indented) or its last line (one object after progress lines)."""
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        return json.loads(out.strip().splitlines()[-1])


def _code_shape(r):
    assert r["package_lines"] > 1000 and r["functions_over_60_lines"] == [], r


def _bench_actor(r):
    assert r["agent_steps"] == 2 * 20 and r["agent_steps_per_s"] > 0, r  # 2 environments x 20 batched steps


def _bench_jpeg(r):
    assert r["lz4"]["bytes_per_frame"] > 0 and set(r["codec"]) == {"90"}, r


def _jpeg_rho(r):
    assert r["qualities"]["90"]["steps"] == 8 and r["qualities"]["90"]["abs_log_r_max"] >= 0, r


def _loadtest(r):
    assert r["obs"] == "cartpole" and r["trajectories_per_s"] > 0 and r["frames_per_s"] > 0, r


def _time_to_return(r):
    assert r["reached"] == "1/1" and r["median_time_s"] > 0, r


def _flow_control(r):
    [run] = r
    assert "error" not in run and 0.0 <= run["dropped_fraction"] <= 1.0 and run["trained_frames_per_s"] > 0, run


def _attack_figures(r):
    assert r["attack"] == "2-8:record_inflation" and "error" not in r["figures"], r
    assert r["figures"]["rejected_inconsistent"] == 250, r  # every crafted message refused


def _actor_start(r):
    assert [len(r[m]["runs_s"]) for m in ("fork", "spawn")] == [1, 1] and r["fork"]["median_s"] > 0, r


def _bench_ingest(r):
    assert r["ceiling_frames_per_s"] is None and r["cartpole_8x1"]["frames_per_s"] > 0, r  # --limits none: no ratio
    assert r["cartpole_8x1"]["of_best_path"] is None and set(r) == {"ceiling_frames_per_s", "cartpole_8x1"}, r


def _ceiling(r):
    assert r["ceiling_before"]["ceiling_agent_steps_per_s"] > 0 and r["ceiling_before"]["learn_us"] > 0, r


def _compare_sample_factory(r):
    assert len(r["impala_async_times_s"]) == 1 and r["impala_async_times_s"][0] > 0, r  # reached 15, in seconds
    assert r["sf_times_s"] == [] and "sps_ratio" not in r, r  # --skip-sf: Sample Factory's venv is not CI's


def _soak(r):
    assert r["ok"] and r["exit_code"] == 0 and not r["attacks_not_run"], r
    assert set(r["attacks"]) == {"tree", "health_starvation"}, r  # the two asked for, without an error
    assert r["actors_killed"] >= 1 and r["actor_restarts"] >= 1, r  # the chaos ran, and actors came back
    assert r["garbage_sent"] > 0 and r["messages_rejected"] > 0 and r["rejected_by_reason"], r
    assert r["issue15"]["health_probes"] and r["hostile_checkpoints"]["resumed_from_good"], r


SMALLEST = {
    "code_shape": (["--json"], _code_shape),
    "actor_start": (["--repeats", "1", "--json"], _actor_start),
    "bench_actor": (
        ["--env", "CartPole-v1", "--envs", "2", "--steps", "20", "--unroll-length", "5", "--warmup-unrolls", "1",
         "--backends", "gymnasium", "--json"],
        _bench_actor,
    ),
    "bench_jpeg": (["--trajectories", "1", "--unroll-length", "4", "--repeats", "1", "--qualities", "90", "--json"],
                   _bench_jpeg),
    "jpeg_rho": (["--unroll-length", "4", "--steps", "8", "--qualities", "90", "--json"], _jpeg_rho),
    "loadtest": (
        ["--obs", "cartpole", "--actors", "1", "--seconds", "1", "--warmup-s", "0.5", "--batch-size", "4",
         "--unroll-length", "10", "--trajectories-per-message", "4", "--json"],
        _loadtest,
    ),
    "time_to_return": (["--seeds", "0", "--target", "15", "--timeout-s", "120", "--json", "--", *TINY],
                       _time_to_return),
    "flow_control": (
        ["--seconds", "4", "--warmup-s", "1", "--settings", f"--flow-control pace {' '.join(TINY)} "
         "--report-interval-s 0.5", "--json"],
        _flow_control,
    ),
    "ceiling": (["--min-s", "0.2", "--json", "--", "--env", "CartPole-v1", "--envs-per-actor", "4"], _ceiling),
    "attack_figures": (["--issue15", "--only", "record_inflation"], _attack_figures),
    "bench_ingest": (["--limits", "none", "--only", "cartpole_8x1", "--actors", "1", "--seconds", "1", "--warmup-s",
                      "0.5"], _bench_ingest),
    "compare_sample_factory": (["--skip-sf", "--target", "15", "--timeout-s", "120", "--envs-per-actor", "4"],
                               _compare_sample_factory),
    "soak": (["--seconds", "12", "--warmup-s", "3", "--baseline-s", "2", "--kill-every-s", "3", "--attack-every-s",
              "0.5", "--attacks", "tree,health_starvation", "--checkpoint-interval-s", "3", "--report-interval-s",
              "0.5", "--rss-window-s", "3", "--max-rss-growth-mib", "200", "--tmpfs-logdir-mib", "0", "--garbage-per-s",
              "20", "--actor-max-env-steps-per-s", "1000", "--json"], _soak),
}  # fmt: skip
OWN_TEST = {
    "ab": "test_ab.py",
    "ab_experiment": "test_ab.py",
    "ab_report": "test_ab.py",
    "curriculum_lag": "test_curriculum.py",
    "fuzz_decoder": "test_fuzz.py",
    "keep_curve": "test_keep_curve.py",
    "k8s_render": "test_deploy.py",
    "plot": "test_plot.py",
    "sf_pong": "test_sf_pong.py",
    "update_shares": "test_update_shares.py",
}
NOT_RUN: dict[str, str] = {}  # a tool no test runs, and why
NEEDS = {"bench_jpeg": ("simplejpeg", "ale_py"), "jpeg_rho": ("simplejpeg", "ale_py")}


@pytest.mark.process
@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_tool_smallest_mode(name):
    for module in NEEDS.get(name, ()):
        pytest.importorskip(module, reason=f"tools/{name}.py needs {module}: pip install -e '.[atari,jpeg]'")
    argv, check = SMALLEST[name]
    out = run_cli(*argv, script=ROOT / "tools" / f"{name}.py", cwd=ROOT, timeout=300)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    check(_last_json(out.stdout))


@pytest.mark.process
@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "tools").glob("*.sh")))
def test_shell_tools_parse(script):
    out = subprocess.run(["bash", "-n", str(ROOT / "tools" / script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def test_every_tool_is_run_somewhere():
    """A tool added to tools/ is added here: run in its smallest mode, by a test of its own, or not run, with why."""
    for path in (ROOT / "tools").glob("*.py"):
        name = path.stem
        assert name in SMALLEST or name in OWN_TEST or name in NOT_RUN, f"tools/{path.name} is run by no test"
        if name in OWN_TEST:
            assert f"tools/{path.name}" in (ROOT / "tests" / OWN_TEST[name]).read_text(), (name, OWN_TEST[name])
