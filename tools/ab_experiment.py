"""The A/B harness's experiment file (tools/ab.py): its keys checked all at once, the runs it plans and the command
line of each, every layer as `train`'s own flags."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: the package's own dependency
    import tomli as tomllib

DEFAULT_CHECKPOINTS = (0.25, 0.5, 0.75)
FLAG_NAME = re.compile(r"[a-z][a-z0-9_]*")  # a field of train's configuration, as the flag names it
EXPERIMENT_KEYS = {
    "name",
    "seeds",
    "total_env_steps",
    "config",
    "flags",
    "checkpoints",
    "threshold",
    "stop_at_threshold",
    "timeout_s",
    "twice",
    "arms",
}


@dataclass(frozen=True)
class Experiment:
    name: str
    seeds: tuple[int, ...]
    total_env_steps: int
    arms: dict[str, dict]  # arm -> its flags (by flag name)
    config: Path | None = None
    flags: dict = field(default_factory=dict)
    checkpoints: tuple[float, ...] = DEFAULT_CHECKPOINTS
    threshold: float | None = None
    stop_at_threshold: bool = False
    timeout_s: float = 0.0
    twice: bool = False

    @classmethod
    def load(cls, path: Path) -> Experiment:
        """The experiment file, every problem in it reported at once (ValueError)."""
        raw = tomllib.loads(path.read_text())
        errors = [f"unknown key {k!r}" for k in raw if k not in EXPERIMENT_KEYS]
        errors += [f"{k} is required" for k in ("name", "seeds", "total_env_steps", "arms") if k not in raw]
        arms = raw.get("arms", {})
        if not isinstance(arms, dict) or not arms or not all(isinstance(v, dict) for v in arms.values()):
            errors.append("arms must be one table or more: [arms.NAME] with the arm's flags")
        named = [("flags", raw.get("flags", {}))]
        named += [(f"arm {k!r}", v) for k, v in arms.items()] if isinstance(arms, dict) else []
        for where, values in named:
            bad = [n for n in values if not FLAG_NAME.fullmatch(str(n))] if isinstance(values, dict) else []
            errors += [f"{where}: {n!r} is not a flag name (a dot in [arms.NAME] nests a table: quote it)" for n in bad]
        if not all(isinstance(s, int) for s in raw.get("seeds", [])) or not raw.get("seeds"):
            errors.append("seeds must be a non-empty list of integers")
        if not all(0 < f < 1 for f in raw.get("checkpoints", DEFAULT_CHECKPOINTS)):
            errors.append("checkpoints must be fractions of the budget, each in (0, 1)")
        if raw.get("stop_at_threshold") and raw.get("threshold") is None:
            errors.append("stop_at_threshold needs a threshold")
        shared = raw.get("flags", {})
        layered = (
            [{**shared, **arm} for arm in arms.values() if isinstance(arm, dict)] if isinstance(arms, dict) else []
        )
        if raw.get("twice") and not all(int(values.get("reproducible", 0)) for values in layered):
            errors.append("twice needs reproducible = 1 in flags or in every arm: other runs of one seed differ")
        if errors:
            raise ValueError(f"{path}: " + "; ".join(errors))
        config = raw.get("config")
        return cls(
            name=raw["name"],
            seeds=tuple(raw["seeds"]),
            total_env_steps=int(raw["total_env_steps"]),
            arms=arms,
            config=(path.parent / config) if config else None,
            flags=raw.get("flags", {}),
            checkpoints=tuple(raw.get("checkpoints", DEFAULT_CHECKPOINTS)),
            threshold=raw.get("threshold"),
            stop_at_threshold=bool(raw.get("stop_at_threshold", False)),
            timeout_s=float(raw.get("timeout_s", 0.0)),
            twice=bool(raw.get("twice", False)),
        )


def as_flags(values: dict) -> list[str]:
    """``{"batch_size": 32}`` -> ``["--batch-size", "32"]`` (JSON for what is not a plain scalar)."""
    out = []
    for name, value in values.items():
        text = value if isinstance(value, str) else json.dumps(value)
        out += [f"--{name.replace('_', '-')}", text]
    return out


def command(exp: Experiment, arm: str, seed: int, logdir: Path) -> list[str]:
    """The run's command line: the layers in order (config file, shared flags, the arm's flags, the run's own)."""
    cmd = [sys.executable, "-m", "impala_async", "train"]
    if exp.config:
        cmd += ["--config", str(exp.config)]
    cmd += as_flags(exp.flags) + as_flags(exp.arms[arm])
    return cmd + ["--total-env-steps", str(exp.total_env_steps), "--seed", str(seed), "--logdir", str(logdir)]


def problems(exp: Experiment, out: Path) -> list[str]:
    """What `train` would refuse in each arm's command line (an unknown flag, a value out of range), found by its own
    parser and configuration before any run starts: one line an arm, all of them at once."""
    from impala_async import cli

    found = []
    for arm in exp.arms:
        argv = command(exp, arm, exp.seeds[0], out / arm / f"s{exp.seeds[0]}")[3:]
        args, unknown = cli.build_parser().parse_known_args(argv)
        if unknown:
            found.append(f"arm {arm!r}: train has no {' '.join(a for a in unknown if a.startswith('--'))}")
            continue
        try:
            cli.load_learner_config(args)
        except SystemExit as e:  # a value train refuses: its one line
            found.append(f"arm {arm!r}: {e}")
    return found


def planned(exp: Experiment, out: Path, twins: bool = False) -> list[tuple[str, int, Path]]:
    """(arm, seed, logdir) in the order runs go: seed by seed, the arms alternating; with ``twins`` (and ``twice``)
    each run followed by its twin."""
    suffixes = ("", "-twin") if twins and exp.twice else ("",)
    return [(arm, seed, out / arm / f"s{seed}{x}") for seed in exp.seeds for arm in exp.arms for x in suffixes]


def selected(exp: Experiment, arms: str | None, seeds: str | None) -> Experiment:
    """The experiment cut down to the arms and seeds named (comma-separated; None: all of them), each of which the
    file must have (ValueError naming what it has)."""
    names = arms.split(",") if arms else list(exp.arms)
    unknown = [a for a in names if a not in exp.arms]
    try:
        numbers = [int(s) for s in seeds.split(",")] if seeds else list(exp.seeds)
    except ValueError:
        raise ValueError(f"--seeds {seeds!r}: comma-separated integers") from None
    missing = [s for s in numbers if s not in exp.seeds]
    errors = [f"no arm {a!r} (the file's arms: {', '.join(exp.arms)})" for a in unknown]
    errors += [f"no seed {s} (the file's seeds: {', '.join(map(str, exp.seeds))})" for s in missing]
    if errors:
        raise ValueError(f"{exp.name}: " + "; ".join(errors))
    return replace(exp, arms={a: exp.arms[a] for a in names}, seeds=tuple(numbers))
