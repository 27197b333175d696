"""A Ctrl-C that the learner's start-up cannot lose.

Until the event loop runs a SIGINT is Python's KeyboardInterrupt, raised wherever the main thread happens to be, and
code that clears every error swallows it: a ``__del__`` or a weakref callback (the error is only printed), a C
extension that clears what it does not expect (Python 3.11's ``PyObject_HasAttr`` clears any error a Python
``__getattr__`` raises). The learner then started and trained as though nothing had been pressed: the suite met it, a
SIGINT at start-up under its full load and the learner training on until SIGTERM (BENCHMARKS.md, section 20).

So the learner's SIGINT handler raises as Python's own does and counts what it raised, and start-up asks, before
the event loop starts, whether one came (:func:`reraise_lost`): one that reached that point was swallowed on its way,
and is raised again there, so the run ends as an interrupted start-up does. Once the loop runs nothing is lost this
way: uvloop has the signal's number written to its own pipe and hands it to the server's handlers as soon as they are
in (learner/server.py), whatever became of the KeyboardInterrupt.
"""

from __future__ import annotations

import signal
import threading

_received = [0]  # SIGINTs since install()
_previous: list = []  # the handler install() replaced


def _on_sigint(signum, frame) -> None:
    _received[0] += 1
    raise KeyboardInterrupt


def install() -> None:
    """Count every SIGINT from now on (main thread only: elsewhere this does nothing)."""
    if threading.current_thread() is threading.main_thread():
        _received[0] = 0
        previous = signal.signal(signal.SIGINT, _on_sigint)
        if previous is not _on_sigint:  # installed twice: the first one's is what uninstall() puts back
            _previous[:] = [previous]


def uninstall() -> None:
    """The handler :func:`install` replaced, back where this module's is still in place."""
    if _previous and threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, _previous[0])
        _previous.clear()


def reraise_lost() -> None:
    """KeyboardInterrupt if a SIGINT came since :func:`install` and start-up went on regardless."""
    if _received[0]:
        raise KeyboardInterrupt
