"""Actor processes forked from a zygote: torch imported once per supervisor, not once per actor.

A fresh interpreter pays about 3 s of CPU importing torch, NumPy, ZeroMQ and gymnasium before it does a thing
(BENCHMARKS.md, section 20): on a small machine a supervisor's actors start one after another, and a restart waits as
long. So a supervisor (train's learner, or ``impala-async actor --num-actors N``) forks a *zygote* at its start,
while it runs no thread of its own, has no ZeroMQ or CUDA context; the zygote imports what an actor imports,
then forks each actor on request. An actor so made is the program ``python -m impala_async actor ARGS`` runs: its
own pid and session, stdin from /dev/null, the heartbeat pipe at the descriptor its argv names and no other
descriptor of the supervisor, the supervisor's environment as of the request, ``__main__`` run fresh and the
interpreter's exit emulated (non-daemon threads joined, atexit, streams flushed; exit codes and signal deaths as
:class:`subprocess.Popen` reports them). ``ps`` shows its command line (setproctitle). Library thread pools that
exist at the fork (OpenBLAS's, made by ``import numpy``) are rebuilt in the child by their own fork handlers.

Where a fork is not safe the supervisor starts fresh interpreters, as ``--actor-start spawn`` always does: actors on
CUDA (a child may not use CUDA its parent's process touched), a supervisor already running Python threads, a
zygote that failed or died (said once, in the log).

Protocol (also the tests' fork server's, tests/forkserver.py): one SOCK_SEQPACKET message per process on the control
socket (JSON: the request) with descriptors: a socket for this process's replies, then those the child gets at the
numbers the request's ``fds`` lists. The zygote answers on that socket ``{"pid": N}``, then ``{"returncode": R}``
when the child ends. The client asks for a signal by sending its number there; the zygote sends it through the
child's pidfd, so a signal never reaches a recycled pid. Closing the control socket kills what the zygote started and
ends it; it is killed too when its supervisor dies (PR_SET_PDEATHSIG), and its children then get SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .procs import set_death_signal

log = logging.getLogger("impala_async.actors.zygote")

MAX_REQUEST_BYTES = 1 << 20
MAX_FDS = 8  # descriptors one request passes (the reply socket and the child's own)
START_TIMEOUT_S = 120.0  # a fork answers in milliseconds, the first after the zygote's imports; this long: stuck
EX_SOFTWARE = 70  # a child's set-up failed before its program ran


@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket | None


# -- the server: the zygote's loop ----------------------------------------------------------------------------------


def serve(control: socket.socket, child: Callable[[dict, list[int]], int]) -> None:
    """Fork a child per request until the control socket closes; the child runs ``child(request, fds)`` (its
    descriptors, the reply socket's left out) and exits with what it returns."""
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ)
    children: dict[int, _Child] = {}  # by pidfd
    while True:
        for key, _ in sel.select():
            if key.fileobj is control:
                msg, fds, _, _ = socket.recv_fds(control, MAX_REQUEST_BYTES, MAX_FDS)
                if not msg:
                    for c in children.values():
                        _signal(c, signal.SIGKILL)
                    return
                c = _start(json.loads(msg), fds, child, [control.fileno(), sel.fileno()], children)
                children[c.pidfd] = c
                sel.register(c.pidfd, selectors.EVENT_READ)
                sel.register(c.conn, selectors.EVENT_READ, c)  # type: ignore[arg-type]
            elif isinstance(key.fileobj, int):
                _reap(children.pop(key.fileobj), sel)
            else:
                _on_request(key.data, sel)


def _start(request: dict, fds: list[int], child, ours: list[int], children: dict[int, _Child]) -> _Child:
    conn, given = socket.socket(fileno=fds[0]), fds[1:]
    pid = os.fork()
    if pid == 0:
        code = EX_SOFTWARE
        try:
            # The server's descriptors, closed by number: the objects stay referenced, the child never returns to them.
            for fd in (
                ours
                + [conn.fileno()]
                + [fd for c in children.values() for fd in (c.pidfd, c.conn.fileno() if c.conn else -1) if fd >= 0]
            ):
                os.close(fd)
            code = child(request, given)
        finally:
            _flush()
            os._exit(code)
    for fd in given:
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


# -- in a child -----------------------------------------------------------------------------------------------------


def place_fds(fds: list[int], targets: list[int]) -> None:
    """Descriptor ``fds[i]`` at number ``targets[i]``, and no other above 2 left open (as subprocess.Popen's
    close_fds): what a child of the server holds is what it was given."""
    base = max([*targets, *fds, 2]) + 1
    moved = [_dup_above(fd, base) for fd in fds]  # out of every target's way
    for fd in fds:
        os.close(fd)
    for fd, target in zip(moved, targets, strict=True):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    keep = sorted({*targets, 0, 1, 2})
    for low, high in zip(keep, [*keep[1:], 1 << 20], strict=True):
        if high - low > 1:
            os.closerange(low + 1, high)


def _dup_above(fd: int, base: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, base)


