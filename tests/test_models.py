"""The networks against the papers that define them: the IMPALA deep ResNet's shapes and parameter count for an Atari
observation (Espeholt et al. 2018, figure 3), the MinAtar network (Young & Tian 2019), and what auto picks."""

from __future__ import annotations

import pytest
import torch

from impala_async.core.models import ModelConfig, build_model
from impala_async.core.spec import TrajectorySpec

ATARI = TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=5)
MINATAR = TrajectorySpec(obs_shape=(4, 10, 10), obs_dtype="uint8", num_actions=3, unroll_length=5)


def conv3(cin: int, cout: int) -> int:
    return cin * cout * 9 + cout


def impala_paper_parameters(channels_in: int, actions: int, lstm: int = 0) -> int:
    """Counted from the paper's figure: per stage a 3x3 conv and two residual blocks of two 3x3 convs (channels 16,
    32, 32), max-pool 3x3 stride 2 (84 -> 42 -> 21 -> 11), FC 256, then policy and baseline heads."""
    total, c = 0, channels_in
    for ch in (16, 32, 32):
        total += conv3(c, ch) + 2 * 2 * conv3(ch, ch)
        c = ch
    flat = 32 * 11 * 11
    total += flat * 256 + 256
    width = 256
    if lstm:
        total += 4 * lstm * (width + lstm) + 2 * 4 * lstm
        width = lstm
    return total + (width * actions + actions) + (width + 1)


@pytest.mark.parametrize("lstm", [0, 256])
def test_deep_network_is_the_papers(lstm):
    net = build_model(ATARI, ModelConfig.deep(lstm_size=lstm))
    assert sum(p.numel() for p in net.parameters()) == impala_paper_parameters(4, 6, lstm)
    shapes = []
    hooks = [
        stage.pool.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape[1:])))
        for stage in net.stages
    ]
    obs = torch.randint(0, 256, (5, 4, 84, 84), dtype=torch.uint8)
    with torch.no_grad():
        features, _ = net.features(obs)
        logits, values, state = net.step(obs, net.initial_state(5))
    for h in hooks:
        h.remove()
    assert shapes == [(16, 42, 42), (32, 21, 21), (32, 11, 11)] * 2  # features(), then step()
    assert features.shape == (5, 256)
    assert logits.shape == (5, 6) and values.shape == (5,)
    assert len(state) == (2 if lstm else 0) and all(s.shape == (5, lstm) for s in state)


def test_minatar_network_is_the_papers():
    net = build_model(MINATAR, ModelConfig().resolved(MINATAR))  # auto picks it for 10x10 images
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride) for c in convs] == [(4, 16, (3, 3), (1, 1))]
    assert net.fc[0].in_features == 16 * 8 * 8 and net.fc[0].out_features == 128
    assert sum(p.numel() for p in net.parameters()) == conv3(4, 16) + (1024 * 128 + 128) + (128 * 3 + 3) + 129


def test_auto_picks_by_image_size_and_the_lstm_obs_norm_and_value_fc_need_images():
    assert ModelConfig().resolved(ATARI).conv_layers[0] == (32, 8, 4, 0)  # Nature
    assert ModelConfig().resolved(MINATAR).conv_layers == ((16, 3, 1, 0),)
    vector = TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=5)
    assert ModelConfig().resolved(vector).kind == "mlp"
    for request in (ModelConfig(lstm_size=8), ModelConfig(obs_norm=True), ModelConfig(value_fc=True)):
        with pytest.raises(ValueError, match="LSTM core, obs_norm or value_fc needs an image network"):
            request.resolved(vector)
    assert ModelConfig(obs_norm=True).resolved(ATARI).obs_norm and ModelConfig(obs_norm=True).resolved(MINATAR).obs_norm
    assert ModelConfig(value_fc=True).resolved(MINATAR) == ModelConfig.minatar(1 / 255, value_fc=True)
    with pytest.raises(ValueError, match="value_fc needs a network without an LSTM core"):
        ModelConfig(value_fc=True, lstm_size=8)


def test_value_fc_leaves_the_policy_untouched_by_the_value_loss():
    """With value_fc the value head reads its own fully connected layer: the value loss's gradient reaches the shared
    convolutions and value_fc but not the policy's fc or head; without it, it reaches fc too."""
    for value_fc, fc_moved in ((True, False), (False, True)):
        torch.manual_seed(0)
        net = build_model(MINATAR, ModelConfig.minatar(value_fc=value_fc))
        obs = torch.randint(0, 2, (5, *MINATAR.obs_shape), dtype=torch.uint8)
        net(obs)[1].square().sum().backward()
        grads = {name: p.grad is not None and p.grad.abs().sum().item() > 0 for name, p in net.named_parameters()}
        assert grads["torso.0.weight"] and not grads["policy_head.weight"]
        assert grads["fc.0.weight"] == fc_moved and grads.get("value_fc.0.weight", False) == value_fc


def test_unroll_equals_stepping_and_resets_at_episode_starts():
    """The learner's unroll over [B, T+1] gives what stepping the core one observation at a time gives, with the
    state zeroed where an episode begins (and only there)."""
    spec = TrajectorySpec(obs_shape=(2, 7, 7), obs_dtype="uint8", num_actions=4, unroll_length=6, core_state_size=8)
    torch.manual_seed(0)
    net = build_model(spec, ModelConfig.minatar(input_scale=1 / 255, lstm_size=8)).eval()
    B, T1 = 3, 7
    obs = torch.randint(0, 256, (B, T1, 2, 7, 7), dtype=torch.uint8)
    starts = torch.zeros(B, T1, dtype=torch.bool)
    starts[0, 3] = starts[2, 1] = starts[2, 5] = True
    state = (torch.randn(B, 8), torch.randn(B, 8))
    with torch.no_grad():
        logits, values = net.unroll(obs, state, starts)
        h, c = state
        for t in range(T1):
            keep = (~starts[:, t]).float().unsqueeze(1) if t > 0 else torch.ones(B, 1)
            lt, vt, (h, c) = net.step(obs[:, t], (h * keep, c * keep))
            torch.testing.assert_close(logits[t], lt, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(values[t], vt, rtol=1e-6, atol=1e-6)
        no_reset, _ = net.unroll(obs, state, torch.zeros_like(starts))
    assert not torch.allclose(no_reset[4, 0], logits[4, 0]), "the reset at step 3 of row 0 changed nothing"
    assert torch.allclose(no_reset[:, 1], logits[:, 1]), "row 1 has no episode start"
