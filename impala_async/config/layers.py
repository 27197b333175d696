"""A learner's configuration in layers, lowest first, each value labelled with the layer that set it:

1. ``default``: the built-in defaults (config/sections.py);
2. ``preset:<family>``: the environment family's preset (config/presets.py);
3. ``resumed``: the configuration of the checkpoint a ``--resume`` continues, but for the fields about this process
   (``metrics_port``, ``metrics_host``) and those only the command line or ``--config`` may set (COMMAND_LINE_ONLY:
   the addresses, ``insecure``, the CURVE keys, the number of local actors, the env-module permission), which a
   resume leaves at their defaults and names in a warning;
4. ``file:<path>``: ``--config FILE``, TOML or YAML (or a run's ``config.json``), with the flags' names;
5. ``flag``: the flags typed on this command line;
6. ``command`` (what the command itself fixes: ``learner`` starts no actors, ``--resume DIR`` writes to DIR) and
   ``resolved`` (values left to resolution: addresses, logdir, input scale, per-message limits; config/resolve.py).

The result is written to ``LOGDIR/config.json`` and printed at start as the differences from the defaults.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import presets
from .actors import PER_INVOCATION
from .learner import INDEX, LearnerConfig, from_flat
from .sections import OWN_ENV_MODULES, env_module

DEFAULT, RESUMED, FLAG, COMMAND, RESOLVED = "default", "resumed", "flag", "command", "resolved"
CONFIG_JSON = "config.json"
log = logging.getLogger("impala_async.config.layers")
# The layers of a run's config.json that ``--config`` takes again (the others follow from the defaults, the preset
# and resolution), and the fields it never takes (a re-run must not write into the old run's directory).
REPLAYED = ("preset", "resumed", "file", "flag")
NOT_REPLAYED = ("logdir", *PER_INVOCATION)
# What opens the learner to the network or starts processes (or imports code) comes from the command line or a file
# the user names with --config, never from the configuration a checkpoint carries: a resume sets these aside, and
# says so.
COMMAND_LINE_ONLY = ("listen", "publish", "insecure", "curve_keys", "num_actors", "allow_env_module")
YAML_HINT = "pip install 'impala-async[yaml]'"
RENAMED = {  # fields of earlier versions: what a file that still names one is told
    "curriculum_episodes": "curriculum_env_steps: the curriculum moves with the env steps the learner trained, not the "
    "episodes actors report (docs/design.md, Curriculum)",
}
MAX_CONFIG_FILE_BYTES = 1 << 20  # a --config file; a run's config.json is about 10 KB
MAX_CONFIG_NESTING = 32  # brackets within brackets: a configuration has at most 2 (a list in a table)


@dataclass(frozen=True)
class Layered:
    cfg: LearnerConfig
    layers: dict = field(default_factory=dict)  # flag name -> label of the layer that set it (absent: default)

    def over(self, label: str, values: dict, where: str | None = None) -> Layered:
        """These values (by flag name) on top, labelled ``label``; a file's values are checked as they are read."""
        if not values:
            return self
        cfg = from_flat(values, where or label, base=self.cfg)
        return Layered(cfg, {**self.layers, **dict.fromkeys(values, label)})

    def layer(self, name: str) -> str:
        return self.layers.get(name, DEFAULT)

    def check(self) -> LearnerConfig:
        """The configuration checked (LearnerConfig.check), a refusal naming where the value at fault came from."""
        try:
            return self.cfg.check()
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            where = self.layer(name) if name in INDEX else DEFAULT
            source = {FLAG: "typed", RESUMED: "from the checkpoint's configuration"}.get(where, where)
            if where.startswith("file:"):
                source = f"from --config {where[len('file:') :]}"
            raise ValueError(f"{e} ({source})" if where != DEFAULT else str(e)) from None

    def differences(self) -> list[tuple[str, str, object, str]]:
        """(section, name, value, layer) of every value that differs from the built-in default."""
        defaults, values = LearnerConfig().flat(), self.cfg.flat()
        return [(INDEX[n][0], n, v, self.layer(n)) for n, v in values.items() if v != defaults[n]]

    def describe(self) -> str:
        rows = self.differences()
        if not rows:
            return "configuration: the built-in defaults"
        width = max(len(f"{s}.{n} = {v!r}") for s, n, v, _ in rows)
        lines = [f"  {f'{s}.{n} = {v!r}':<{width}}  ({layer})" for s, n, v, layer in rows]
        return "configuration (values that differ from the defaults, and the layer that set each):\n" + "\n".join(lines)

    def to_json(self, command: str) -> dict:
        sections: dict[str, dict] = {}
        for name, value in self.cfg.flat().items():
            sections.setdefault(INDEX[name][0], {})[name] = value
        return {
            "command": command,
            "config": sections,
            "layers": {name: self.layer(name) for name in INDEX if self.layer(name) != DEFAULT},
        }

    def write(self, directory: str | Path, command: str) -> Path:
        """``directory/config.json``, written whole or not at all."""
        path = Path(directory) / CONFIG_JSON
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{CONFIG_JSON}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(command), indent=1) + "\n")
        os.replace(tmp, path)
        return path


