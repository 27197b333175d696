"""Curricula (the source article, section 5.2): environment difficulty as a function of training progress.

A schedule is any object with ``value(env_steps) -> float``, driven by the env steps the learner trained (its own
count, which a checkpoint keeps, so a resumed run continues the schedule where it was). Not by the episodes actors
report: an episode's end is a flag a peer sets, and 250 messages of all-ended trajectories once moved the article's
curriculum from 0.5 to its end in 5 seconds; a trained step is work the learner did, so a peer moves the schedule only
by its share of what was trained. Its current value travels to actors in the weights message (``difficulty``,
docs/protocol.md) and reaches each environment through one hook, ``env.unwrapped.set_difficulty(value)``, at that
environment's next reset (impala_async.actors.envs.set_difficulty). Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class Schedule(Protocol):
    def value(self, env_steps: int) -> float: ...


@dataclass(frozen=True)
class Linear:
    """``start`` at 0 env steps trained, rising (or falling) linearly to ``end`` at ``env_steps``, then ``end``: the
    article's example is 0.5 -> 2.0 over 10,000 episodes (of its environment's length: 10,000 x the mean episode
    length in env steps here)."""

    start: float
    end: float
    env_steps: int

    def __post_init__(self):
        if not (math.isfinite(self.start) and math.isfinite(self.end)):
            raise ValueError(f"a linear curriculum needs finite ends, got {self.start} -> {self.end}")
        if self.env_steps < 1:
            raise ValueError(f"a linear curriculum needs env_steps >= 1, got {self.env_steps}")

    def value(self, env_steps: int) -> float:
        progress = min(1.0, max(0, env_steps) / self.env_steps)
        return self.start + (self.end - self.start) * progress


SCHEDULES = {"linear": Linear}  # --curriculum NAME (besides "none"; config/sections.py lists the same names)


def from_config(cfg) -> Schedule | None:
    """The schedule ``cfg.env.curriculum`` names, or None for "none"."""
    if cfg.env.curriculum == "none":
        return None
    if cfg.env.curriculum not in SCHEDULES:
        raise ValueError(f"curriculum must be none or one of {', '.join(SCHEDULES)}, got {cfg.env.curriculum!r}")
    return SCHEDULES[cfg.env.curriculum](cfg.env.curriculum_start, cfg.env.curriculum_end, cfg.env.curriculum_env_steps)
