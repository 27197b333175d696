"""The jpeg payload codec (impala_async/core/codecs.py; docs/protocol.md, "Payload framing"): round trips within
JPEG's error, a payload built from the page alone, every rejection (sizes, headers, dimensions checked before
anything is decoded, corrupt data), fuzzing in the spirit of tests/test_fuzz.py, the actor's and the learner's
choices, and a real learner trained on JPEG frames.

Skipped where simplejpeg (the `jpeg` extra) is not installed; the README's test command installs it.
"""

import sys

import msgpack
import numpy as np
import pytest
from helpers import assert_values_allowed, random_arrays
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

simplejpeg = pytest.importorskip("simplejpeg")

from impala_async.actors.envs import PongLike  # noqa: E402
from impala_async.actors.runs import image_codec  # noqa: E402
from impala_async.config import LearnerConfig  # noqa: E402
from impala_async.core import codecs, wire  # noqa: E402
from impala_async.core.decoder import TrajectoryDecoder  # noqa: E402
from impala_async.core.spec import TrajectorySpec  # noqa: E402

FRAMES = TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=12, frame_stack=4)
STACKS = TrajectorySpec(obs_shape=(4, 84, 84), obs_dtype="uint8", num_actions=6, unroll_length=5)  # obs [T+1, C, H, W]
VECTOR = TrajectorySpec(obs_shape=(4,), obs_dtype="float32", num_actions=2, unroll_length=5)
JPEG_REASONS = ("bad_size", "bad_jpeg", "bad_jpeg_dimensions")


