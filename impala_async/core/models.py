"""Which actor-critic network to build: :class:`ModelConfig` (the ``model`` entry of the run info the learner
publishes with its weights, :meth:`ModelConfig.to_dict`) and :func:`build_model`. The modules themselves, and the calls
they answer (``forward``, ``step``, ``unroll``), are in :mod:`impala_async.core.nets`.

Actors build the same network from ``run.model``. That entry describes the network completely; docs/protocol.md, "The
network", says how to compute logits and value from it and the weights alone, and tests/test_network_doc.py checks
that page against these modules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from .nets import ACTIVATIONS, ActorCritic, ConvActorCritic, MLPActorCritic, ResNetActorCritic
from .spec import TrajectorySpec

NATURE_CONV_LAYERS = ((32, 8, 4, 0), (64, 4, 2, 0), (64, 3, 1, 0))  # (out_channels, kernel, stride, padding)
MINATAR_CONV_LAYERS = ((16, 3, 1, 0),)  # Young & Tian 2019: one 3x3 convolution of 16 channels, then 128 units
MINATAR_FC_SIZE = 128
SMALL_IMAGE_PIXELS = 16  # "auto" picks the MinAtar network for images at most this high and wide
IMPALA_STAGES = ((16, 2), (32, 2), (32, 2))  # (channels, residual blocks) per stage of the IMPALA deep network
IMPALA_FC_SIZE = 256
# The keys of run.model per kind, closed: an actor refuses a kind or a key it does not know. OPTIONAL_KEYS may be
# absent (learners before them; a learner leaves them out at their default, so actors before them still act).
OPTIONAL_KEYS = {"mlp": (), "conv": ("obs_norm", "value_fc"), "deep": ("obs_norm", "value_fc")}
MODEL_KEYS = {
    "mlp": ("kind", "hidden_sizes", "activation"),
    "conv": ("kind", "input_scale", "conv_layers", "fc_size", "activation", "lstm_size", "obs_norm", "value_fc"),
    "deep": ("kind", "input_scale", "stages", "fc_size", "lstm_size", "obs_norm", "value_fc"),
}
IMAGE_ONLY = ("lstm_size", "obs_norm", "value_fc")  # fields an MLP cannot take
# The ModelConfig fields each kind uses; a concrete kind leaves the others at their defaults.
_KIND_FIELDS = {
    "mlp": ("hidden_sizes", "activation"),
    "conv": ("conv_layers", "fc_size", "conv_activation", "input_scale", *IMAGE_ONLY),
    "deep": ("stages", "fc_size", "input_scale", *IMAGE_ONLY),
}


def _index(value, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _int_seq(value, what: str) -> tuple:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{what} must be an array, got {value!r}")
    return tuple(value)


def _conv_layers(value) -> tuple[tuple[int, int, int, int], ...]:
    """``(out_channels, kernel, stride, padding)`` per layer, checked; at least one."""
    layers: list[tuple[int, int, int, int]] = []
    for layer in _int_seq(value, "conv_layers"):
        layer = _int_seq(layer, "a conv layer")
        if len(layer) != 4:
            raise ValueError(f"a conv layer is [out_channels, kernel, stride, padding], got {list(layer)}")
        names, lows = ("out_channels", "kernel", "stride", "padding"), (1, 1, 1, 0)
        c, k, s, p = (_index(v, f"conv layer {n}", low) for v, n, low in zip(layer, names, lows, strict=True))
        layers.append((c, k, s, p))
    if not layers:
        raise ValueError("conv_layers must name at least one layer")
    return tuple(layers)


def _stages(value) -> tuple[tuple[int, int], ...]:
    """``(channels, residual blocks)`` per stage of the deep network, checked; at least one."""
    stages = []
    for stage in _int_seq(value, "stages"):
        stage = _int_seq(stage, "a stage")
        if len(stage) != 2:
            raise ValueError(f"a stage is [channels, residual blocks], got {list(stage)}")
        stages.append((_index(stage[0], "stage channels", 1), _index(stage[1], "stage residual blocks", 0)))
    if not stages:
        raise ValueError("stages must name at least one stage")
    return tuple(stages)


@dataclass(frozen=True)
class ModelConfig:
    """Which network to build.

    ``kind`` "mlp" (vector observations) uses ``hidden_sizes`` and ``activation``; "conv" (images ``[C, H, W]``) uses
    ``conv_layers`` (``(out_channels, kernel, stride, padding)`` per layer), ``fc_size``, ``conv_activation``,
    ``input_scale`` and ``lstm_size``; "deep" (the IMPALA ResNet) uses ``stages`` (``(channels, residual blocks)``
    per stage), ``fc_size``, ``input_scale`` and ``lstm_size``; "auto" carries them all and :meth:`resolved` keeps
    what the observations call for. ``lstm_size`` > 0 adds an LSTM core of that many units after the torso;
    ``obs_norm`` normalises image inputs by running statistics; ``value_fc`` gives the value head a fully connected
    layer of its own (image networks without an LSTM core: only the convolutions are then shared). A concrete
    kind's unused fields must stay at their defaults, so two configs are equal exactly when they build the same
    network, and ``from_dict(to_dict(c)) == c``.
    """

    kind: str = "auto"  # "mlp", "conv", "deep", or "auto": conv for uint8 [C, H, W] observations, else mlp
    hidden_sizes: tuple[int, ...] = (64, 64)  # MLP layers, one torso for the policy and one for the baseline
    activation: str = "tanh"  # the MLP's (the learner's --activation); the conv net's is conv_activation
    conv_layers: tuple[tuple[int, int, int, int], ...] = NATURE_CONV_LAYERS
    fc_size: int = 512  # width of the fully connected layer after the convolutions
    conv_activation: str = "relu"
    input_scale: float = 1 / 255  # image networks multiply their float32 input by this (uint8 pixels to [0, 1])
    stages: tuple[tuple[int, int], ...] = IMPALA_STAGES
    lstm_size: int = 0  # units of the LSTM core after the torso (0: none); image networks only
    obs_norm: bool = False  # image networks: scaled pixels normalised per element by running statistics (nets.ObsNorm)
    value_fc: bool = False  # image networks: the value head's own fully connected layer, beside the policy's fc

    def __post_init__(self):
        if self.kind not in ("auto", *MODEL_KEYS):
            raise ValueError(f"model kind must be auto, {', '.join(MODEL_KEYS)}, got {self.kind!r}")
        hidden = tuple(_index(h, "hidden_sizes", 1) for h in _int_seq(self.hidden_sizes, "hidden_sizes"))
        if not hidden:
            raise ValueError(f"hidden_sizes must be positive integers, got {self.hidden_sizes}")
        object.__setattr__(self, "hidden_sizes", hidden)
        object.__setattr__(self, "conv_layers", _conv_layers(self.conv_layers))
        object.__setattr__(self, "stages", _stages(self.stages))
        _index(self.fc_size, "fc_size", 1)
        _index(self.lstm_size, "lstm_size", 0)
        for name in ("activation", "conv_activation"):
            if getattr(self, name) not in ACTIVATIONS:
                raise ValueError(f"{name} must be one of {sorted(ACTIVATIONS)}, got {getattr(self, name)!r}")
        scale = self.input_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"input_scale must be a finite number > 0, got {scale!r}")
        object.__setattr__(self, "input_scale", float(scale))
        for name in ("obs_norm", "value_fc"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.value_fc and self.lstm_size:
            raise ValueError("value_fc needs a network without an LSTM core (the core feeds both heads)")
        self._check_unused()

    def _check_unused(self) -> None:
        """A concrete kind's unused fields stay at their defaults (so equal configs build equal networks)."""
        if self.kind == "auto":
            return
        unused = [
            f.name
            for f in fields(self)
            if f.name != "kind" and f.name not in _KIND_FIELDS[self.kind] and getattr(self, f.name) != f.default
        ]
        if unused:
            image_only = set(IMAGE_ONLY) & set(unused)
            why = " (an LSTM core, obs_norm or value_fc needs an image network)" if image_only else ""
            raise ValueError(f"a {self.kind} model does not use {', '.join(unused)}{why}")

    @classmethod
    def deep(
        cls, input_scale: float = 1 / 255, lstm_size: int = 0, obs_norm: bool = False, value_fc: bool = False
    ) -> ModelConfig:
        """The IMPALA paper's deep network: stages (16, 2), (32, 2), (32, 2) and a fully connected layer of 256."""
        return cls(
            "deep",
            stages=IMPALA_STAGES,
            fc_size=IMPALA_FC_SIZE,
            input_scale=input_scale,
            lstm_size=lstm_size,
            obs_norm=obs_norm,
            value_fc=value_fc,
        )

    @classmethod
    def minatar(
        cls, input_scale: float = 1.0, lstm_size: int = 0, obs_norm: bool = False, value_fc: bool = False
    ) -> ModelConfig:
        """The MinAtar paper's network: one 3x3 convolution of 16 channels, a fully connected layer of 128."""
        return cls(
            "conv",
            conv_layers=MINATAR_CONV_LAYERS,
            fc_size=MINATAR_FC_SIZE,
            input_scale=input_scale,
            lstm_size=lstm_size,
            obs_norm=obs_norm,
            value_fc=value_fc,
        )

    def resolved(self, spec: TrajectorySpec) -> ModelConfig:
        """The concrete config for ``spec``: ``self`` unless kind is "auto", which becomes "conv" for uint8
        ``[C, H, W]`` observations (the MinAtar network for images of at most 16x16, the Nature one otherwise) and
        "mlp" otherwise (the other kinds' fields back at their defaults)."""
        if self.kind != "auto":
            return self
        image = {name: getattr(self, name) for name in IMAGE_ONLY}
        if spec.obs_dtype == "uint8" and len(spec.obs_shape) == 3:
            if max(spec.obs_shape[1:]) <= SMALL_IMAGE_PIXELS:
                return ModelConfig.minatar(self.input_scale, **image)
            return ModelConfig("conv", input_scale=self.input_scale, **image)
        if any(image.values()):
            raise ValueError(
                "an LSTM core, obs_norm or value_fc needs an image network (uint8 [C, H, W] observations); these are "
                f"{spec.obs_dtype} {list(spec.obs_shape)}"
            )
        return ModelConfig("mlp", hidden_sizes=self.hidden_sizes, activation=self.activation)

    def to_dict(self) -> dict:
        """``run.model``: the network, completely, with the keys in ``MODEL_KEYS[kind]`` (those in ``OPTIONAL_KEYS``
        only away from their defaults). Raises ValueError
        for kind "auto", which is a request and no network yet (resolve it against a spec first)."""
        if self.kind == "mlp":
            return {"kind": "mlp", "hidden_sizes": list(self.hidden_sizes), "activation": self.activation}
        # Left out at their defaults: actors that predate them still act for a learner that does not use them.
        optional = {name: True for name in OPTIONAL_KEYS.get(self.kind, ()) if getattr(self, name)}
        if self.kind == "conv":
            return {
                "kind": "conv",
                "input_scale": self.input_scale,
                "conv_layers": [list(layer) for layer in self.conv_layers],
                "fc_size": self.fc_size,
                "activation": self.conv_activation,
                "lstm_size": self.lstm_size,
                **optional,
            }
        if self.kind == "deep":
            return {
                "kind": "deep",
                "input_scale": self.input_scale,
                "stages": [list(s) for s in self.stages],
                "fc_size": self.fc_size,
                "lstm_size": self.lstm_size,
                **optional,
            }
        raise ValueError("a model config of kind auto describes no network yet: resolve it against a spec first")

    @classmethod
    def from_dict(cls, d: Mapping) -> ModelConfig:
        """The config ``to_dict`` gave. Raises ValueError for anything else: not a map, an unknown kind (``auto``
        included), a missing or unknown key, or a value of the wrong type or range."""
        if not isinstance(d, Mapping):
            raise ValueError(f"run.model must be a map, got {type(d).__name__}")
        kind = d.get("kind")
        if not isinstance(kind, str) or kind not in MODEL_KEYS:
            raise ValueError(f"run.model: unknown model kind {kind!r} (this actor knows {', '.join(MODEL_KEYS)})")
        want, optional = set(MODEL_KEYS[kind]), set(OPTIONAL_KEYS[kind])
        missing, unknown = sorted(want - optional - set(d)), sorted(map(repr, set(d) - want))
        if missing or unknown:
            raise ValueError(
                f"run.model of kind {kind}: "
                + "; ".join(
                    part
                    for part in (
                        missing and f"missing {', '.join(missing)}",
                        unknown and f"unknown key(s) {', '.join(unknown)}",
                    )
                    if part
                )
            )
        try:
            if kind == "mlp":
                return cls("mlp", hidden_sizes=_int_seq(d["hidden_sizes"], "hidden_sizes"), activation=d["activation"])
            if kind == "deep":
                return cls(
                    "deep",
                    stages=_int_seq(d["stages"], "stages"),
                    fc_size=d["fc_size"],
                    input_scale=d["input_scale"],
                    lstm_size=d["lstm_size"],
                    obs_norm=d.get("obs_norm", False),
                    value_fc=d.get("value_fc", False),
                )
            return cls(
                "conv",
                conv_layers=_int_seq(d["conv_layers"], "conv_layers"),
                fc_size=d["fc_size"],
                conv_activation=d["activation"],
                input_scale=d["input_scale"],
                lstm_size=d["lstm_size"],
                obs_norm=d.get("obs_norm", False),
                value_fc=d.get("value_fc", False),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"run.model of kind {kind}: {e}") from None

    def with_lstm(self, lstm_size: int) -> ModelConfig:
        return replace(self, lstm_size=lstm_size)


