"""Presets: values for an environment family, a layer between the built-in defaults and ``--config``/flags.

``--preset auto`` (the default) picks the family from the environment id (:func:`family`); ``--preset none`` applies
nothing; ``--preset classic|minatar|atari`` picks one by hand. A preset maps flag names to values; the values a run
took from one are labelled ``preset:<family>`` in LOGDIR/config.json and in the configuration printed at start.
Where each family's values come from, and what they reached: BENCHMARKS.md, sections 10, 15 and 16 (MinAtar) and
14 (Atari).
"""

from __future__ import annotations

FAMILIES = ("classic", "minatar", "atari")
# Classic control (CartPole, ...) learns with the built-in defaults (BENCHMARKS.md, section 1): its preset is empty.
CLASSIC: dict = {}

# MinAtar's 10x10 planes: rewards of +1 a brick or a fish need no shrinking (CartPole's 0.1 leaves them too small
# against the entropy bonus), a large entropy bonus annealed tenfold keeps the seeds exploring past the first plateau,
# small batches make many updates of a small network, and each batch is learnt twice before its slot is freed (a run
# takes about 1.5x as long, under 6 minutes on 2 cores). BENCHMARKS.md, sections 10, 15 and 16: how each value was
# found and what the five games reach with them. They were found with the schedules' horizon at the 5M-step budget and
# without an active gradient clip (the clip of 40 was then on the mean loss, where it never fired: section 17).
MINATAR: dict = {
    "max_grad_norm": 0.0,
    "schedule_env_steps": 5_000_000,
    "reward_scale": 1.0,
    "entropy_cost": 0.03,
    "final_entropy_cost": 0.003,
    "learning_rate": 1e-3,
    "batch_size": 8,
    "ring_batches": 16,
    "updates_per_batch": 2,
}

# Atari (ALE v5 and NoFrameskip-v4): the IMPALA paper's Atari values (rewards clipped to +-1 and not scaled, entropy
# 0.01, learning rate 6e-4 decayed linearly to 0 over the paper's 200M frames, 50M agent steps) and its optimiser:
# RMSprop (epsilon 0.01, no momentum) with the gradient clipped at 40, both in the paper's unit (the loss summed over
# the batch's steps). Against the same values with Adam and no clip, Pong v5 left -15 after 2.09M and 2.17M agent
# steps instead of 2.84M and 2.70M (2 seeds each, and -9.6 / -9.9 against -14 at 3M): BENCHMARKS.md section 17.
# Each pixel is normalised by running statistics (--obs-norm 1, Sample Factory's normalize_input, without which its
# own Atari example sat at a uniform policy): Pong v5 then left -15 after 0.45M and 0.48M agent steps instead of
# 2.09M and 2.17M, and stood at +10.7 and +14.4 at 2M against -16.4 and -15.6 (2 seeds each; BENCHMARKS.md
# section 17, "Observation normalisation on sticky Pong").
ATARI: dict = {
    "optimizer": "rmsprop",
    "max_grad_norm": 40.0,
    "schedule_env_steps": 50_000_000,
    "reward_clip": 1.0,
    "reward_scale": 1.0,
    "entropy_cost": 0.01,
    "learning_rate": 6e-4,
    "obs_norm": 1,
}

PRESETS: dict[str, dict] = {"classic": CLASSIC, "minatar": MINATAR, "atari": ATARI}


def is_atari(env_id: str) -> bool:
    """ALE ids (``ALE/Pong-v5``) and the NoFrameskip-v4 ones (``PongNoFrameskip-v4``)."""
    return env_id.startswith("ALE/") or env_id.endswith("NoFrameskip-v4")


def is_minatar(env_id: str) -> bool:
    return env_id.startswith("MinAtar/")


def family(env_id: str) -> str:
    """The environment family of an id: atari, minatar, or classic (anything else: CartPole, ...)."""
    if is_atari(env_id):
        return "atari"
    if is_minatar(env_id):
        return "minatar"
    return "classic"


def chosen(preset: str, env_id: str) -> str | None:
    """The family whose preset applies (``auto``: the environment's), or None for ``none``."""
    if preset == "none":
        return None
    return family(env_id) if preset == "auto" else preset
