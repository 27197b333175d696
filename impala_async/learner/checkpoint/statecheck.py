"""What a learner checkpoint must hold before anything uses it (checkpoint.validate_learner_state, at resume and in
eval), after checkpoint.load made sure it is a bounded tree of scalars and dense tensors.

Every field typed and ranged: the counters within [0, 2^63) (int64 wherever they go: the wire, metrics), the wall
time, returns and lengths finite, torch's RNG state a uint8 tensor of its size; the configuration one this version
accepts (``from_flat`` for the types, each section's ``check()`` for the ranges); the trajectory spec. Then the
network the configuration and the spec describe, built on the meta device (shapes, no memory): a network whose fp32
weights alone would exceed ``max_checkpoint_bytes`` is refused before anything is allocated for it; the weights and
the optimizer's state must fit it name for name and shape for shape, and every float tensor must be finite.
"""

from __future__ import annotations

import math

import torch

from ...config import INDEX, LearnerConfig, from_flat, layers
from ...core.finite import nonfinite
from ...core.models import build_model
from ...core.spec import TrajectorySpec
from ..learn import SWITCH_KEYS, Learner, model_config

MAX_COUNT = 1 << 63  # counters stay below: they travel as int64
# key -> accepted type of a learner checkpoint (checkpoint.learner_state); "config_layers" is optional (older ones).
STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "learner": dict,
    "policy_version": int,
    "env_steps": int,
    "episodes": int,
    "returns": list,
    "lengths": list,
    "wall_s": (float, int),
    "config": dict,
    "spec": dict,
    "torch_rng": torch.Tensor,
}
LEARNER_TYPES: dict[str, type | tuple[type, ...]] = {
    "model": dict,
    "optimizer": dict,
    "env_steps_trained": int,
    "updates": int,
}
COUNTERS = ("policy_version", "env_steps", "episodes")
SPEC_INTS = ("num_actions", "unroll_length", "frame_stack", "core_state_size")
MAX_SPEC_INT = 1 << 31  # a dimension, an action count, an unroll length
# The per-parameter state each optimizer keeps (torch.optim): anything else is no optimizer state of ours.
OPTIMIZER_STATE_KEYS = {
    "adam": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "rmsprop": {"step", "square_avg", "momentum_buffer", "grad_avg"},
}


def validate(state: dict, max_bytes: int, optimizer: bool = True) -> None:
    """Raise ValueError unless ``state`` is a learner checkpoint this version can resume (module docstring). Without
    ``optimizer`` (eval, which never uses it) the optimizer's state is not checked."""
    layout(state)
    cfg = configuration(state["config"], state.get("config_layers", {}))
    spec = trajectory_spec(state["spec"])
    weights_fit(state["learner"]["model"], network(cfg, spec, state["learner"]["model"], max_bytes))
    if optimizer:
        optimizer_fits(state["learner"]["optimizer"], cfg, spec)
    tensors = list(state["learner"]["model"].items())
    if optimizer:
        tensors += [
            (f"optimizer.{i}.{k}", v) for i, s in state["learner"]["optimizer"]["state"].items() for k, v in s.items()
        ]
    bad = nonfinite(tensors)
    if bad:
        raise ValueError(f"non-finite values in tensor {bad[0]}")


