"""docs/protocol.md, "The network (rebuilding the policy from the weights)", implemented in numpy from that page alone.

``forward`` below takes ``run.model`` (a dict) and ``tensors`` (numpy arrays, received through the real wire format:
``wire.encode_weights`` then ``wire.decode_weights``) and must give the torch network's logits and values to 1e-5 for
every model kind, with all parameters perturbed (biases non-zero). No torch inside it; convolutions are an im2col by
stride tricks. ``expected_shapes`` is the page's tensor tables. ``test_the_check_can_fail`` shows that plausible
misreadings of the page (the activation left out after the last hidden layer, one torso for both heads, H-W-C
flattening, a flipped kernel, no input scaling) do not match, so a match means something.

Model kinds added later (the pixels issue adds a MinAtar net, an IMPALA deep ResNet and an LSTM core) must be added to
the doc section and to this test: their ``run.model`` keys, ``expected_shapes``, ``forward`` and ``CASES``.
"""

import inspect
import json

import numpy as np
import pytest
import torch
from numpy.lib.stride_tricks import sliding_window_view

from impala_async.core import wire
from impala_async.core.models import MODEL_KEYS, OPTIONAL_KEYS, ModelConfig, build_model
from impala_async.core.spec import TrajectorySpec

MAX_BYTES = 64 << 20
F32 = np.float32
ACT = {
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, F32(0)),
    "elu": lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0))),
}  # exp(x) - 1 for x <= 0
NATURE = {
    "kind": "conv",
    "input_scale": 0.00392156862745098,  # the page's Atari run.model
    "conv_layers": [[32, 8, 4, 0], [64, 4, 2, 0], [64, 3, 1, 0]],
    "fc_size": 512,
    "activation": "relu",
    "lstm_size": 0,
}
MINATAR = {
    "kind": "conv",
    "input_scale": 1.0,
    "conv_layers": [[16, 3, 1, 0]],
    "fc_size": 128,
    "activation": "relu",
    "lstm_size": 0,
}
DEEP = {
    "kind": "deep",
    "input_scale": 0.00392156862745098,
    "stages": [[16, 2], [32, 2], [32, 2]],
    "fc_size": 256,
    "lstm_size": 0,
}


# ---------------------------------------------------------------------------------- from the page, numpy only
def expected_shapes(model: dict, obs_shape, num_actions: int) -> dict[str, tuple]:
    """The page's tensor tables: name -> shape, exactly these names."""
    A = num_actions
    if model["kind"] == "mlp":
        h = [int(np.prod(obs_shape)), *model["hidden_sizes"]]
        out = {
            f"{torso}.{2 * i}.{p}": (h[i + 1], h[i]) if p == "weight" else (h[i + 1],)
            for torso in ("policy_torso", "value_torso")
            for i in range(len(h) - 1)
            for p in ("weight", "bias")
        }
        width = h[-1]
    elif model["kind"] == "deep":
        c, H, W = obs_shape
        out = {}
        for i, (ch, blocks) in enumerate(model["stages"]):
            out[f"stages.{i}.conv.weight"], out[f"stages.{i}.conv.bias"] = (ch, c, 3, 3), (ch,)
            for j in range(blocks):
                for conv in ("conv0", "conv1"):
                    out[f"stages.{i}.blocks.{j}.{conv}.weight"] = (ch, ch, 3, 3)
                    out[f"stages.{i}.blocks.{j}.{conv}.bias"] = (ch,)
            c, H, W = ch, (H - 1) // 2 + 1, (W - 1) // 2 + 1
        width = model["fc_size"]
        out["fc.0.weight"], out["fc.0.bias"] = (width, c * H * W), (width,)
        if model.get("value_fc"):
            out["value_fc.0.weight"], out["value_fc.0.bias"] = (width, c * H * W), (width,)
    else:
        c, H, W = obs_shape
        out = {}
        for j, (o, k, s, p) in enumerate(model["conv_layers"]):
            out[f"torso.{2 * j}.weight"], out[f"torso.{2 * j}.bias"] = (o, c, k, k), (o,)
            c, H, W = o, (H + 2 * p - k) // s + 1, (W + 2 * p - k) // s + 1
        width = model["fc_size"]
        out["fc.0.weight"], out["fc.0.bias"] = (width, c * H * W), (width,)
        if model.get("value_fc"):
            out["value_fc.0.weight"], out["value_fc.0.bias"] = (width, c * H * W), (width,)
    if model.get("obs_norm"):
        out.update({"obs_norm.mean": tuple(obs_shape), "obs_norm.var": tuple(obs_shape), "obs_norm.count": (1,)})
    L = model.get("lstm_size", 0)
    if L:
        out.update(
            {
                "core.weight_ih": (4 * L, width),
                "core.weight_hh": (4 * L, L),
                "core.bias_ih": (4 * L,),
                "core.bias_hh": (4 * L,),
            }
        )
        width = L
    out.update(
        {
            "policy_head.weight": (A, width),
            "policy_head.bias": (A,),
            "value_head.weight": (1, width),
            "value_head.bias": (1,),
        }
    )
    return out


