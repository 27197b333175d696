"""Machines for tests, made of Linux network namespaces: one namespace per host, each with one interface (``eth0``,
an address of its own in a private /24) joined by a veth pair to a bridge in a namespace of its own (the switch), so
that hosts talk only through the bridge and a host's cable can be pulled (``set_link``) at the switch.

Needs root and iproute2's ``ip`` (Debian: ``apt-get install iproute2``); :func:`unavailable` says why not, for a skip.
Every name carries this process's pid and a random tag, so parallel or leftover runs do not collide; interface names
are per namespace. Deleting the namespaces (:meth:`Network.destroy`) deletes the veths and the bridge with them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time

CLONE_NEWNET = 0x40000000
IFACE = "eth0"  # each host's interface (in its own namespace)
BRIDGE = "br0"  # in the switch's namespace
PREFIX = "ia"  # every namespace made here is named PREFIX<pid>x<tag>-<host>
_OURS = re.compile(rf"{PREFIX}(\d+)x[0-9a-f]{{4}}-\S+")


class Unavailable(Exception):
    """Namespaces, veths or a bridge cannot be made here (the reason is the message)."""


def ip(*args: str, timeout_s: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s)


def unavailable() -> str | None:
    """Why no namespaces can be made here, or None if they might be (Network.create still may fail)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2; on Debian: apt-get install iproute2)"
    return None


def remove_stale() -> list[str]:
    """Delete the namespaces an earlier run left behind when it was killed (SIGKILL leaves no time to clean up): ours
    by name, made by a process that no longer exists, with no process left in them. Returns their names."""
    out = ip("netns", "list")
    removed = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        name = line.split()[0] if line.strip() else ""
        m = _OURS.fullmatch(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}") and not Network._ns_pids(name):
            if ip("netns", "del", name).returncode == 0:
                removed.append(name)
    return removed


class Network:
    """``hosts``: name -> IPv4 address in ``prefix``/24. Call :meth:`create`, and :meth:`destroy` in a finalizer."""

    def __init__(self, hosts: dict[str, str], prefix_len: int = 24):
        tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.switch = f"{tag}-switch"
        self.ns = {h: f"{tag}-{h}" for h in hosts}
        self.address = dict(hosts)
        self.port = {h: f"to-{h}"[:15] for h in hosts}  # the switch side of each host's veth pair
        self.prefix_len = prefix_len
        self._made: list[str] = []  # namespaces created, to delete

    def _run(self, *args: str) -> None:
        out = ip(*args)
        if out.returncode != 0:
            raise Unavailable(f"`ip {' '.join(args)}` failed ({out.returncode}): {out.stderr.strip()}")

    def create(self) -> Network:
        """Make the namespaces, the bridge and the links; Unavailable (with everything made removed) if it fails."""
        try:
            for ns in (self.switch, *self.ns.values()):
                self._run("netns", "add", ns)
                self._made.append(ns)
                self._run("-n", ns, "link", "set", "lo", "up")
            self._run("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
            self._run("-n", self.switch, "link", "set", BRIDGE, "up")
            for host, ns in self.ns.items():
                self._run(
                    "link",
                    "add",
                    IFACE,
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    self.port[host],
                    "netns",
                    self.switch,
                )
                self._run("-n", self.switch, "link", "set", self.port[host], "master", BRIDGE, "up")
                self._run("-n", ns, "addr", "add", f"{self.address[host]}/{self.prefix_len}", "dev", IFACE)
                self._run("-n", ns, "link", "set", IFACE, "up")
            probe = subprocess.run(
                ["ip", "netns", "exec", next(iter(self.ns.values())), "true"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            if probe.returncode != 0:
                raise Unavailable(f"`ip netns exec` does not work here: {probe.stderr.strip()}")
        except BaseException:
            self.destroy()
            raise
        return self

    def set_link(self, host: str, up: bool) -> None:
        """Pull (or put back) the host's cable at the switch: its veth's bridge side goes down (up); the host's own
        interface then has no carrier."""
        out = ip("-n", self.switch, "link", "set", self.port[host], "up" if up else "down")
        if out.returncode != 0:
            raise RuntimeError(f"cannot set {self.port[host]} {'up' if up else 'down'}: {out.stderr.strip()}")

    def argv(self, host: str, *argv: str) -> list[str]:
        """A command run in the host's namespace (``ip netns exec`` execs it: the process is the command itself)."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def pids(self, host: str) -> list[int]:
        return self._ns_pids(self.ns[host])

    def established(self, host: str) -> list[tuple[str, str]]:
        """(local, peer) address:port of the host's established TCP connections (iproute2's ss)."""
        out = subprocess.run(
            ["ss", "-N", self.ns[host], "-Htn", "state", "established"], capture_output=True, text=True, timeout=10
        )
        pairs = []
        for line in out.stdout.splitlines():
            cols = line.split()
            if len(cols) >= 4:
                pairs.append((cols[2], cols[3]))
        return pairs

    def tcp_info(self, host: str) -> dict[str, dict[str, str]]:
        """``local peer`` -> the kernel's TCP state of each established connection (``ss -i``: rto, backoff, retrans,
        unacked, ...), as strings, for figures."""
        out = subprocess.run(
            ["ss", "-N", self.ns[host], "-Htin", "state", "established"], capture_output=True, text=True, timeout=10
        )
        info, key = {}, None
        for line in out.stdout.splitlines():
            cols = line.split()
            if not line[:1].isspace() and len(cols) >= 4:
                key = f"{cols[2]} {cols[3]}"
                info[key] = {}
            elif key is not None:
                info[key].update(re.findall(r"\b(rto|backoff|retrans|unacked|lastsnd|lastrcv):(\S+)", line))
        return info

    def call_in(self, host: str, fn):
        """fn() on a thread of this process that has entered the host's network namespace (sockets it opens live
        there); returns its result or raises its exception."""
        result: dict = {}

        def run():
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fd = os.open(f"/run/netns/{self.ns[host]}", os.O_RDONLY)
                try:
                    if libc.setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.ns[host]}")
                finally:
                    os.close(fd)
                result["value"] = fn()
            except BaseException as e:  # handed to the caller
                result["error"] = e

        t = threading.Thread(target=run, name=f"netns-{host}")
        t.start()
        t.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    def destroy(self) -> list[str]:
        """Kill what still runs in the namespaces (processes the test started there), then delete them. Returns the
        namespaces that could not be deleted (should be none)."""
        for ns in self._made:
            for pid in self._ns_pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(self._ns_pids(ns) for ns in self._made):
            time.sleep(0.05)
        left = []
        for ns in reversed(self._made):
            if ip("netns", "del", ns).returncode != 0:
                left.append(ns)
        self._made = left
        return left

    @staticmethod
    def _ns_pids(ns: str) -> list[int]:
        out = ip("netns", "pids", ns)
        return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []
