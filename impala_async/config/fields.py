"""Sections of configuration: frozen dataclasses whose fields are command-line flags, config-file keys and config.json
entries, all under one name.

A field is declared with :func:`opt` (its default, its help, and where it differs, the flag it has in the learner's
commands). Its type is its default's (``int``, ``float`` or ``str``). A section is a :class:`Section`: a frozen
dataclass with a ``NAME`` (the table it is written under), a ``TITLE`` (its ``--help`` group) and a ``check()`` that
raises ValueError naming the field and the failure it would cause. No I/O, no imports from the rest of the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

TYPES = (int, float, str)


def opt(default, help: str, *, learner_flag: str = "", choices: tuple = ()):
    """A configuration field. ``learner_flag``: its name in ``train``/``learner`` (and their files) where that differs
    from the field's own (an actor's ``device`` is the learner's ``actor_device``). ``choices``: the only values
    accepted, listed in ``--help`` and checked by :meth:`Section.check_choices`."""
    if type(default) not in TYPES:
        raise TypeError(f"a configuration default must be an int, float or str, got {default!r}")
    return field(default=default, metadata={"help": help, "learner_flag": learner_flag, "choices": tuple(choices)})


@dataclass(frozen=True)
class Section:
    NAME: ClassVar[str] = ""
    TITLE: ClassVar[str] = ""

    def check(self) -> None:
        """Raise ValueError naming the field and what its value would break. Sections add their own checks."""
        self.check_choices()
        self.check_finite()

    def check_finite(self) -> None:
        """Every float field finite: no value means "never" or "unbounded" by being infinite (a timeout of inf would
        hang a shutdown, a learning rate of inf skip every update), and NaN means nothing."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if type(value) is float and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value}")

    def check_choices(self) -> None:
        for f in dataclasses.fields(self):
            allowed = f.metadata["choices"]
            if allowed and getattr(self, f.name) not in allowed:
                raise ValueError(
                    f"{f.name} must be one of {', '.join(map(str, allowed))}, got {getattr(self, f.name)!r}"
                )


def flag_of(f: dataclasses.Field, learner: bool) -> str:
    """The field's name as a flag and file key (underscores) in the learner's commands or in ``actor``."""
    return (f.metadata["learner_flag"] or f.name) if learner else f.name


def fields_of(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def kind_of(f: dataclasses.Field) -> type:
    return type(f.default)


def coerce(name: str, kind: type, value: Any, where: str) -> Any:
    """``value`` from a file or a store as ``kind``; ValueError naming ``name`` and ``where`` if it is not one. An int
    (or a bool, for 0/1 switches) is taken for a float field; nothing else is converted."""
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool):
        return int(value)
    if type(value) is kind:
        return value
    wanted = {float: "a number", int: "an integer"}.get(kind, "a string")
    raise ValueError(f"{where}: {name} must be {wanted}, got {value!r:.80}")


def finite(name: str, value: float, minimum: float = 0.0, strict: bool = False) -> None:
    """Raise ValueError unless ``value`` is finite and >= ``minimum`` (> with ``strict``)."""
    ok = math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {minimum:g}, got {value}")


def positive(section: Section, *names: str) -> None:
    """Each of ``names`` must be > 0 (and, a float, finite: Section.check_finite)."""
    for name in names:
        value = getattr(section, name)
        if not value > 0:  # NaN fails too
            raise ValueError(f"{name} must be > 0, got {value}")


def finite_positive(section: Section, *names: str) -> None:
    """Each of ``names`` must be a finite number > 0."""
    for name in names:
        finite(name, getattr(section, name), 0.0, strict=True)


def at_least(section: Section, minimum: int, *names: str) -> None:
    for name in names:
        if getattr(section, name) < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {getattr(section, name)}")


def need(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def add_arguments(parser: argparse.ArgumentParser, cls, *, learner: bool, skip=(), required=()):
    """One ``--flag`` per field of section ``cls`` in a group titled by the section, each with ``default=SUPPRESS``:
    the namespace then holds exactly the flags typed on the command line (an abbreviation included), and the layers
    below them (defaults, preset, file) stay the config's business. ``required``: flags that must be typed."""
    group = parser.add_argument_group(f"{cls.TITLE} [{cls.NAME}]", (cls.__doc__ or "").strip().split("\n\n")[0])
    for f in fields_of(cls):
        name = flag_of(f, learner)
        if name in skip:
            continue
        kind = kind_of(f)
        choices = f.metadata["choices"]
        shown = f" {{{','.join(map(str, choices))}}}" if choices else ""
        text = f.metadata["help"] + shown
        if name in required:
            text += " (required)"
        elif "default:" not in text:  # a help that explains its default itself keeps its own words
            text += f" (default: {f.default!r})"
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=kind,
            default=argparse.SUPPRESS,
            required=name in required,
            metavar=kind.__name__.upper(),
            help=text,
        )
    return group