def linear(x, t, name):
    """y = x W^T + b, W [out, in]."""
    return x @ t[f"{name}.weight"].T + t[f"{name}.bias"]


def conv2d(x, w, b, stride: int, padding: int):
    """Cross-correlation of x [N, in, H, W] with w [out, in, k, k], zero padding on every side, then stride."""
    x = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    k = w.shape[2]
    windows = sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]  # [N, in, H', W', k, k]
    return np.einsum("nchwuv,ocuv->nohw", windows, w, optimize=True) + b[None, :, None, None]


def maxpool(x, padding: int = 1):
    """MaxPool2d(3, stride 2, padding 1): -inf padding, the maximum of each 3x3 window at stride 2."""
    x = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)), constant_values=-np.inf)
    return sliding_window_view(x, (3, 3), axis=(2, 3))[:, :, ::2, ::2].max(axis=(-1, -2))


def sigmoid(x):
    return F32(1) / (F32(1) + np.exp(-x))


def lstm(x, t, state, mutant=None):
    """The page's core: gates i, f, g, o in that order; returns (h', c')."""
    h, c = state
    gates = x @ t["core.weight_ih"].T + t["core.bias_ih"] + h @ t["core.weight_hh"].T + t["core.bias_hh"]
    i, f, g, o = np.split(gates, 4, axis=1)
    if mutant == "gate_order":
        i, f, o, g = i, f, g, o  # i, f, o, g: another library's order
    c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
    return sigmoid(o) * np.tanh(c), c


def scaled(model: dict, t: dict, obs: np.ndarray, mutant: str | None) -> np.ndarray:
    """An image network's input: float32 pixels times input_scale, then with obs_norm per element
    clip((x - mean) / sqrt(var + 1e-5), -5, 5)."""
    x = obs.astype(F32) * (F32(1) if mutant == "no_input_scale" else F32(model["input_scale"]))
    if model.get("obs_norm") and mutant != "no_obs_norm":
        x = np.clip((x - t["obs_norm.mean"]) / np.sqrt(t["obs_norm.var"] + F32(1e-5)), F32(-5), F32(5))
    return x


