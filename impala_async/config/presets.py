"""Presets: values for an environment family, a layer between the built-in defaults and ``--config``/flags.

``--preset auto`` (the default) picks the family from the environment id (:func:`family`); ``--preset none`` applies
nothing; ``--preset classic|minatar|atari`` picks one by hand. A preset maps flag names to values; the values a run
took from one are labelled ``preset:<family>`` in LOGDIR/config.json and in the configuration printed at start.
The families' values are the learning issue's to fill: today every preset is empty, and a run's values are the
built-in defaults unless a file or a flag sets them.
"""

from __future__ import annotations

FAMILIES = ("classic", "minatar", "atari")
PRESETS: dict[str, dict] = {"classic": {}, "minatar": {}, "atari": {}}


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
