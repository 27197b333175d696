#!/usr/bin/env python3
"""How far JPEG moves the importance weights: the same trajectories' log-probabilities on original and decoded frames.

    python tools/jpeg_rho.py [--checkpoint RUN_DIR_OR_FILE] [--steps 2400] [--qualities 75,90,95] [--json]

An actor computes the behaviour logits on the frames it saw; under ``--obs-codec jpeg`` the learner computes the
target policy on the frames JPEG gave back. With the same weights on both sides the importance weight would be 1; the
ratio ``r = pi(a | decoded) / pi(a | original)`` for the action taken is the factor JPEG alone multiplies every rho
by (``rho = pi_learner(a | decoded) / mu(a | original)``). This plays ``--steps`` steps of the checkpoint's environment
with its policy (sampling, as actors do; without ``--checkpoint``, ALE/Pong-v5 and a freshly initialised network of
the learner's default kind), cuts them into unrolls of the run's length, packs each as ``frames`` (docs/protocol.md),
sends the frames of 16 unrolls through the codec together (one message's payload, as actors send it), rebuilds the
stacks as the learner does, and evaluates the network on both.

Reports per quality: the pixel error, the mean logit change against the logits' spread, quantiles of ``|log r|``,
the share of steps with ``r`` outside [0.9, 1.1] and outside [1/2, 2] (``rho_far_frac``'s band), the mean KL
divergence between the two action distributions (nats), and the share of steps whose most likely action differs. A
network trained for minutes on a CPU is still close to uniform, so ``--sharpen NATS`` adds the same figures for
``softmax(k * logits)``, k chosen for that mean entropy, with actions sampled from it in the same states: how far the
same logit changes would move a confident policy (a sensitivity figure, not a trained policy).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from impala_async.actors.envs import frame_stack_of, make_env
from impala_async.core import codecs, frames
from impala_async.core.models import ModelConfig, build_model
from impala_async.core.spec import TrajectorySpec

MESSAGE_TRAJECTORIES = 16  # unrolls sent through the codec together, as one message's frames payload


def network(checkpoint: str, env_id: str, unroll_length: int) -> tuple[torch.nn.Module, TrajectorySpec, str]:
    """The checkpoint's network, spec and environment; or a fresh default one for ``env_id``."""
    if checkpoint:
        from impala_async import evaluate

        state, _ = evaluate.load_state(checkpoint, 4 << 30)
        cfg = evaluate.run_config(state)
        spec = TrajectorySpec.from_dict(state["spec"])
        return evaluate.build_network(cfg, spec, state["learner"]["model"]), spec, cfg.env.env
    env = make_env(env_id)
    spec = TrajectorySpec.from_spaces(
        env.observation_space, env.action_space, unroll_length, frame_stack=frame_stack_of(env)
    )
    env.close()
    torch.manual_seed(0)
    return build_model(spec, ModelConfig(input_scale=1 / 255).resolved(spec)).eval(), spec, env_id


@torch.inference_mode()
def play(model, spec: TrajectorySpec, env_id: str, unrolls: int, seed: int) -> tuple[np.ndarray, ...]:
    """``unrolls`` unrolls of the policy: ``obs [K, T+1, S, H, W]``, ``actions [K, T]``, ``done [K, T]``."""
    env, rng = make_env(env_id), np.random.default_rng(seed)
    T = spec.unroll_length
    obs_out = np.empty((unrolls, T + 1, *spec.obs_shape), np.uint8)
    actions, done = np.zeros((unrolls, T), np.int64), np.zeros((unrolls, T), np.uint8)
    obs, _ = env.reset(seed=seed)
    for k in range(unrolls):
        obs_out[k, 0] = obs
        for t in range(T):
            logits, _ = model(torch.from_numpy(np.asarray(obs)[None]))
            a = int(np.argmax(logits[0].numpy() - np.log(-np.log(rng.random(spec.num_actions)))))
            obs, _, term, trunc, _ = env.step(a)
            actions[k, t] = a
            if term or trunc:
                done[k, t] = 1
                obs, _ = env.reset()
            obs_out[k, t + 1] = obs
    env.close()
    return obs_out, actions, done


def through_jpeg(obs: np.ndarray, done: np.ndarray, S: int, quality: int) -> np.ndarray:
    """The stacks the learner rebuilds from JPEG frames: pack, encode per message, decode, unstack."""
    packed = frames.pack(obs, done)  # [K, T+S, H, W]
    out = np.empty_like(packed)
    H, W = packed.shape[-2:]
    for i in range(0, len(packed), MESSAGE_TRAJECTORIES):
        part = packed[i : i + MESSAGE_TRAJECTORIES]
        payload = codecs.encode_jpeg(part, quality)
        codecs.decode_jpeg_into(
            codecs.split_jpeg(payload, part.shape[0] * part.shape[1], H, W), out[i : i + MESSAGE_TRAJECTORIES], H, W
        )
    flags = torch.from_numpy(done)
    return frames.unstack(torch.from_numpy(out), flags, torch.zeros_like(flags), S).numpy()


