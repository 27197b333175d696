"""Starving the health signal (issue 15, class 1): idle TCP connections to a learner's metrics port, reopened as soon
as the server closes them, while ``/healthz`` is probed and ``impala-async healthcheck`` runs, as the Docker
HEALTHCHECK, Compose, the kubelet and the actor supervisor would.

Used by tests/test_health_attacks.py, and meant for tools/attack_figures.py and tools/soak.py: every function takes a
learner's metrics address and returns figures (plain dicts of numbers), and nothing here imports pytest or the package
(the healthcheck runs as a subprocess of the interpreter named), so the same attack measures an older checkout.

    python tests/attacks_health.py                                   # this checkout: a learner of its own, figures
    python tests/attacks_health.py --python /work/flaky/.venv/bin/python --cwd /work/flaky   # another checkout's
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from procutil import cli


class IdleHolder:
    """Holds ``count`` TCP connections to ``host:port`` that send nothing (or only ``prefix``, a request head that
    never ends), on a thread of its own, and reopens each as soon as the server closes it or answers it (an answer
    is followed by a close). ``source``: the local address to connect from (another 127.x.y.z on loopback)."""

    def __init__(self, host: str, port: int, count: int, *, prefix: bytes = b"", source: str = ""):
        self.host, self.port, self.count, self.prefix, self.source = host, port, count, prefix, source
        self.opened = 0  # connections made
        self.closed_by_server = 0  # of which the server closed (an answer, a timeout, an eviction)
        self.answered_503 = 0  # of which the server answered 503 before closing
        self.connect_failed = 0
        self._open: dict[socket.socket, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-holder", daemon=True)

    @property
    def open_now(self) -> int:
        return len(self._open)

    def start(self) -> IdleHolder:
        self._thread.start()
        return self

    def wait_open(self, timeout_s: float = 30.0) -> bool:
        """True once all ``count`` connections were open at the same time (False after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.open_now >= self.count:
                return True
            time.sleep(0.01)
        return False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _connect(self, sel: selectors.BaseSelector) -> None:
        try:
            s = socket.create_connection(
                (self.host, self.port), timeout=2.0, source_address=(self.source, 0) if self.source else None
            )
            if self.prefix:
                s.sendall(self.prefix)
        except OSError:
            self.connect_failed += 1
            time.sleep(0.01)
            return
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        self._open[s] = b""
        self.opened += 1

    def _readable(self, sel: selectors.BaseSelector, s: socket.socket) -> None:
        try:
            chunk = s.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self._open[s] = self._open[s] or chunk[:16]  # the start of the status line is all that is kept
            return
        if self._open.pop(s).startswith(b"HTTP/1.0 503"):
            self.answered_503 += 1
        self.closed_by_server += 1
        sel.unregister(s)
        s.close()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            while not self._stop.is_set():
                while len(self._open) < self.count and not self._stop.is_set():
                    self._connect(sel)
                for key, _ in sel.select(0.05):
                    self._readable(sel, key.fileobj)
        finally:
            for s in self._open:
                s.close()
            self._open.clear()
            sel.close()


def get(host: str, port: int, path: str = "/healthz", timeout_s: float = 5.0, headers=None) -> tuple[int, float]:
    """(status, seconds) of one GET; status 0 when no answer came (refused, reset, timed out)."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.monotonic() - t0
    except (OSError, http.client.HTTPException):
        return 0, time.monotonic() - t0
    finally:
        conn.close()


def probe_healthz(host: str, port: int, count: int, *, interval_s: float = 0.1, timeout_s: float = 5.0) -> dict:
    """``count`` GET /healthz one after another, ``interval_s`` apart: how many got 200, the statuses, latencies."""
    statuses, latencies = [], []
    for _ in range(count):
        status, took = get(host, port, "/healthz", timeout_s)
        statuses.append(status)
        latencies.append(took)
        time.sleep(interval_s)
    latencies.sort()
    return {
        "probes": count,
        "probes_200": statuses.count(200),
        "probe_statuses": dict(Counter(statuses)),
        "probe_ms_p50": round(1000 * latencies[len(latencies) // 2], 1),
        "probe_ms_max": round(1000 * latencies[-1], 1),
    }


def healthchecks(port: int, times: int, *, python: str = sys.executable, cwd: str | None = None) -> dict:
    """``impala-async healthcheck --metrics-port PORT`` run ``times`` times (as the Docker HEALTHCHECK runs it): exit
    codes (0: healthy)."""
    env = {k: v for k, v in os.environ.items() if k != "IMPALA_ASYNC_METRICS_HOST"}
    codes, failures = [], []
    for _ in range(times):
        out = subprocess.run(
            [python, "-m", "impala_async", "healthcheck", "--metrics-port", str(port)],
            env=env,
            cwd=cwd,
            capture_output=True,
            timeout=60,
        )
        codes.append(out.returncode)
        if out.returncode:
            failures.append((out.stdout + out.stderr).decode("utf-8", "replace").strip()[-200:])
    return {
        "healthchecks": times,
        "healthchecks_ok": codes.count(0),
        "healthcheck_exit_codes": codes,
        "healthcheck_failures": failures,
    }


def starve_health(
    host: str,
    port: int,
    *,
    idle_connections: int = 8,
    probes: int = 49,
    healthcheck_runs: int = 5,
    python: str = sys.executable,
    cwd: str | None = None,
    prefix: bytes = b"",
    source: str = "",
) -> dict:
    """The issue's attack: ``idle_connections`` idle connections to ``host:port``, reopened as they close; once all
    are open, ``probes`` GET /healthz and ``healthcheck_runs`` runs of ``impala-async healthcheck``. Figures: how
    many probes got 200 and healthchecks exited 0, and what the holder saw (opened, closed by the server)."""
    holder = IdleHolder(host, port, idle_connections, prefix=prefix, source=source).start()
    try:
        all_open = holder.wait_open(30.0)
        figures = {"idle_connections": idle_connections, "idle_all_open": all_open}
        figures |= probe_healthz(host, port, probes)
        figures |= healthchecks(port, healthcheck_runs, python=python, cwd=cwd)
    finally:
        holder.stop()
    figures |= {
        "idle_opened": holder.opened,
        "idle_closed_by_server": holder.closed_by_server,
        "idle_answered_503": holder.answered_503,
        "idle_connect_failed": holder.connect_failed,
    }
    return figures


def host_header(host: str, port: int) -> dict:
    """A DNS-rebinding page's request (its own domain as Host) and the learner's own forms: the status of each."""
    out = {}
    for name, value in (
        ("rebinding", f"attacker.example:{port}"),
        ("ip_literal", f"127.0.0.1:{port}"),
        ("localhost", f"localhost:{port}"),
    ):
        out[f"host_{name}_metrics"] = get(host, port, "/metrics", headers={"Host": value})[0]
    return out


def head_limit(host: str, port: int, limit_bytes: int = 8192) -> dict:
    """Request heads of ``limit_bytes`` and ``limit_bytes + 200`` bytes, each sent in one write: their statuses."""
    out = {}
    for name, size in (("at_limit", limit_bytes), ("over_limit", limit_bytes + 200)):
        start = b"GET /healthz HTTP/1.0\r\nX-Pad: "
        head = start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"
        assert len(head) == size
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(head)
            got = b""
            try:
                while chunk := s.recv(4096):
                    got += chunk
            except OSError:
                pass
        parts = got.split(b" ", 2)
        out[f"head_{name}_status"] = int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else 0
    return out


# --------------------------------------------------------------------------------------- a learner of its own
TRAIN_FLAGS = [
    "--env",
    "CartPole-v1",
    "--num-actors",
    "1",
    "--envs-per-actor",
    "4",
    "--unroll-length",
    "10",
    "--batch-size",
    "4",
    "--report-interval-s",
    "0.5",
    "--total-env-steps",
    "100000000",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_row(logdir: Path) -> dict:
    try:
        lines = (logdir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


def _updates_per_s(before: dict, after: dict) -> float | None:
    dt = after.get("wall_s", 0) - before.get("wall_s", 0)
    return round((after["learner_steps"] - before["learner_steps"]) / dt, 1) if dt > 0 else None


SLOW_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # a request head that never ends


def measure(python: str, cwd: str | None, idle_counts=(8, 200), slow_counts=(200,), extra_flags=()) -> dict:
    """Start ``python -m impala_async train --metrics-port P`` (in ``cwd``: that checkout's package), wait until it
    trains, then run :func:`starve_health` with each of ``idle_counts`` idle connections and each of ``slow_counts``
    connections that send a head that never ends (:data:`SLOW_HEAD`), :func:`host_header` and :func:`head_limit`;
    updates/s before and during each attack from its metrics.jsonl."""
    tmp = Path(tempfile.mkdtemp(prefix="attack-health-"))
    port, mport = _free_port(), _free_port()
    with socket.socket() as s:  # the weights port, listen + 1, must be free too: pick again until it is
        while True:
            try:
                s.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                port = _free_port()
    logdir = tmp / "run"
    argv = ["train", *TRAIN_FLAGS, "--listen", f"tcp://127.0.0.1:{port}"]
    argv += ["--metrics-port", str(mport), "--logdir", str(logdir), *extra_flags]
    proc = cli(*argv, log=tmp / "learner.log", python=python, cwd=cwd)
    try:
        deadline = time.monotonic() + 180
        while _last_row(logdir).get("learner_steps", 0) < 50:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the learner did not train: {(tmp / 'learner.log').read_text()[-3000:]}")
            time.sleep(0.2)
        time.sleep(3.0)
        out: dict = {"python": python, "cwd": cwd}
        row = _last_row(logdir)
        time.sleep(5.0)
        out["updates_per_s_unattacked"] = _updates_per_s(row, _last_row(logdir))
        attacks = [("idle", n, b"") for n in idle_counts] + [("slow", n, SLOW_HEAD) for n in slow_counts]
        for i, (kind, n, prefix) in enumerate(attacks):
            row = _last_row(logdir)
            figures = starve_health("127.0.0.1", mport, idle_connections=n, python=python, cwd=cwd, prefix=prefix)
            figures["updates_per_s_during"] = _updates_per_s(row, _last_row(logdir))
            out[f"{kind}_{n}" if idle_counts.count(n) <= 1 else f"{kind}_{n}_{i}"] = figures
        out |= host_header("127.0.0.1", mport) | head_limit("127.0.0.1", mport)
        out["learner_alive_after"] = proc.poll() is None
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable, help="interpreter of the checkout to measure")
    p.add_argument("--cwd", default=None, help="that checkout's directory (python -m impala_async takes it from there)")
    p.add_argument("--idle", default="8,200", help="idle connection counts, comma separated")
    p.add_argument("--slow", default="200", help="counts of connections sending an endless head, comma separated")
    args = p.parse_args()
    idle, slow = (tuple(int(n) for n in arg.split(",") if n) for arg in (args.idle, args.slow))
    print(json.dumps(measure(args.python, args.cwd, idle, slow), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
