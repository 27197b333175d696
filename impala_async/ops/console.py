"""The console as weather: a line for the user that cannot be written (its file on a full disk, a closed pipe) is
lost, never the process. ``logging`` already behaves so (``Handler.handleError``); ``say`` is the same for the lines
the commands print themselves (the learner's progress line, the address it listens on, the reason it stopped)."""

from __future__ import annotations

import sys


def say(text: str, stream=None, end: str = "\n") -> bool:
    """Write ``text + end`` to ``stream`` (default: stderr) and flush; False if the console could not take it."""
    stream = stream if stream is not None else sys.stderr
    try:
        stream.write(text + end)
        stream.flush()
    except (OSError, ValueError):  # ENOSPC, EIO, EPIPE; ValueError: the stream was closed
        return False
    return True