@torch.inference_mode()
def logits_of(model, obs: np.ndarray) -> np.ndarray:
    """``obs [K, T, *O]`` -> logits ``[K*T, A]`` (float64)."""
    flat = torch.from_numpy(np.ascontiguousarray(obs.reshape(-1, *obs.shape[2:])))
    return torch.cat([model(x)[0].double() for x in flat.split(256)]).numpy()


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def entropy(z: np.ndarray) -> float:
    lp = log_softmax(z)
    return float(-(np.exp(lp) * lp).sum(axis=1).mean())


def sharpening(z: np.ndarray, target_nats: float) -> float:
    """The factor k that brings the mean entropy of softmax(k z) to ``target_nats`` (bisection)."""
    lo, hi = 0.0, 1.0
    while entropy(hi * z) > target_nats and hi < 1e6:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if entropy(mid * z) > target_nats else (lo, mid)
    return hi


def compare(lp_orig: np.ndarray, lp_dec: np.ndarray, actions: np.ndarray) -> dict:
    idx = np.arange(len(actions))
    log_r = lp_dec[idx, actions] - lp_orig[idx, actions]
    abs_log_r = np.abs(log_r)
    kl = (np.exp(lp_orig) * (lp_orig - lp_dec)).sum(axis=1)
    return {
        "steps": len(actions),
        "abs_log_r_median": float(np.median(abs_log_r)),
        "abs_log_r_p99": float(np.quantile(abs_log_r, 0.99)),
        "abs_log_r_max": float(abs_log_r.max()),
        "r_outside_0.9_1.1": float((abs_log_r > np.log(1.1)).mean()),
        "r_outside_half_2": float((abs_log_r > np.log(2)).mean()),
        "kl_mean_nats": float(kl.mean()),
        "argmax_changed": float((lp_orig.argmax(1) != lp_dec.argmax(1)).mean()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="", help="a learner checkpoint or run directory (default: a fresh network)")
    p.add_argument("--env", default="ALE/Pong-v5", help="without --checkpoint: the environment")
    p.add_argument("--unroll-length", type=int, default=80, help="without --checkpoint: T")
    p.add_argument("--steps", type=int, default=2400, help="agent steps played (rounded up to whole unrolls)")
    p.add_argument("--qualities", default="75,90,95")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sharpen",
        type=float,
        default=0.0,
        help=(
            "also report the policy softmax(k * logits) with k chosen for this mean entropy in nats (a sensitivity "
            "figure: how far the same logit changes would move a confident policy; 0: no)"
        ),
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, spec, env_id = network(a.checkpoint, a.env, a.unroll_length)
    if not spec.frame_stack:
        raise SystemExit("jpeg_rho: the run must send frames (frame_stack > 0, --frame-dedup 1)")
    unrolls = -(-a.steps // spec.unroll_length)
    obs, actions, done = play(model, spec, env_id, unrolls, a.seed)
    z_orig = logits_of(model, obs[:, :-1])
    k = sharpening(z_orig, a.sharpen) if a.sharpen else 0.0
    result = {
        "checkpoint": a.checkpoint or None,
        "env": env_id,
        "unroll_length": spec.unroll_length,
        "policy_entropy_mean_nats": entropy(z_orig),
        "sharpened_by": k,
        "qualities": {},
    }
    for q in (int(x) for x in a.qualities.split(",")):
        decoded = through_jpeg(obs, done, spec.frame_stack, q)
        z_dec = logits_of(model, decoded[:, :-1])
        pixels = np.abs(decoded.astype(np.int16) - obs)
        result["qualities"][str(q)] = {
            "pixel_error_mean": float(pixels.mean()),
            "pixel_error_signed_mean": float((decoded - obs.astype(np.float64)).mean()),
            "logit_change_mean": float(np.abs(z_dec - z_orig).mean()),
            "logit_std": float(z_orig.std(axis=1).mean()),
            **compare(log_softmax(z_orig), log_softmax(z_dec), actions.reshape(-1)),
        }
        if k:  # actions as the sharpened policy would take them (Gumbel-max on its logits), in the same states
            gumbel = -np.log(-np.log(np.random.default_rng(a.seed).random(z_orig.shape)))
            result["qualities"][str(q)]["sharpened"] = compare(
                log_softmax(k * z_orig), log_softmax(k * z_dec), np.argmax(k * z_orig + gumbel, axis=1)
            )
    print(json.dumps(result) if a.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
