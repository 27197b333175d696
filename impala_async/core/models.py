"""Actor-critic networks: policy logits and a state-value baseline.

Pure torch. ``forward(obs)`` takes a flat batch ``[N, *obs_shape]`` and returns ``(logits [N, A], values [N])``;
callers fold time and batch dimensions into ``N``. Actors build the same network from the ``model`` entry of the
run info the learner publishes with its weights (:meth:`ModelConfig.to_dict`). That entry describes the network
completely; docs/protocol.md, "The network", says how to compute logits and value from it and the weights alone, and
tests/test_network_doc.py checks that page against these modules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
from torch import nn

from .spec import TrajectorySpec

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU}
NATURE_CONV_LAYERS = ((32, 8, 4, 0), (64, 4, 2, 0), (64, 3, 1, 0))  # (out_channels, kernel, stride, padding)
# The keys of run.model per kind, closed: an actor refuses a kind or a key it does not know.
MODEL_KEYS = {"mlp": ("kind", "hidden_sizes", "activation"),
              "conv": ("kind", "input_scale", "conv_layers", "fc_size", "activation")}
# The ModelConfig fields each kind uses; a concrete kind leaves the others at their defaults.
_KIND_FIELDS = {"mlp": ("hidden_sizes", "activation"),
                "conv": ("conv_layers", "fc_size", "conv_activation", "input_scale")}


def _index(value, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _int_seq(value, what: str) -> tuple:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{what} must be an array, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class ModelConfig:
    """Which network to build.

    ``kind`` "mlp" (vector observations) uses ``hidden_sizes`` and ``activation``; "conv" (images ``[C, H, W]``) uses
    ``conv_layers`` (``(out_channels, kernel, stride, padding)`` per layer), ``fc_size``, ``conv_activation`` and
    ``input_scale``; "auto" carries both sets and :meth:`resolved` keeps the one the observations call for. A concrete
    kind's unused fields must stay at their defaults, so two configs are equal exactly when they build the same
    network, and ``from_dict(to_dict(c)) == c``.
    """

    kind: str = "auto"  # "mlp", "conv", or "auto": conv for uint8 [C, H, W] observations, else mlp
    hidden_sizes: tuple[int, ...] = (64, 64)  # MLP layers, one torso for the policy and one for the baseline
    activation: str = "tanh"  # the MLP's (the learner's --activation); the conv net's is conv_activation
    conv_layers: tuple[tuple[int, int, int, int], ...] = NATURE_CONV_LAYERS
    fc_size: int = 512  # width of the conv net's fully connected layer after the convolutions
    conv_activation: str = "relu"
    input_scale: float = 1 / 255  # the conv net multiplies its float32 input by this (uint8 pixels to [0, 1])

    def __post_init__(self):
        if self.kind not in ("auto", *MODEL_KEYS):
            raise ValueError(f"model kind must be auto, mlp or conv, got {self.kind!r}")
        hidden = tuple(_index(h, "hidden_sizes", 1) for h in _int_seq(self.hidden_sizes, "hidden_sizes"))
        if not hidden:
            raise ValueError(f"hidden_sizes must be positive integers, got {self.hidden_sizes}")
        layers = []
        for layer in _int_seq(self.conv_layers, "conv_layers"):
            layer = _int_seq(layer, "a conv layer")
            if len(layer) != 4:
                raise ValueError(f"a conv layer is [out_channels, kernel, stride, padding], got {list(layer)}")
            layers.append(tuple(_index(v, f"conv layer {name}", low) for v, name, low in
                                zip(layer, ("out_channels", "kernel", "stride", "padding"), (1, 1, 1, 0), strict=True)))
        if not layers:
            raise ValueError("conv_layers must name at least one layer")
        object.__setattr__(self, "hidden_sizes", hidden)
        object.__setattr__(self, "conv_layers", tuple(layers))
        _index(self.fc_size, "fc_size", 1)
        for name in ("activation", "conv_activation"):
            if getattr(self, name) not in ACTIVATIONS:
                raise ValueError(f"{name} must be one of {sorted(ACTIVATIONS)}, got {getattr(self, name)!r}")
        scale = self.input_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"input_scale must be a finite number > 0, got {scale!r}")
        object.__setattr__(self, "input_scale", float(scale))
        if self.kind != "auto":
            unused = [f.name for f in fields(self) if f.name != "kind" and f.name not in _KIND_FIELDS[self.kind]
                      and getattr(self, f.name) != f.default]
            if unused:
                raise ValueError(f"a {self.kind} model does not use {', '.join(unused)}")

    def resolved(self, spec: TrajectorySpec) -> ModelConfig:
        """The concrete config for ``spec``: ``self`` unless kind is "auto", which becomes "conv" for uint8
        ``[C, H, W]`` observations and "mlp" otherwise (the other kind's fields back at their defaults)."""
        if self.kind != "auto":
            return self
        kind = "conv" if spec.obs_dtype == "uint8" and len(spec.obs_shape) == 3 else "mlp"
        return ModelConfig(kind, **{name: getattr(self, name) for name in _KIND_FIELDS[kind]})

    def to_dict(self) -> dict:
        """``run.model``: the network, completely, with exactly the keys in ``MODEL_KEYS[kind]``. Raises ValueError
        for kind "auto", which is a request and no network yet (resolve it against a spec first)."""
        if self.kind == "mlp":
            return {"kind": "mlp", "hidden_sizes": list(self.hidden_sizes), "activation": self.activation}
        if self.kind == "conv":
            return {"kind": "conv", "input_scale": self.input_scale,
                    "conv_layers": [list(layer) for layer in self.conv_layers], "fc_size": self.fc_size,
                    "activation": self.conv_activation}
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
        want = set(MODEL_KEYS[kind])
        missing, unknown = sorted(want - set(d)), sorted(map(repr, set(d) - want))
        if missing or unknown:
            raise ValueError(f"run.model of kind {kind}: " + "; ".join(
                part for part in (missing and f"missing {', '.join(missing)}",
                                  unknown and f"unknown key(s) {', '.join(unknown)}") if part))
        try:
            if kind == "mlp":
                return cls("mlp", hidden_sizes=_int_seq(d["hidden_sizes"], "hidden_sizes"),
                           activation=d["activation"])
            return cls("conv", conv_layers=_int_seq(d["conv_layers"], "conv_layers"), fc_size=d["fc_size"],
                       conv_activation=d["activation"], input_scale=d["input_scale"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"run.model of kind {kind}: {e}") from None


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


def _init(layer: nn.Linear | nn.Conv2d, gain: float):
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def _mlp(sizes, activation) -> nn.Sequential:
    """Linear, activation, Linear, activation, ...: the activation follows every layer, the last one included."""
    layers = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [_init(nn.Linear(n_in, n_out), math.sqrt(2)), ACTIVATIONS[activation]()]
    return nn.Sequential(*layers)


class MLPActorCritic(nn.Module):
    """Separate MLP torsos for policy and baseline (a shared torso lets the baseline loss disturb the policy).

    ``policy_torso``/``value_torso``: ``[N, D] -> [N, hidden_sizes[-1]]`` (``D = prod(obs_shape)``);
    ``policy_head``: ``-> [N, A]``; ``value_head``: ``-> [N, 1]``, squeezed to ``[N]``.
    """

    def __init__(self, obs_dim: int, num_actions: int, hidden_sizes=(64, 64), activation="tanh"):
        super().__init__()
        sizes = (obs_dim, *hidden_sizes)
        self.policy_torso = _mlp(sizes, activation)
        self.value_torso = _mlp(sizes, activation)
        self.policy_head = _init(nn.Linear(hidden_sizes[-1], num_actions), 0.01)
        self.value_head = _init(nn.Linear(hidden_sizes[-1], 1), 1.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``obs [N, *obs_shape]`` (any dtype; converted to float32, not scaled) -> ``(logits [N, A], values [N])``."""
        x = obs.float().flatten(1)
        return self.policy_head(self.policy_torso(x)), self.value_head(self.value_torso(x)).squeeze(-1)


class ConvActorCritic(nn.Module):
    """A convolutional torso shared by both heads; by default the Nature-DQN one on uint8 frames ``[N, 4, 84, 84]``.

    ``torso``: ``[N, C, H, W]`` -> per layer ``Conv2d`` then activation -> flattened ``[N, C' * H' * W']``
    (``conv_output_shape``; ``[N, 64 * 7 * 7]`` for Atari); ``fc``: ``Linear`` then activation ``-> [N, fc_size]``;
    ``policy_head``: ``-> [N, A]``; ``value_head``: ``-> [N, 1]``, squeezed to ``[N]``.
    """

    def __init__(self, obs_shape, num_actions: int, fc_size: int = 512, conv_layers=NATURE_CONV_LAYERS,
                 activation: str = "relu", input_scale: float = 1 / 255):
        super().__init__()
        self.input_scale = float(input_scale)
        n_flat = math.prod(conv_output_shape(obs_shape, conv_layers))
        layers, c = [], obs_shape[0]
        for out, k, s, p in conv_layers:
            layers += [_init(nn.Conv2d(c, out, k, stride=s, padding=p), math.sqrt(2)), ACTIVATIONS[activation]()]
            c = out
        self.torso = nn.Sequential(*layers, nn.Flatten())
        self.fc = nn.Sequential(_init(nn.Linear(n_flat, fc_size), math.sqrt(2)), ACTIVATIONS[activation]())
        self.policy_head = _init(nn.Linear(fc_size, num_actions), 0.01)
        self.value_head = _init(nn.Linear(fc_size, 1), 1.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``obs [N, C, H, W]`` (uint8 pixels) -> float32 times ``input_scale`` -> ``(logits [N, A], values [N])``."""
        x = self.fc(self.torso(obs.float() * self.input_scale))
        return self.policy_head(x), self.value_head(x).squeeze(-1)


def build_model(spec: TrajectorySpec, cfg: ModelConfig) -> nn.Module:
    """The network ``cfg`` (resolved against ``spec``) describes, for ``spec``'s observations and actions."""
    cfg = cfg.resolved(spec)
    if cfg.kind == "conv":
        if len(spec.obs_shape) != 3:
            raise ValueError(f"conv model needs [C, H, W] observations, got {spec.obs_shape}")
        return ConvActorCritic(spec.obs_shape, spec.num_actions, cfg.fc_size, cfg.conv_layers, cfg.conv_activation,
                               cfg.input_scale)
    return MLPActorCritic(math.prod(spec.obs_shape), spec.num_actions, cfg.hidden_sizes, cfg.activation)
