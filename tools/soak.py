#!/usr/bin/env python3
"""Soak test: train for a while under chaos and attack, and check that nothing was lost.

Runs `impala-async train --env CartPole-v1` with local actors for --seconds while
  - every --kill-every-s, a random local actor is killed (SIGKILL) or frozen (SIGSTOP), alternately;
  - a sender pushes --garbage-per-s hostile messages (random bytes, truncated and corrupted valid messages, NaN
    rewards, bad actions, future versions, replays, multipart messages, contradicting flags, absurd episodes,
    sent_at_ns 0, extreme but finite values that would poison the model);
  - an attacker cycles through the heavier attacks, --attack-every-s apart, every one of them within --seconds:
    tests/attacks.py's, a 4 MiB message of a million objects, then (where it may mount a tmpfs for the logdir,
    --tmpfs-logdir-mib) the logdir's disk filled to the last byte for 10 s, unfinished multipart messages (200 MiB
    offered), a 2 GiB frame on the weights socket, 20K distinct subscriptions, 300 connections that never handshake
    (held 5 s), and 20 re-subscriptions a second; then issue 15's (tests/attacks_control.py, soak_steps): valid
    messages from fresh actor ids, one 256-trajectory message, messages claiming 4,096 episodes, messages of another
    learner run claiming drops, 100 weights subscribers that read nothing, 200K empty messages followed by an
    unfinished 200 MiB one, and 200 idle connections on the metrics port while /healthz is probed; then issue 27's:
    20 one-trajectory messages a second over 200 connections, and messages whose every step ends an episode;
  - an honest subscriber counts the weights copies it receives (amplification).
Before any of it, the honest actors' unattacked rate (trajectories received a second) is taken over --baseline-s.
It samples the learner's resident memory every second. At the end it stops the learner with SIGTERM and checks:
every attack ran, exit code 0, training progressed (learner steps grew in every quarter of the attacked run), the newest
checkpoint passes the checks resume applies (layout, finite weights), memory stayed flat after warm-up (the median RSS
of the last minute is within --max-rss-growth-mib of the median of the minute after warm-up), the honest subscriber got
at most --max-copies-per-s weights copies a second, the honest actors kept --min-honest-fraction of their unattacked
rate (what the attacker got accepted is subtracted), every /healthz probe was answered 200, every stalled subscriber
and every credit-bypass connection was cut, every line of metrics.jsonl parses, and a resume meeting a crafted FIFO
and a stride-0 tensor as the two newest checkpoints sets both aside and loads the good one before them.

    python tools/soak.py --seconds 600 --json

--attacks picks some of the heavier attacks (the checks of the others' findings are then left out): CI's smallest mode
(tests/test_tools.py) runs two of them for 12 seconds against capped actors, a smoke of every part but the attacks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import psutil
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import attacks  # noqa: E402  (tests/attacks.py: the same attacks as tests/test_robustness.py)
import attacks_checkpoints  # noqa: E402
import attacks_control  # noqa: E402  (issue 15's: tests/test_misleading.py, test_outbound_attacks.py, ...)
import attacks_health  # noqa: E402
import procutil  # noqa: E402

from impala_async.learner import checkpoint  # noqa: E402
from impala_async.learner.reports.metrics import read_metrics  # noqa: E402


def garbage_sender(listen: str, weights: str, rate_per_s: float, stop: threading.Event, sent: list) -> None:
    """Push hostile messages at rate_per_s until stop is set."""
    ctx = zmq.Context()
    view = attacks.LearnerView(ctx, weights).refresh(60)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 100)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(listen)
    rng = np.random.default_rng(0)
    kinds = garbage_kinds(view, rng)
    seq = 1
    while not stop.is_set():
        try:
            view.sub.poll(0) and view.refresh(0.001)  # the learner's current version, when a new one is there
        except AssertionError:
            pass
        kind = int(rng.integers(len(kinds)))
        try:
            if kind == 0 and rng.random() < 0.1:
                push.send_multipart([b"x"] * 100, zmq.NOBLOCK)
            else:
                push.send(kinds[kind](seq), zmq.NOBLOCK)
            sent[0] += 1
        except zmq.Again:
            pass
        seq += 1
        stop.wait(1.0 / rate_per_s)
    push.close(0)
    view.close()
    ctx.term()


def garbage_kinds(view, rng: np.random.Generator) -> list:
    """The hostile messages, as functions of a sequence number (kind 0, random bytes, first)."""
    A = view.spec.num_actions

    def valid(seq, **kw):
        return attacks.message(view, actor="garbage", seq=seq, **kw)

    def poke(name, value):
        return lambda a: a[name].reshape(-1).__setitem__(0, value)

    return [
        lambda s: rng.bytes(int(rng.integers(0, 2000))),
        lambda s: valid(s)[: int(rng.integers(1, 200))],
        lambda s: valid(s, edit=poke("reward", np.nan)),
        lambda s: valid(s, edit=poke("action", A + 3)),
        lambda s: valid(s, edit=poke("terminated", 7)),
        lambda s: valid(s, raw_edit=lambda m: m.update(policy_version=10**12)),
        lambda s: valid(0),  # replay after the first one
        lambda s: b"\x91" * 50_000 + b"\xc0",
        lambda s: b"\xdd\xff\xff\xff\xff",
        lambda s: msgpack.packb(
            {
                "v": 2,
                "type": "trajectories",
                "n": 1,
                "fields": {"obs": {"data": (2**31).to_bytes(4, "little") + b"x" * 30}},
            }
        ),
        lambda s: valid(s, edit=lambda a: (a["terminated"].fill(1), a["truncated"].fill(1))),
        lambda s: valid(s, episodes=[(1.7e308, 1)]),
        lambda s: valid(s, sent_at_ns=0),
        lambda s: attacks.poisoned(view, actor="garbage-poison", seq=s),
        lambda s: attacks.poisoned(
            view, actor="garbage-poison2", seq=s, fields=("truncation_value", "reward", "behaviour_logits")
        ),
        lambda s: valid(
            s, raw_edit=lambda m: m["fields"]["obs"].update(shape=[float(x) for x in m["fields"]["obs"]["shape"]])
        ),
    ]


def attacker(
    listen: str,
    weights: str,
    metrics_port: int,
    every_s: float,
    names: list[str],
    stop: threading.Event,
    done: list,
    seen: dict,
    disk: Path | None = None,
) -> None:
    """The heavier attacks named (ATTACKS' names), one every every_s, in turn: tests/attacks.py's, then issue 15's
    (tests/attacks_control.py, soak_steps)."""
    ctx = zmq.Context()
    host, port = listen[len("tcp://") :].rsplit(":", 1)
    port = int(port)
    wport = int(weights.rsplit(":", 1)[1])
    pusher = ctx.socket(zmq.PUSH)
    pusher.setsockopt(zmq.LINGER, 0)
    pusher.connect(listen)

    def flood():
        held = attacks.connection_flood(host, port, 300)
        stop.wait(5.0)
        for s in held:
            s.close()

    def subscriptions():
        attacks.subscription_flood(host, wport, 20_000)

    steps = [  # the full disk early: it must run in every soak, however long the slower attacks take
        ("tree", lambda: pusher.send(attacks.tree_message("actor", 4 << 20), zmq.NOBLOCK)),
        ("full_disk", lambda: fill_disk(disk, 10.0, stop, seen)),  # where the logdir is a tmpfs (disk not None)
        ("multipart", lambda: attacks.unfinished_multipart(host, port, 200 << 20)),
        ("oversized_frame", lambda: attacks.oversized_frame(host, wport, 2 << 30, 100 << 20)),
        ("subscriptions", subscriptions),
        ("connection_flood", flood),
        ("resubscribe", lambda: attacks.resubscribe_flood(ctx, weights, 20, 5.0)),
        *attacks_control.soak_steps(ctx, listen, weights, metrics_port, stop, seen),
    ]
    assert tuple(name for name, _ in steps) == ATTACKS, "ATTACKS names the steps in their order"
    by_name = dict(steps)
    seen["steps"] = [name for name in names if name != "full_disk" or disk is not None]
    steps = [(name, by_name[name]) for name in seen["steps"]]
    took = seen.setdefault("step_s", {})
    i = 0
    while not stop.wait(every_s):
        name, run = steps[i % len(steps)]
        t0 = time.monotonic()
        try:
            run()
            done.append(name)
        except (OSError, zmq.ZMQError) as e:
            done.append(f"{name}: {type(e).__name__}")
        took[name] = round(max(took.get(name, 0.0), time.monotonic() - t0), 1)
        i += 1
    pusher.close(0)
    ctx.destroy(linger=0)


ATTACKS = (
    "tree",
    "full_disk",
    "multipart",
    "oversized_frame",
    "subscriptions",
    "connection_flood",
    "resubscribe",
    *attacks_control.SOAK_STEPS,
)


def mount_tmpfs(directory: Path, mib: int) -> str:
    """Mount a tmpfs of ``mib`` MiB on ``directory`` for the learner's logdir (issue 27, row 2: a disk that fills up);
    "" if it is mounted, else why not (the soak then runs without the full-disk step)."""
    if mib <= 0:
        return "--tmpfs-logdir-mib 0"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(directory)], capture_output=True)
    return "" if done.returncode == 0 else f"cannot mount a tmpfs (root only): {done.stderr.decode().strip()}"


def fill_disk(directory: Path, hold_s: float, stop: threading.Event, seen: dict) -> None:
    """Fill ``directory``'s filesystem to the last byte, hold it ``hold_s``, free it again."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
    stop.wait(hold_s)
    filler.unlink()
    seen["disk_fills"] = seen.get("disk_fills", 0) + 1


def unattacked_rate(logdir: Path, seconds: float, learner: subprocess.Popen) -> float:
    """Trajectories received per second over ``seconds`` from the first report, before any attack or chaos."""
    deadline = time.monotonic() + 300
    while not (logdir / "metrics.jsonl").exists() or not read_metrics(logdir / "metrics.jsonl"):
        if learner.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"soak: the learner reported nothing; see {logdir}/train.log")
        time.sleep(0.5)
    first = read_metrics(logdir / "metrics.jsonl")[-1]
    time.sleep(seconds)
    last = read_metrics(logdir / "metrics.jsonl")[-1]
    return (last["trajectories_received"] - first["trajectories_received"]) / max(
        1e-9, last["wall_s"] - first["wall_s"]
    )


