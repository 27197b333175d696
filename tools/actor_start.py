#!/usr/bin/env python3
"""How soon a supervised actor is alive: from its start to its first heartbeat, forked by the supervisor's zygote
(``--actor-start fork``, the default) against a fresh interpreter (``--actor-start spawn``), alternating.

The supervisor here is this process, as train's learner or ``impala-async actor --num-actors N`` is one: it forks
the zygote first (impala_async/actors/zygote.py), lets it import what an actor imports (one start, not timed), then
starts one actor at a time both ways. The actors attach to an address where no learner listens and beat while they
wait for weights; each is stopped after its first beat. This is the time an actor's start or restart costs before it
can act (its environments come next and cost the same either way).

    python tools/actor_start.py --repeats 5 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from impala_async.actors.procs import ActorProcesses, actor_argv  # noqa: E402
from impala_async.actors.zygote import Zygote  # noqa: E402
from impala_async.config import ActorOptions  # noqa: E402

NOWHERE = ("tcp://127.0.0.1:9", "tcp://127.0.0.1:10")  # the discard port: no learner there


def first_beat_s(zygote: Zygote | None, timeout_s: float) -> float:
    """Seconds from one actor's start to its first heartbeat."""
    options = ActorOptions(envs_per_actor=1, max_wait_for_weights_s=timeout_s)
    procs = ActorProcesses(
        lambda i, fd, parent: actor_argv(*NOWHERE, i, fd, parent, seed=0, options=options), 1, zygote=zygote
    )
    t0 = time.monotonic()
    procs.start()
    try:
        while not procs.heartbeating():
            if time.monotonic() - t0 > timeout_s:
                raise SystemExit(f"actor_start: no heartbeat within {timeout_s:g} s")
            procs.check()
            time.sleep(0.002)
        return time.monotonic() - t0
    finally:
        procs.stop(5.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="starts each way, alternating (default: 5)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="give up on an actor silent this long")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = p.parse_args()
    zygote = Zygote.fork()
    if zygote is None:
        raise SystemExit("actor_start: this process runs threads: no zygote")
    try:
        first_beat_s(zygote, a.timeout_s)  # the zygote's own imports, once
        times: dict[str, list[float]] = {"fork": [], "spawn": []}
        for _ in range(a.repeats):
            times["fork"].append(first_beat_s(zygote, a.timeout_s))
            times["spawn"].append(first_beat_s(None, a.timeout_s))
    finally:
        zygote.close()
    result = {
        mode: {"median_s": round(statistics.median(xs), 4), "runs_s": [round(x, 4) for x in xs]}
        for mode, xs in times.items()
    }
    if a.json:
        print(json.dumps(result))
    else:
        for mode, r in result.items():
            print(f"{mode}: first heartbeat after {r['median_s']:.3f} s (median of {len(r['runs_s'])}: {r['runs_s']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