def forward(model: dict, t: dict, obs: np.ndarray, mutant: str | None = None, state=None):
    """(logits [N, A], values [N]) as the page says, plus the next state (h', c') with an LSTM core (``state`` (h, c)
    is zeros when not given); ``mutant`` names a misreading of the page, for the negative tests."""
    if model["kind"] == "deep":
        return deep_forward(model, t, obs, mutant, state)
    act = ACT[model["activation"]]
    last_act = (lambda x: x) if mutant == "no_last_activation" else act
    n = obs.shape[0]
    if model["kind"] == "mlp":
        x = obs.astype(F32).reshape(n, -1)
        L = len(model["hidden_sizes"])
        out = {}
        for torso in ("policy_torso", "value_torso"):
            h = x
            for i in range(L):
                source = "policy_torso" if mutant == "shared_torso" else torso
                h = (act if i < L - 1 else last_act)(linear(h, t, f"{source}.{2 * i}"))
            out[torso] = h
        p, v = out["policy_torso"], out["value_torso"]
    elif model["kind"] == "conv":
        x = scaled(model, t, obs, mutant)
        for j, (_out, _k, stride, padding) in enumerate(model["conv_layers"]):
            w = t[f"torso.{2 * j}.weight"]
            w = w[:, :, ::-1, ::-1] if mutant == "flipped_kernel" else w
            x = act(conv2d(x, w, t[f"torso.{2 * j}.bias"], stride, padding))
        x = (x.transpose(0, 2, 3, 1) if mutant == "flatten_hwc" else x).reshape(n, -1)  # C order: C, H, W
        p, v = fully_connected(model, t, x, last_act, mutant)
    else:
        raise ValueError(f"unknown model kind {model['kind']!r}")
    return heads(model, t, p, v, mutant, state)


def fully_connected(model, t, x, act, mutant):
    """fc.0 then the activation for the policy; for the value the same, or with value_fc its own value_fc.0."""
    p = act(linear(x, t, "fc.0"))
    if not model.get("value_fc") or mutant == "shared_fc":
        return p, p
    return p, act(linear(x, t, "value_fc.0"))


def heads(model, t, p, v, mutant, state):
    L = model.get("lstm_size", 0)
    if not L:
        return linear(p, t, "policy_head"), linear(v, t, "value_head")[:, 0]
    if state is None:
        state = (np.zeros((len(p), L), F32), np.zeros((len(p), L), F32))
    h, c = lstm(p, t, state, mutant)
    return linear(h, t, "policy_head"), linear(h, t, "value_head")[:, 0], (h, c)


def deep_forward(model, t, obs, mutant, state):
    n = obs.shape[0]
    x = scaled(model, t, obs, mutant)
    relu = ACT["relu"]
    for i, (_ch, blocks) in enumerate(model["stages"]):
        x = conv2d(x, t[f"stages.{i}.conv.weight"], t[f"stages.{i}.conv.bias"], 1, 1)
        x = maxpool(relu(x) if mutant == "relu_before_pool" else x, 0 if mutant == "pool_unpadded" else 1)
        for j in range(blocks):
            b = f"stages.{i}.blocks.{j}"
            y = conv2d(relu(x), t[f"{b}.conv0.weight"], t[f"{b}.conv0.bias"], 1, 1)
            y = conv2d(relu(y), t[f"{b}.conv1.weight"], t[f"{b}.conv1.bias"], 1, 1)
            x = y if mutant == "no_skip" else x + y
    p, v = fully_connected(model, t, relu(x).reshape(n, -1), relu, mutant)
    return heads(model, t, p, v, mutant, state)


# ---------------------------------------------------------------------------------- the torch side
def _mlp(obs_shape, hidden, activation, A=5):
    return TrajectorySpec(obs_shape=obs_shape, obs_dtype="float32", num_actions=A, unroll_length=4), ModelConfig(
        hidden_sizes=hidden, activation=activation
    )


def _conv(obs_shape, A, model: dict | None = None):
    spec = TrajectorySpec(obs_shape=obs_shape, obs_dtype="uint8", num_actions=A, unroll_length=4)
    return spec, ModelConfig() if model is None else ModelConfig.from_dict(model)


