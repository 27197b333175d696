"""Defaults that come from the machine and the environment rather than from the run: usable CPUs and memory, and where
the metrics port is served (so that a container image can turn it on for every command it runs; a flag still wins)."""

from __future__ import annotations

import math
import os

METRICS_PORT_ENV, METRICS_HOST_ENV = "IMPALA_ASYNC_METRICS_PORT", "IMPALA_ASYNC_METRICS_HOST"


def usable_cpus(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (``docker run --cpus 4`` on a
    64-core host gives 4, where ``os.cpu_count()`` says 64 and one actor per core would oversubscribe 16x)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cgroup_cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota readable: the affinity mask is the answer
    return n


def usable_memory_bytes(cgroup_memory_max: str = "/sys/fs/cgroup/memory.max") -> int:
    """Memory this process may use: the machine's physical memory, capped by a cgroup v2 limit (``docker run -m``)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open(cgroup_memory_max) as f:
            limit = f.read().strip()
        if limit != "max":
            total = min(total, int(limit))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit readable: the physical memory is the answer
    return total


def env_metrics_port() -> int:
    """The default metrics port: IMPALA_ASYNC_METRICS_PORT, else 0 (off); -1 if that variable is not a number (the
    config check then names it)."""
    raw = os.environ.get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        return -1


def env_metrics_host() -> str:
    return os.environ.get(METRICS_HOST_ENV, "").strip() or "127.0.0.1"


def metrics_address_problem(port: int, host: str) -> str | None:
    """Why ``port``/``host`` cannot be served (None if they can), naming the environment variable they came from."""
    if not 0 <= port <= 65535:
        raw = os.environ.get(METRICS_PORT_ENV)
        source = f" (from {METRICS_PORT_ENV}={raw!r})" if raw else ""
        return f"metrics_port must be 0 (off) or a TCP port 1-65535, got {port}{source}"
    if port and not host:
        return "metrics_host must be an address to bind, e.g. 127.0.0.1"
    return None
