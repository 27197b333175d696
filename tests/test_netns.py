"""Actor machines, as a new user sets them up (README, More machines and Security), each a network namespace of its own
on one bridge (tests/netns.py): a learner host bound to its own address with CURVE on, and two actor hosts with a key
each. The real CLI runs in each namespace (``ip netns exec NS impala-async ...``). Proven, with the learner's own
per-key count (``trajectories_by_key`` in metrics.jsonl, ``impala_async_trajectories_by_key_total`` in /metrics):

1. both actor hosts attach by the learner's address and contribute trajectories, counted under their own key;
2. a host whose cable is pulled at the switch for 20 s stops contributing while it is out, comes back by itself
   once the link is back (the same process) and carries on, while the other host keeps contributing throughout;
3. both carry on across a learner restart with ``--resume`` (SIGTERM, exit 0, final checkpoint, the same address
   and keys from the checkpoint), under the new incarnation, with the same actor processes.

The figures the test saw are printed (``pytest -s``) and written to ``figures.json`` in the test's tmp dir.
Skipped, with the reason, where namespaces cannot be made (not root, no ``ip``, an unprivileged container).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from netns import Network, Unavailable, remove_stale, unavailable
from procutil import CAPPED_ACTOR, CARTPOLE_LEARNER, tail

from impala_async.learner import checkpoint

HOSTS = {"learner": "10.77.0.1", "host-a": "10.77.0.2", "host-b": "10.77.0.3"}
ACTOR_HOSTS = ("host-a", "host-b")
PORT = 5555  # each namespace has ports of its own: no collision with other tests or runs
LISTEN = f"tcp://{HOSTS['learner']}:{PORT}"
WEIGHTS = f"tcp://{HOSTS['learner']}:{PORT + 1}"  # what --publish defaults to: the listen port + 1
METRICS_PORT = 9481  # on the learner namespace's loopback
OUTAGE_S = 20.0  # how long host-a's link stays down
SETTLE_S = 2.0  # after the link goes down, what was already on its way may still be counted
MIN_TRAJECTORIES = 20  # "contributes": at least this many accepted trajectories (200 env steps) in a phase
LEARNER_FLAGS = CARTPOLE_LEARNER
ACTOR_FLAGS = ["--num-actors", "1", "--envs-per-actor", "2", *CAPPED_ACTOR]  # not flat out: the test is the link
_CLI = Path(sys.executable).with_name("impala-async")
CLI = [str(_CLI)] if _CLI.exists() else [sys.executable, "-m", "impala_async"]
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child


def _die_with_test() -> None:
    """In the child before exec: SIGKILL when the test process dies, so that nothing outlives a killed pytest (the
    process then runs in a namespace nobody deletes; `ip netns exec` execs, so the setting reaches the CLI)."""
    _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Lab:
    """The network and the CLI processes started in it; ``close`` stops them all and deletes the namespaces."""

    def __init__(self, net: Network, root: Path):
        self.net, self.root = net, root
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, host: str, *args, log: str) -> subprocess.Popen:
        path = self.root / log
        with open(path, "w") as out:
            proc = subprocess.Popen(
                self.net.argv(host, *CLI, *map(str, args)),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                preexec_fn=_die_with_test,
            )
        self.procs.append((proc, path))
        return proc

    def logs(self, n: int = 25) -> str:
        return "\n".join(f"--- {path.name} (exit {proc.poll()})\n{tail(path, n)}" for proc, path in self.procs)

    def close(self) -> list[str]:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return self.net.destroy()  # kills anything left in the namespaces, then deletes them


@pytest.fixture
def lab(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    remove_stale()  # namespaces of an earlier run that was killed
    try:
        net = Network(HOSTS).create()
    except Unavailable as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    lab = Lab(net, tmp_path)
    try:
        yield lab
    finally:
        left = lab.close()
        names = set(net.ns.values()) | {net.switch}
        listed = {
            line.split()[0]
            for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
            if line.strip()
        }
        assert not left and not names & listed, f"namespaces left behind: {sorted(names & listed)}"


def keygen(directory: Path, name: str) -> None:
    out = subprocess.run([*CLI, "keygen", str(directory), "--name", name], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def make_keys(root: Path) -> dict[str, Path]:
    """README, Security, Keys: the learner's pair, one pair per actor host, each actor's public key in the learner's
    allowed/ under the host's name, the learner's public key on each actor host."""
    dirs = {h: root / h for h in ("learner", *ACTOR_HOSTS)}
    keygen(dirs["learner"], "learner")
    (dirs["learner"] / "allowed").mkdir(mode=0o700)
    for host in ACTOR_HOSTS:
        keygen(dirs[host], "actor")
        shutil.copy(dirs[host] / "actor.key", dirs["learner"] / "allowed" / f"{host}.key")
        shutil.copy(dirs["learner"] / "learner.key", dirs[host] / "learner.key")
    return dirs


class Metrics:
    """The newest record of LOGDIR/metrics.jsonl that satisfies a condition, read from the file's end (it grows by 4
    records a second; reading it whole at every poll would cost the 2 cores more than the run)."""

    def __init__(self, logdir: Path):
        self.path = logdir / "metrics.jsonl"

    def last(self, where=lambda r: True) -> dict | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - (128 << 10)))
                lines = f.read().splitlines()
        except FileNotFoundError:
            return None
        for line in reversed(lines[1:] if len(lines) > 1 else lines):  # the first may be cut
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line still being written
            if where(record):
                return record
        return None


def by_key(record: dict | None) -> dict[str, int]:
    return dict(record["trajectories_by_key"]) if record else {}


def scrape_by_key(net: Network) -> dict[str, float]:
    """impala_async_trajectories_by_key_total by key, from the learner's /metrics (on its namespace's loopback)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = net.call_in(
        "learner", lambda: urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).read().decode()
    )
    return {
        s.labels["key"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "impala_async_trajectories_by_key_total"
    }


def listening_line(log: Path) -> str:
    return next((line for line in log.read_text().splitlines() if "listening: --learner" in line), "")


@pytest.mark.process
def test_actor_hosts_through_a_link_outage_and_a_learner_restart(lab, tmp_path):
    figures: dict = {"outage_s": OUTAGE_S, "report_interval_s": 0.25, "hosts": HOSTS}
    t0 = time.monotonic()
    logdir = tmp_path / "run"
    metrics = Metrics(logdir)
    procs: dict[str, subprocess.Popen] = {}

    def alive() -> None:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode})\n{lab.logs()}")

    def wait_until(cond, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            alive()
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{lab.logs()}")

    def check_counts(record: dict) -> None:
        """Every allowed key, and no other, in the map; together they are every accepted trajectory."""
        counts = by_key(record)
        assert set(counts) == set(ACTOR_HOSTS), counts
        assert sum(counts.values()) == record["trajectories_received"], record

    try:
        keys = make_keys(tmp_path / "keys")
        procs["learner"] = lab.start(
            "learner",
            "learner",
            *LEARNER_FLAGS,
            "--listen",
            LISTEN,
            "--curve-keys",
            keys["learner"],
            "--logdir",
            logdir,
            "--metrics-port",
            METRICS_PORT,
            log="learner.log",
        )
        for i, host in enumerate(ACTOR_HOSTS):
            procs[host] = lab.start(
                host,
                "actor",
                "--learner",
                LISTEN,
                "--curve-keys",
                keys[host],
                "--seed",
                i,
                *ACTOR_FLAGS,
                log=f"actor-{host}.log",
            )
        pids = {host: procs[host].pid for host in ACTOR_HOSTS}
        for pid in pids.values():  # the process is the actor itself (ip netns exec execs)
            assert "actor" in psutil.Process(pid).cmdline(), psutil.Process(pid).cmdline()

        # --- 1. both hosts attach by the learner's address and contribute, each under its own key -------------------
        llog = tmp_path / "learner.log"
        line = wait_until(lambda: listening_line(llog), 90, "the learner to listen")
        assert f"--learner {LISTEN} --weights {WEIGHTS}" in line, line  # bound to its address; weights on port + 1
        assert "CURVE on: 2 allowed actor key(s)" in llog.read_text()
        figures["learner_listening_after_s"] = round(time.monotonic() - t0, 2)
        first_seen: dict[str, float] = {}

        def both_contribute():
            r = metrics.last()
            for host, n in by_key(r).items():
                if n > 0 and host not in first_seen:
                    first_seen[host] = round(time.monotonic() - t0, 2)
            counts = by_key(r)
            return r if counts and min(counts.values()) >= MIN_TRAJECTORIES and r["learner_steps"] > 0 else None

        attached = wait_until(both_contribute, 90, f"both keys to count {MIN_TRAJECTORIES} trajectories")
        check_counts(attached)
        assert attached["messages_rejected"] == 0, attached
        figures["first_trajectory_after_s"] = first_seen
        figures["attached"] = by_key(attached)
        conns = lab.net.established("learner")
        peers = {
            port: sorted({peer.rpartition(":")[0] for local, peer in conns if local.endswith(f":{port}")})
            for port in (PORT, PORT + 1)
        }
        figures["learner_tcp_peers"] = peers
        for port in (PORT, PORT + 1):  # both sockets of both actor hosts, through the bridge
            assert peers[port] == sorted(HOSTS[h] for h in ACTOR_HOSTS), (port, conns)

        # --- 2. host-a's cable pulled at the switch for OUTAGE_S ----------------------------------------------------
        before = metrics.last()
        lab.net.set_link("host-a", up=False)
        t_down = time.monotonic()
        samples = []  # (seconds since the link went down, record)
        while time.monotonic() - t_down < OUTAGE_S:  # the outage itself: the only fixed wait, sampled throughout
            alive()
            samples.append((time.monotonic() - t_down, metrics.last()))
            time.sleep(0.25)
        tcp = {
            "learner": {k: v for k, v in lab.net.tcp_info("learner").items() if f" {HOSTS['host-a']}:" in k},
            "host-a": lab.net.tcp_info("host-a"),
        }  # retransmission backoff of both ends, just before link up
        lab.net.set_link("host-a", up=True)
        t_up = time.monotonic()
        down = samples[-1][1]
        settled = next(r for t, r in samples if t >= SETTLE_S)
        late = next(r for t, r in samples if t >= (SETTLE_S + OUTAGE_S) / 2)
        for _, r in samples:
            check_counts(r)
        figures["outage"] = {
            "before": by_key(before),
            "settled": by_key(settled),
            "end": by_key(down),
            "series_t_a_b": [(round(t, 1), by_key(r)["host-a"], by_key(r)["host-b"]) for t, r in samples[::4]],
            "learner_connections_trajectories": sorted({r["connections_trajectories"] for _, r in samples}),
            "learner_connections_weights": sorted({r["connections_weights"] for _, r in samples}),
            "learner_subscriptions": [before["subscriptions"], down["subscriptions"]],
            "dropped_stale": [before["dropped_stale"], down["dropped_stale"]],
            "tcp_just_before_link_up": tcp,
        }
        assert by_key(down)["host-a"] == by_key(settled)["host-a"], "host-a's count rose while its link was down"
        for a, b in ((settled, late), (late, down)):  # the other host kept contributing all through
            assert by_key(b)["host-b"] >= by_key(a)["host-b"] + MIN_TRAJECTORIES, figures["outage"]
        assert down["learner_steps"] > settled["learner_steps"]

        stuck_at, stale_at = by_key(down)["host-a"], down["dropped_stale"]
        flowing: list[float] = []  # when host-a's bytes reached the learner again (what it had queued is stale)

        def host_a_counts():
            r = metrics.last()
            if not flowing and (r["dropped_stale"] > stale_at or by_key(r)["host-a"] > stuck_at):
                flowing.append(time.monotonic() - t_up)
            return r if by_key(r)["host-a"] > stuck_at else None

        back = wait_until(host_a_counts, 60, "host-a to contribute again after its link came back")
        resumed_s = time.monotonic() - t_up
        carrying_on = wait_until(
            lambda: (r := metrics.last()) and by_key(r)["host-a"] >= stuck_at + MIN_TRAJECTORIES and r,
            30,
            f"host-a to contribute {MIN_TRAJECTORIES} more",
        )
        check_counts(carrying_on)
        cuts = {k: v for k, v in carrying_on.items() if k.startswith("connections_cut_") and v}
        figures["after_outage"] = {
            "learner_receives_again_after_link_up_s": round(flowing[0], 2),
            "first_count_after_link_up_s": round(resumed_s, 2),
            f"{MIN_TRAJECTORIES}_more_after_link_up_s": round(time.monotonic() - t_up, 2),
            "first": by_key(back),
            "later": by_key(carrying_on),
            "learner_subscriptions": carrying_on["subscriptions"],
            "dropped_stale": carrying_on["dropped_stale"],
            "connections_cut": cuts,
        }
        assert procs["host-a"].poll() is None and procs["host-a"].pid == pids["host-a"]
        for host in ACTOR_HOSTS:  # one start each: never restarted
            assert (tmp_path / f"actor-{host}.log").read_text().count("actor 0 (") == 1

        # --- 3. learner restart with --resume -----------------------------------------------------------------------
        old = metrics.last()
        incarnation = old["incarnation"]
        t_term = time.monotonic()
        learner = procs.pop("learner")
        learner.send_signal(signal.SIGTERM)
        code = learner.wait(30)
        figures["learner_shutdown_s"] = round(time.monotonic() - t_term, 2)
        assert code == 0, lab.logs()
        assert "final checkpoint:" in llog.read_text(), tail(llog)
        final = metrics.last(lambda r: r["incarnation"] == incarnation)
        ckpts = checkpoint.list_checkpoints(logdir)
        assert ckpts and ckpts[-1].name == f"checkpoint-{final['env_steps_trained']:012d}.pt", (ckpts, final)
        figures["at_learner_exit"] = by_key(final)
        for host in ACTOR_HOSTS:
            assert procs[host].poll() is None, f"{host} exited with the learner\n{lab.logs()}"

        t_restart = time.monotonic()
        procs["learner"] = lab.start(  # the address and keys typed again: a checkpoint cannot set them (issue 27)
            "learner",
            "learner",
            "--resume",
            logdir,
            "--listen",
            LISTEN,
            "--curve-keys",
            keys["learner"],
            "--metrics-port",
            METRICS_PORT,
            log="learner2.log",
        )
        llog2 = tmp_path / "learner2.log"
        line = wait_until(lambda: listening_line(llog2), 90, "the resumed learner to listen")
        t_listen = time.monotonic()
        assert f"--learner {LISTEN} --weights {WEIGHTS}" in line, line  # the same address
        assert "CURVE on: 2 allowed actor key(s)" in llog2.read_text()
        new_seen: dict[str, float] = {}

        def both_again():
            r = metrics.last(lambda r: r["incarnation"] != incarnation)
            for host, n in by_key(r).items():
                if n > 0 and host not in new_seen:
                    new_seen[host] = round(time.monotonic() - t_listen, 2)
            counts = by_key(r)
            return r if counts and min(counts.values()) >= MIN_TRAJECTORIES else None

        again = wait_until(both_again, 60, "both keys to count trajectories under the new learner")
        check_counts(again)
        assert again["learner_steps"] > final["learner_steps"], (again["learner_steps"], final["learner_steps"])
        assert again["messages_rejected"] == 0, again
        figures["restart"] = {
            "learner_start_to_listening_s": round(t_listen - t_restart, 2),
            "first_count_after_listening_s": new_seen,
            f"{MIN_TRAJECTORIES}_each_after_sigterm_s": round(time.monotonic() - t_term, 2),
            f"{MIN_TRAJECTORIES}_each_after_listening_s": round(time.monotonic() - t_listen, 2),
            "counts": by_key(again),
            "dropped_incarnation": again["dropped_incarnation"],
            "learner_steps": [final["learner_steps"], again["learner_steps"]],
        }
        for host in ACTOR_HOSTS:
            assert procs[host].poll() is None and procs[host].pid == pids[host]
            text = (tmp_path / f"actor-{host}.log").read_text()
            assert text.count("actor 0 (") == 1 and "the learner restarted (new incarnation)" in text, tail(
                tmp_path / f"actor-{host}.log"
            )

        scraped = scrape_by_key(lab.net)  # the same counts in Prometheus, at least what the record said
        figures["prometheus_by_key"] = scraped
        assert set(scraped) == set(ACTOR_HOSTS), scraped
        assert all(scraped[h] >= by_key(again)[h] for h in ACTOR_HOSTS), (scraped, by_key(again))

        # --- the end: SIGTERM, and every process exits 0 ------------------------------------------------------------
        stopping = dict(procs)
        procs.clear()
        for proc in stopping.values():
            proc.send_signal(signal.SIGTERM)
        codes = {name: proc.wait(30) for name, proc in stopping.items()}
        assert codes == dict.fromkeys(stopping, 0), (codes, lab.logs())
        figures["total_s"] = round(time.monotonic() - t0, 1)
    finally:
        figures.setdefault("total_s", round(time.monotonic() - t0, 1))
        with contextlib.suppress(OSError):
            (tmp_path / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
        print(f"\nnetns figures ({tmp_path / 'figures.json'}):")
        for name, value in figures.items():
            print(f"  {name}: {json.dumps(value)}")
