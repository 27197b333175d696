#!/usr/bin/env python3
"""Throughput probe: how many env frames per second can a learner ingest, and which stage limits it.

Self-contained (default): starts `impala-async learner` in ingest-only mode (decode into the ring, release full
batches) or, with --train, in full training mode, pinned to CPU 0 when --pin, plus --actors synthetic actor processes
(pinned to the other CPUs). Synthetic actors send realistic, pre-compressed trajectories through the real wire format:
`--obs cartpole` (real CartPole-v1 states) or `--obs atari` (4x84x84 uint8 frame stacks from the Pong-like
environment: flat background, two paddles, a ball) or `--obs ale` (real ALE/Pong-v5 frames, which the jpeg codec is
measured on). They learn the spec and the policy version from the learner's weights messages, exactly as real actors
do.

`--codec lz4,jpeg` measures each codec in turn, with a fresh learner and actors each time (jpeg is always measured
beside lz4: lz4 is added if not named), and reports for each: encode cost per frame on the actor side (CPU time to
encode the image field of the pre-encoded messages), decode cost per frame on the learner side (the decode stage per
trajectory, all fields and the value checks included, over the image planes of a trajectory), wire bytes per frame,
wire MB/s and frames/s.
Under jpeg only the image field (obs or frames) is JPEG; every other field is LZ4, as real actors send it.

Attach mode: `--learner tcp://HOST:PORT` sends to a learner that is already running (give `--metrics
LOGDIR/metrics.jsonl` if it is on this machine, for the learner-side figures; `--curve-keys DIR` if it requires CURVE).

Reports one line a second and a summary: env frames/s, trajectories/s, wire and decoded MB/s, end-to-end latency
p50/p99 (actor send -> trajectory in its ring slot), event-loop lag p99, dropped and rejected counts, and seconds per
trajectory in each stage (receive, parse, decode = decompress + copy into the slot + checks, h2d, train).

    python tools/loadtest.py --obs atari --actors 8 --seconds 20 --pin --json
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
import tempfile
import time
from pathlib import Path

from impala_async.learner.reports.metrics import read_metrics

ENVS = {"cartpole": "CartPole-v1", "atari": "impala_async.actors.envs:PongLike-v0", "ale": "ALE/Pong-v5"}
CODECS = ("lz4", "none", "jpeg")


# ------------------------------------------------------------------------------------------------ synthetic actor
def synthetic_actor(a: argparse.Namespace) -> int:
    """One synthetic actor process: pre-encoded trajectories, fresh header (seq, version, time) per message."""
    import lz4.block
    import msgpack
    import numpy as np
    import zmq

    from impala_async.actors.envs import make_env
    from impala_async.core import codecs, frames, wire
    from impala_async.core.spec import TrajectorySpec

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    ctx = zmq.Context(1)
    sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    if a.curve_keys:
        from impala_async.ops import auth

        keys = auth.load_actor_keys(a.curve_keys)
        auth.make_curve_client(sub, keys)
        auth.make_curve_client(push, keys)
    sub.setsockopt(zmq.CONFLATE, 1)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    push.setsockopt(zmq.SNDHWM, a.send_hwm)
    for s in (sub, push):
        s.setsockopt(zmq.LINGER, 0)
    sub.connect(a.weights)
    push.connect(a.learner)
    first = None
    deadline = time.monotonic() + 120
    while first is None and not stop and time.monotonic() < deadline:
        if sub.poll(100):
            first = wire.decode_weights(sub.recv(), 1 << 30)
    if first is None:
        return 3
    from impala_async.actors.endpoints import Endpoints

    Endpoints(push, a.learner).update(first.run_info)  # a learner of several ranks: push to every rank, round-robin
    spec = TrajectorySpec.from_dict(first.run_info["spec"])
    version, incarnation = first.version, first.incarnation
    T, N = spec.unroll_length, a.trajectories_per_message
    # Distinct realistic trajectories from the learner's own environment under random actions.
    env = make_env(first.run_info["env_id"], **first.run_info.get("env_kwargs", {}))
    rng = np.random.default_rng(a.index)
    obs, _ = env.reset(seed=a.index)
    trajectories = []
    for _ in range(a.distinct):
        arrays = {f.name: np.zeros(f.shape, f.dtype) for f in spec.fields}
        arrays["obs"] = np.zeros((T + 1, *spec.obs_shape), spec.obs_dtype)
        arrays["obs"][0] = obs
        for t in range(T):
            action = int(rng.integers(spec.num_actions))
            obs, r, term, trunc, _ = env.step(action)
            arrays["action"][t], arrays["reward"][t] = action, r
            arrays["terminated"][t], arrays["truncated"][t] = term, trunc and not term
            arrays["behaviour_logits"][t] = rng.normal(size=spec.num_actions)
            if term or trunc:
                obs, _ = env.reset()
            arrays["obs"][t + 1] = obs
        if spec.frame_stack:  # single frames on the wire, as real actors send them
            done = arrays["terminated"] | arrays["truncated"]
            arrays["frames"] = frames.pack(arrays.pop("obs")[None], done[None])[0]
        trajectories.append(arrays)
    # Pre-encoded payloads of distinct messages: each field of n trajectories is one block (docs/protocol.md).
    image, geometry = spec.fields[0].name, codecs.image_geometry(spec.fields[0])
    distinct, encode_s, image_bytes = [], 0.0, 0
    for j in range(a.distinct):
        picks = [trajectories[(j * N + i) % a.distinct] for i in range(N)]
        stacked = {name: np.stack([p[name] for p in picks]) for name in picks[0]}
        payloads = {}
        for name, x in stacked.items():
            codec = a.codec if a.codec != "jpeg" or (name == image and geometry) else "lz4"
            t0 = time.process_time()  # this process's CPU time: actors sharing a core do not inflate it
            payloads[name] = (
                codec,
                codecs.encode_jpeg(x, a.jpeg_quality)
                if codec == "jpeg"
                else lz4.block.compress(x)
                if codec == "lz4"
                else x.tobytes(),
            )
            if name == image:
                encode_s += time.process_time() - t0
                image_bytes += len(payloads[name][1])
        distinct.append(payloads)
    planes = geometry[0] if geometry else 0  # image planes (frames) per trajectory
    encoded_frames = a.distinct * N * planes
    field_meta = {f.name: (f.wire_dtype, list(f.shape)) for f in spec.fields}
    ident = f"loadtest/{os.getpid()}/{a.index}"
    per_actor_rate = a.rate / a.actors / (N * T) if a.rate > 0 else 0.0  # messages/s
    sent = blocked_s = 0
    seq = 0
    next_at = time.monotonic()
    start = time.monotonic()
    while not stop:
        if sub.poll(0):
            latest = wire.weights_header(sub.recv())
            version, incarnation = (version, incarnation) if latest is None else latest
        payloads = distinct[seq % len(distinct)]
        fields = {
            name: {"dtype": d, "shape": s, "codec": payloads[name][0], "data": payloads[name][1]}
            for name, (d, s) in field_meta.items()
        }
        msg = msgpack.packb(
            {
                "v": wire.PROTOCOL_VERSION,
                "type": "trajectories",
                "actor": ident,
                "seq": seq,
                "policy_version": version,
                "incarnation": incarnation,
                "n": N,
                "episodes": [],
                "fields": fields,
                "sent_at_ns": time.time_ns(),
            }
        )
        if per_actor_rate:
            next_at += 1.0 / per_actor_rate
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        while not stop:
            try:
                push.send(msg, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                t0 = time.monotonic()
                push.poll(100, zmq.POLLOUT)
                blocked_s += time.monotonic() - t0
        sent += N
        seq += 1
    elapsed = time.monotonic() - start
    print(
        json.dumps(
            {
                "trajectories_sent": sent,
                "blocked_frac": blocked_s / max(elapsed, 1e-9),
                "seconds": elapsed,
                "planes_per_trajectory": planes,
                "encode_us_per_frame": encode_s / encoded_frames * 1e6 if encoded_frames else None,
                "wire_bytes_per_frame": image_bytes / encoded_frames if encoded_frames else None,
            }
        ),
        flush=True,
    )
    sub.close(0)
    push.close(0)
    ctx.term()
    return 0


# ------------------------------------------------------------------------------------------------------ driver
def _affinity(cpus):
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def _live_line(r: dict) -> str:
    stages = r.get("stage_s_per_trajectory") or {}
    share = " ".join(f"{k} {v * 1e6:.0f}us" for k, v in stages.items() if v)
    return (
        f"{r['wall_s']:7.1f}s  frames/s {r['sps']:>11,.0f}  traj/s {r['trajectories_per_s']:>9,.0f}  "
        f"wire {r['wire_mb_per_s']:7.1f} MB/s  decoded {r['decoded_mb_per_s']:8.1f} MB/s  "
        f"lat p50/p99 {r['latency_p50_ms']}/{r['latency_p99_ms']} ms  loop p99 {r['loop_lag_p99_ms']} ms  "
        f"dropped {r['trajectories_dropped']}  rejected {r['trajectories_rejected']}  [{share}]"
    )


def _flag(flags: list[str], name: str, default):
    """Value of a learner flag given as --learner-flag=NAME=VALUE, else the default."""
    for f in flags:
        if f.startswith(name + "="):
            return f.split("=", 1)[1]
    return default


def summarise(rows: list[dict], window_start_s: float, frames_per_batch: int | None) -> dict:
    win = [r for r in rows if r["wall_s"] >= window_start_s]
    if len(win) < 2:
        raise SystemExit("loadtest: too few metrics lines in the measurement window; run longer")
    first, last = win[0], win[-1]
    dt = last["wall_s"] - first["wall_s"]
    med = lambda key: statistics.median([r[key] for r in win[1:] if r.get(key) is not None] or [0.0])  # noqa: E731
    stages: dict[str, list[float]] = {}
    for r in win[1:]:
        for k, v in (r.get("stage_s_per_trajectory") or {}).items():
            if v is not None:
                stages.setdefault(k, []).append(v)
    trajectories = last["trajectories_received"] - first["trajectories_received"]
    decoded = (last["env_steps"] - first["env_steps"]) / dt
    # Rank 0's batches; with several learner ranks each of them takes as many (in lock step when training).
    batches = sum(r["batches_per_s"] for r in win[1:]) / len(win[1:]) * last.get("learner_ranks", 1)
    return {
        # Frames in batches handed to the consumer (trainer): what was ingested, net of any later drop.
        "frames_per_s": batches * frames_per_batch if frames_per_batch else decoded,
        "frames_decoded_per_s": decoded,
        "trajectories_per_s": trajectories / dt,
        "wire_mb_per_s": (last["bytes_received"] - first["bytes_received"]) / dt / 1e6,
        "decoded_mb_per_s": med("decoded_mb_per_s"),
        "latency_p50_ms": med("latency_p50_ms"),
        "latency_p99_ms": med("latency_p99_ms"),
        "latency_p99_ms_worst_second": max((r["latency_p99_ms"] or 0) for r in win[1:]),
        "loop_lag_p99_ms": med("loop_lag_p99_ms"),
        "loop_lag_p99_ms_worst_second": max((r["loop_lag_p99_ms"] or 0) for r in win[1:]),
        "dropped": last["trajectories_dropped"],
        "rejected": last["trajectories_rejected"],
        "learner_steps_per_s": (last["learner_steps"] - first["learner_steps"]) / dt,
        "stages": {k: statistics.mean(v) for k, v in stages.items()},
        "window_s": dt,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--learner", default="", help="attach to this learner instead of starting one")
    p.add_argument("--weights", default="", help="its weights address (default: learner port + 1)")
    p.add_argument("--metrics", default="", help="attach mode: the learner's metrics.jsonl, if readable here")
    p.add_argument("--curve-keys", default="", help="actor key directory (actor.key_secret, learner.key)")
    p.add_argument("--train", action="store_true", help="full training mode instead of ingest-only")
    p.add_argument(
        "--learner-ranks",
        type=int,
        default=1,
        help=(
            "learner ranks (README, Several learner ranks): each binds its own trajectory socket and the synthetic "
            "actors push to all of them; with --train they train in lock step (default: 1)"
        ),
    )
    p.add_argument("--obs", choices=sorted(ENVS), default="atari")
    p.add_argument("--actors", type=int, default=8)
    p.add_argument("--unroll-length", type=int, default=80)
    p.add_argument(
        "--trajectories-per-message",
        type=int,
        default=16,
        help=("trajectories per message (real actors send one per environment of an unroll: 32 by default)"),
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--codec",
        default="lz4",
        help="lz4, none or jpeg, or several separated by commas, measured in "
        "turn (jpeg: --obs ale; lz4 is always measured beside it)",
    )
    p.add_argument("--jpeg-quality", type=int, default=90)
    p.add_argument(
        "--rate", type=float, default=0.0, help="offered env frames/s over all actors (0: as fast as possible)"
    )
    p.add_argument("--seconds", type=float, default=20.0, help="measurement window")
    p.add_argument("--warmup-s", type=float, default=5.0, help="ignored start of the run, after the first data")
    p.add_argument("--pin", action="store_true", help="learner on CPU 0, actors on the other CPUs")
    p.add_argument("--learner-flag", action="append", default=[], help="extra flag for the learner (repeatable)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--send-hwm", type=int, default=4)
    p.add_argument("--distinct", type=int, default=8, help="distinct trajectories each actor cycles through")
    p.add_argument("--actor-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.actor_worker:
        return synthetic_actor(a)
    chosen = a.codec.split(",")
    if not set(chosen) <= set(CODECS):
        raise SystemExit(f"loadtest: --codec takes {', '.join(CODECS)} (comma-separated), got {a.codec!r}")
    if "jpeg" in chosen:
        if a.obs != "ale" and not a.learner:
            raise SystemExit(
                "loadtest: --codec jpeg is measured on real ALE frames: use --obs ale (--obs atari's "
                "PongLike frames are synthetic, flat pictures that say nothing about JPEG)"
            )
        chosen = ["lz4"] * ("lz4" not in chosen) + chosen
    results = {}
    for codec in chosen:
        a.codec = codec
        results[codec] = measure(a)
    result = (
        results[chosen[0]]
        if len(chosen) == 1
        else {
            "codecs": results,
            "comparison": {
                c: {
                    k: r.get(k)
                    for k in (
                        "frames_per_s",
                        "wire_mb_per_s",
                        "encode_us_per_frame",
                        "decode_us_per_frame",
                        "wire_bytes_per_frame",
                    )
                }
                for c, r in results.items()
            },
        }
    )
    if a.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    return 0


def measure(a: argparse.Namespace) -> dict:
    """One run of learner and synthetic actors with ``a.codec``; the summary as a dict."""
    a = argparse.Namespace(**vars(a))  # the addresses of a learner started here stay this run's
    cpus = os.sched_getaffinity(0)
    learner_cpus = {min(cpus)} if a.pin else None
    actor_cpus = (cpus - learner_cpus or cpus) if a.pin else None
    tmp = Path(tempfile.mkdtemp(prefix="loadtest-"))
    learner = None
    metrics_path = Path(a.metrics) if a.metrics else None
    if not a.learner:
        cmd = [
            sys.executable,
            "-m",
            "impala_async",
            "learner",
            "--env",
            ENVS[a.obs],
            "--listen",
            "tcp://127.0.0.1:*",
            "--unroll-length",
            str(a.unroll_length),
            "--batch-size",
            str(a.batch_size),
            "--logdir",
            str(tmp),
            "--ingest-only",
            "0" if a.train else "1",
            "--total-env-steps",
            str(10**15),
            "--report-interval-s",
            "1",
            "--no-data-timeout-s",
            "600",
            "--checkpoint-interval-s",
            "100000",
            "--learner-ranks",
            str(a.learner_ranks),
            *(["--obs-codec", "jpeg"] if a.codec == "jpeg" else []),  # a learner decodes JPEG only when it asks for it
            *a.learner_flag,
        ]
        learner = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=open(tmp / "learner.log", "w"),
            text=True,
            preexec_fn=_affinity(learner_cpus),
        )
        line = learner.stdout.readline()
        m = re.search(r"--learner (\S+) --weights (\S+)", line)
        if not m:
            learner.kill()
            raise SystemExit(f"loadtest: learner did not start:\n{(tmp / 'learner.log').read_text()[-3000:]}")
        a.learner, a.weights = m.group(1), m.group(2)
        metrics_path = tmp / "metrics.jsonl"
    elif not a.weights:
        host, _, port = a.learner.rpartition(":")
        a.weights = f"{host}:{int(port) + 1}"
    actors = []
    for i in range(a.actors):
        cmd = [
            sys.executable,
            __file__,
            "--actor-worker",
            "--index",
            str(i),
            "--learner",
            a.learner,
            "--weights",
            a.weights,
            "--actors",
            str(a.actors),
            "--trajectories-per-message",
            str(a.trajectories_per_message),
            "--codec",
            a.codec,
            "--jpeg-quality",
            str(a.jpeg_quality),
            "--rate",
            str(a.rate),
            "--send-hwm",
            str(a.send_hwm),
            "--distinct",
            str(a.distinct),
        ]
        if a.curve_keys:
            cmd += ["--curve-keys", a.curve_keys]
        actors.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=_affinity(actor_cpus)))
    import psutil

    rss_mib: list[tuple[bool, float]] = []  # (data flowing yet, learner RSS)
    try:
        t_first = None
        deadline = time.monotonic() + 120
        shown = 0
        while time.monotonic() < deadline:
            time.sleep(1.0)
            if learner is not None and learner.poll() is None:
                rss_mib.append((t_first is not None, psutil.Process(learner.pid).memory_info().rss / 2**20))
            rows = read_metrics(metrics_path)
            for r in rows[shown:]:
                if not a.json:
                    print(_live_line(r), flush=True)
            shown = len(rows)
            live = [r for r in rows if r["env_steps"] > 0]
            if live and t_first is None:
                t_first = live[0]["wall_s"]
                deadline = time.monotonic() + a.warmup_s + a.seconds + 1.5
            if learner is not None and learner.poll() is not None:
                raise SystemExit(f"loadtest: learner exited:\n{(tmp / 'learner.log').read_text()[-3000:]}")
        if metrics_path is None:
            print("attach mode without --metrics: learner-side figures unavailable; sender totals follow")
    finally:
        for proc in actors:
            proc.send_signal(signal.SIGTERM)
        sent = []
        for proc in actors:
            try:
                out, _ = proc.communicate(timeout=15)
                sent.append(json.loads(out.strip().splitlines()[-1]))
            except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
                proc.kill()
        if learner is not None:
            learner.send_signal(signal.SIGTERM)
            try:
                learner.wait(30)
            except subprocess.TimeoutExpired:
                learner.kill()
    result = {
        "obs": a.obs,
        "actors": a.actors,
        "train": a.train,
        "learner_ranks": a.learner_ranks,
        "unroll_length": a.unroll_length,
        "trajectories_per_message": a.trajectories_per_message,
        "codec": a.codec,
        "rate": a.rate,
        "pinned": a.pin,
        "sender_trajectories": sum(s["trajectories_sent"] for s in sent),
        "sender_blocked_frac": statistics.mean(s["blocked_frac"] for s in sent) if sent else None,
    }
    rows = read_metrics(metrics_path)
    if rows and t_first is not None:
        result.update(
            summarise(rows, t_first + a.warmup_s, a.batch_size * a.unroll_length if learner is not None else None)
        )
    if rss_mib and rows:
        # What the learner may hold beyond its idle footprint: the ring and decode scratch (touched as they fill)
        # and, per connected actor, receive_hwm_messages queued messages of at most max_message_bytes.
        before = [m for flowing, m in rss_mib if not flowing]
        hwm = int(_flag(a.learner_flag, "--receive-hwm-messages", 8))
        max_msg_mib = int(_flag(a.learner_flag, "--max-message-bytes", 16 << 20)) / 2**20
        result["rss_mib_idle"] = round(before[-1] if before else rss_mib[0][1], 1)
        result["rss_mib_max"] = round(max(m for _, m in rss_mib), 1)
        result["rss_bound_mib"] = round(
            result["rss_mib_idle"] + rows[-1]["ring_mib"] + rows[-1]["scratch_mib"] + a.actors * hwm * max_msg_mib, 1
        )
    planes = sent[0]["planes_per_trajectory"] if sent else 0
    decode_s = (result.get("stages") or {}).get("decode")
    result["encode_us_per_frame"] = _median([s["encode_us_per_frame"] for s in sent])
    result["wire_bytes_per_frame"] = _median([s["wire_bytes_per_frame"] for s in sent])
    result["decode_us_per_frame"] = round(decode_s / planes * 1e6, 2) if decode_s and planes else None
    return result


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


if __name__ == "__main__":
    sys.exit(main())
