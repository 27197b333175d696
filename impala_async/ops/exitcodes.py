"""Exit codes of every impala-async command, one meaning per code (README, Exit codes; ``impala-async --help``).

Actors and the learner share this table, so a supervisor, a shell script or Kubernetes reads a code the same way
whichever process it came from.
"""

from __future__ import annotations

OK = 0
ERROR = 1  # an internal error or a failed training thread; also a refusal to start, printed as one line
USAGE = 2  # a command line argparse refuses; an actor that cannot build its environments or lacks an extra it needs
NO_WEIGHTS = 3  # actor: no weights within --max-wait-for-weights-s (nothing at that address, or not a learner)
NO_DATA = 4  # learner: no trajectory within --actor-start-timeout-s, or for --no-data-timeout-s once data flowed
REFUSED = 5  # actor: the learner refused this actor's CURVE key (it is not in the learner's allowed/)
RANK_FAILED = 6  # learner: a learner rank died, failed or hung (README, Several learner ranks)
ACTORS_FAILED = 7  # learner: every local actor failed more than --max-actor-restarts times in a row
NO_CHECKPOINT = 8  # learner: the final checkpoint could not be written
RUN_CHANGED = 9  # actor: a restarted learner runs something this actor cannot act in (docs/protocol.md)
FORCED = 130  # a second Ctrl-C, a Ctrl-C during startup, or a shutdown longer than --shutdown-timeout-s

TABLE = (
    (OK, "the run ended as asked (steps reached, a signal, or the actor stopped)"),
    (ERROR, "an internal error or a failed training thread; also a refusal to start (one line on stderr)"),
    (USAGE, "a command line argparse refuses; an actor that cannot build its environments or lacks an extra"),
    (NO_WEIGHTS, "actor: no weights within --max-wait-for-weights-s (nothing at that address, or no learner)"),
    (NO_DATA, "learner: no trajectory within --actor-start-timeout-s, or for --no-data-timeout-s"),
    (REFUSED, "actor: the learner refused this actor's CURVE key (not in its allowed/)"),
    (RANK_FAILED, "learner: a learner rank died, failed or hung"),
    (ACTORS_FAILED, "learner: every local actor failed more than --max-actor-restarts times in a row"),
    (NO_CHECKPOINT, "learner: the final checkpoint could not be written"),
    (RUN_CHANGED, "actor: a restarted learner runs something this actor cannot act in"),
    (FORCED, "forced exit: a second Ctrl-C, a Ctrl-C during startup, or a shutdown past --shutdown-timeout-s"),
)


def table_text() -> str:
    """The table as --help prints it."""
    return "exit codes:\n" + "\n".join(f"  {code:>3}  {text}" for code, text in TABLE)
