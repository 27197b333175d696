"""Policy-collapse warnings (the source article, section 4: "Policy collapse (sudden performance cliff): watch the
distribution of importance weights rho, lower rho-bar (0.8-1.2), raise the entropy cost").

Pure: :class:`CollapseWatch` is fed each metrics record (learner/metrics.py) and returns the warnings due, which the
reports log. Two signs, each judged on the median of the last ``SMOOTH_REPORTS`` reports that made updates, so that
one odd report neither fires nor hides anything, and each warned about at most once per ``warn_interval_s``:

- **entropy cliff**: the entropy fell below ``entropy_fraction`` of its maximum over the last ``window_updates``
  updates (an order of magnitude within about a thousand updates, by default). Relative to where the entropy was,
  so it holds for any number of actions and any entropy cost; a fresh run counts the uniform policy's entropy,
  log(num_actions), as its value at update 0 (an untrained network is close to uniform), so that a collapse within
  the very first report is caught too.
- **policy drift**: more than ``rho_far_frac`` of the importance weights rho = pi/mu lie outside [1/2, 2]
  (``rho_far_frac`` in metrics.jsonl): on that share of the actions taken, the policy being trained and the one that
  acted disagree by a factor of two. Healthy runs stay near 0 (CartPole with a lag of 2-5 versions: below 0.001);
  ``rho_clipped_frac`` cannot serve, as half the ratios lie just above 1 in a healthy run.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

SMOOTH_REPORTS = 3  # the median of this many reports is what the thresholds are compared with


class CollapseWatch:
    def __init__(
        self,
        *,
        entropy_fraction: float,
        window_updates: int,
        rho_far_frac: float,
        warn_interval_s: float,
        knobs: dict[str, float],
        initial_entropy: float | None = None,
    ):
        """``knobs``: the current ``clip_rho_threshold``, ``entropy_cost`` and ``learning_rate``, quoted in the advice.
        ``initial_entropy``: the entropy at update 0 of a fresh run (None for a resumed one). A fraction of 0 turns
        its warning off."""
        self.entropy_fraction, self.window_updates = entropy_fraction, window_updates
        self.rho_far_threshold, self.warn_interval_s = rho_far_frac, warn_interval_s
        self.knobs = knobs
        self._entropy: deque[tuple[int, float]] = deque()  # (learner_steps, interval entropy) within the window
        if initial_entropy is not None:
            self._entropy.append((0, initial_entropy))
        self._recent_entropy: deque[float] = deque(maxlen=SMOOTH_REPORTS)
        self._recent_rho: deque[float] = deque(maxlen=SMOOTH_REPORTS)
        self._last_warned: dict[str, float] = {}
        self.warnings: dict[str, int] = {"entropy": 0, "rho": 0}  # warnings given, by kind

    @classmethod
    def from_config(cls, cfg, num_actions: int, fresh: bool) -> CollapseWatch:
        return cls(
            entropy_fraction=cfg.observe.collapse_entropy_fraction,
            window_updates=cfg.observe.collapse_window_updates,
            rho_far_frac=cfg.observe.collapse_rho_far_frac,
            warn_interval_s=cfg.observe.collapse_warn_interval_s,
            knobs={
                "clip_rho_threshold": cfg.loss.clip_rho_threshold,
                "entropy_cost": cfg.loss.entropy_cost,
                "learning_rate": cfg.loss.learning_rate,
            },
            initial_entropy=math.log(num_actions) if fresh and num_actions > 1 else None,
        )

    def feed(self, rec: dict) -> list[str]:
        """Take one metrics record; return the warnings due now (none while rate-limited)."""
        out = []
        now, steps = float(rec["wall_s"]), int(rec["learner_steps"])
        entropy, far = rec.get("entropy"), rec.get("rho_far_frac")
        if entropy is not None and _finite(entropy):
            self._recent_entropy.append(entropy)
            self._entropy.append((steps, entropy))
            while self._entropy and self._entropy[0][0] < steps - self.window_updates:
                self._entropy.popleft()
            text = self._entropy_cliff(steps, rec)
            if text and self._due("entropy", now):
                out.append(text)
        if far is not None and _finite(far):
            self._recent_rho.append(far)
            if (
                self.rho_far_threshold > 0
                and len(self._recent_rho) == SMOOTH_REPORTS
                and median(self._recent_rho) > self.rho_far_threshold
                and self._due("rho", now)
            ):
                lag = rec.get("policy_lag_avg")
                out.append(
                    f"policy drift: {median(self._recent_rho):.0%} of the importance weights lie outside "
                    f"[1/2, 2] (over --collapse-rho-far-frac {self.rho_far_threshold:g}): the policy being "
                    f"trained and the one that acted disagree by a factor of two on that share of the actions"
                    f"{'' if lag is None else f' (policy lag {lag:g} versions on average)'}, the road to a "
                    f"policy collapse. {self.advice()}"
                )
        return out

    def _entropy_cliff(self, steps: int, rec: dict) -> str | None:
        if self.entropy_fraction <= 0 or len(self._recent_entropy) < SMOOTH_REPORTS:
            return None
        now = median(self._recent_entropy)
        at, top = max(self._entropy, key=lambda p: p[1])
        if not now < self.entropy_fraction * top:
            return None
        ret = rec.get("episode_return_mean")
        return (
            f"policy collapse? the policy's entropy fell from {top:.3g} to {now:.2g} nats within {steps - at} "
            f"updates (below --collapse-entropy-fraction {self.entropy_fraction:g} of its recent maximum)"
            f"{'' if ret is None else f'; mean return now {ret:.4g}'}. {self.advice()}"
        )

    def advice(self) -> str:
        k = self.knobs
        rho = k["clip_rho_threshold"]
        return (
            f"The source article's remedies: keep rho-bar within 0.8-1.2, toward 0.8 "
            f"(--clip-rho-threshold, now {'off' if rho == 0 else f'{rho:g}'}), raise --entropy-cost (now "
            f"{k['entropy_cost']:g}), lower --learning-rate (now {k['learning_rate']:g}); metrics.jsonl has the "
            f"importance weights' histogram (rho_hist)"
        )

    def _due(self, kind: str, now: float) -> bool:
        last = self._last_warned.get(kind)
        if last is not None and now - last < self.warn_interval_s:
            return False
        self._last_warned[kind] = now
        self.warnings[kind] += 1
        return True


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)