CASES = {
    **{
        f"mlp-{act}-{'x'.join(map(str, hidden))}": _mlp(shape, hidden, act)
        for act in ("tanh", "relu", "elu")
        for shape, hidden in (((4,), (64, 64)), ((3, 5), (16, 8, 24)))
    },
    "conv-atari": _conv((4, 84, 84), 6),
    "conv-small-image": _conv((3, 44, 52), 4),  # 64 x 2 x 3 after the convolutions
    "conv-padded-elu": _conv(
        (2, 11, 9),
        3,
        {
            "kind": "conv",
            "input_scale": 1 / 255,
            "conv_layers": [[8, 3, 1, 1], [16, 3, 2, 1]],
            "fc_size": 32,
            "activation": "elu",
            "lstm_size": 0,
        },
    ),
    "conv-minatar": _conv((4, 10, 10), 3, MINATAR),
    "conv-minatar-lstm": _conv((6, 10, 10), 5, {**MINATAR, "lstm_size": 24}),
    "deep-atari": _conv((4, 84, 84), 6, DEEP),
    "deep-small-lstm": _conv((3, 13, 10), 4, {**DEEP, "stages": [[8, 1], [12, 2]], "fc_size": 32, "lstm_size": 16}),
    "conv-small-image-obs-norm": _conv((3, 44, 52), 4, {**NATURE, "obs_norm": True}),
    "deep-small-obs-norm": _conv((3, 13, 10), 4, {**DEEP, "stages": [[8, 1]], "fc_size": 32, "obs_norm": True}),
    "conv-minatar-value-fc": _conv((4, 10, 10), 3, {**MINATAR, "value_fc": True}),
    "deep-small-value-fc": _conv((3, 13, 10), 4, {**DEEP, "stages": [[8, 1]], "fc_size": 32, "value_fc": True}),
}
MUTANTS = {
    "mlp": ("no_last_activation", "shared_torso"),
    "conv": ("no_last_activation", "flatten_hwc", "flipped_kernel", "no_input_scale", "no_obs_norm", "shared_fc"),
    "deep": ("relu_before_pool", "pool_unpadded", "no_skip", "no_obs_norm", "shared_fc"),
}
LSTM_MUTANTS = ("gate_order",)


