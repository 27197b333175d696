"""A fork server for the tests' CLI processes: `import torch` once, not once a process.

The suite starts a few hundred ``python -m impala_async`` processes; each paid ~3.3 s of CPU importing torch, NumPy,
ZeroMQ and gymnasium before doing a thing (BENCHMARKS.md, section 20). One server per pytest worker imports them
once and forks a child per request. A child is the CLI as ``python -m impala_async ARGS`` runs it: its own pid (a
real process: signals, psutil, its own children), the environment, working directory and stdin/stdout/stderr the
test gave, ``__main__`` run fresh, exit codes and signal deaths reported as subprocess.Popen reports them.

What a child shares with its siblings that fresh interpreters would not: the modules imported before the fork, and
what they read as they were imported (so a test that changes that, through PYTHONPATH or a variable the config reads
for its defaults, gets a real process: see procutil.cli), and the string hash seed. The state a fresh process sets at
its start is set again in each child (:func:`_fresh_state`).

The tools (``python tools/NAME.py``) are forked the same way. The server and its protocol are the actors' zygote's
(impala_async/actors/zygote.py), with the child's stdin, stdout and stderr as the descriptors a request passes; the
server exits, killing what it started, when the control socket closes (the worker ended).
"""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from impala_async.actors import zygote
from impala_async.actors.zygote import place_fds, run_main, serve

START_TIMEOUT_S = 180.0  # the first request waits for the server's imports, on a loaded machine


def _child(request: dict, fds: list[int]) -> int:
    """A child of the server: the request's session, stdio, directory and environment, then its program."""
    if request["new_session"]:
        os.setsid()
    place_fds(fds, [0, 1, 2])
    if request["cwd"]:
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_state()
    return run_main(request["argv"], request["script"])


def _fresh_state() -> None:
    """What a fresh interpreter sets at its start and the server set at its own, besides what run_main sets again
    (NumPy's generator): the CLI's start time (metrics' wall_s and actor_start_timeout_s count from it)."""
    import impala_async.cli

    impala_async.cli.START_MONOTONIC = time.monotonic()


# -- the client, in the pytest worker -------------------------------------------------------------------------------


class Forked(zygote.Forked):
    """A process the server forked, with the parts of subprocess.Popen the tests use."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, stdout=None, stderr=None, text=False):
        super().__init__(args, pid, conn)
        self.stdout, self.stderr = stdout, stderr
        self._text = text
        self._got: dict[int, bytearray] = {}  # what communicate() has read, by pipe

    def _server_gone(self) -> int:
        raise RuntimeError(f"the fork server ended before process {self.pid} did")

    def communicate(self, input=None, timeout: float | None = None):
        """Read the piped outputs to their end, then wait; a timeout keeps what was read for the next call."""
        assert input is None, "no stdin pipe"
        deadline = None if timeout is None else time.monotonic() + timeout
        pipes = [f for f in (self.stdout, self.stderr) if f is not None and not f.closed]
        with selectors.DefaultSelector() as sel:
            for f in pipes:
                sel.register(f, selectors.EVENT_READ)
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    self._got.setdefault(key.fd, bytearray()).extend(chunk)
                    if not chunk:
                        sel.unregister(key.fileobj)
        outs = []
        for f in (self.stdout, self.stderr):
            if f is None:
                outs.append(None)
                continue
            if not f.closed:
                data = bytes(self._got.pop(f.fileno(), b""))
                f.close()
                outs.append(_decode(data) if self._text else data)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        return tuple(outs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


def _decode(data: bytes) -> str:
    return data.decode().replace("\r\n", "\n").replace("\r", "\n")  # as text=True's universal newlines


class Client:
    """One server for this process, started on first use."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.server = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=self.env,
        )  # fmt: skip
        theirs.close()
        self.control, self.lock = ours, threading.Lock()

    def spawn(self, argv, *, script=None, env=None, cwd=None, stdin=None, stdout=None, stderr=None, text=False,
              start_new_session=False) -> Forked:  # fmt: skip
        """Start ``python -m impala_async *argv`` (``python SCRIPT *argv`` given a script's path); stdin, stdout and
        stderr as subprocess.Popen takes them (None, a file, a descriptor, DEVNULL, PIPE; stderr also STDOUT)."""
        opened: list[int] = []  # our descriptors to close once sent
        fd_in = _fd(stdin, 0, opened)
        reader_out, fd_out = _out(stdout, 1, opened)
        reader_err, fd_err = (None, fd_out) if stderr == subprocess.STDOUT else _out(stderr, 2, opened)
        request = {"argv": list(argv), "script": str(script or ""), "env": dict(os.environ if env is None else env),
                   "cwd": str(cwd or ""), "new_session": start_new_session}  # fmt: skip
        try:
            ours, pid = zygote.request(self.control, self.lock, request, [fd_in, fd_out, fd_err], START_TIMEOUT_S)
        except OSError as e:
            raise RuntimeError(f"the fork server started no process ({e}; exit {self.server.poll()})") from None
        finally:
            for fd in opened:
                os.close(fd)
        files = [None if r is None else open(r, "r" if text else "rb", closefd=True) for r in (reader_out, reader_err)]
        args = [sys.executable, *([str(script)] if script else ["-m", "impala_async"]), *argv]
        return Forked(args, pid, ours, *files, text=text)

    def close(self, timeout_s: float = 30.0) -> None:
        self.control.close()  # the server kills what still runs and ends
        try:
            self.server.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.server.kill()


def _fd(stream, inherit: int, opened: list[int]) -> int:
    if stream is None:
        return inherit
    if stream == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd
    if isinstance(stream, int):
        return stream
    return stream.fileno()


def _out(stream, inherit: int, opened: list[int]) -> tuple[int | None, int]:
    """(our read end or None, the descriptor the child writes to)."""
    if stream == subprocess.PIPE:
        read, write = os.pipe()
        opened.append(write)
        return read, write
    return None, _fd(stream, inherit, opened)


_client: list[Client] = []
_client_lock = threading.Lock()


def started() -> bool:
    """Whether this process's server has started (without starting it)."""
    return bool(_client)


def client() -> Client:
    """This process's server, started on first use and ended at exit."""
    with _client_lock:
        if not _client:
            import atexit

            _client.append(Client())
            atexit.register(_client[0].close)
        return _client[0]


# -- the server's imports -------------------------------------------------------------------------------------------


def _preload() -> None:
    """What every CLI process imports, and the environments the tests' processes make."""
    import gymnasium  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import zmq  # noqa: F401

    import impala_async.cli  # noqa: F401

    zygote.prepare_titles()  # a child that forks actors has its environment replaced: too late then


if __name__ == "__main__":
    _preload()
    serve(socket.socket(fileno=int(sys.argv[1])), _child)