def layout(state: dict) -> None:
    """The keys and their types; counters, wall time, returns and lengths ranged; torch's RNG state its own shape.
    Prevents: a policy version of 2^64 (which no weights message can carry), a float RNG state, counters below 0."""
    for where, tree, types in (("", state, STATE_TYPES), ("learner.", state.get("learner"), LEARNER_TYPES)):
        for key, kind in types.items():
            value = tree.get(key) if isinstance(tree, dict) else None
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{where}{key} is missing or not a {kind}")
    for name in (*COUNTERS, "learner.env_steps_trained", "learner.updates"):
        value = state["learner"][name[len("learner.") :]] if name.startswith("learner.") else state[name]
        if not 0 <= value < MAX_COUNT:
            raise ValueError(f"{name} must lie in [0, 2^63), got {value}")
    if not (math.isfinite(state["wall_s"]) and 0 <= state["wall_s"] < MAX_COUNT):
        raise ValueError(f"wall_s must be a finite number >= 0, got {state['wall_s']}")
    for name in ("returns", "lengths"):
        if not all(_number(x) and math.isfinite(x) for x in state[name]):
            raise ValueError(f"{name} must be a list of finite numbers")
    rng, size = state["torch_rng"], torch.get_rng_state().numel()
    if rng.dtype != torch.uint8 or tuple(rng.shape) != (size,):
        raise ValueError(f"torch_rng must be uint8 [{size}] (torch.get_rng_state()), got {rng.dtype} {list(rng.shape)}")
    layers = state.get("config_layers", {})
    if not (isinstance(layers, dict) and all(type(k) is str and type(v) is str for k, v in layers.items())):
        raise ValueError("config_layers must map field names to layer names")


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def configuration(values: dict, saved_layers: dict) -> LearnerConfig:
    """The configuration a resume takes from the checkpoint (config/layers.py ``stack``: the defaults, the preset,
    every field the run chose but those about one process and those resolution fills), each value of its field's type
    (``from_flat``; every field, taken or not, which eval reads too; fields this version does not know are left out)
    and in its range (``check()``). ValueError naming the field otherwise. Prevents a string in an integer field, or
    a value no run could have had, reaching the learner."""
    if not all(type(k) is str for k in values):
        raise ValueError("config: field names must be strings")
    from_flat(values, "the checkpoint's configuration", strict=False)
    try:
        return layers.stack({}, {}, "", values, saved_layers, {}).cfg.check()
    except ValueError as e:
        missing = [name for name in INDEX if name not in values]
        if missing:  # a field this version added took its default: maybe that, not the file, fails the check
            raise OtherVersion(f"{e} (a checkpoint of another version: it lacks {', '.join(missing[:3])})") from None
        raise


class OtherVersion(ValueError):
    """A configuration this version refuses that an older version wrote, lacking fields added since: no damage to
    the file, which a resume skips but does not set aside (checkpoint.load_latest reads ``damage``)."""

    damage = False


def trajectory_spec(d: dict) -> TrajectorySpec:
    """The checkpoint's trajectory spec, each entry typed and ranged (TrajectorySpec checks the rest)."""
    known = {"obs_shape", "obs_dtype", *SPEC_INTS}
    if not set(d) <= known or not {"obs_shape", "obs_dtype", "num_actions", "unroll_length"} <= set(d):
        raise ValueError(f"spec must have the keys {sorted(known)} (frame_stack, core_state_size optional)")
    shape = d["obs_shape"]
    if not isinstance(shape, list | tuple) or not 1 <= len(shape) <= 8:
        raise ValueError(f"spec.obs_shape must be a list of 1 to 8 dimensions, got {shape!r:.80}")
    for name, value in [
        *((f"obs_shape[{i}]", v) for i, v in enumerate(shape)),
        *((k, d[k]) for k in SPEC_INTS if k in d),
    ]:
        if type(value) is not int or not 0 <= value < MAX_SPEC_INT:
            raise ValueError(f"spec.{name} must be an integer in [0, 2^31), got {value!r:.80}")
    if type(d["obs_dtype"]) is not str:
        raise ValueError("spec.obs_dtype must be a string")
    return TrajectorySpec.from_dict(d)


def network(cfg: LearnerConfig, spec: TrajectorySpec, weights: dict, max_bytes: int) -> torch.nn.Module:
    """The network ``cfg`` and ``spec`` describe, on the meta device. Prevents building a network too large for any
    checkpoint: refused when its fp32 weights alone exceed ``max_bytes`` (max_checkpoint_bytes; a checkpoint holds
    them and the optimizer's state besides), and an MLP whose layers are more than the checkpoint's weights could fill
    (each hidden layer is 4 tensors: weight and bias in both torsos), so that even building it on the meta device
    stays cheap."""
    resolved = model_config(cfg).resolved(spec)  # ValueError: an LSTM on vector observations
    if spec.core_state_size != resolved.lstm_size:
        raise ValueError(f"spec.core_state_size {spec.core_state_size} is not the LSTM core's {resolved.lstm_size}")
    if resolved.kind == "mlp" and 4 * len(resolved.hidden_sizes) + 4 != len(weights):
        raise ValueError(
            f"the configuration's MLP of {len(resolved.hidden_sizes)} hidden layers has "
            f"{4 * len(resolved.hidden_sizes) + 4} tensors; the checkpoint's weights are {len(weights)}"
        )
    with torch.device("meta"):
        model = build_model(spec, resolved)
    count = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if nbytes > max_bytes:
        raise ValueError(
            f"the network its configuration describes has {count:,} parameters, {nbytes:,} bytes of weights > "
            f"max_checkpoint_bytes={max_bytes}: no checkpoint could hold it"
        )
    return model


