#!/usr/bin/env python3
"""Env frames per second of one actor core, for each environment backend in turn.

Each backend runs in a fresh process pinned to one CPU (``os.sched_setaffinity``; torch and OpenCV on one thread, as
an actor runs): K environments, and the actor's own inner loop (``impala_async.actors.rollout.unroll``: the policy's
forward pass on a batch of K, here the Nature CNN (``--model deep``: the IMPALA ResNet) with initial weights,
Gumbel-max sampling, the environments' step and reset, the truncation bootstrap), then per unroll what the actor
does before sending: frames packed into single frames and the LZ4 wire encoding
(``--no-encode`` leaves that out). Nothing is sent.

Units. An *agent step* is one action in one environment. *Env frames* are agent steps x 4 (the frame skip), the
unit of the IMPALA paper, torchbeast and this project's ``env_steps``-based figures x 4; the emulator runs a little
fewer (a step that ends an episode stops at its ending frame) plus the 1-30 no-op frames of each reset, which neither
count. Both are reported, per second of wall time of the pinned process, with the split of that time between the
policy (forward pass and sampling), the environments, and the encoding.

    python tools/bench_actor.py --env ALE/Pong-v5 --envs 32 --steps 1000 --backends gymnasium,envpool --json
    python tools/bench_actor.py --device cuda ...   # the policy on the GPU (--actor-device cuda)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

FRAME_SKIP = 4


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


def child(a: argparse.Namespace) -> dict:
    os.sched_setaffinity(0, {a.cpu})
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from impala_async.actors.rollout import Policy, unroll
    from impala_async.actors.vec import make_vec
    from impala_async.core import frames, wire
    from impala_async.core.models import ModelConfig, build_model
    from impala_async.core.spec import TrajectorySpec

    K, T = a.envs, a.unroll_length
    seeds = list(range(K))
    t0 = time.perf_counter()
    vec = make_vec(a.env, json.loads(a.env_kwargs), K, a.backend, "uint8", seeds=seeds)
    vec.reset(seeds)
    build_s = time.perf_counter() - t0
    spec = TrajectorySpec.from_spaces(
        vec.single_observation_space, vec.single_action_space, T, frame_stack=vec.frame_stack
    )
    cfg = (
        ModelConfig.deep(input_scale=1 / 255)
        if a.model == "deep"
        else ModelConfig("auto", input_scale=1 / 255).resolved(spec)
    )
    torch.manual_seed(0)
    net = build_model(spec, cfg)
    run_info = {"env_id": a.env, "spec": spec.to_dict(), "model": cfg.to_dict()}
    msg = wire.decode_weights(
        wire.encode_weights(0, {k: v.numpy() for k, v in net.state_dict().items()}, run_info, incarnation=1), 1 << 30
    )
    policy, envs = Timed(Policy(msg, a.device)), Timed(vec)
    buf = {f.name: np.zeros((K, *f.shape), f.dtype) for f in spec.fields}
    obs_buf = np.zeros((K, T + 1, *spec.obs_shape), spec.obs_dtype) if spec.frame_stack else buf["obs"]
    rng, state = np.random.default_rng(0), policy.initial_state(K)
    unrolls = max(1, -(-a.steps // T))
    encode_s = elapsed = 0.0
    for i in range(unrolls + a.warmup_unrolls):
        if i == a.warmup_unrolls:
            policy.seconds = envs.seconds = encode_s = 0.0
            vec.pop_episodes()
            start = time.perf_counter()
        state = unroll(policy, envs, state, rng, buf, obs_buf)
        if not a.no_encode:
            t1 = time.perf_counter()
            if spec.frame_stack:
                buf["frames"][:] = frames.pack(obs_buf, buf["terminated"] | buf["truncated"])
            wire.encode_trajectories(
                spec, actor_id="bench", seq=i, policy_version=0, incarnation=1, arrays=buf, episodes=[], codec="lz4"
            )
            encode_s += time.perf_counter() - t1
    elapsed = time.perf_counter() - start
    episodes = vec.pop_episodes()
    vec.close()
    steps = unrolls * T * K
    return {
        "backend": vec.backend,
        "env": a.env,
        "model": cfg.kind,
        "envs": K,
        "cpu": a.cpu,
        "device": a.device,
        "agent_steps": steps,
        "seconds": round(elapsed, 3),
        "agent_steps_per_s": round(steps / elapsed, 1),
        "env_frames_per_s": round(FRAME_SKIP * steps / elapsed, 1),
        "policy_share": round(policy.seconds / elapsed, 3),
        "env_share": round(envs.seconds / elapsed, 3),
        "encode_share": round(encode_s / elapsed, 3),
        "episodes": len(episodes),
        "build_s": round(build_s, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="ALE/Pong-v5")
    p.add_argument("--env-kwargs", default="{}", help="JSON object, as --env-kwargs of train")
    p.add_argument("--envs", type=int, default=32, help="K environments (train's --envs-per-actor; default 32)")
    p.add_argument("--steps", type=int, default=1000, help="batched steps timed (each K agent steps; default 1000)")
    p.add_argument("--unroll-length", type=int, default=20)
    p.add_argument("--warmup-unrolls", type=int, default=2)
    p.add_argument("--backends", default="gymnasium,envpool")
    p.add_argument(
        "--model",
        choices=("auto", "deep"),
        default="auto",
        help="policy network: auto (as train picks it: the Nature CNN for Atari) or deep (IMPALA ResNet)",
    )
    p.add_argument("--device", default="cpu", help="where the policy runs: cpu or cuda[:N]")
    p.add_argument("--cpu", type=int, default=-1, help="the CPU to pin to (default: the last one allowed)")
    p.add_argument("--no-encode", action="store_true", help="leave out frame packing and the wire encoding")
    p.add_argument("--json", action="store_true", help="one JSON object per backend, nothing else")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.cpu < 0:
        a.cpu = max(os.sched_getaffinity(0))
    if a.child:
        a.backend = a.child
        print(json.dumps(child(a)), flush=True)
        return 0
    rows, code = [], 0
    for backend in a.backends.split(","):
        argv = [sys.executable, __file__, "--child", backend] + [x for x in sys.argv[1:] if x != "--json"]
        proc = subprocess.run(argv, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            print(f"{backend}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
            code = 1
            continue
        rows.append(json.loads(lines[-1]))
        print(
            lines[-1]
            if a.json
            else f"{backend:>10}: {rows[-1]['env_frames_per_s']:>8.0f} env frames/s "
            f"({rows[-1]['agent_steps_per_s']:.0f} agent steps/s), policy {rows[-1]['policy_share']:.0%}, "
            f"envs {rows[-1]['env_share']:.0%}, encode {rows[-1]['encode_share']:.0%}; "
            f"{a.envs} envs on CPU {a.cpu}, policy on {a.device}",
            flush=True,
        )
    if len(rows) == 2 and not a.json:
        print(
            f"{rows[1]['backend']} / {rows[0]['backend']}: "
            f"{rows[1]['env_frames_per_s'] / rows[0]['env_frames_per_s']:.2f}x"
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
