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

The tools (``python tools/NAME.py``) are forked the same way. Protocol: the client sends one message per process on
a SOCK_SEQPACKET control socket (JSON: argv, script, env, cwd, new_session) with four descriptors (a socket for this
process's replies, and its stdin, stdout, stderr); the server answers on that socket ``{"pid": N}``, then
``{"returncode": R}`` when the child ends. The client asks for a signal by sending its number on the same socket; the
server sends it through the child's pidfd, so a signal never reaches a recycled pid. The server exits, killing what
it started, when the control socket closes (the worker ended).
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

MAX_REQUEST_BYTES = 1 << 20
START_TIMEOUT_S = 180.0  # the first request waits for the server's imports, on a loaded machine


@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket | None


def serve(control: socket.socket) -> None:
    """Fork a child per request until the control socket closes."""
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ)
    children: dict[int, _Child] = {}  # by pidfd
    while True:
        for key, _ in sel.select():
            if key.fileobj is control:
                msg, fds, _, _ = socket.recv_fds(control, MAX_REQUEST_BYTES, 4)
                if not msg:
                    for child in children.values():
                        _signal(child, signal.SIGKILL)
                    return
                child = _start(json.loads(msg), fds, sel, control, children)
                children[child.pidfd] = child
                sel.register(child.pidfd, selectors.EVENT_READ)
                sel.register(child.conn, selectors.EVENT_READ, child)  # type: ignore[arg-type]
            elif isinstance(key.fileobj, int):
                _reap(children.pop(key.fileobj), sel)
            else:
                _on_request(key.data, sel)


def _start(request: dict, fds: list[int], sel, control: socket.socket, children: dict[int, _Child]) -> _Child:
    conn, stdio = socket.socket(fileno=fds[0]), fds[1:]
    pid = os.fork()
    if pid == 0:
        # Close what is the server's, by number: the objects stay referenced and the child never returns to them.
        for fd in [control.fileno(), sel.fileno(), conn.fileno()] + [
            fd for c in children.values() for fd in (c.pidfd, c.conn.fileno() if c.conn else -1) if fd >= 0
        ]:
            os.close(fd)
        _child(request, stdio)  # never returns
    for fd in stdio:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    return _Child(pid, os.pidfd_open(pid), conn)


def _reap(child: _Child, sel) -> None:
    _, status = os.waitpid(child.pid, 0)
    sel.unregister(child.pidfd)
    os.close(child.pidfd)
    if child.conn is not None:
        sel.unregister(child.conn)
        try:
            child.conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            pass  # the client is gone
        child.conn.close()
        child.conn = None  # a request on it in the same select() batch is then dropped


def _on_request(child: _Child, sel) -> None:
    if child.conn is None:  # reaped earlier in this select() batch
        return
    data = child.conn.recv(64)
    if not data:  # the client closed its end; the process runs on, reaped when it ends
        sel.unregister(child.conn)
        child.conn.close()
        child.conn = None
        return
    _signal(child, int(data))


def _signal(child: _Child, sig: int) -> None:
    try:
        signal.pidfd_send_signal(child.pidfd, sig)
    except ProcessLookupError:
        pass  # ended; its exit is on the way


def _child(request: dict, stdio: list[int]) -> None:
    code = 70  # EX_SOFTWARE: the set-up below failed
    try:
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
            os.close(fd)
        if request["cwd"]:
            os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = request["script"]
        sys.path[0] = os.path.dirname(os.path.realpath(script)) if script else os.getcwd()  # as python sets it
        sys.argv = [script or "-m", *request["argv"]]  # run_module puts the module's path in argv[0]
        _fresh_state()
        code = _run_main(script)
    finally:
        _flush()
        os._exit(code)


def _fresh_state() -> None:
    """What a fresh interpreter sets at its start and the server set at its own: NumPy's global generator (Python's
    ``random`` reseeds itself at a fork) and the CLI's start time (metrics' wall_s and actor_start_timeout_s count
    from it)."""
    import time

    import numpy

    import impala_async.cli

    numpy.random.seed()
    impala_async.cli.START_MONOTONIC = time.monotonic()


def _run_main(script: str) -> int:
    """``python -m impala_async`` (or ``python SCRIPT``) from here: __main__ run fresh, then what the interpreter
    does at exit."""
    import atexit
    import runpy
    import threading

    code = 0
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module("impala_async", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as CPython ends on an uncaught KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # wait for non-daemon threads, as at interpreter exit
    atexit._run_exitfuncs()
    return code


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


# -- the client, in the pytest worker -------------------------------------------------------------------------------


class Forked:
    """A process the server forked, with the parts of subprocess.Popen the tests use."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, stdout=None, stderr=None, text=False):
        self.args, self.pid, self.returncode = args, pid, None
        self.stdout, self.stderr = stdout, stderr
        self._conn, self._text = conn, text
        self._got: dict[int, bytearray] = {}  # what communicate() has read, by pipe

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_exit(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read_exit(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        return self.returncode  # type: ignore[return-value]

    def _read_exit(self, timeout: float | None) -> bool:
        if not select.select([self._conn], [], [], timeout)[0]:
            return False
        data = self._conn.recv(4096)
        if not data:
            raise RuntimeError(f"the fork server ended before process {self.pid} did")
        self.returncode = json.loads(data)["returncode"]
        self._conn.close()
        return True

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                self._conn.send(str(int(sig)).encode())
            except OSError:
                pass  # it ended meanwhile

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

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
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        opened: list[int] = []  # our descriptors to close once sent
        fd_in = _fd(stdin, 0, opened)
        reader_out, fd_out = _out(stdout, 1, opened)
        reader_err, fd_err = (None, fd_out) if stderr == subprocess.STDOUT else _out(stderr, 2, opened)
        request = {"argv": list(argv), "script": str(script or ""), "env": dict(os.environ if env is None else env),
                   "cwd": str(cwd or ""), "new_session": start_new_session}  # fmt: skip
        try:
            with self.lock:
                socket.send_fds(self.control, [json.dumps(request).encode()], [theirs.fileno(), fd_in, fd_out, fd_err])
        finally:
            theirs.close()
            for fd in opened:
                os.close(fd)
        if not select.select([ours], [], [], START_TIMEOUT_S)[0]:
            raise RuntimeError(f"the fork server did not start a process within {START_TIMEOUT_S:g} s")
        reply = ours.recv(4096)
        if not reply:
            raise RuntimeError(f"the fork server ended (exit {self.server.poll()}): see its stderr above")
        files = [None if r is None else open(r, "r" if text else "rb", closefd=True) for r in (reader_out, reader_err)]
        args = [sys.executable, *([str(script)] if script else ["-m", "impala_async"]), *argv]
        return Forked(args, json.loads(reply)["pid"], ours, *files, text=text)

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


if __name__ == "__main__":
    _preload()
    serve(socket.socket(fileno=int(sys.argv[1])))