def pictures(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """uint8 ``shape`` (``[..., 84, 84]``) filled with PongLike frames (walls, paddles, a ball) of a random game."""
    env = PongLike()
    env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    planes = [env.step(int(rng.integers(6)))[0][-1] for _ in range(int(np.prod(shape[:-2])))]
    return np.stack(planes).reshape(shape)


def honest(spec: TrajectorySpec, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    arrays = random_arrays(spec, n, seed=seed)
    image = "frames" if spec.frame_stack else "obs"
    arrays[image] = pictures(arrays[image].shape, seed)
    return arrays


def encode(spec, arrays, quality: int = 90) -> bytes:
    return wire.encode_trajectories(
        spec,
        actor_id="jpeg/1",
        seq=1,
        policy_version=0,
        incarnation=1,
        arrays=arrays,
        episodes=[(1.0, 3)],
        image_codec="jpeg",
        jpeg_quality=quality,
    )


def decode(spec, data):
    """parse + decode_into into destinations filled with a pattern a skipped write would leave visible."""
    decoder = TrajectoryDecoder(spec)
    msg = decoder.parse(data)
    dest = {f.name: np.full((msg.n, *f.shape), 0xAB if f.dtype == np.uint8 else -7, f.dtype) for f in spec.fields}
    decoder.decode_into(msg, dest)
    return msg, dest


def reason(spec, data) -> str:
    with pytest.raises(wire.Rejected) as e:
        decode(spec, data)
    return e.value.reason


def patched(data: bytes, name: str, payload: bytes, codec: str = "jpeg") -> bytes:
    msg = msgpack.unpackb(data, raw=False)
    msg["fields"][name].update(codec=codec, data=payload)
    return msgpack.packb(msg, use_bin_type=True)


def image_payload(data: bytes, name: str = "frames") -> bytes:
    return msgpack.unpackb(data, raw=False)["fields"][name]["data"]


def with_pieces(pieces: list[bytes]) -> bytes:
    """A payload as docs/protocol.md lays it out: the length table, then the pieces."""
    return b"".join(len(p).to_bytes(4, "little") for p in pieces) + b"".join(pieces)


# ------------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("spec", [FRAMES, STACKS], ids=["frames", "obs"])
def test_round_trip_within_jpeg_error(spec):
    arrays = honest(spec, 3)
    data = encode(spec, arrays)
    msg, dest = decode(spec, data)
    image = spec.fields[0].name
    assert {name: codec for name, (codec, _) in msg.fields.items()} == {
        f.name: "jpeg" if f.name == image else "lz4" for f in spec.fields
    }
    err = np.abs(dest[image].astype(np.int16) - arrays[image])
    assert err.mean() < 0.5 and err.max() <= 24, (err.mean(), err.max())  # PongLike at quality 90: 0.23 and 14
    for name, a in arrays.items():
        if name != image:
            np.testing.assert_array_equal(dest[name], a, err_msg=name)  # every other field arrives bit for bit
    assert len(data) < sum(a.nbytes for a in arrays.values())


def test_higher_quality_is_closer():
    arrays = honest(FRAMES, 2)
    errors = [
        np.abs(decode(FRAMES, encode(FRAMES, arrays, q))[1]["frames"].astype(np.int16) - arrays["frames"]).mean()
        for q in (50, 90, 100)
    ]
    assert errors[0] > errors[1] > errors[2], errors


def test_a_payload_built_from_the_doc_alone():
    """docs/protocol.md: the [n, *shape] array as N planes of H x W one under the other, cut into pieces of
    floor(65500 / H) planes, one baseline greyscale JPEG each; the pieces' lengths (4 bytes, little-endian), then the
    pieces. The learner decodes each piece into its rows, exactly as any JPEG decoder would."""
    spec = TrajectorySpec(obs_shape=(1, 9000, 8), obs_dtype="uint8", num_actions=2, unroll_length=4)  # 5 planes each
    arrays = random_arrays(spec, 3)
    arrays["obs"] = np.broadcast_to(np.linspace(0, 255, 8, dtype=np.uint8), arrays["obs"].shape).copy()
    tall = arrays["obs"].reshape(-1, 8, 1)  # 15 planes of 9000 x 8, one under the other
    per = 65500 // 9000 * 9000  # 7 planes a piece: pieces of 7, 7 and 1 planes
    pieces = [
        simplejpeg.encode_jpeg(
            np.ascontiguousarray(tall[r : r + per]), quality=95, colorspace="GRAY", colorsubsampling="Gray"
        )
        for r in range(0, len(tall), per)
    ]
    assert len(pieces) == 3
    msg, dest = decode(spec, patched(encode(spec, arrays), "obs", with_pieces(pieces)))
    want = np.concatenate([simplejpeg.decode_jpeg(p, colorspace="GRAY") for p in pieces]).reshape(dest["obs"].shape)
    np.testing.assert_array_equal(dest["obs"], want)
    assert [len(p) for p in msg.fields["obs"][1]] == [len(p) for p in pieces]


# ------------------------------------------------------------------------------------------------- rejections
def test_jpeg_only_for_image_fields(monkeypatch):
    arrays = honest(FRAMES, 2)
    data, frames = encode(FRAMES, arrays), image_payload(encode(FRAMES, arrays))
    assert reason(FRAMES, patched(data, "action", frames)) == "bad_field"  # int32, no image
    assert reason(FRAMES, patched(data, "terminated", frames)) == "bad_field"  # uint8, but no image
    vector = wire.encode_trajectories(
        VECTOR,
        actor_id="a",
        seq=0,
        policy_version=0,
        incarnation=1,
        arrays=random_arrays(VECTOR, 1),
        image_codec="jpeg",
    )
    assert msgpack.unpackb(vector)["fields"]["obs"]["codec"] == "lz4"  # the encoder sends what is no image as lz4
    assert reason(VECTOR, patched(vector, "obs", frames)) == "bad_field"  # float32 observations
    monkeypatch.setattr(codecs, "_available", [False])  # a learner without simplejpeg
    assert reason(FRAMES, data) == "bad_field"
    with pytest.raises(ValueError, match="uint8"):
        codecs.encode_jpeg(arrays["reward"], 90)


def test_sizes_come_from_the_spec():
    arrays = honest(FRAMES, 2)
    data = encode(FRAMES, arrays)
    payload = image_payload(data)
    assert len(payload) > 8 and int.from_bytes(payload[:4], "little") == len(payload) - 4  # one piece
    assert reason(FRAMES, patched(data, "frames", b"\x01\x02")) == "bad_size"  # no room for the length table
    longer = (int.from_bytes(payload[:4], "little") + 1).to_bytes(4, "little") + payload[4:]
    assert reason(FRAMES, patched(data, "frames", longer)) == "bad_size"
    assert reason(FRAMES, patched(data, "frames", payload + b"\0")) == "bad_size"
    two = with_pieces([payload[4:], payload[4:]])  # two pieces where the spec gives one
    assert reason(FRAMES, patched(data, "frames", two)) == "bad_size"


class NoDecoding:
    """Stands in for simplejpeg: any decode fails the test (dimensions must be refused before decoding)."""

    @staticmethod
    def decode_jpeg(*args, **kw):
        raise AssertionError("decoded a piece whose dimensions were wrong")


def test_dimensions_are_checked_before_decoding(monkeypatch):
    arrays = honest(FRAMES, 2)
    data = encode(FRAMES, arrays)
    piece = image_payload(data)[4:]
    other = image_payload(encode(FRAMES, {name: a[:1] for name, a in arrays.items()}))  # 1 trajectory's rows, not 2
    monkeypatch.setattr(codecs, "jpeg_module", lambda: NoDecoding)
    assert reason(FRAMES, patched(data, "frames", other)) == "bad_jpeg_dimensions"
    # A decompression bomb: a valid piece whose frame header claims 65500 x 65500 pixels (4 GB decoded).
    sof = piece.index(b"\xff\xc0")
    bomb = piece[: sof + 5] + (65500).to_bytes(2, "big") * 2 + piece[sof + 9 :]
    assert codecs.frame_header(bomb) == (65500, 65500)
    assert reason(FRAMES, patched(data, "frames", with_pieces([bomb]))) == "bad_jpeg_dimensions"
    wide = piece[: sof + 7] + (83).to_bytes(2, "big") + piece[sof + 9 :]
    assert reason(FRAMES, patched(data, "frames", with_pieces([wide]))) == "bad_jpeg_dimensions"


def test_headers_other_than_baseline_greyscale_are_refused(monkeypatch):
    arrays = honest(FRAMES, 1)
    data = encode(FRAMES, arrays)
    piece = image_payload(data)[4:]
    sof = piece.index(b"\xff\xc0")
    colour = simplejpeg.encode_jpeg(np.repeat(arrays["frames"].reshape(-1, 84, 1), 3, axis=2), colorspace="RGB")
    cases = {
        "progressive": piece[: sof + 1] + b"\xc2" + piece[sof + 2 :],
        "arithmetic": piece[: sof + 1] + b"\xc9" + piece[sof + 2 :],
        "12-bit": piece[: sof + 4] + b"\x0c" + piece[sof + 5 :],
        "colour": colour,
        "no SOI": b"\x00" + piece[1:],
        "no EOI": piece[:-2],
        "bytes after EOI": piece + b"xyz",
        "scan first": b"\xff\xd8\xff\xda\x00\x08" + bytes(6) + piece[2:],
        "overrun": piece[: sof + 2] + b"\xff\xff" + piece[sof + 4 :],
        "too many segments": b"\xff\xd8" + b"\xff\xfe\x00\x02" * codecs.MAX_HEADER_SEGMENTS + piece[2:],
        "truncated header": piece[: sof + 3] + b"\xff\xd9",
        "two frame headers": piece[:sof] + piece[sof : sof + 13] + piece[sof:],
    }
    monkeypatch.setattr(codecs, "jpeg_module", lambda: NoDecoding)
    for name, bad in cases.items():
        assert reason(FRAMES, patched(data, "frames", with_pieces([bad]))) == "bad_jpeg", name


def test_corrupt_pictures_are_refused_when_decoded():
    arrays = honest(FRAMES, 1)
    data = encode(FRAMES, arrays)
    piece = image_payload(data)[4:]
    decoder = TrajectoryDecoder(FRAMES)
    cut = piece[: len(piece) // 2] + b"\xff\xd9"  # header intact, the scan cut short by an end-of-image marker
    msg = decoder.parse(patched(data, "frames", with_pieces([cut])))
    dest = {f.name: np.empty((1, *f.shape), f.dtype) for f in FRAMES.fields}
    with pytest.raises(wire.Rejected) as e:
        decoder.decode_into(msg, dest)
    assert e.value.reason == "bad_jpeg" and "frames" in e.value.detail


# ----------------------------------------------------------------------------------------------------- fuzzing
SMALL = TrajectorySpec(obs_shape=(2, 16, 24), obs_dtype="uint8", num_actions=3, unroll_length=3, frame_stack=2)
SMALL_DECODER = TrajectoryDecoder(SMALL)
SMALL_SEEDS = [encode(SMALL, random_arrays(SMALL, n, seed=n)) for n in (1, 3)]
FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def fuzz_decode(data: bytes) -> None:
    """Either accepted, with every value the spec allows, or rejected with a known reason: nothing else."""
    try:
        msg = SMALL_DECODER.parse(data)
        dest = {f.name: np.full((msg.n, *f.shape), 0xAB, f.dtype) for f in SMALL.fields}
        SMALL_DECODER.decode_into(msg, dest)
    except wire.Rejected as e:
        assert e.reason in wire.REJECT_REASONS
        event(e.reason)
        return
    event("accepted")
    assert_values_allowed(SMALL, dest)


_edit = st.tuples(st.sampled_from(["flip", "set", "insert", "delete"]), st.integers(0, 1 << 16), st.integers(1, 255))


@FUZZ
@given(seed=st.sampled_from([0, 1]), edits=st.lists(_edit, min_size=1, max_size=4), table=st.booleans())
def test_byte_mutations_of_jpeg_payloads(seed, edits, table):
    """Edits anywhere in the payload; with ``table`` the length table is then made to fit (the payload is one piece),
    so that the edits reach the header checks and the decoder."""
    payload = bytearray(image_payload(SMALL_SEEDS[seed]))
    for op, pos, value in edits:
        i = pos % (len(payload) + 1)
        if op == "insert":
            payload[i:i] = bytes([value])
        elif payload and op == "delete":
            del payload[i % len(payload)]
        elif payload:
            payload[i % len(payload)] = payload[i % len(payload)] ^ value if op == "flip" else value
    if table and len(payload) >= 4:
        payload[:4] = (len(payload) - 4).to_bytes(4, "little")
    fuzz_decode(patched(SMALL_SEEDS[seed], "frames", bytes(payload)))


def _sof0(rows: int, cols: int, precision: int = 8, components: int = 1) -> bytes:
    return bytes([precision]) + rows.to_bytes(2, "big") + cols.to_bytes(2, "big") + bytes([components, 1, 0x11, 0])


HONEST_PIECE = image_payload(SMALL_SEEDS[0])[4:]
_segment = st.one_of(
    st.tuples(
        st.sampled_from([0xE0, 0xDB, 0xC4, 0xDD, 0xFE, 0xC2, 0xC9, 0xDA, 0xD9, 0x01, 0xFF]), st.binary(max_size=40)
    ),
    st.tuples(
        st.just(0xC0),
        st.one_of(  # frame headers: right, wrong or absurd dimensions; other precisions
            st.just(_sof0(5 * 16, 24)),
            st.builds(
                _sof0, st.integers(0, 65535), st.integers(0, 65535), st.sampled_from([8, 12]), st.sampled_from([1, 3])
            ),
        ),
    ),
    st.tuples(st.just(-1), st.sampled_from([seg for seg in HONEST_PIECE.split(b"\xff")[1:6]])),  # the honest ones
)


@FUZZ
@given(
    segments=st.lists(_segment, max_size=8),
    tail=st.sampled_from(["honest", "garbage", "none"]),
    garbage=st.binary(max_size=64),
)
def test_pieces_of_arbitrary_segments(segments, tail, garbage):
    """Pieces assembled from marker segments (honest ones, frame headers with any dimensions, scans, markers that
    have no place before a scan) and an honest, garbage or no scan after them: rejected or decoded, nothing else."""
    piece = b"\xff\xd8"
    for marker, body in segments:
        piece += b"\xff" + body if marker == -1 else bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body
    piece += {"honest": HONEST_PIECE[HONEST_PIECE.index(b"\xff\xda") :], "garbage": garbage, "none": b""}[tail]
    fuzz_decode(patched(SMALL_SEEDS[0], "frames", with_pieces([piece])))


# ------------------------------------------------------------------------------- who asks for jpeg, and how
def test_the_actor_follows_the_learner(monkeypatch):
    assert image_codec({}, "lz4") == ("lz4", codecs.DEFAULT_QUALITY)  # a learner from before --obs-codec
    assert image_codec({"obs_codec": "lz4"}, "none")[0] == "none"  # lz4 asked: the actor's own --codec
    assert image_codec({"obs_codec": "jpeg", "jpeg_quality": 75}, "lz4") == ("jpeg", 75)
    assert image_codec({"obs_codec": "webp"}, "lz4")[0] == "lz4"  # unknown: lz4, which every learner accepts
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # not installed
    with pytest.raises(ImportError) as e:
        image_codec({"obs_codec": "jpeg"}, "lz4")
    assert "pip install 'impala-async[jpeg]'" in str(e.value) and "\n" not in str(e.value)


def test_the_learner_flag():
    for bad in ({"obs_codec": "png"}, {"jpeg_quality": 0}, {"jpeg_quality": 101}):
        with pytest.raises(ValueError):
            LearnerConfig.of(**bad).check()
    LearnerConfig.of(obs_codec="jpeg", jpeg_quality=100).check()
    assert codecs.refusal(FRAMES.fields[0], 255.0) is None and codecs.refusal(STACKS.fields[0], 255.0) is None
    minatar = TrajectorySpec(obs_shape=(4, 10, 10), obs_dtype="uint8", num_actions=3, unroll_length=5)
    assert "0 to 255" in codecs.refusal(minatar.fields[0], 1.0)  # 0/1 planes: JPEG would blur them
    assert "uint8 image" in codecs.refusal(VECTOR.fields[0], 255.0)


@pytest.mark.process
def test_train_pong_on_jpeg_frames(tmp_path):
    """The real CLI: actors read --obs-codec from the weights message and send JPEG frames; the learner trains."""
    pytest.importorskip("ale_py")
    from procutil import TINY_PONG, cli, finish, read_metrics

    logdir, log = tmp_path / "run", tmp_path / "log"
    proc = cli(
        "train", *TINY_PONG, "--obs-codec", "jpeg", "--jpeg-quality", "80", "--total-env-steps", "200",
        "--logdir", str(logdir), log=log,
    )  # fmt: skip
    finish(proc, log, 120)
    last = read_metrics(logdir)[-1]
    assert last["trajectories_received"] >= 10 and last["learner_steps"] >= 5, last
    assert last["trajectories_jpeg"] == last["trajectories_received"], "the actor did not send JPEG frames"
    assert last["trajectories_rejected"] == 0 and last["rejected_bad_jpeg"] == 0
