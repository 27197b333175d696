#!/usr/bin/env python3
"""JPEG against LZ4 for Atari frames, on real ALE frames: cost per 84x84 greyscale frame, bytes, pixel error.

    python tools/bench_jpeg.py [--env ALE/Pong-v5] [--trajectories 16] [--unroll-length 80] [--repeats 15] [--json]

Plays ``--trajectories`` unrolls of ``--unroll-length`` steps of ``make_env(--env)`` under random actions (real ALE
frames after the standard preprocessing), packs each as ``frames [T+S, 84, 84]`` (docs/protocol.md, "Frames instead of
stacks") and times, per frame, on one message's payload (all trajectories together, as one wire field):

- ``lz4``: ``lz4.block.compress`` (what the actor runs) and ``cramjam.lz4.decompress_block_into`` into a
  preallocated array (what the learner runs);
- for each JPEG library, simplejpeg and PyTurboJPEG (``pip install simplejpeg PyTurboJPEG``; PyTurboJPEG also needs
  the system's libturbojpeg), two layouts: ``tiled``, the frames one under the other cut into pictures of at most
  65500 rows (the codec ``"jpeg"`` of docs/protocol.md), and ``per_frame``, one JPEG per frame; decoding writes into a
  preallocated array in both;
- the codec of impala_async.core.codecs itself (``encode_jpeg`` and header checks plus ``decode_jpeg_into``), at
  several qualities: bytes per frame and the error against the original pixels (mean and largest absolute difference).

Times are ``[median, best]`` of ``--repeats`` passes over the whole payload, in microseconds per frame. A library that
is not installed is reported as missing, not measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

JPEG_MAX_ROWS = 65500  # libjpeg's JPEG_MAX_DIMENSION (the header's 16-bit field would allow 65535)


def real_frames(env_id: str, n: int, T: int, seed: int = 0) -> np.ndarray:
    """``[n, T+S, H, W]`` uint8: ``n`` unrolls of ``make_env(env_id)`` under random actions, as actors pack them."""
    from impala_async.actors.envs import make_env
    from impala_async.core import frames

    env = make_env(env_id)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    out = []
    for _ in range(n):
        stacks, done = [obs], np.zeros(T, np.uint8)
        for t in range(T):
            obs, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
            if term or trunc:
                done[t] = 1
                obs, _ = env.reset()
            stacks.append(obs)
        out.append(frames.pack(np.stack(stacks)[None], done[None])[0])
    env.close()
    return np.stack(out)


def us_per_frame(fn, frames_count: int, repeats: int) -> list[float]:
    """``[median, best]`` of ``repeats`` timed calls of ``fn``, in microseconds per frame. Another process on the
    same core can only add time, so the best is the figure least disturbed by it; the median shows how much it was."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return [round(statistics.median(times) / frames_count * 1e6, 2), round(min(times) / frames_count * 1e6, 2)]


def pieces(a: np.ndarray) -> list[np.ndarray]:
    """The tiled layout: ``a [N, H, W]`` as pictures of at most JPEG_MAX_ROWS rows, cut between frames."""
    per = JPEG_MAX_ROWS // a.shape[1]
    return [a[i : i + per].reshape(-1, a.shape[2], 1) for i in range(0, len(a), per)]


def jpeg_library(name: str):
    """(encode(picture [rows, W, 1], quality) -> bytes, decode_into(bytes, out [rows, W, 1])) or None if missing."""
    if name == "simplejpeg":
        try:
            import simplejpeg
        except ImportError:
            return None
        return (
            lambda p, q: simplejpeg.encode_jpeg(p, quality=q, colorspace="GRAY", colorsubsampling="Gray"),
            lambda b, out: simplejpeg.decode_jpeg(b, colorspace="GRAY", buffer=out),
        )
    try:
        import turbojpeg

        tj = turbojpeg.TurboJPEG()
    except (ImportError, OSError, RuntimeError):  # no module, or no libturbojpeg it can load
        return None
    return (
        lambda p, q: tj.encode(p, quality=q, pixel_format=turbojpeg.TJPF_GRAY, jpeg_subsample=turbojpeg.TJSAMP_GRAY),
        lambda b, out: tj.decode(b, pixel_format=turbojpeg.TJPF_GRAY, dst=out),
    )


