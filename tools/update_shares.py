#!/usr/bin/env python3
"""Where a learner update's time goes, stage by stage: the real `Learner.step` of `train`'s resolved configuration.

    python tools/update_shares.py --updates 200 -- --env MinAtar/Breakout-v1
    python tools/update_shares.py --updates 20 --json -- --env ALE/Pong-v5

Times `--updates` updates (after a warm-up) of the learner `train` would build with the flags after `--`, on one
thread (`--threads`), on a batch of plausible values (tools/ceiling.py's), and splits each into its stages:

- ``inputs``: the ring batch made into the network's and the loss's tensors (loss.inputs: frames unstacked, clipping);
- ``forward``: the network over the T+1 observations;
- ``targets``: V-trace's targets (core/vtrace.from_importance_weights: what the source article says actors could
  precompute), part of ``loss``;
- ``loss``: the rest of the loss (log-probabilities, the three terms, the metrics);
- ``backward + optimizer``: backward, the gradient clip and the optimizer step;
- ``rest``: what `Learner.step` does besides (statistics to Python numbers, the schedules).

Prints ms per update and per agent step and each stage's share (``--json``: one JSON object). Measure alone on the
machine; compare two checkouts by running this file with `PYTHONPATH=<checkout>` in alternation.

``--device cuda``: the update on the GPU (the learner warmed up as the learner command does), timed whole: its stages
run asynchronously there, so only the total (which `Learner.step` ends by waiting for) and the agent steps a second
one rank trains are printed. That is the learner alone, without its ingest: an upper bound for a learner fed by
enough actors.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

STAGES = ("inputs", "forward", "targets", "loss", "backward + optimizer")


def timed(into: dict, name: str, fn):
    """``fn`` with the seconds spent in it added to ``into[name]``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[name] = into.get(name, 0.0) + time.perf_counter() - t0

    return wrapper


def measure(train_flags: list[str], updates: int, warmup: int, threads: int, device: str = "cpu") -> dict:
    import torch
    from ceiling import random_batch, resolved

    from impala_async.core import vtrace
    from impala_async.learner import learn
    from impala_async.learner.main import build_learner

    torch.set_num_threads(threads)
    cfg, spec, _ = resolved(train_flags)
    learner = build_learner(cfg, spec, torch.device(device))
    learner.warm_up()
    batch = {k: v.to(device) for k, v in random_batch(spec, cfg.loss.batch_size, spec.num_actions).items()}
    if device != "cpu":
        return _whole(learner, batch, cfg, spec, updates, warmup, device)
    spent: dict[str, float] = {}
    # learn.py calls these through its module attributes and the learner's own: wrapped there, for this process only
    learn.loss.inputs = timed(spent, "inputs", learn.loss.inputs)
    learn.loss.impala_loss = timed(spent, "loss", learn.loss.impala_loss)
    vtrace.from_importance_weights = timed(spent, "targets", vtrace.from_importance_weights)
    learner.forward = timed(spent, "forward", learner.forward)
    learner._apply = timed(spent, "backward + optimizer", learner._apply)
    for _ in range(warmup):
        learner.step(batch)
    spent.clear()
    t0 = time.perf_counter()
    for _ in range(updates):
        learner.step(batch)
    total_s = time.perf_counter() - t0
    spent["loss"] -= spent.get("targets", 0.0)  # the targets are computed inside the loss
    spent["rest"] = total_s - sum(spent.values())
    steps = cfg.loss.batch_size * spec.unroll_length
    return {
        "env": cfg.env.env,
        "batch_size": cfg.loss.batch_size,
        "unroll_length": spec.unroll_length,
        "threads": threads,
        "updates": updates,
        "ms_per_update": round(1e3 * total_s / updates, 3),
        "us_per_agent_step": round(1e6 * total_s / updates / steps, 3),
        "ms": {k: round(1e3 * v / updates, 3) for k, v in spent.items()},
        "share": {k: round(v / total_s, 4) for k, v in spent.items()},
    }


def _whole(learner, batch, cfg, spec, updates: int, warmup: int, device: str) -> dict:
    """Whole updates on an accelerator, where the stages run asynchronously."""
    for _ in range(warmup):
        learner.step(batch)
    t0 = time.perf_counter()
    for _ in range(updates):
        learner.step(batch)  # ends with the statistics' .tolist(): the update is done on the device
    total_s = time.perf_counter() - t0
    steps = cfg.loss.batch_size * spec.unroll_length
    return {
        "env": cfg.env.env,
        "device": device,
        "model": learner.model_config.kind,
        "precision": cfg.loss.precision,
        "batch_size": cfg.loss.batch_size,
        "unroll_length": spec.unroll_length,
        "updates": updates,
        "ms_per_update": round(1e3 * total_s / updates, 3),
        "agent_steps_per_s": round(updates * steps / total_s, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--updates", type=int, default=100, help="updates timed (default: 100)")
    p.add_argument("--warmup", type=int, default=10, help="updates before timing (default: 10)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--device", default="cpu", help="cpu (stages timed) or cuda (whole updates; default: cpu)")
    p.add_argument("--json", action="store_true")
    p.add_argument("train_flags", nargs="*", help="after --: train's flags")
    args = p.parse_args(argv)
    r = measure(args.train_flags, args.updates, args.warmup, args.threads, args.device)
    if args.json:
        print(json.dumps(r))
        return 0
    if "share" not in r:
        print(
            f"{r['env']} on {r['device']}: {r['ms_per_update']:.2f} ms an update, "
            f"{r['agent_steps_per_s']:,.0f} agent steps/s"
        )
        return 0
    print(
        f"{r['env']}: B {r['batch_size']} x T {r['unroll_length']}, {r['threads']} thread(s), {r['updates']} updates:"
        f" {r['ms_per_update']:.2f} ms an update, {r['us_per_agent_step']:.2f} us an agent step"
    )
    for name in (*STAGES, "rest"):
        print(f"  {name:22s} {r['ms'][name]:8.3f} ms  {100 * r['share'][name]:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