def hostile_checkpoints(logdir: Path) -> dict:
    """Issue 15, class 5, on the soak's own checkpoints after the run: a stride-0 tensor and a FIFO written as the two
    newest; what a resume loads (checkpoint.load_latest, as a resume calls it) must be the good one before
    them, with both set aside."""
    good, _ = attacks_checkpoints.newest_good(logdir)
    crafted = attacks_checkpoints.stack_crafts(logdir, ("fifo", "stride0"))
    found = checkpoint.load_latest(logdir, validate=checkpoint.validate_learner_state, quarantine=True)
    set_aside = sorted(p.name for p in logdir.glob("*.bad"))
    return {
        "crafted": sorted(p.name for p in crafted.values()),
        "loaded": found[1].name if found else None,
        "set_aside": set_aside,
        "resumed_from_good": found is not None and found[1] == good and len(set_aside) == len(crafted),
    }


# The attack steps whose own measurements the verdict reads (seen's key): checked where the soak runs the step.
STEP_FINDINGS = {
    "health_starvation": "health_probes",
    "credit_bypass": "credit_bypass_cut",
    "idle_subscribers": "idle_subscribers_cut",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--warmup-s", type=float, default=60)
    p.add_argument("--baseline-s", type=float, default=30, help="unattacked seconds, after the first report")
    p.add_argument("--min-honest-fraction", type=float, default=0.5, help="of the unattacked rate, under attack")
    p.add_argument("--kill-every-s", type=float, default=20)
    p.add_argument("--garbage-per-s", type=float, default=50)
    p.add_argument("--attack-every-s", type=float, default=2, help="pause between two attacks (every one must run)")
    p.add_argument(
        "--attacks",
        default=",".join(ATTACKS),
        help="the heavier attacks to run, comma-separated, in this order (default: all of them)",
    )
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--actor-max-env-steps-per-s", type=float, default=0.0, help="each actor's cap (0: none)")
    p.add_argument("--checkpoint-interval-s", type=float, default=30)
    p.add_argument("--report-interval-s", type=float, default=2, help="the learner's; progress is read per quarter")
    p.add_argument("--max-rss-growth-mib", type=float, default=20)
    p.add_argument("--rss-window-s", type=float, default=60, help="memory: the window after warm-up against the last")
    p.add_argument(
        "--max-copies-per-s",
        type=float,
        default=3.0,
        help="weights copies an honest subscriber may receive per second (publish interval 1 s)",
    )
    p.add_argument(
        "--tmpfs-logdir-mib", type=int, default=256, help="the logdir on a tmpfs this size, filled now and then"
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    a.attacks = [name for name in a.attacks.split(",") if name]
    unknown = [name for name in a.attacks if name not in ATTACKS]
    if unknown:
        p.error(f"--attacks: no attack named {', '.join(unknown)}; the attacks are {', '.join(ATTACKS)}")
    return a


def start_learner(a: argparse.Namespace, logdir: Path, metrics_port: int) -> tuple[subprocess.Popen, str, str]:
    """`train --env CartPole-v1` for ever with local actors, the soak's limits; (process, listen, weights)."""
    cmd = [sys.executable, "-m", "impala_async", "train", "--env", "CartPole-v1", "--num-actors", str(a.actors),
           "--envs-per-actor", "8", "--total-env-steps", str(10**13), "--logdir", str(logdir),
           "--checkpoint-interval-s", str(a.checkpoint_interval_s), "--heartbeat-timeout-s", "5",
           "--max-actor-restarts", "1000", "--report-interval-s", str(a.report_interval_s), "--publish-interval-s", "1",
           "--max-policy-lag", "1000", "--metrics-port", str(metrics_port),
           "--actor-max-env-steps-per-s", str(a.actor_max_env_steps_per_s)]  # fmt: skip
    with open(logdir / "train.log", "w") as log:
        learner = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
    line = learner.stdout.readline()
    if "--learner " not in line:
        learner.kill()
        raise SystemExit(f"soak: the learner did not start; see {logdir}/train.log")
    listen, weights = line.split("--learner ")[1].split(" --weights ")
    return learner, listen, weights.strip()


def chaos(a: argparse.Namespace, learner: subprocess.Popen, honest, logdir: Path) -> dict:
    """The run itself: every second the learner's RSS; from warm-up the honest subscriber counts; every
    --kill-every-s a local actor killed or frozen, in turn. {"rss": [(s, MiB)], "killed", "stopped", "counted_s"}."""
    proc = psutil.Process(learner.pid)
    got: dict = {"rss": [], "killed": 0, "stopped": 0, "counted_s": None}
    rnd = random.Random(0)
    t0 = time.monotonic()
    next_chaos, counting_from = t0 + a.warmup_s / 2, None
    try:
        while time.monotonic() - t0 < a.seconds:
            time.sleep(1.0)
            if learner.poll() is not None:
                raise SystemExit(f"soak: the learner exited early with {learner.returncode}; see {logdir}/train.log")
            now = time.monotonic() - t0
            got["rss"].append((now, proc.memory_info().rss / 2**20))
            if now >= a.warmup_s and counting_from is None:
                honest.counting.set()
                counting_from = now
            if time.monotonic() >= next_chaos:
                next_chaos += a.kill_every_s
                kids = procutil.actors_under(learner.pid)  # not the actors' zygote: chaos is an actor's crash or hang
                if kids:
                    how = "killed" if got["killed"] <= got["stopped"] else "stopped"
                    os.kill(rnd.choice(kids), signal.SIGKILL if how == "killed" else signal.SIGSTOP)
                    got[how] += 1
    finally:
        honest.counting.clear()
        if counting_from is not None:
            got["counted_s"] = time.monotonic() - t0 - counting_from
    return got


def stop_learner(learner: subprocess.Popen) -> int | str:
    learner.send_signal(signal.SIGTERM)
    try:
        return learner.wait(60)
    except subprocess.TimeoutExpired:
        learner.kill()
        return "timeout"


def main(argv=None) -> int:
    a = parse_args(argv)
    logdir = Path(tempfile.mkdtemp(prefix="soak-"))
    no_disk = mount_tmpfs(logdir, a.tmpfs_logdir_mib) if "full_disk" in a.attacks else "not among --attacks"
    metrics_port = attacks_health._free_port()
    learner, listen, weights = start_learner(a, logdir, metrics_port)
    baseline = unattacked_rate(logdir, a.baseline_s, learner)
    stop = threading.Event()
    sent, done, seen = [0], [], {}
    disk = None if no_disk else logdir
    threads = [
        threading.Thread(target=garbage_sender, args=(listen, weights, a.garbage_per_s, stop, sent), daemon=True),
        threading.Thread(
            target=attacker,
            args=(listen, weights, metrics_port, a.attack_every_s, a.attacks, stop, done, seen, disk),
            daemon=True,
        ),
    ]
    for t in threads:
        t.start()
    ctx = zmq.Context()
    honest = attacks.CopyCounter(ctx, weights)
    honest.start()
    try:
        run = chaos(a, learner, honest, logdir)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        honest.done.set()
        honest.join(5)
        code = stop_learner(learner)
        ctx.term()
    run.update(code=code, baseline=baseline, garbage_sent=sent[0], copies=honest.copies, no_disk=no_disk)
    result = summarize(a, logdir, run, done, seen)
    result["ok"] = verdict(a, result, seen)
    print(json.dumps(result) if a.json else json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


def summarize(a: argparse.Namespace, logdir: Path, run: dict, done: list, seen: dict) -> dict:
    """What the run's metrics, memory samples, checkpoints and attacks say, as the JSON the soak prints."""
    rows = read_metrics(logdir / "metrics.jsonl")
    attacked = [r for r in rows if r["wall_s"] >= rows[0]["wall_s"] + a.baseline_s] if rows else []
    honest_rate = (
        (attacked[-1]["trajectories_received"] - attacked[0]["trajectories_received"] - seen.get("accepted", 0))
        / max(1e-9, attacked[-1]["wall_s"] - attacked[0]["wall_s"])
        if len(attacked) >= 2
        else None
    )
    start, span = (attacked[0]["wall_s"], attacked[-1]["wall_s"] - attacked[0]["wall_s"]) if attacked else (0, 0)
    quarters = [[r for r in attacked if q <= 4 * (r["wall_s"] - start) / max(span, 1e-9) <= q + 1] for q in range(4)]
    found = checkpoint.load_latest(logdir, validate=checkpoint.validate_learner_state)
    rss = run["rss"]
    early = [m for t, m in rss if a.warmup_s <= t < a.warmup_s + a.rss_window_s]
    late = [m for t, m in rss if t >= a.seconds - a.rss_window_s]
    growth = statistics.median(late) - statistics.median(early) if early and late else None
    final = rows[-1] if rows else {}
    lags = [r["loop_lag_p99_ms"] for r in rows if r.get("loop_lag_p99_ms") is not None]
    no_disk = run["no_disk"]
    return {
        "seconds": a.seconds,
        "exit_code": run["code"],
        "learner_steps": final.get("learner_steps"),
        "env_steps": final.get("env_steps"),
        "episode_return_mean": final.get("episode_return_mean"),
        "progressed_in_every_quarter": all(
            len(q) >= 2 and q[-1]["learner_steps"] > q[0]["learner_steps"] for q in quarters
        ),  # fmt: skip
        "checkpoint_valid": found is not None,
        "checkpoint": str(found[1]) if found else None,
        "rss_mib_after_warmup": round(statistics.median(early), 1) if early else None,
        "rss_mib_last_window": round(statistics.median(late), 1) if late else None,
        "rss_growth_mib": round(growth, 1) if growth is not None else None,
        "rss_max_mib": round(max(m for _, m in rss), 1) if rss else None,
        "loop_lag_p99_ms_max": max(lags) if lags else None,
        "honest_copies_per_s": round(run["copies"] / run["counted_s"], 2) if run["counted_s"] else None,
        "honest_trajectories_per_s_unattacked": round(run["baseline"], 1),
        "honest_trajectories_per_s_attacked": round(honest_rate, 1) if honest_rate is not None else None,
        "issue15": {k: v for k, v in seen.items() if k not in ("accepted", "steps", "step_s")},
        "hostile_checkpoints": hostile_checkpoints(logdir),
        "garbage_sent": run["garbage_sent"],
        "attacks": {name: done.count(name) for name in sorted(set(done))},
        "attacks_not_run": [name for name in seen.get("steps", []) if name not in done],
        "attack_s_max": seen.get("step_s", {}),
        "messages_rejected": final.get("messages_rejected"),
        "rejected_by_reason": {k[len("rejected_") :]: v for k, v in final.items() if k.startswith("rejected_") and v},
        "connections_cut": {
            k[len("connections_cut_") :]: v for k, v in final.items() if k.startswith("connections_cut_") and v
        },
        "inputs_clipped": final.get("inputs_clipped"),
        "updates_skipped_nonfinite": final.get("updates_skipped_nonfinite"),
        "checkpoint_failures": final.get("checkpoint_failures"),
        "actors_killed": run["killed"],
        "actors_stopped": run["stopped"],
        "actor_restarts": final.get("actor_restarts"),
        "disk_fills": seen.get("disk_fills", 0) if not no_disk else f"skipped: {no_disk}",
        "logdir_mount": "" if no_disk else f"a tmpfs, left mounted to be read: umount {logdir}",
        "metrics_lines_not_parsing": _unparsed_lines(logdir / "metrics.jsonl"),
        "logdir": str(logdir),
    }


def verdict(a: argparse.Namespace, r: dict, seen: dict) -> bool:
    """Every check of the docstring on the summary; a step's own findings only where the soak ran that step."""
    ran = [k for step, k in STEP_FINDINGS.items() if step in a.attacks]
    honest_rate = r["honest_trajectories_per_s_attacked"]
    return bool(
        r["exit_code"] == 0
        and r["progressed_in_every_quarter"]
        and r["checkpoint_valid"]
        and r["rss_growth_mib"] is not None
        and r["rss_growth_mib"] < a.max_rss_growth_mib
        and r["honest_copies_per_s"] is not None
        and r["honest_copies_per_s"] <= a.max_copies_per_s
        and honest_rate is not None
        and honest_rate >= a.min_honest_fraction * r["honest_trajectories_per_s_unattacked"]
        and r["hostile_checkpoints"]["resumed_from_good"]
        and seen.get("steps")
        and not r["attacks_not_run"]  # every attack, each without an error
        and all(seen.get(k) for k in ran)  # each ran
        and all(ok == n for ok, n in seen.get("health_probes", []))
        and all(seen.get("credit_bypass_cut", []))
        and all(cut == n for cut, n in seen.get("idle_subscribers_cut", []))
        and r["metrics_lines_not_parsing"] == 0
        and (isinstance(r["disk_fills"], str) or r["disk_fills"] > 0)
    )


def _unparsed_lines(path: Path) -> int:
    """Lines of metrics.jsonl that do not parse (a full disk must leave none)."""
    bad = 0
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            json.loads(line)
        except json.JSONDecodeError:
            bad += 1
    return bad


if __name__ == "__main__":
    sys.exit(main())
