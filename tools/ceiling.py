#!/usr/bin/env python3
"""The machine's ceiling for a run, and the run's share of it.

The ceiling: the cost of one agent step's three parts, each timed alone in a process pinned to one CPU (torch on one
thread, as the learner and the actors run on CPU), with the run's own resolved configuration (`train`'s flags after
``--``, resolved as `train` resolves them: network, B x T, environments per actor, backend):

- learn: one update of the real learner (learner/learn.py ``Learner.step``: forward, V-trace, backward, optimiser)
  on a batch of B trajectories of T steps, divided by B x T;
- infer: the actor's batched forward pass (actors/rollout.py ``Policy.step`` on K = --envs-per-actor observations,
  inside the actor's own ``unroll``), divided by K;
- env: the K environments' step with their preprocessing (actors/vec.py, the backend ``train`` picks), divided by K.

With C cores and nothing else to pay for, C agent steps take (learn + infer + env) of CPU time: the ceiling is
C / (learn + infer + env) agent steps a second. What `unroll` spends beyond infer and env (sampling, buffers, the
truncation bootstrap) is printed as ``actor_rest``: it is overhead, not in the ceiling.

With ``--train-s S`` the real `train` runs with the same flags (a fresh logdir, an unbounded --total-env-steps) for
--warmup-s plus S seconds, and its trained agent steps a second over the S seconds (metrics.jsonl:
``env_steps_trained``) are printed as a share of the ceiling, measured just before and just after the run (this VM's
speed drifts; both are printed, the share is of their mean). Nothing else should run meanwhile.

    python tools/ceiling.py -- --env MinAtar/Breakout-v1 --batch-size 8 --ring-batches 16
    python tools/ceiling.py --train-s 60 --json -- --env ALE/Pong-v5
    python tools/ceiling.py --checkout /tmp/before --train-s 60 -- ...   # another checkout's package, same method
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def resolved(train_flags: list[str]):
    """(configuration, trajectory spec, env backend) as `train` with ``train_flags`` resolves them."""
    from impala_async import cli
    from impala_async.config.resolve import resolve
    from impala_async.learner import main as learner_main

    args = cli.build_parser().parse_args(["train", *train_flags])
    layered, _ = cli.load_learner_config(args)
    spec, probe, backend = learner_main.probe_environment(layered.cfg)
    layered = resolve(layered, default_listen=cli.COMMANDS["train"][0], probe=probe)
    return layered.cfg, spec, backend


class Timed:
    """``inner`` with the seconds spent in its ``step`` added up."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, *args):
        t0 = time.perf_counter()
        out = self.inner.step(*args)
        self.seconds += time.perf_counter() - t0
        return out


def random_batch(spec, batch_size: int, num_actions: int, seed: int = 0) -> dict:
    """A ring batch (loss.inputs' layout, ``[B, ...]`` per field) of plausible values: actions in range, small
    logits, images in their dtype's range, few episode ends."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    out = {}
    for f in spec.fields:
        shape = (batch_size, *f.shape)
        if f.name == "action":
            a = rng.integers(0, num_actions, shape)
        elif f.name in ("terminated", "truncated"):
            a = rng.random(shape) < 0.01
        elif np.dtype(f.dtype) == np.uint8:
            a = rng.integers(0, 2, shape)
        else:
            a = rng.standard_normal(shape) * 0.1
        out[f.name] = torch.from_numpy(np.ascontiguousarray(a.astype(f.dtype)))
    return out


def time_learn(cfg, spec, min_s: float) -> dict:
    """Seconds per update of the real learner on one thread; per agent step."""
    import torch

    from impala_async.learner.main import build_learner

    learner = build_learner(cfg, spec, torch.device("cpu"))
    batch = random_batch(spec, cfg.loss.batch_size, spec.num_actions)
    for _ in range(3):
        learner.step(batch)
    n, t0 = 0, time.perf_counter()
    while n < 5 or time.perf_counter() - t0 < min_s:
        learner.step(batch)
        n += 1
    per_update = (time.perf_counter() - t0) / n
    return {"learn_us": 1e6 * per_update / (cfg.loss.batch_size * spec.unroll_length), "updates_timed": n}, learner


def time_actor(cfg, spec, backend: str, learner, min_s: float) -> dict:
    """The actor's unroll on K environments with the learner's initial weights: its policy's and its environments'
    seconds per agent step, and the rest of the unroll's."""
    import numpy as np

    from impala_async.actors.rollout import Policy, unroll
    from impala_async.actors.vec import make_vec
    from impala_async.core import wire

    K, T = cfg.actors.envs_per_actor, spec.unroll_length
    seeds = list(range(K))
    vec = make_vec(cfg.env.env, cfg.env.env_kwargs_dict, K, backend, spec.obs_dtype, seeds=seeds)
    vec.reset(seeds)
    run_info = {"env_id": cfg.env.env, "spec": spec.to_dict(), "model": learner.model_config.to_dict()}
    weights = {k: v.numpy() for k, v in learner.model.state_dict().items()}
    msg = wire.decode_weights(wire.encode_weights(0, weights, run_info, incarnation=1), 1 << 31)
    policy, envs = Timed(Policy(msg, "cpu")), Timed(vec)
    buf = {f.name: np.zeros((K, *f.shape), f.dtype) for f in spec.fields}
    obs_buf = np.zeros((K, T + 1, *spec.obs_shape), spec.obs_dtype) if spec.frame_stack else buf["obs"]
    rng, state = np.random.default_rng(0), policy.initial_state(K)
    for _ in range(2):
        state = unroll(policy, envs, state, rng, buf, obs_buf)
    policy.seconds = envs.seconds = 0.0
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < min_s:
        state = unroll(policy, envs, state, rng, buf, obs_buf)
        n += 1
    elapsed, steps = time.perf_counter() - t0, n * T * K
    vec.close()
    return {
        "infer_us": 1e6 * policy.seconds / steps,
        "env_us": 1e6 * envs.seconds / steps,
        "actor_rest_us": 1e6 * (elapsed - policy.seconds - envs.seconds) / steps,
        "agent_steps_timed": steps,
    }


