"""The actor-critic networks: torsos (MLP, convolutional, the IMPALA ResNet), an optional LSTM core, two heads.

Pure torch. Every network answers three calls:

- ``forward(obs [N, *obs_shape]) -> (logits [N, A], values [N])``, feed-forward networks only;
- ``step(obs [B, *obs_shape], state) -> (logits [B, A], values [B], state)``: one step of B environments (actors);
- ``unroll(obs [B, T+1, *obs_shape], state, starts [B, T+1]) -> (logits [T+1, B, A], values [T+1, B])``: a batch of
  unrolls (the learner), batch-major in, time-major out. ``starts[b, t]`` marks an observation that begins an
  episode: the recurrent state is reset to zeros before it.

``state`` is ``()`` for a feed-forward network and ``(h [B, H], c [B, H])`` with an LSTM core (``initial_state(B)``
gives zeros). The torso runs on all ``B * (T+1)`` observations at once; only the core steps through time, with the
same ``nn.LSTMCell`` the actor steps with, so learner and actor compute the same numbers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU}


def init_(layer: nn.Linear | nn.Conv2d, gain: float):
    nn.init.orthogonal_(layer.weight, gain)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)
    return layer


def mlp(sizes, activation) -> nn.Sequential:
    """Linear, activation, Linear, activation, ...: the activation follows every layer, the last one included."""
    layers = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [init_(nn.Linear(n_in, n_out), math.sqrt(2)), ACTIVATIONS[activation]()]
    return nn.Sequential(*layers)


class ObsNorm(nn.Module):
    """Per-element running normalisation of scaled image observations ``x [N, C, H, W]`` (Sample Factory's
    ``normalize_input``): ``clamp((x - mean) / sqrt(var + 1e-5), -5, 5)``. Its buffers ``mean`` and ``var`` ``[C, H,
    W]`` and ``count`` ``[1]`` travel with the weights, so actor and learner normalise alike; only the learner changes
    them (:meth:`update`, once per batch). A pixel that never changes (Pong's background) is 0 to the network, one
    that rarely does (the ball's path) stands out at up to 5."""

    EPS, CLIP = 1e-5, 5.0
    mean: torch.Tensor  # buffers (annotations only: a class value would shadow them)
    var: torch.Tensor
    count: torch.Tensor

    def __init__(self, shape):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("var", torch.ones(shape))
        self.register_buffer("count", torch.ones(1))  # the prior's weight: mean 0, var 1 as if from one sample

    def forward(self, pixels: torch.Tensor, scale: float) -> torch.Tensor:
        """``pixels [N, C, H, W]`` (float32, unscaled) -> ``clamp((pixels * scale - mean) / sqrt(var + 1e-5), -5,
        5)``, computed as one multiply-add per element (``pixels * gain + shift``, gain and shift ``[C, H, W]``):
        the learner's largest tensor passes over memory twice instead of four times; the result agrees with the
        formula to float32 rounding."""
        inv_std = torch.rsqrt(self.var + self.EPS)
        return torch.addcmul(-self.mean * inv_std, pixels, inv_std * scale).clamp_(-self.CLIP, self.CLIP)

    @torch.no_grad()
    def update(self, pixels: torch.Tensor, scale: float) -> None:
        """Fold ``pixels [N, C, H, W]`` (float32, unscaled) times ``scale`` into the running moments (Chan et al.'s
        parallel combination; the batch's variance unbiased, as Sample Factory's). One pass over the batch: the
        moments of the unscaled pixels, then scaled."""
        n = pixels.shape[0]
        if n > 1:
            batch_var, batch_mean = torch.var_mean(pixels, 0)
        else:
            batch_var, batch_mean = torch.zeros_like(self.var), pixels[0]
        batch_mean, batch_var = batch_mean * scale, batch_var * (scale * scale)
        total = self.count + n
        delta = batch_mean - self.mean
        self.var.copy_((self.var * self.count + batch_var * n + delta.square() * self.count * n / total) / total)
        self.mean.add_(delta * (n / total))
        self.count.copy_(total)


class ActorCritic(nn.Module):
    """Subclasses build their torso, then call :meth:`_heads`, and implement ``features(obs [N, ...]) ->
    (policy features [N, F], value features [N, F])`` (the same tensor twice for a shared torso)."""

    input_scale: float  # image networks set these in their constructor (annotations only: see :meth:`scaled`)
    obs_norm: ObsNorm | None
    fc: nn.Sequential
    value_fc: nn.Sequential | None

    def scaled(self, obs: torch.Tensor) -> torch.Tensor:
        """Image observations ``[N, C, H, W]`` as the torso takes them: float32 times ``input_scale``, normalised by
        :class:`ObsNorm` where the network has one (``obs_norm``, a submodule or None: a class value would shadow
        the registered module)."""
        if self.obs_norm is None:
            return obs.float() * self.input_scale
        return self.obs_norm(obs.float(), self.input_scale)

    def _heads(self, width: int, num_actions: int, lstm_size: int = 0) -> None:
        # A submodule attribute, not a class one: a class attribute would shadow the registered module.
        self.core: nn.LSTMCell | None = nn.LSTMCell(width, lstm_size) if lstm_size else None
        width = lstm_size or width
        self.policy_head = init_(nn.Linear(width, num_actions), 0.01)
        self.value_head = init_(nn.Linear(width, 1), 1.0)

    def _value_fc(self, wanted: bool, linear, activation) -> None:
        """Image networks: with ``wanted``, ``value_fc`` (``linear()`` then ``activation``), the value's own fully
        connected layer beside the policy's ``fc``, built after the heads (which so initialise the same with it or
        without); else None. Not with an LSTM core, which reads one vector for both heads."""
        if wanted and self.core is not None:
            raise ValueError("value_fc needs a network without an LSTM core (the core feeds both heads)")
        self.value_fc = nn.Sequential(linear(), activation()) if wanted else None

    def _split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Image networks: the torso's flattened output ``[N, F]`` -> ``(fc(flat), value_fc(flat))``, each
        ``[N, fc_size]`` (``fc(flat)`` twice without a ``value_fc``)."""
        x = self.fc(flat)
        return x, (x if self.value_fc is None else self.value_fc(flat))

    def features(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``obs [N, *obs_shape]`` -> ``(policy features [N, F], value features [N, F])``: the subclass's torso."""
        raise NotImplementedError

    @property
    def recurrent(self) -> bool:
        return self.core is not None

    def initial_state(self, batch_size: int, device=None) -> tuple:
        if self.core is None:
            return ()
        zeros = torch.zeros(batch_size, self.core.hidden_size, device=device)
        return zeros, zeros.clone()

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``obs [N, *obs_shape]`` -> ``(logits [N, A], values [N])``; feed-forward networks only."""
        if self.core is not None:
            raise TypeError("a recurrent network needs its state: use step() or unroll()")
        p, v = self.features(obs)
        return self.policy_head(p), self.value_head(v).squeeze(-1)

    def step(self, obs: torch.Tensor, state: tuple) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """One step: ``obs [B, *obs_shape]``, ``state`` -> ``(logits [B, A], values [B], next state)``. A caller that
        starts a new episode in row b resets ``state`` there first (zeros)."""
        if self.core is None:
            logits, values = self(obs)
            return logits, values, ()
        x, _ = self.features(obs)
        h, c = self.core(x, state)
        return self.policy_head(h), self.value_head(h).squeeze(-1), (h, c)

    def unroll(
        self, obs: torch.Tensor, state: tuple, starts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``obs [B, T1, *obs_shape]`` (batch-major, as the ring holds it), ``state`` at ``obs[:, 0]``, ``starts
        [B, T1]`` -> ``(logits [T1, B, A], values [T1, B])`` (time-major)."""
        B, T1 = obs.shape[:2]
        p, v = self.features(obs.reshape(B * T1, *obs.shape[2:]))
        if self.core is None:
            logits = self.policy_head(p).view(B, T1, -1).transpose(0, 1)
            return logits, self.value_head(v).view(B, T1).transpose(0, 1)
        if starts is None:
            raise TypeError("a recurrent network's unroll needs starts [B, T1]: where episodes begin")
        x = p.view(B, T1, -1).transpose(0, 1)  # [T1, B, F]
        keep = (~starts.bool()).transpose(0, 1).unsqueeze(-1).to(x.dtype)  # [T1, B, 1]: 0 where an episode begins
        h, c = state
        outs = []
        for t in range(T1):
            if t > 0:  # the state given is the one obs[:, 0] was processed with (the actor reset it already)
                h, c = h * keep[t], c * keep[t]
            h, c = self.core(x[t], (h, c))
            outs.append(h)
        out = torch.stack(outs)  # [T1, B, H]
        return self.policy_head(out), self.value_head(out).squeeze(-1)


class MLPActorCritic(ActorCritic):
    """Separate MLP torsos for policy and baseline (a shared torso lets the baseline loss disturb the policy).

    ``policy_torso``/``value_torso``: ``[N, D] -> [N, hidden_sizes[-1]]`` (``D = prod(obs_shape)``; the input converted
    to float32, not scaled); ``policy_head``: ``-> [N, A]``; ``value_head``: ``-> [N, 1]``, squeezed to ``[N]``.
    """

    def __init__(self, obs_dim: int, num_actions: int, hidden_sizes=(64, 64), activation="tanh"):
        super().__init__()
        sizes = (obs_dim, *hidden_sizes)
        self.policy_torso = mlp(sizes, activation)
        self.value_torso = mlp(sizes, activation)
        self._heads(hidden_sizes[-1], num_actions)

    def features(self, obs):
        x = obs.float().flatten(1)
        return self.policy_torso(x), self.value_torso(x)


class ConvActorCritic(ActorCritic):
    """A convolutional torso shared by both heads (the Nature-DQN one on Atari frames ``[N, 4, 84, 84]``, the MinAtar
    paper's on ``[N, C, 10, 10]`` planes), then an optional LSTM core.

    ``torso``: ``[N, C, H, W]`` times ``input_scale`` -> per layer ``Conv2d`` then activation -> flattened
    ``[N, C' * H' * W']``; ``fc``: ``Linear`` then activation ``-> [N, fc_size]``; ``core`` (with ``lstm_size``):
    ``LSTMCell -> [N, lstm_size]``; ``policy_head``: ``-> [N, A]``; ``value_head``: ``-> [N, 1]``, squeezed. With
    ``value_fc`` the value head reads a fully connected layer of its own (``value_fc``, shaped as ``fc``) and ``fc``
    feeds the policy head alone: only the convolutions are shared (no LSTM core then).
    """

    def __init__(
        self,
        obs_shape,
        num_actions: int,
        fc_size: int,
        conv_layers,
        activation: str = "relu",
        input_scale: float = 1 / 255,
        lstm_size: int = 0,
        flat_size: int = 0,
        obs_norm: bool = False,
        value_fc: bool = False,
    ):
        super().__init__()
        self.input_scale = float(input_scale)
        self.obs_norm = ObsNorm(tuple(obs_shape)) if obs_norm else None
        layers, c = [], obs_shape[0]
        for out, k, s, p in conv_layers:
            layers += [init_(nn.Conv2d(c, out, k, stride=s, padding=p), math.sqrt(2)), ACTIVATIONS[activation]()]
            c = out
        self.torso = nn.Sequential(*layers, nn.Flatten())
        self.fc = nn.Sequential(init_(nn.Linear(flat_size, fc_size), math.sqrt(2)), ACTIVATIONS[activation]())
        self._heads(fc_size, num_actions, lstm_size)
        self._value_fc(value_fc, lambda: init_(nn.Linear(flat_size, fc_size), math.sqrt(2)), ACTIVATIONS[activation])

    def features(self, obs):
        return self._split(self.torso(self.scaled(obs)))


class ResidualBlock(nn.Module):
    """``x + conv1(relu(conv0(relu(x))))``, both convolutions 3x3, stride 1, padding 1, ``channels`` to itself."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, stride=1, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, stride=1, padding=1)

    def forward(self, x):
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


class ResNetActorCritic(ActorCritic):
    """The IMPALA paper's deep network (Espeholt et al. 2018, figure 3, right).

    Per stage (channels, blocks) of ``stages`` (default (16, 2), (32, 2), (32, 2)): ``conv`` 3x3 stride 1 padding 1
    -> ``MaxPool2d(3, stride 2, padding 1)`` (halves H and W, rounding up) -> ``blocks`` residual blocks. Then ReLU,
    flatten (``[N, 32 * 11 * 11]`` for 84x84), ``fc`` Linear + ReLU ``-> [N, fc_size]`` (256), the optional LSTM core,
    and the heads; ``value_fc`` as in :class:`ConvActorCritic`. Convolutions and ``fc`` keep PyTorch's default
    initialisation (as torchbeast does)."""

    def __init__(
        self,
        obs_shape,
        num_actions: int,
        stages,
        fc_size: int = 256,
        input_scale: float = 1 / 255,
        lstm_size: int = 0,
        flat_size: int = 0,
        obs_norm: bool = False,
        value_fc: bool = False,
    ):
        super().__init__()
        self.input_scale = float(input_scale)
        self.obs_norm = ObsNorm(tuple(obs_shape)) if obs_norm else None
        self.stages = nn.ModuleList()
        c = obs_shape[0]
        for channels, blocks in stages:
            stage = nn.Module()
            stage.conv = nn.Conv2d(c, channels, 3, stride=1, padding=1)
            stage.pool = nn.MaxPool2d(3, stride=2, padding=1)
            stage.blocks = nn.ModuleList(ResidualBlock(channels) for _ in range(blocks))
            self.stages.append(stage)
            c = channels
        self.fc = nn.Sequential(nn.Linear(flat_size, fc_size), nn.ReLU())
        self._heads(fc_size, num_actions, lstm_size)
        self._value_fc(value_fc, lambda: nn.Linear(flat_size, fc_size), nn.ReLU)

    def features(self, obs):
        x = self.scaled(obs)
        for stage in self.stages:
            x = stage.pool(stage.conv(x))
            for block in stage.blocks:
                x = block(x)
        return self._split(torch.relu(x).flatten(1))