def weights_fit(weights: dict, template: torch.nn.Module) -> None:
    """The weights name for name, shape for shape and dtype for dtype those of the network; the state dict's
    ``_metadata`` (module versions, read by load_state_dict) a map of maps."""
    expected = template.state_dict()
    if set(weights) != set(expected):
        missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
        raise ValueError(f"the weights do not fit the network: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, want in expected.items():
        got = weights[name]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            raise ValueError(f"weights {name}: expected {want.dtype} {list(want.shape)}, got {_describe(got)}")
    metadata = getattr(weights, "_metadata", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(type(k) is str and type(v) is dict for k, v in metadata.items())
    ):
        raise ValueError("the weights' _metadata must map module names to maps")


def optimizer_fits(saved: dict, cfg: LearnerConfig, spec: TrajectorySpec) -> None:
    """The optimizer's state as torch.optim keeps it for the learner ``cfg`` and ``spec`` describe (built on the meta
    device): its parameter groups (:func:`param_group`), and per parameter only the state its optimizer keeps, each
    tensor of its parameter's shape (``step`` a finite count). Prevents state that torch would load and the first
    update would crash on, after the first publish."""
    with torch.device("meta"):
        template = Learner(cfg, spec, torch.device("meta"))
    kind = cfg.loss.optimizer
    expected = template.optimizer.state_dict()
    if set(saved) != {"state", "param_groups"}:
        raise ValueError(f"optimizer must hold state and param_groups, got {sorted(map(str, saved))[:4]}")
    groups = saved["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(expected["param_groups"]):
        raise ValueError(f"optimizer.param_groups must be a list of {len(expected['param_groups'])}")
    for group, want in zip(groups, expected["param_groups"], strict=True):
        param_group(group, want)
    shapes = [p.shape for p in template.model.parameters()]
    state = saved["state"]
    if not isinstance(state, dict):
        raise ValueError("optimizer.state must be a map")
    for index, entry in state.items():
        if type(index) is not int or not 0 <= index < len(shapes):
            raise ValueError(f"optimizer.state: no parameter {index!r:.40}")
        if not isinstance(entry, dict) or not set(entry) <= OPTIMIZER_STATE_KEYS[kind]:
            raise ValueError(f"optimizer.state[{index}] must hold only {sorted(OPTIMIZER_STATE_KEYS[kind])}")
        for key, value in entry.items():
            step = key == "step"
            if not isinstance(value, torch.Tensor) or (
                (value.numel() != 1 or not 0 <= float(value) < MAX_COUNT) if step else value.shape != shapes[index]
            ):
                want = "a count" if step else f"{list(shapes[index])}"
                raise ValueError(f"optimizer.state[{index}].{key} must be a tensor of {want}, got {_describe(value)}")
            if not value.is_floating_point():
                raise ValueError(f"optimizer.state[{index}].{key} must be floating point, got {value.dtype}")


def param_group(group, want: dict) -> None:
    """One parameter group, against the one this torch builds for the network: its parameters the same, each flag
    (None or bool: amsgrad, maximize...) the same, foreach and fused None or a bool (how the saving learner ran the
    update: the loading one applies its own), each number (lr, eps, betas...) finite and >= 0.
    Keys this torch does not know are left to it (a newer torch's); keys missing take torch's defaults."""
    if not isinstance(group, dict):
        raise ValueError("an optimizer parameter group must be a map")
    for key, expected in want.items():
        if key not in group:
            continue
        got = group[key]
        if key in SWITCH_KEYS:  # how the saving learner ran its optimizer: the loading one sets its own
            ok = got is None or type(got) is bool
        elif key == "params" or expected is None or type(expected) is bool:
            ok = got == expected and type(got) is type(expected)
        elif isinstance(expected, tuple):
            ok = isinstance(got, tuple) and len(got) == len(expected) and all(_nonnegative(x) for x in got)
        else:
            ok = _nonnegative(got)
        if not ok:
            raise ValueError(f"optimizer parameter group: {key} = {got!r:.80} (this network's: {expected!r:.80})")
    for key, value in group.items():
        if key not in want and (type(key) is not str or isinstance(value, list | tuple | dict)):
            raise ValueError(f"optimizer parameter group: unknown entry {key!r:.40} must be a scalar")


def _nonnegative(x) -> bool:
    return _number(x) and math.isfinite(x) and x >= 0


def _describe(x) -> str:
    return f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