def load(
    *,
    flags: dict,
    file: str = "",
    resumed: dict | None = None,
    resumed_layers: dict | None = None,
    command: dict | None = None,
) -> Layered:
    """The layers put together (module docstring); ValueError naming the file or field at fault, or refusing an env
    id that would import a module named by a file (:func:`env_module_refusal`). ``resumed``: a checkpoint's
    configuration, ``resumed_layers`` the layers it was saved with (absent in older checkpoints)."""
    from_file = read_file(file) if file else {}
    layered = stack(flags, from_file, file, resumed or {}, resumed_layers or {}, command or {})
    ignored = ignored_from_checkpoint(resumed or {}, resumed_layers or {}, {**from_file, **flags})
    if ignored:
        log.warning(
            "resume: the checkpoint's configuration sets %s, which only the command line or --config sets (they open "
            "the learner to the network or start processes): ignored; type them to keep them",
            ", ".join(f"{k} = {v!r}" for k, v in ignored.items()),
        )
    refusal = env_module_refusal(layered)
    if refusal:
        raise ValueError(refusal)
    return layered


def stack(flags: dict, from_file: dict, file: str, resumed: dict, resumed_layers: dict, command: dict) -> Layered:
    """The defaults, the preset, what a resume takes of ``resumed`` (:func:`_resumed`), the file's values, the flags
    and the command's, in that order. With only ``resumed``: the configuration a checkpoint would resume with, which
    is what validating a checkpoint checks (learner/checkpoint/statecheck.py)."""
    resumed_values = _resumed(resumed, resumed_layers, {**from_file, **flags})
    on_top = {**resumed_values, **from_file, **flags}
    env_id = on_top.get("env", LearnerConfig().env.env)
    family = presets.chosen(on_top.get("preset", LearnerConfig().run.preset), str(env_id))
    layered = Layered(LearnerConfig())
    if family is not None:
        layered = layered.over(f"preset:{family}", presets.PRESETS[family])
    layered = layered.over(RESUMED, resumed_values, "the checkpoint's configuration")
    layered = layered.over(f"file:{file}", from_file, file)
    return layered.over(FLAG, flags).over(COMMAND, command)


def env_module_refusal(layered: Layered) -> str:
    """Why the env id must not be used ("" if it may). An id ``module:Name`` makes gymnasium import ``module``, which
    runs its code: from a file (the configuration of the checkpoint a --resume continues, a --config file) that is
    refused, so that a file cannot make the learner run code, unless the module is the package's own test environments'
    (sections.OWN_ENV_MODULES) or --allow-env-module 1 was typed on the command line (the flag layer: the same value
    from a file does not count). An id typed with --env is the user's own choice."""
    env = layered.cfg.env
    module = env_module(env.env)
    if not module or module in OWN_ENV_MODULES or layered.layer("env") == FLAG:
        return ""
    if env.allow_env_module and layered.layer("allow_env_module") == FLAG:
        return ""
    source = layered.layer("env")
    where = "the resumed checkpoint's configuration" if source == RESUMED else source.replace("file:", "--config ")
    return (
        f"env {env.env!r} from {where} would import module {module!r}, running its code: type --allow-env-module 1 "
        f"to allow that (or the id itself with --env)"
    )


def _resumed(saved: dict, saved_layers: dict, above: dict) -> dict:
    """What a resume takes from its checkpoint's configuration: every field it knows (a checkpoint of an older version
    may lack some, or have some no longer known) but the process's own and those resolution filled (resolved again
    here, on this machine: the number of local actors, the descriptor limit's connections); with a new ``listen``
    from above and no ``publish``, the publish address is derived from the new listen, not kept from the old run."""
    values = {
        k: v
        for k, v in saved.items()
        if k in INDEX and k not in (*PER_INVOCATION, *COMMAND_LINE_ONLY) and saved_layers.get(k) != RESOLVED
    }
    return values


