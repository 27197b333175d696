"""Weights going out: the learner's current weights encoded as a weights message (docs/protocol.md) with what travels
beside them (the run, the learner's incarnation, the curriculum's difficulty, the flow-control pace), after an update
at most every ``publish_interval_s`` (in lockstep, ``--reproducible 1``, at the end of each round instead:
transport/lockstep.py ``Rounds``). Encoded on the training thread, handed to the publisher on the event loop.
Weights with a non-finite value are never encoded (counted, and logged)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ..core import wire
from ..core.finite import nonfinite

log = logging.getLogger("impala_async.learner.weights")


class Publication:
    def __init__(
        self,
        model: torch.nn.Module,
        run_info: dict,
        incarnation: int,
        *,
        version: Callable[[], int],
        difficulty: Callable[[], float | None],
        pace: Callable[[], float],
        publish: Callable[[bytes], None],
        interval_s: float,
    ):
        """``version()``: the policy version; ``difficulty()``: the curriculum's value now (None: no curriculum);
        ``pace()``: the pace to ask of actors (learner/transport/pacing.py); ``publish(data)``: hands a message to the
        publisher, from any thread."""
        self.model, self.run_info, self.incarnation = model, run_info, incarnation
        self._version, self._difficulty, self._pace, self._publish = version, difficulty, pace, publish
        self.interval_s = interval_s
        self.refused_nonfinite = 0
        self.difficulty: float | None = None  # the value sent with the latest weights
        self._last = time.monotonic()

    def counters(self) -> dict:
        return {"weights_refused_nonfinite": self.refused_nonfinite, "difficulty": self.difficulty}

    def encode(self) -> bytes | None:
        """The current weights as a weights message; None (and an error logged) if any of them is not finite."""
        state = {k: v.detach().to("cpu").numpy() for k, v in self.model.state_dict().items()}
        bad = nonfinite(state.items())
        if bad:
            self.refused_nonfinite += 1
            log.error("not publishing weights with non-finite values in %s", bad[:5])
            return None
        self.difficulty = self._difficulty()
        return wire.encode_weights(
            self._version(),
            state,
            self.run_info,
            self.incarnation,
            difficulty=self.difficulty,
            pace_s_per_trajectory=self._pace(),
        )

    def after_update(self, now: float) -> None:
        """Publish the weights if ``publish_interval_s`` has passed since the last publication (training thread)."""
        if now - self._last < self.interval_s:
            return
        self._last = now
        self.publish()

    def publish(self) -> None:
        """Publish the weights now (training thread)."""
        data = self.encode()
        if data is not None:
            self._publish(data)
