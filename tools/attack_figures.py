#!/usr/bin/env python3
"""What each attack of tests/attacks.py costs a real, training learner: time, memory, copies sent, training.

Starts `impala-async learner` (CartPole, loopback, no CURVE, default limits) with one real actor, then runs each
attack in turn and prints one JSON object of figures. Uses only flags the learner has had from the start, so it also
measures an older checkout: run it from that checkout's directory (`python -m impala_async` takes the package from
the working directory) with this file and tests/attacks.py copied in.

    python tools/attack_figures.py                 # about 3 minutes

Issue 15's attacks (tests/attacks_control.py, attacks_health.py, attacks_outbound.py, attacks_checkpoints.py,
attacks_ranks.py) start the learner of any checkout themselves: run them from this checkout, naming the one to measure
(``python -m impala_async`` takes the package from the directory it runs in), one JSON object per attack:

    python tools/attack_figures.py --issue15                           # this checkout, about 15 minutes
    python tools/attack_figures.py --issue15 --checkout /tmp/before    # e.g. git archive d6c3855 unpacked there
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import attacks  # noqa: E402
from procutil import cli, free_port_pair, read_metrics, stop  # noqa: E402

MIB = 1 << 20
FLAGS = [
    "--env",
    "CartPole-v1",
    "--unroll-length",
    "10",
    "--batch-size",
    "4",
    "--report-interval-s",
    "0.25",
    "--total-env-steps",
    "100000000",
    "--publish-interval-s",
    "1",
    "--max-policy-lag",
    "1000",
]


class Run:
    def __init__(self, tmp: Path, *extra, preexec_fn=None):
        self.port = free_port_pair()
        self.listen, self.weights = f"tcp://127.0.0.1:{self.port}", f"tcp://127.0.0.1:{self.port + 1}"
        self.logdir, self.log = tmp / f"run-{self.port}", tmp / f"learner-{self.port}.log"
        self.proc = cli(
            "learner",
            *FLAGS,
            "--listen",
            self.listen,
            "--logdir",
            str(self.logdir),
            *extra,
            log=self.log,
            preexec_fn=preexec_fn,
        )
        self.actor = cli("actor", "--learner", self.listen, "--envs-per-actor", "2")
        self.wait(lambda r: r.get("learner_steps", 0) > 0, 120)

    def last(self) -> dict:
        rows = read_metrics(self.logdir)
        return rows[-1] if rows else {}

    def wait(self, cond, timeout_s: float = 30.0) -> dict | None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.proc.poll() is None:
            row = self.last()
            if row and cond(row):
                return row
            time.sleep(0.1)
        return None

    def trains(self, timeout_s: float = 20.0) -> bool:
        before = self.last()
        return (
            self.wait(
                lambda r: (
                    r["learner_steps"] > before.get("learner_steps", 0) + 2
                    and r["trajectories_received"] > before.get("trajectories_received", 0)
                ),
                timeout_s,
            )
            is not None
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        stop(self.actor)
        stop(self.proc)


def push(ctx, endpoint):
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def tree(run: Run, ctx) -> dict:
    s, stall, log0 = push(ctx, run.listen), [], run.log.stat().st_size
    with attacks.PeakRss(run.proc.pid) as rss:
        for key in ("v", "actor", "episodes", "fields"):
            before = run.last().get("messages_rejected", 0)
            t0 = time.monotonic()
            s.send(attacks.tree_message(key, 15 * MIB))
            run.wait(lambda r, b=before: r["messages_rejected"] > b, 120)
            stall.append(round(time.monotonic() - t0, 2))
    s.close(linger=5000)  # what is queued is delivered
    lags = [r["loop_lag_p99_ms"] for r in read_metrics(run.logdir)[-40:] if r.get("loop_lag_p99_ms") is not None]
    return {
        "messages": 4,
        "bytes_each": 15 * MIB,
        "seconds_to_reject": stall,
        "rss_growth_mib": round(rss.grown_mib),
        "log_bytes_written": run.log.stat().st_size - log0,
        "loop_lag_p99_ms_max": max(lags, default=None),
        "training_went_on": run.trains(),
    }


def multipart(run: Run, ctx) -> dict:
    sent = [0, 0]

    def attack(i):
        sent[i] = attacks.unfinished_multipart("127.0.0.1", run.port, 1 << 30)

    with attacks.PeakRss(run.proc.pid) as rss:
        threads = [threading.Thread(target=attack, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        time.sleep(2.0)
    after = attacks.PeakRss(run.proc.pid)
    return {
        "connections": 2,
        "offered_mib_each": 1024,
        "sent_mib": [round(x / MIB) for x in sent],
        "rss_peak_growth_mib": round(rss.grown_mib),
        "rss_after_mib_vs_before": round((after.base - rss.base) / MIB),
        "training_went_on": run.trains(),
    }


def oversized(run: Run, ctx) -> dict:
    with attacks.PeakRss(run.proc.pid) as rss:
        sent = attacks.oversized_frame("127.0.0.1", run.port + 1, 2 << 30, 512 * MIB)
    return {
        "claimed_bytes": 2 << 30,
        "offered_mib": 512,
        "accepted_mib": round(sent / MIB),
        "rss_growth_mib": round(rss.grown_mib),
    }


def subscriptions(run: Run, ctx) -> dict:
    with attacks.PeakRss(run.proc.pid) as rss:
        sent = attacks.subscription_flood("127.0.0.1", run.port + 1, 400_000)
        time.sleep(3.0)
    return {
        "topics_offered": 400_000,
        "topics_sent": sent,
        "rss_growth_mib": round(rss.grown_mib),
        "training_went_on": run.trains(),
    }


def amplification(run: Run, ctx) -> dict:
    honest = attacks.CopyCounter(ctx, run.weights)
    honest.start()
    time.sleep(1.0)
    honest.counting.set()
    t0 = time.monotonic()
    made = attacks.resubscribe_flood(ctx, run.weights, 50, 20.0)
    honest.counting.clear()
    elapsed = time.monotonic() - t0
    honest.done.set()
    honest.join(5)
    return {
        "subscriptions_per_s": 50,
        "seconds": round(elapsed, 1),
        "subscriptions": made,
        "honest_copies": honest.copies,
        "copies_per_s": round(honest.copies / elapsed, 2),
        "honest_mb_received": round(honest.bytes / 1e6, 1),
        "training_went_on": run.trains(),
    }


def poison(run: Run, ctx) -> dict:
    view = attacks.LearnerView(ctx, run.weights).refresh()
    s = push(ctx, run.listen)
    for i in range(20):
        s.send(attacks.poisoned(view, actor="poisoner", seq=i))
    s.close(linger=5000)  # what is queued is delivered
    time.sleep(3.0)
    finite = all(view.refresh().weights_finite() for _ in range(3))
    row = run.last()
    view.close()
    return {
        "trajectories": 20,
        "published_weights_finite": finite,
        "actor_messages_rejected_nonfinite": row.get("rejected_nonfinite"),
        "training_went_on": run.trains(),
    }


def rejected_whole(run: Run, ctx) -> dict:
    view = attacks.LearnerView(ctx, run.weights).refresh()
    s = push(ctx, run.listen)
    before = run.last()
    s.send(
        attacks.message(
            view, actor="retrier", seq=5, episodes=[(1e9, 10)], edit=lambda a: a["reward"].__setitem__((0, 0), np.nan)
        )
    )
    time.sleep(1.0)
    s.send(attacks.message(view.refresh(), actor="retrier", seq=5, episodes=[(3.0, 10)]))
    for i in range(200):
        s.send(attacks.message(view, actor="clock", seq=i, sent_at_ns=0))
    time.sleep(2.0)
    rows = [r for r in read_metrics(run.logdir) if r["wall_s"] >= before["wall_s"]]
    s.close(linger=5000)  # what is queued is delivered
    view.close()
    return {
        "return_mean_max_after": max((r["episode_return_mean"] or 0) for r in rows),
        "retry_rejected_as_replay": rows[-1]["rejected_replay"] > before["rejected_replay"],
        "latency_p99_ms_max_after": max((r["latency_p99_ms"] or 0) for r in rows),
    }


def descriptors(tmp: Path, ctx) -> dict:
    run = Run(
        tmp, "--checkpoint-interval-s", "1", preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    )
    try:
        started = time.time()
        held = attacks.connection_flood("127.0.0.1", run.port, 1200)
        held += attacks.connection_flood("127.0.0.1", run.port + 1, 300)
        time.sleep(5.0)
        went_on = run.alive() and run.trains()
        ckpts = [p for p in run.logdir.glob("checkpoint-*.pt") if p.stat().st_mtime > started + 1]
        for s in held:
            s.close()
        return {
            "fd_limit": 1024,
            "connections_opened": len(held),
            "learner_alive": run.alive(),
            "training_went_on": went_on,
            "checkpoints_during_attack": len(ckpts),
            "exit": None if run.alive() else run.proc.returncode,
        }
    finally:
        run.close()


def issue15(checkout: str | None, only: list[str]) -> int:
    """Every issue-15 attack against a fresh learner of ``checkout`` (None: this one); one JSON line each."""
    import attacks_checkpoints
    import attacks_control
    import attacks_health
    import attacks_outbound
    import attacks_ranks

    tmp = Path(tempfile.mkdtemp(prefix="attack-figures-15-"))
    python, cwd = sys.executable, checkout
    runs = {
        f"2-8:{k}": lambda k=k: attacks_control.run_attack(k, python=python, cwd=cwd) for k in attacks_control.KINDS
    }
    runs["1:health"] = lambda: attacks_health.measure(python, cwd)
    runs.update(
        {f"3-4:{k}": lambda k=k: attacks_outbound.run_attack(k, python=python, cwd=cwd) for k in ("idle", "credit")}
    )
    runs["5:checkpoints"] = lambda: attacks_checkpoints.all_figures(tmp / "checkpoints", pythonpath=checkout or "")
    runs.update({f"6:{k}": lambda k=k: attacks_ranks.run_attack(k, python=python, cwd=cwd) for k in ("stop", "beat")})
    for name, run in runs.items():
        if only and not any(name.endswith(o) or name.startswith(o) for o in only):
            continue
        t0 = time.monotonic()
        try:
            got = run()
        except Exception as e:  # a checkout that lacks what an attack needs: say so, go on
            got = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        print(
            json.dumps(
                {"attack": name, "checkout": checkout or "this", "s": round(time.monotonic() - t0), "figures": got}
            ),
            flush=True,
        )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--issue15", action="store_true", help="issue 15's attacks instead (see above)")
    p.add_argument("--checkout", default=None, help="--issue15: the checkout to measure (default: this one)")
    p.add_argument("--only", nargs="*", default=[], help="--issue15: attacks whose name starts or ends so")
    args = p.parse_args()
    if args.issue15:
        return issue15(args.checkout, args.only)
    return classic()


def classic() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="attack-figures-"))
    ctx = zmq.Context()
    out = {
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    }
    run = Run(tmp)
    try:
        # The attacks that measure memory first: freed but retained memory would absorb later growth.
        for name, attack in (
            ("subscriptions", subscriptions),
            ("oversized_weights_frame", oversized),
            ("tree", tree),
            ("multipart", multipart),
            ("amplification", amplification),
            ("poison", poison),
            ("rejected_whole", rejected_whole),
        ):
            if not run.alive():
                out[name] = {"skipped": f"the learner exited with {run.proc.returncode}"}
                continue
            t0 = time.monotonic()
            out[name] = attack(run, ctx)
            out[name]["attack_s"] = round(time.monotonic() - t0, 1)
            print(name, json.dumps(out[name]), file=sys.stderr, flush=True)
    finally:
        run.close()
    out["descriptors"] = descriptors(tmp, ctx)
    ctx.destroy(linger=0)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