def _published(name: str, seed: int = 0):
    """The torch network with every parameter perturbed, and the weights message the learner would publish for it."""
    spec, cfg = CASES[name]
    torch.manual_seed(seed)
    net = build_model(spec, cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in net.parameters():  # about the init's own scale, biases included, heads made to matter
            fan_in = p[0].numel() if p.dim() > 1 else 10
            p.add_(torch.randn(p.shape, generator=g) / fan_in**0.5)
        if getattr(net, "obs_norm", None) is not None:  # statistics a run could have: some pixels clipped at +-5
            net.obs_norm.mean.copy_(torch.rand(net.obs_norm.mean.shape, generator=g))
            net.obs_norm.var.copy_(torch.rand(net.obs_norm.var.shape, generator=g) * 0.1 + 1e-3)
            net.obs_norm.count.fill_(1000.0)
    run_info = {"protocol": wire.PROTOCOL_VERSION, "spec": spec.to_dict(), "model": cfg.resolved(spec).to_dict()}
    tensors = {k: v.numpy() for k, v in net.state_dict().items()}
    # encode_weights gained an incarnation argument while this test was written; pass one when it takes it
    extra = {"incarnation": 1} if "incarnation" in inspect.signature(wire.encode_weights).parameters else {}
    buf = wire.encode_weights(3, tensors, run_info, **extra)
    return spec, net.eval(), wire.decode_weights(buf, MAX_BYTES)


def _inputs(spec: TrajectorySpec, seed: int, model: dict | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if spec.obs_dtype == "uint8":
        high = 1 if model is not None and model.get("input_scale") == 1.0 else 255  # MinAtar's 0/1 planes
        obs = rng.integers(0, high + 1, (4, *spec.obs_shape), dtype=np.uint8)
        obs[0], obs[1] = 0, high
        return obs
    return (rng.standard_normal((8, *spec.obs_shape)) * 2).astype(F32)


def _torch(net, obs, state=None):
    """(logits, values), and for a recurrent network the next state (h, c), from ``state`` (zeros when None)."""
    with torch.inference_mode():
        if net.recurrent:
            st = net.initial_state(len(obs)) if state is None else tuple(torch.from_numpy(x) for x in state)
            logits, values, (h, c) = net.step(torch.from_numpy(obs), st)
            return logits.numpy(), values.numpy(), (h.numpy(), c.numpy())
        logits, values = net(torch.from_numpy(obs))
    return logits.numpy(), values.numpy()


def _close(a, b) -> bool:
    return a.shape == b.shape and np.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_numpy_forward_from_doc_matches_torch(name):
    spec, net, msg = _published(name)
    model, tensors = msg.run_info["model"], msg.tensors
    assert {k: v.shape for k, v in tensors.items()} == expected_shapes(model, spec.obs_shape, spec.num_actions)
    assert all(v.dtype == F32 for v in tensors.values())
    state = None  # a recurrent network: three steps, the state carried from one to the next as the page says
    for seed in range(3):
        obs = _inputs(spec, seed, model)
        want = _torch(net, obs, state)
        want_logits, want_values = want[:2]
        assert np.abs(want_logits).max() > 0.1 and np.abs(want_values).max() > 0.1, "outputs too small to test"
        got = forward(model, tensors, obs, state=state)
        logits, values = got[:2]
        assert logits.dtype == F32 and values.dtype == F32
        assert logits.shape == (len(obs), spec.num_actions) and values.shape == (len(obs),)
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(values, want_values, rtol=1e-5, atol=1e-5)
        assert len(got) == len(want) == (3 if model.get("lstm_size") else 2)
        if len(got) == 3:
            for a, b in zip(got[2], want[2], strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
            state = want[2]


@pytest.mark.parametrize(
    "name,mutant",
    [
        (name, m)
        for name, (spec, cfg) in CASES.items()
        for m in MUTANTS[cfg.resolved(spec).kind] + (LSTM_MUTANTS if cfg.resolved(spec).lstm_size else ())
        if not (m == "no_input_scale" and cfg.resolved(spec).input_scale == 1)
        and not (m == "no_obs_norm" and not cfg.resolved(spec).obs_norm)
        and not (m == "shared_fc" and not cfg.resolved(spec).value_fc)
    ],
)
def test_the_check_can_fail(name, mutant):
    """A misreading of the page gives other logits or values: the match above is not vacuous."""
    spec, net, msg = _published(name)
    obs = _inputs(spec, 0, msg.run_info["model"])
    want_logits, want_values = _torch(net, obs)[:2]
    try:
        logits, values = forward(msg.run_info["model"], msg.tensors, obs, mutant=mutant)[:2]
    except ValueError:  # the misreading does not even fit the tensors' shapes: noticed
        return
    assert not (_close(logits, want_logits) and _close(values, want_values)), f"{mutant} went unnoticed"


def test_run_model_says_what_is_built():
    atari = TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=4)
    vector = TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=4)
    learner_cfg = ModelConfig(hidden_sizes=(32, 32), activation="tanh")  # as learner.learn.model_config makes it
    conv = learner_cfg.resolved(atari).to_dict()
    assert conv == NATURE and set(conv) == set(MODEL_KEYS["conv"]) - set(OPTIONAL_KEYS["conv"])  # obs_norm: off
    assert "hidden_sizes" not in conv and "tanh" not in json.dumps(conv)
    assert learner_cfg.resolved(vector).to_dict() == {"kind": "mlp", "hidden_sizes": [32, 32], "activation": "tanh"}
    with pytest.raises(ValueError, match="auto"):
        learner_cfg.to_dict()  # a request, no network yet


@pytest.mark.parametrize("name", CASES)
def test_from_dict_rebuilds_the_same_network(name):
    spec, net, msg = _published(name)
    cfg = CASES[name][1].resolved(spec)
    assert ModelConfig.from_dict(msg.run_info["model"]) == cfg == ModelConfig.from_dict(cfg.to_dict())
    rebuilt = build_model(spec, ModelConfig.from_dict(msg.run_info["model"])).eval()
    rebuilt.load_state_dict({k: torch.from_numpy(v) for k, v in msg.tensors.items()})  # strict: same names, shapes
    obs = _inputs(spec, 1)
    for a, b in zip(_torch(rebuilt, obs)[:2], _torch(net, obs)[:2], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "model,match",
    [
        ({"kind": "lstm", "hidden_sizes": [64]}, "unknown model kind 'lstm'"),
        ({**DEEP, "stages": [[16, 2, 1]]}, "channels, residual blocks"),
        ({**DEEP, "conv_layers": [[16, 3, 1, 0]]}, "unknown key"),
        ({**NATURE, "lstm_size": -1}, "lstm_size"),
        ({k: v for k, v in NATURE.items() if k != "lstm_size"}, "missing lstm_size"),
        ({"kind": "auto", "hidden_sizes": [64], "activation": "tanh"}, "unknown model kind 'auto'"),
        ({"hidden_sizes": [64], "activation": "tanh"}, "unknown model kind None"),
        ({"kind": "conv", "hidden_sizes": [64, 64], "activation": "tanh"}, "missing.*unknown key.*'hidden_sizes'"),
        ({**NATURE, "dropout": 0.1}, "unknown key.*'dropout'"),
        ({"kind": "mlp", "hidden_sizes": [64, 64]}, "missing activation"),
        ({"kind": "mlp", "hidden_sizes": [64, 64], "activation": "gelu"}, "activation"),
        ({"kind": "mlp", "hidden_sizes": [], "activation": "tanh"}, "hidden_sizes"),
        ({"kind": "mlp", "hidden_sizes": [64, True], "activation": "tanh"}, "hidden_sizes"),
        ({"kind": "mlp", "hidden_sizes": "64,64", "activation": "tanh"}, "hidden_sizes"),
        ({**NATURE, "conv_layers": [[32, 8, 4]]}, "out_channels, kernel, stride, padding"),
        ({**NATURE, "conv_layers": [[32, 8, 0, 0]]}, "stride"),
        ({**NATURE, "fc_size": 512.0}, "fc_size"),
        ({**NATURE, "input_scale": float("nan")}, "input_scale"),
        ({**NATURE, "obs_norm": 1}, "obs_norm must be true or false"),
        ({"kind": "mlp", "hidden_sizes": [64], "activation": "tanh", "obs_norm": True}, "unknown key.*'obs_norm'"),
        ({**NATURE, "value_fc": 1}, "value_fc must be true or false"),
        ({**MINATAR, "value_fc": True, "lstm_size": 8}, "value_fc needs a network without an LSTM core"),
        ([("kind", "mlp")], "must be a map"),
    ],
)
def test_unknown_or_malformed_run_model_is_refused(model, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(model)


def test_a_concrete_kind_takes_only_its_own_fields():
    with pytest.raises(ValueError, match="does not use fc_size"):
        ModelConfig(kind="mlp", fc_size=256)
    with pytest.raises(ValueError, match="does not use hidden_sizes, activation"):
        ModelConfig(kind="conv", hidden_sizes=(8,), activation="elu")
    with pytest.raises(ValueError, match="LSTM core, obs_norm or value_fc needs an image network"):
        ModelConfig(kind="mlp", lstm_size=8)
    with pytest.raises(ValueError, match="does not use obs_norm"):
        ModelConfig(kind="mlp", obs_norm=True)
    spec = TrajectorySpec(obs_shape=(1, 6, 6), obs_dtype="uint8", num_actions=2, unroll_length=4)
    with pytest.raises(ValueError, match="too small"):
        build_model(spec, ModelConfig("conv"))  # the Nature network's 8x8 stride 4 cannot take 6x6
    assert ModelConfig().resolved(spec) == ModelConfig.minatar(input_scale=1 / 255)  # auto: small images
