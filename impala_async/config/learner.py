"""The learner's whole configuration: its sections together, addressed by flag name where a flat view is needed
(config files, config.json, checkpoints, the learner ranks' store)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .actors import ActorOptions
from .fields import coerce, fields_of, flag_of, kind_of, need, opt
from .machine import usable_cpus
from .sections import Env, Loss, Model, Ring, Run
from .service import Checkpoints, Limits, Network, Observe, Ranks


@dataclass(frozen=True)
class LocalActors(ActorOptions):
    """Actor processes train starts itself (their options are an impala-async actor's, under --actor-* names)."""

    num_actors: int = opt(
        -1,
        "actor processes started by 'train' (-1: one per usable CPU core, a container's quota "
        "included, but the one the learner keeps; 0: none, attach external actors instead)",
    )

    def check(self) -> None:
        super().check()
        need(self.num_actors >= -1, "num_actors must be >= 0, or -1 for one per CPU core but one")

    def options(self) -> ActorOptions:
        """The options every actor process takes (without train's count of them)."""
        return ActorOptions(**{f.name: getattr(self, f.name) for f in fields_of(ActorOptions)})


@dataclass(frozen=True)
class LearnerConfig:
    """Sections in --help order. Build one from flag names with :meth:`of`; change one with :meth:`replace` (a new
    config: sections are frozen)."""

    run: Run = field(default_factory=Run)
    env: Env = field(default_factory=Env)
    model: Model = field(default_factory=Model)
    loss: Loss = field(default_factory=Loss)
    ring: Ring = field(default_factory=Ring)
    network: Network = field(default_factory=Network)
    limits: Limits = field(default_factory=Limits)
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    observe: Observe = field(default_factory=Observe)
    actors: LocalActors = field(default_factory=LocalActors)
    ranks: Ranks = field(default_factory=Ranks)

    @classmethod
    def of(cls, **values) -> LearnerConfig:
        """A config with the defaults but for ``values``, given by flag name (``batch_size=8``)."""
        return cls().replace(**values)

    def replace(self, **values) -> LearnerConfig:
        """A copy with ``values`` (by flag name) changed; TypeError for a name that is no flag."""
        by_section: dict[str, dict] = {}
        for name, value in values.items():
            if name not in INDEX:
                raise TypeError(f"no configuration field {name!r}")
            section, attr = INDEX[name]
            by_section.setdefault(section, {})[attr] = value
        changes = {s: dataclasses.replace(getattr(self, s), **v) for s, v in by_section.items()}
        return dataclasses.replace(self, **changes)

    def flat(self) -> dict:
        """Every value by flag name, in --help order."""
        return {name: getattr(getattr(self, section), attr) for name, (section, attr) in INDEX.items()}

    def check(self) -> LearnerConfig:
        """Raise ValueError naming the field and the failure it would cause (each section checks its own)."""
        for f in dataclasses.fields(self):
            getattr(self, f.name).check()
        return self

    def warnings(self) -> list[str]:
        """What a valid configuration does that its user may not mean, one line each (the learner logs them)."""
        loss, total = self.loss, self.run.total_env_steps
        out = []
        if loss.lr_schedule == "linear" and total > loss.schedule_env_steps:
            out.append(
                f"lr_schedule linear reaches a learning rate of 0 at schedule_env_steps = {loss.schedule_env_steps:,}, "
                f"before total_env_steps = {total:,}: the rest of the run will not learn (raise --schedule-env-steps "
                "to the budget, or choose --lr-schedule constant)"
            )
        if loss.entropy_schedule_env_steps and loss.final_entropy_cost < 0:
            out.append(
                "entropy_schedule_env_steps is set but final_entropy_cost is not: the entropy cost stays at "
                f"entropy_cost = {loss.entropy_cost:g} (give --final-entropy-cost the value to anneal to)"
            )
        return out

    @property
    def local_actors(self) -> int:
        n = self.actors.num_actors
        return max(1, usable_cpus() - 1) if n == -1 else n


def section_classes() -> list[tuple[str, type]]:
    """(attribute, section class) of every section of LearnerConfig, in order."""
    defaults = LearnerConfig()
    return [(f.name, type(getattr(defaults, f.name))) for f in dataclasses.fields(LearnerConfig)]


def _index() -> dict[str, tuple[str, str]]:
    """flag name -> (section attribute, field attribute), in --help order; names are unique across sections."""
    out: dict[str, tuple[str, str]] = {}
    for section, cls in section_classes():
        for f in fields_of(cls):
            name = flag_of(f, learner=True)
            assert name not in out, f"configuration field {name} in two sections"
            out[name] = (section, f.name)
    return out


INDEX = _index()
KINDS = {
    name: kind_of(next(f for f in fields_of(cls) if f.name == attr))
    for name, (section, attr) in INDEX.items()
    for s, cls in section_classes()
    if s == section
}


def from_flat(values: dict, where: str, base: LearnerConfig | None = None, strict: bool = True) -> LearnerConfig:
    """``base`` (default: the defaults) with ``values`` by flag name, each coerced to its field's type (ValueError
    naming ``where`` for a wrong type; for an unknown name too, with ``strict``, else it is skipped)."""
    known = {}
    for name, value in values.items():
        if name not in INDEX:
            if strict:
                raise ValueError(f"{where}: no configuration field {name!r} (see impala-async train --help)")
            continue
        known[name] = coerce(name, KINDS[name], value, where)
    return (base or LearnerConfig()).replace(**known)