def run_main(argv: list[str], script: str = "") -> int:
    """``python -m impala_async ARGV`` (``python SCRIPT ARGV`` given a script) from here: ``__main__`` run fresh,
    then what the interpreter does at its exit; the exit code."""
    import atexit
    import runpy

    sys.path[0] = os.path.dirname(os.path.realpath(script)) if script else os.getcwd()  # as python sets it
    sys.argv = [script or "-m", *argv]  # run_module puts the module's path in argv[0]
    if "numpy" in sys.modules:  # a fresh interpreter's NumPy seeds its global generator from the OS
        sys.modules["numpy"].random.seed()
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


def _actor(request: dict, fds: list[int]) -> int:
    """A zygote's child: an actor's command line (``-m impala_async`` onwards) in a process of its own."""
    os.setsid()  # own session: a Ctrl-C in the terminal reaches only the supervisor, which stops actors in order
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    place_fds(fds, request["fds"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    set_title(request["argv"])
    os.environ.clear()
    os.environ.update(request["env"])
    return run_main(request["argv"][3:])


def prepare_titles() -> None:
    """Make room for :func:`set_title` in this process and the children it forks: setproctitle moves the environment
    out of the memory after argv (/proc/PID/environ then shows the title), which it can do only while the environment
    is still the one the process began with (so: before anything sets a variable)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.getproctitle()


def set_title(argv: list[str]) -> None:
    """What ``ps`` shows for this process: argv as typed (setproctitle where installed: nothing otherwise)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join(argv))


# -- the client, in the supervisor ----------------------------------------------------------------------------------


class Forked:
    """A process a server forked, with the parts of subprocess.Popen a supervisor uses."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket):
        self.args, self.pid, self.returncode = args, pid, None
        self._conn = conn

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
        self.returncode = json.loads(data)["returncode"] if data else self._server_gone()
        self._conn.close()
        return True

    def _server_gone(self) -> int:
        """The exit code of a process whose server died (killed): a zygote's children got SIGTERM then
        (PR_SET_PDEATHSIG), and their codes went with it."""
        log.warning("the zygote ended before process %d did: its exit is taken as SIGTERM's", self.pid)
        return -signal.SIGTERM

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


def request(control: socket.socket, lock: threading.Lock, req: dict, fds: list[int], timeout_s: float):
    """Send one request; (our reply socket, the child's pid). OSError when the server does not answer."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with lock:
            socket.send_fds(control, [json.dumps(req).encode()], [theirs.fileno(), *fds])
    except OSError:
        ours.close()
        raise
    finally:
        theirs.close()
    if not select.select([ours], [], [], timeout_s)[0]:
        ours.close()
        raise OSError(f"no answer within {timeout_s:g} s")
    reply = ours.recv(4096)
    if not reply:
        ours.close()
        raise OSError("it ended")
    return ours, json.loads(reply)["pid"]


class Zygote:
    """An idle fork of this process that forks actors (see the module's docstring)."""

    def __init__(self, pid: int, control: socket.socket):
        self.pid, self._control, self._lock = pid, control, threading.Lock()

    @classmethod
    def fork(cls) -> Zygote | None:
        """Fork the zygote now; None (said in the log) where this process runs Python threads besides this one."""
        if threading.active_count() > 1:
            log.info("actors start as fresh interpreters: the supervisor runs threads already, a fork is not safe")
            return None
        _flush()  # nothing buffered is written twice
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            code = EX_SOFTWARE
            try:
                ours.close()
                os.setsid()  # the terminal's Ctrl-C is the supervisor's to handle
                set_death_signal(signal.SIGKILL)
                prepare_titles()  # here, not in the supervisor: /proc/PID/environ of the supervisor stays readable
                set_title(["impala-async", "zygote", f"(forks the actors of {parent})"])
                if os.getppid() == parent:  # else the supervisor died before prctl took effect
                    from . import actor  # noqa: F401  # what an actor imports (torch, ...), once: here

                    serve(theirs, _actor)
                    code = 0
            finally:
                os._exit(code)
        theirs.close()
        return cls(pid, ours)

    @staticmethod
    def runs(argv: list[str]) -> bool:
        """Whether ``argv`` is a command line the zygote runs (this interpreter's ``-m impala_async``)."""
        return argv[:3] == [sys.executable, "-m", "impala_async"]

    def spawn(self, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> Forked:
        """Start ``argv`` (see :meth:`runs`) with ``env`` and the descriptors ``pass_fds`` at their numbers;
        OSError where the zygote does not answer."""
        req = {"argv": list(argv), "env": dict(env), "fds": list(pass_fds)}
        conn, pid = request(self._control, self._lock, req, list(pass_fds), START_TIMEOUT_S)
        return Forked(list(argv), pid, conn)

    def close(self, timeout_s: float = 5.0) -> None:
        """End the zygote (what it still runs is killed) and reap it; again: nothing."""
        if self._control.fileno() < 0:
            return
        self._control.close()
        deadline = time.monotonic() + timeout_s
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                return
            time.sleep(0.01)