def child(cpu: int, train_flags: list[str], min_s: float) -> dict:
    os.sched_setaffinity(0, {cpu})
    import torch

    torch.set_num_threads(1)
    cfg, spec, backend = resolved(train_flags)
    torch.manual_seed(0)
    learn, learner = time_learn(cfg, spec, min_s)
    out = {
        "env": cfg.env.env,
        "backend": backend,
        "model": learner.model_config.kind,
        "batch_size": cfg.loss.batch_size,
        "unroll_length": spec.unroll_length,
        "envs_per_actor": cfg.actors.envs_per_actor,
        "cpu": cpu,
        **learn,
        **time_actor(cfg, spec, backend, learner, min_s),
    }
    return out


def package(checkout: str | None) -> tuple[Path, dict]:
    """(working directory, environment) of a process that runs ``checkout``'s package (None: this one's)."""
    if checkout is None:
        return ROOT, dict(os.environ)
    return Path(checkout), dict(os.environ, PYTHONPATH=str(Path(checkout).resolve()))


def measure(train_flags: list[str], cores: int, min_s: float, checkout: str | None = None) -> dict:
    """One ceiling measurement, in a fresh process pinned to the last allowed CPU."""
    cpu = max(os.sched_getaffinity(0))
    cmd = [sys.executable, __file__, "--child", str(cpu), "--min-s", str(min_s), "--", *train_flags]
    cwd, env = package(checkout)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=cwd, env=env)
    if out.returncode:
        raise SystemExit(f"ceiling: the measuring process failed:\n{out.stderr[-3000:]}")
    parts = json.loads(out.stdout.strip().splitlines()[-1])
    per_step_us = parts["learn_us"] + parts["infer_us"] + parts["env_us"]
    parts["cores"] = cores
    parts["ceiling_agent_steps_per_s"] = cores * 1e6 / per_step_us
    for k in ("learn_us", "infer_us", "env_us", "actor_rest_us"):
        parts[k] = round(parts[k], 2)
    parts["ceiling_agent_steps_per_s"] = round(parts["ceiling_agent_steps_per_s"], 1)
    return parts


def run_train(train_flags: list[str], warmup_s: float, seconds: float, checkout: str | None = None) -> dict:
    """The real `train` for warmup_s + seconds: its trained agent steps a second over the last ``seconds``."""
    from impala_async.learner.reports.metrics import read_metrics

    logdir = Path(tempfile.mkdtemp(prefix="ceiling-train-"))
    cmd = [sys.executable, "-m", "impala_async", "train", *train_flags]
    cmd += ["--total-env-steps", str(10**13), "--logdir", str(logdir), "--report-interval-s", "1"]
    cwd, env = package(checkout)
    with open(logdir / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, cwd=cwd, env=env)
        try:
            deadline = time.monotonic() + 300
            metrics = logdir / "metrics.jsonl"
            while not (metrics.exists() and read_metrics(metrics)):  # started: first report written
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"ceiling: train did not start; see {logdir}/train.log")
                time.sleep(0.5)
            time.sleep(warmup_s)
            first = read_metrics(metrics)[-1]
            time.sleep(seconds)
            last = read_metrics(metrics)[-1]
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    dt = last["wall_s"] - first["wall_s"]
    received = last["trajectories_received"] - first["trajectories_received"]
    dropped = last["trajectories_dropped"] - first["trajectories_dropped"]
    return {
        "trained_agent_steps_per_s": round((last["env_steps_trained"] - first["env_steps_trained"]) / dt, 1),
        "env_steps_per_s": round((last["env_steps"] - first["env_steps"]) / dt, 1),
        "updates_per_s": round((last["learner_steps"] - first["learner_steps"]) / dt, 1),
        "dropped_share": round(dropped / received, 4) if received else None,
        "policy_lag_avg": last.get("policy_lag_avg"),
        "seconds": round(dt, 1),
        "logdir": str(logdir),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("train_flags", nargs="*", help="train's flags, after --")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="default: the CPUs allowed")
    p.add_argument("--min-s", type=float, default=3.0, help="seconds each part is timed, at least")
    p.add_argument("--train-s", type=float, default=0.0, help="also run train this long and print its share")
    p.add_argument("--warmup-s", type=float, default=20.0, help="train's seconds left out, after its first report")
    p.add_argument("--checkout", default=None, help="measure this checkout's package (e.g. git archive REV, unpacked)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child, a.train_flags, a.min_s)))
        return 0
    result = {"checkout": a.checkout or "this", "ceiling_before": measure(a.train_flags, a.cores, a.min_s, a.checkout)}
    if a.train_s > 0:
        result["train"] = run_train(a.train_flags, a.warmup_s, a.train_s, a.checkout)
        result["ceiling_after"] = measure(a.train_flags, a.cores, a.min_s, a.checkout)
        ceilings = [result[k]["ceiling_agent_steps_per_s"] for k in ("ceiling_before", "ceiling_after")]
        result["share"] = round(result["train"]["trained_agent_steps_per_s"] / (sum(ceilings) / 2), 3)
    print(json.dumps(result) if a.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