def conv_output_shape(obs_shape, conv_layers) -> tuple[int, int, int]:
    """``(C, H, W)`` after ``conv_layers`` on ``[C, H, W]`` inputs: per layer ``H' = floor((H + 2p - k) / s) + 1``.
    Raises ValueError when an image is too small for them."""
    c, h, w = obs_shape
    for out, k, s, p in conv_layers:
        h, w = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
        if h < 1 or w < 1:
            raise ValueError(f"observations {list(obs_shape)} are too small for conv layers {conv_layers}")
        c = out
    return c, h, w


def resnet_output_shape(obs_shape, stages) -> tuple[int, int, int]:
    """``(C, H, W)`` after the deep network's stages: each keeps H and W through its 3x3 convolution (padding 1) and
    halves them, rounding up, in its max-pool (3x3, stride 2, padding 1): ``H' = floor((H - 1) / 2) + 1``."""
    c, h, w = obs_shape
    for channels, _ in stages:
        c, h, w = channels, (h - 1) // 2 + 1, (w - 1) // 2 + 1
    return c, h, w


def build_model(spec: TrajectorySpec, cfg: ModelConfig) -> ActorCritic:
    """The network ``cfg`` (resolved against ``spec``) describes, for ``spec``'s observations and actions (see
    :mod:`impala_async.core.nets` for what it computes and the calls it answers)."""
    cfg = cfg.resolved(spec)
    if cfg.kind in ("conv", "deep") and len(spec.obs_shape) != 3:
        raise ValueError(f"a {cfg.kind} model needs [C, H, W] observations, got {spec.obs_shape}")
    if cfg.kind == "conv":
        return ConvActorCritic(
            spec.obs_shape,
            spec.num_actions,
            cfg.fc_size,
            cfg.conv_layers,
            cfg.conv_activation,
            cfg.input_scale,
            cfg.lstm_size,
            flat_size=math.prod(conv_output_shape(spec.obs_shape, cfg.conv_layers)),
            obs_norm=cfg.obs_norm,
            value_fc=cfg.value_fc,
        )
    if cfg.kind == "deep":
        return ResNetActorCritic(
            spec.obs_shape,
            spec.num_actions,
            cfg.stages,
            cfg.fc_size,
            cfg.input_scale,
            cfg.lstm_size,
            flat_size=math.prod(resnet_output_shape(spec.obs_shape, cfg.stages)),
            obs_norm=cfg.obs_norm,
            value_fc=cfg.value_fc,
        )
    return MLPActorCritic(math.prod(spec.obs_shape), spec.num_actions, cfg.hidden_sizes, cfg.activation)
