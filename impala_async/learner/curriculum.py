"""Curricula (the source article, section 5.2): environment difficulty as a function of training progress.

A schedule is any object with ``value(episodes) -> float``, driven by the learner's count of finished episodes (the
episodes actors report in accepted messages; a checkpoint keeps that count, so a resumed run continues the schedule
where it was). Its current value travels to actors in the weights message (``difficulty``, docs/protocol.md) and
reaches each environment through one hook, ``env.unwrapped.set_difficulty(value)``, at that environment's next reset
(impala_async.actors.envs.set_difficulty). Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class Schedule(Protocol):
    def value(self, episodes: int) -> float: ...


@dataclass(frozen=True)
class Linear:
    """``start`` at 0 episodes, rising (or falling) linearly to ``end`` at ``episodes``, then ``end``: the article's
    example is 0.5 -> 2.0 over 10,000 episodes."""

    start: float
    end: float
    episodes: int

    def __post_init__(self):
        if not (math.isfinite(self.start) and math.isfinite(self.end)):
            raise ValueError(f"a linear curriculum needs finite ends, got {self.start} -> {self.end}")
        if self.episodes < 1:
            raise ValueError(f"a linear curriculum needs episodes >= 1, got {self.episodes}")

    def value(self, episodes: int) -> float:
        progress = min(1.0, max(0, episodes) / self.episodes)
        return self.start + (self.end - self.start) * progress


SCHEDULES = {"linear": Linear}  # --curriculum NAME (besides "none"; config/sections.py lists the same names)


def from_config(cfg) -> Schedule | None:
    """The schedule ``cfg.env.curriculum`` names, or None for "none"."""
    if cfg.env.curriculum == "none":
        return None
    if cfg.env.curriculum not in SCHEDULES:
        raise ValueError(f"curriculum must be none or one of {', '.join(SCHEDULES)}, got {cfg.env.curriculum!r}")
    return SCHEDULES[cfg.env.curriculum](cfg.env.curriculum_start, cfg.env.curriculum_end, cfg.env.curriculum_episodes)
