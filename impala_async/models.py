"""Actor-critic networks: policy logits and a state-value baseline.

Pure torch. ``forward(obs)`` takes a flat batch ``[N, *obs_shape]`` and returns ``(logits [N, A], values [N])``;
callers fold time and batch dimensions into ``N``. Actors build the same network from the ``model`` entry of the
run info the learner publishes with its weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .spec import TrajectorySpec

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU}


@dataclass(frozen=True)
class ModelConfig:
    kind: str = "auto"  # "mlp" (vector observations), "conv" (uint8 images [C, H, W]), "auto" picks by obs dtype
    hidden_sizes: tuple[int, ...] = (64, 64)  # MLP layers, one torso for the policy and one for the baseline
    activation: str = "tanh"

    def __post_init__(self):
        if self.kind not in ("auto", "mlp", "conv"):
            raise ValueError(f"model kind must be auto, mlp or conv, got {self.kind!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}")
        if not self.hidden_sizes or any(h < 1 for h in self.hidden_sizes):
            raise ValueError(f"hidden_sizes must be positive integers, got {self.hidden_sizes}")

    def resolved(self, spec: TrajectorySpec) -> ModelConfig:
        if self.kind != "auto":
            return self
        kind = "conv" if spec.obs_dtype == "uint8" and len(spec.obs_shape) == 3 else "mlp"
        return ModelConfig(kind, self.hidden_sizes, self.activation)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hidden_sizes"] = list(self.hidden_sizes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return cls(kind=str(d["kind"]), hidden_sizes=tuple(int(h) for h in d["hidden_sizes"]),
                   activation=str(d["activation"]))


def _init(layer: nn.Linear | nn.Conv2d, gain: float):
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def _mlp(sizes, activation) -> nn.Sequential:
    layers = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [_init(nn.Linear(n_in, n_out), math.sqrt(2)), ACTIVATIONS[activation]()]
    return nn.Sequential(*layers)


class MLPActorCritic(nn.Module):
    """Separate MLP torsos for policy and baseline (a shared torso lets the baseline loss disturb the policy)."""

    def __init__(self, obs_dim: int, num_actions: int, hidden_sizes=(64, 64), activation="tanh"):
        super().__init__()
        sizes = (obs_dim, *hidden_sizes)
        self.policy_torso = _mlp(sizes, activation)
        self.value_torso = _mlp(sizes, activation)
        self.policy_head = _init(nn.Linear(hidden_sizes[-1], num_actions), 0.01)
        self.value_head = _init(nn.Linear(hidden_sizes[-1], 1), 1.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = obs.float().flatten(1)
        return self.policy_head(self.policy_torso(x)), self.value_head(self.value_torso(x)).squeeze(-1)


class ConvActorCritic(nn.Module):
    """The Nature-DQN torso on uint8 frames ``[N, C, 84, 84]`` (scaled to [0, 1]), shared by both heads."""

    def __init__(self, obs_shape, num_actions: int, hidden: int = 512):
        super().__init__()
        c, h, w = obs_shape
        self.torso = nn.Sequential(
            _init(nn.Conv2d(c, 32, 8, stride=4), math.sqrt(2)), nn.ReLU(),
            _init(nn.Conv2d(32, 64, 4, stride=2), math.sqrt(2)), nn.ReLU(),
            _init(nn.Conv2d(64, 64, 3, stride=1), math.sqrt(2)), nn.ReLU(),
            nn.Flatten())
        with torch.no_grad():
            n_flat = self.torso(torch.zeros(1, c, h, w)).shape[1]
        self.fc = nn.Sequential(_init(nn.Linear(n_flat, hidden), math.sqrt(2)), nn.ReLU())
        self.policy_head = _init(nn.Linear(hidden, num_actions), 0.01)
        self.value_head = _init(nn.Linear(hidden, 1), 1.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(self.torso(obs.float() * (1.0 / 255.0)))
        return self.policy_head(x), self.value_head(x).squeeze(-1)


def build_model(spec: TrajectorySpec, cfg: ModelConfig) -> nn.Module:
    cfg = cfg.resolved(spec)
    if cfg.kind == "conv":
        if len(spec.obs_shape) != 3:
            raise ValueError(f"conv model needs [C, H, W] observations, got {spec.obs_shape}")
        return ConvActorCritic(spec.obs_shape, spec.num_actions)
    return MLPActorCritic(math.prod(spec.obs_shape), spec.num_actions, cfg.hidden_sizes, cfg.activation)