def ignored_from_checkpoint(saved: dict, saved_layers: dict, above: dict) -> dict:
    """The COMMAND_LINE_ONLY values of a checkpoint's configuration that a resume sets aside: those its run chose (not
    defaults, not resolved on its machine) and that neither the flags nor the --config file give again."""
    defaults = LearnerConfig().flat()
    return {
        k: saved[k]
        for k in COMMAND_LINE_ONLY
        if k in saved and k not in above and saved[k] != defaults[k] and saved_layers.get(k) != RESOLVED
    }


def read_file(path: str) -> dict:
    """A config file's values by flag name. TOML (.toml) or YAML (.yaml, .yml; JSON is YAML too, and a run's
    config.json is read as such): a mapping of flag names (dashes or underscores) to values, at the top or in tables
    named after sections (``[loss]``), whose names must then belong to that section."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_CONFIG_FILE_BYTES + 1)
        text = raw.decode("utf-8")
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--config {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        raise ValueError(f"--config {path}: larger than {MAX_CONFIG_FILE_BYTES:,} bytes; a configuration is a few KB")
    if _bracket_depth(text) > MAX_CONFIG_NESTING:  # before parsing: PyYAML takes tens of seconds over 5,000
        raise ValueError(f"--config {path}: brackets nested more than {MAX_CONFIG_NESTING} deep; not a configuration")
    try:
        data = _parse(text, p)
    except RecursionError:  # nesting by indentation, which the parsers recurse into
        raise ValueError(f"--config {path}: nested too deeply to be a configuration") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: a mapping of flag names to values, got {type(data).__name__}")
    if "config" in data and "layers" in data:  # a run's config.json
        return _replayed(data, path)
    return _flatten(data, path)


def _bracket_depth(text: str) -> int:
    """The deepest nesting of [] and {} in ``text`` (brackets inside strings count too: no configuration has many)."""
    depth = deepest = 0
    for ch in re.sub(r"[^\[\]{}]", "", text):
        depth = depth + 1 if ch in "[{" else max(0, depth - 1)
        deepest = max(deepest, depth)
    return deepest


def _parse(text: str, p: Path):
    """The file's data structure, by its suffix; ValueError naming the file for what does not parse."""
    path = str(p)
    if p.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {path}: not valid TOML: {e}") from None
    elif p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {path}: not valid JSON: {e}") from None
    elif p.suffix in (".yaml", ".yml"):
        data = _yaml(text, path)
    else:
        raise ValueError(f"--config {path}: a TOML (.toml), YAML (.yaml, .yml) or JSON (.json) file, please")
    return data


def _yaml(text: str, path: str):
    try:
        import yaml
    except ImportError:
        raise ValueError(f"--config {path}: reading YAML needs PyYAML, which is not installed: {YAML_HINT}") from None
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):  # linear, before anything is built
            if getattr(event, "anchor", None) is not None or isinstance(event, yaml.AliasEvent):
                raise ValueError(
                    f"--config {path}: YAML anchors and aliases (&, *) are refused: a configuration needs none, and "
                    "an alias can make a few bytes expand without bound"
                )
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {str(e)[:500]}") from None


def _flatten(data: dict, path: str) -> dict:
    sections = {s for s, _ in INDEX.values()}
    out: dict = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if isinstance(value, dict) and name in sections:
            for inner, v in value.items():
                n = str(inner).replace("-", "_")
                if n in INDEX and INDEX[n][0] != name:
                    raise ValueError(f"--config {path}: {n} belongs to section [{INDEX[n][0]}], not [{name}]")
                _put(out, n, v, path)
        else:
            _put(out, name, value, path)
    return out


def _put(out: dict, name: str, value, path: str) -> None:
    if name in RENAMED:
        raise ValueError(f"--config {path}: {name} is now {RENAMED[name]}")
    if name not in INDEX:
        raise ValueError(f"--config {path}: no configuration field {name!r} (see impala-async train --help)")
    if name in out:
        raise ValueError(f"--config {path}: {name} given twice")
    out[name] = value


def _replayed(data: dict, path: str) -> dict:
    """A run's config.json: the values that run chose (REPLAYED layers), but for NOT_REPLAYED."""
    flat = _flatten(data["config"], path)
    layers = data["layers"] if isinstance(data["layers"], dict) else {}
    return {
        n: v for n, v in flat.items() if n not in NOT_REPLAYED and str(layers.get(n, DEFAULT)).split(":")[0] in REPLAYED
    }