def bench_library(name: str, frames: np.ndarray, quality: int, repeats: int) -> dict | None:
    lib = jpeg_library(name)
    if lib is None:
        return None
    encode, decode = lib
    flat = frames.reshape(-1, *frames.shape[-2:])  # [N, H, W]
    count = len(flat)
    out = np.empty_like(flat)
    result = {}
    for layout, parts, outs in (
        ("tiled", pieces(flat), pieces(out)),
        ("per_frame", [f[:, :, None] for f in flat], [o[:, :, None] for o in out]),
    ):
        blobs = [encode(p, quality) for p in parts]

        def decode_all(blobs=blobs, outs=outs):
            for b, o in zip(blobs, outs, strict=True):
                decode(b, o)

        result[layout] = {
            "encode_us_per_frame": us_per_frame(
                lambda parts=parts: [encode(p, quality) for p in parts], count, repeats
            ),
            "decode_us_per_frame": us_per_frame(decode_all, count, repeats),
            "bytes_per_frame": round(sum(len(b) for b in blobs) / count, 1),
        }
        decode_all()
        assert np.abs(out.astype(np.int16) - flat).max() < 64, f"{name} {layout}: decoded pictures are wrong"
    return result


def bench_lz4(frames: np.ndarray, repeats: int) -> dict:
    import cramjam
    import lz4.block

    count = frames.shape[0] * frames.shape[1]
    block = lz4.block.compress(frames, store_size=True)
    out = np.empty_like(frames)
    return {
        "encode_us_per_frame": us_per_frame(lambda: lz4.block.compress(frames, store_size=True), count, repeats),
        "decode_us_per_frame": us_per_frame(lambda: cramjam.lz4.decompress_block_into(block, out), count, repeats),
        "bytes_per_frame": round(len(block) / count, 1),
    }


def bench_codec(frames: np.ndarray, qualities: list[int], repeats: int) -> dict:
    """The shipped codec (impala_async.core.codecs): the frames field of one message, per quality."""
    from impala_async.core import codecs

    n, F, H, W = frames.shape
    count = n * F
    out = np.empty_like(frames)
    result = {}
    for q in qualities:
        payload = codecs.encode_jpeg(frames, q)

        def decode(payload=payload):
            codecs.decode_jpeg_into(codecs.split_jpeg(payload, n * F, H, W), out, H, W)

        decode()
        err = np.abs(out.astype(np.int16) - frames)
        result[str(q)] = {
            "encode_us_per_frame": us_per_frame(lambda q=q: codecs.encode_jpeg(frames, q), count, repeats),
            "decode_us_per_frame": us_per_frame(decode, count, repeats),
            "bytes_per_frame": round(len(payload) / count, 1),
            "mean_abs_error": round(float(err.mean()), 3),
            "max_abs_error": int(err.max()),
            "frames_exact": round(float((err.reshape(count, -1).max(axis=1) == 0).mean()), 3),
        }
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="ALE/Pong-v5")
    p.add_argument("--trajectories", type=int, default=16, help="trajectories in the message (default: 16)")
    p.add_argument("--unroll-length", type=int, default=80)
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of the library comparison (default: 90)")
    p.add_argument("--qualities", default="75,90,95", help="qualities of the codec's sweep (default: 75,90,95)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    t0 = time.perf_counter()
    frames = real_frames(a.env, a.trajectories, a.unroll_length)
    result = {
        "env": a.env,
        "frames": int(frames.shape[0] * frames.shape[1]),
        "frame_shape": list(frames.shape[2:]),
        "collect_s": round(time.perf_counter() - t0, 1),
        "quality": a.quality,
        "lz4": bench_lz4(frames, a.repeats),
    }
    for name in ("simplejpeg", "turbojpeg"):
        result[name] = bench_library(name, frames, a.quality, a.repeats) or "not installed"
    try:
        result["codec"] = bench_codec(frames, [int(q) for q in a.qualities.split(",")], a.repeats)
    except ImportError as e:
        result["codec"] = str(e)
    if a.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
