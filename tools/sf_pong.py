#!/usr/bin/env python3
"""Sample Factory on Pong beside impala-async: wall time to a mean return of +15, both curves in one figure.

Runs Sample Factory's own Atari example (`sf_examples.atari.train_atari --env atari_pong`: APPO with its Atari
settings, PongNoFrameskip-v4, on the CPU, seed 0) from a separate virtualenv until its average episode return reaches
--target or --timeout-s passes, and writes what it reported as OUT/sample-factory/metrics.jsonl in this project's
keys (``wall_s``; ``env_steps`` in agent steps, where Sample Factory counts frames, 4 a step; ``episode_return_mean``,
its average over the last 100 episodes), so that tools/plot.py draws it beside an impala-async run. Then, unless
--skip-ours, it runs ours with the preset through the A/B harness (tools/experiments/pong-v4-vs-sf.toml, which
repeats the target and the time limit), one after the other, and draws both against agent steps and wall time.

Set up Sample Factory once (a separate venv, so that its pins do not touch this project's; `import ale_py` in the
launcher below is what makes its spawned workers see the ALE ids):
    python3 -m venv .venv-sf && .venv-sf/bin/pip install torch==2.13.0 \\
        && .venv-sf/bin/pip install sample-factory "gymnasium==0.29.1" "ale-py<0.11"
    python tools/sf_pong.py [--target 15] [--timeout-s 9000] [--out runs/sf-pong]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRAME_SKIP = 4
SEED = 0  # one seed each, as the comparison asks
FRAMES = re.compile(r"Fps is \(10 sec: [\d.na]+, 60 sec: [\d.na]+, 300 sec: [\d.na]+\)\. Total num frames: (\d+)")
REWARD = re.compile(r"Avg episode reward: \[\(0, '(-?[\d.]+)'\)\]")
LAUNCHER = """import sys
import ale_py
import gymnasium
gymnasium.register_envs(ale_py)  # at import: Sample Factory's spawned workers import this module too
if __name__ == "__main__":
    import runpy
    sys.argv = ["train_atari", *sys.argv[1:]]
    runpy.run_module("sf_examples.atari.train_atari", run_name="__main__")
"""


def parse(line: str, state: dict) -> dict | None:
    """Update ``state`` (frames and return seen so far) from one line of Sample Factory's log; a metrics record when
    the line reported something new."""
    m = FRAMES.search(line)
    if m:
        state["env_steps"] = int(m.group(1)) // FRAME_SKIP
        return {**state}
    m = REWARD.search(line)
    if m:
        state["episode_return_mean"] = float(m.group(1))
        return {**state}
    return None


def stop_group(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGINT to Sample Factory's process group (it saves and ends its workers), SIGKILL after timeout_s."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_sample_factory(
    sf_python: str, out: Path, seed: int, target: float, timeout_s: float, extra: tuple[str, ...] = ()
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    launcher = out / "launch_sf_atari.py"
    launcher.write_text(LAUNCHER)
    cmd = [sf_python, str(launcher), "--env=atari_pong", "--experiment=pong", f"--train_dir={out / 'train_dir'}"]
    cmd += ["--device=cpu", f"--seed={seed}", "--train_for_env_steps=1000000000", *extra]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    state: dict = {"env_steps": 0, "episode_return_mean": None}
    hit = None
    with open(out / "metrics.jsonl", "w") as metrics, open(out / "sf.log", "w") as log:
        for line in proc.stdout:  # Sample Factory reports every 5 s: the deadline is checked as often
            log.write(line)
            rec = parse(line, state)
            now = time.monotonic() - t0
            if rec is not None:
                metrics.write(json.dumps({"wall_s": round(now, 1), **rec}) + "\n")
                metrics.flush()
                ret = rec["episode_return_mean"]
                if hit is None and ret is not None and ret >= target:
                    hit = {"wall_s": now, "env_steps": rec["env_steps"]}
            if hit is not None or now > timeout_s:
                break
    stop_group(proc)
    return {"system": "sample-factory", "reached": hit, "wall_s": round(time.monotonic() - t0, 1), **state}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__)
    p.add_argument("--sf-python", default=str(ROOT / ".venv-sf" / "bin" / "python"))
    p.add_argument("--target", type=float, default=15.0)
    p.add_argument("--timeout-s", type=float, default=9000.0, help="each run's limit (default: 150 minutes)")
    p.add_argument("--out", type=Path, default=Path("runs/sf-pong"))
    p.add_argument("--skip-sf", action="store_true", help="keep Sample Factory's run of an earlier call")
    p.add_argument("--skip-ours", action="store_true", help="only Sample Factory's run")
    p.add_argument(
        "--sf-flag",
        action="append",
        default=[],
        help="one more flag for Sample Factory (repeatable), e.g. --sf-flag=--normalize_input=False: an ablation",
    )
    a = p.parse_args()
    sf_dir = a.out / "sample-factory"
    if not a.skip_sf:
        print(
            json.dumps(run_sample_factory(a.sf_python, sf_dir, SEED, a.target, a.timeout_s, tuple(a.sf_flag))),
            flush=True,
        )
    experiment = ROOT / "tools" / "experiments" / "pong-v4-vs-sf.toml"  # seed 0, the same target and limit
    if not a.skip_ours:
        ab = [sys.executable, str(ROOT / "tools" / "ab.py"), str(experiment), "--out", str(a.out)]
        subprocess.run(ab, check=True)
    ours = a.out / "pong-v4-vs-sf" / "preset" / f"s{SEED}"
    runs = [d for d in (sf_dir, ours) if (d / "metrics.jsonl").exists()]
    labels = ["Sample Factory APPO (its Atari example)", "impala-async (Atari preset)"][: len(runs)]
    plot = [sys.executable, str(ROOT / "tools" / "plot.py"), *map(str, runs), "--labels", ",".join(labels)]
    plot += ["--anchor", f"all={a.target}:+{a.target:g}", "-o", str(a.out / "pong-vs-sf.png"), "--title", "Pong"]
    subprocess.run(plot, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
