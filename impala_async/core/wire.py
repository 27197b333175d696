"""The wire format: trajectory messages (actor -> learner) and weight messages (learner -> actors).

Pure: msgpack, lz4, cramjam and numpy only (no zmq, no asyncio). ``docs/protocol.md`` is the contract this module
implements; keep the two in agreement.

A trajectory message is one msgpack map carrying ``n`` trajectories of one actor. Every array travels as the raw
little-endian bytes of one trajectory's field, either uncompressed or as an LZ4 block preceded by its uncompressed size
(4 bytes, little-endian: the layout of ``lz4.block.compress(data)``); uint8 images may also travel as JPEG
(:mod:`.codecs`). The decoder never trusts a size the sender states: every expected size comes from the
:class:`~impala_async.core.spec.TrajectorySpec`, every container length is capped before anything is allocated, and
decompression writes straight into the destination (a ring-buffer slot).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import NamedTuple

import lz4.block
import msgpack
import numpy as np

from . import codecs, mpack
from .spec import TrajectorySpec

PROTOCOL_VERSION = 2
TYPE_TRAJECTORIES = "trajectories"
TYPE_WEIGHTS = "weights"
CODEC_LZ4 = "lz4"
CODEC_NONE = "none"
CODECS = (CODEC_LZ4, CODEC_NONE)  # for any field
CODEC_JPEG = codecs.CODEC_JPEG  # for uint8 image fields only (codecs.image_geometry; docs/protocol.md)
ALL_CODECS = (*CODECS, CODEC_JPEG)

_MAX_UINT63 = (1 << 63) - 1
_MAX_KEY_BYTES = 32  # longer than any key of the layout
_MAX_TOP_KEYS = 16
_FIELD_KEYS = (b"dtype", b"shape", b"codec", b"data")
_CODECS_RAW = {c.encode(): c for c in ALL_CODECS}
_MAX_SHAPE_DIMS = 8
_MAX_DETAIL_CHARS = 240  # a rejection's detail (it is logged) never carries more of a peer's bytes than this

# Every reason a message can be rejected for; metrics count them as ``rejected_<reason>``.
REJECT_REASONS = (
    "malformed",  # not MessagePack, truncated, a map key that is not a short string, a top level that is not a map
    "multipart",  # more than one ZeroMQ frame
    "too_large",  # over max_message_bytes
    "bad_version",  # unknown protocol version
    "bad_type",  # unknown message type
    "bad_header",  # a header key missing, unknown or repeated, of the wrong type or out of range
    "bad_field",  # field set, dtype, shape, codec or payload type differs from the spec
    "bad_size",  # payload length or LZ4 size header differs from the spec's size
    "bad_lz4",  # LZ4 block invalid or decompressing to the wrong length
    "bad_jpeg",  # a jpeg piece that is not a baseline 8-bit greyscale JPEG, or does not decode
    "bad_jpeg_dimensions",  # a jpeg piece whose header gives other dimensions than the spec (checked before decoding)
    "nonfinite",  # NaN or infinity in a float field
    "bad_action",  # action index outside [0, num_actions)
    "bad_flag",  # terminated/truncated not 0 or 1
    "inconsistent",  # fields that contradict each other: terminated and truncated both 1 at a step, or a non-zero
    #                  truncation_value where the step was not truncated
    "future_version",  # policy version newer than the learner's, in this learner's incarnation
    "replay",  # (actor id, sequence number) not newer than the last one accepted
    "bad_identity",  # with CURVE: no authenticated key name on the message
)


class Rejected(Exception):
    """A message that breaks the protocol. ``reason`` is one of REJECT_REASONS; ``detail`` is short (it is logged)."""

    def __init__(self, reason: str, detail: str):
        assert reason in REJECT_REASONS, reason
        if len(detail) > _MAX_DETAIL_CHARS:
            detail = detail[:_MAX_DETAIL_CHARS] + "..."
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class OtherIncarnation(Exception):
    """A message acted under another learner run's weights (docs/protocol.md, Learner restarts): dropped, not
    rejected, whatever its fields (they may follow another run's spec). ``trajectories``: how many it says it holds."""

    def __init__(self, incarnation: int, trajectories: int):
        super().__init__(f"incarnation {incarnation}")
        self.incarnation, self.trajectories = incarnation, trajectories


def short_repr(value, max_chars: int = 48) -> str:
    """``repr`` of a peer's value, escaped and cut to ``max_chars`` (for log lines and rejection details)."""
    text = repr(value if not isinstance(value, bytes | bytearray | memoryview) else bytes(value[:max_chars]))
    return text if len(text) <= max_chars else text[:max_chars] + "..."


@dataclass(frozen=True)
class WireLimits:
    max_message_bytes: int = 64 << 20
    max_trajectories_per_message: int = 256
    max_episodes_per_message: int = 4096
    max_actor_id_bytes: int = 64
    max_abs_episode_return: float = 1e12
    max_episode_length_steps: int = 1 << 40


class TrajectoryMessage(NamedTuple):
    actor_id: str
    seq: int
    policy_version: int
    incarnation: int
    n: int
    episodes: list  # [[return: float, length: int], ...]
    fields: dict  # name -> (codec, payload: bytes-like; for jpeg the list of its checked pieces)
    sent_at_ns: int | None


def _compress(a: np.ndarray, codec: str, jpeg_quality: int) -> bytes:
    if codec == CODEC_LZ4:
        return lz4.block.compress(a, store_size=True)
    if codec == CODEC_JPEG:
        return codecs.encode_jpeg(a, jpeg_quality)
    return a.tobytes()


def encode_trajectories(
    spec: TrajectorySpec,
    *,
    actor_id: str,
    seq: int,
    policy_version: int,
    incarnation: int,
    arrays: dict[str, np.ndarray],
    episodes=(),
    codec: str = CODEC_LZ4,
    sent_at_ns: int | None = None,
    image_codec: str = "",
    jpeg_quality: int = codecs.DEFAULT_QUALITY,
) -> bytes:
    """Encode ``n`` trajectories; ``arrays[name]`` is ``[n, *field.shape]`` for every field of ``spec``.
    Each field travels as one payload holding all ``n`` trajectories (trajectory-major). ``policy_version`` and
    ``incarnation`` are those of the weights message whose policy chose the actions. ``image_codec`` (one of
    ALL_CODECS; "": ``codec``) encodes the uint8 image field (``obs`` or ``frames``, see codecs.image_geometry), if
    the spec has one; every other field travels with ``codec``."""
    if codec not in CODECS or image_codec not in ("", *ALL_CODECS):
        raise ValueError(
            f"codec must be one of {CODECS} and image_codec one of {ALL_CODECS}, got {codec!r}, {image_codec!r}"
        )
    n = len(arrays[spec.fields[0].name])
    fields = {}
    for f in spec.fields:
        a = np.ascontiguousarray(arrays[f.name], dtype=f.dtype)
        if a.shape != (n, *f.shape):
            raise ValueError(f"field {f.name!r}: shape {a.shape}, expected {(n, *f.shape)}")
        c = image_codec if image_codec and codecs.image_geometry(f) else codec
        fields[f.name] = {
            "dtype": f.wire_dtype,
            "shape": list(f.shape),
            "codec": c,
            "data": _compress(a, c, jpeg_quality),
        }
    msg = {
        "v": PROTOCOL_VERSION,
        "type": TYPE_TRAJECTORIES,
        "actor": actor_id,
        "seq": seq,
        "policy_version": policy_version,
        "incarnation": incarnation,
        "n": n,
        "episodes": [[float(r), int(length)] for r, length in episodes],
        "fields": fields,
    }
    if sent_at_ns is not None:
        msg["sent_at_ns"] = int(sent_at_ns)
    return msgpack.packb(msg, use_bin_type=True)


FINITE_CHUNK = 1 << 16  # elements per finiteness check (bounds its temporary)
_REQUIRED = (b"v", b"type", b"actor", b"seq", b"policy_version", b"incarnation", b"n", b"episodes", b"fields")
_REQUIRED_SET = frozenset(_REQUIRED)


# ---------------------------------------------------------------------------------------------------- weights
class WeightsMessage(NamedTuple):
    version: int
    incarnation: int
    run_info: dict
    tensors: dict  # name -> np.ndarray
    difficulty: float | None = None  # the learner's curriculum value (None: no curriculum)
    pace_s_per_trajectory: float = 0.0  # flow control: least seconds per trajectory between unroll starts (0: none)


def new_incarnation() -> int:
    """A learner's incarnation: random in [1, 2^63), drawn at every start (a restart from a checkpoint included)."""
    return secrets.randbelow(_MAX_UINT63) + 1


def encode_weights(
    version: int,
    tensors: dict[str, np.ndarray],
    run_info: dict,
    incarnation: int,
    difficulty: float | None = None,
    pace_s_per_trajectory: float = 0.0,
) -> bytes:
    """``tensors``: name -> array (as in a model's state_dict), sent uncompressed, little-endian. ``difficulty``: the
    curriculum's value, written after ``incarnation`` (left out when None); ``pace_s_per_trajectory``: the flow
    control's pace (learner/transport/pacing.py), written next (left out when 0)."""
    out = {}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        out[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}
    msg = {"v": PROTOCOL_VERSION, "type": TYPE_WEIGHTS, "version": int(version), "incarnation": int(incarnation)}
    if difficulty is not None:
        msg["difficulty"] = float(difficulty)
    if pace_s_per_trajectory:
        msg["pace_s_per_trajectory"] = float(pace_s_per_trajectory)
    return msgpack.packb({**msg, "run": run_info, "tensors": out}, use_bin_type=True)


def weights_header(buf) -> tuple[int, int] | None:
    """``(version, incarnation)`` of a weights message, read without decoding its tensors (None if it is not one).

    Lets an actor skip the re-sent copies of weights it already has at the cost of reading a few keys. Both numbers
    are needed: after a learner restart the same version number names other weights."""
    try:
        r = mpack.Reader(buf)
        found = {}
        for _ in range(r.map_header()):
            key = r.raw_str(_MAX_KEY_BYTES)
            if key in (b"version", b"incarnation"):
                found[key] = r.int()
                if len(found) == 2:
                    return found[b"version"], found[b"incarnation"]
            elif key in (b"v", b"type"):
                r.number() if key == b"v" else r.raw_str(_MAX_KEY_BYTES)
            else:
                return None  # the learner writes version and incarnation before run and tensors
    except (mpack.Truncated, mpack.WrongKind):
        return None
    return None


def decode_weights(buf, max_message_bytes: int) -> WeightsMessage:
    """Decode a weights message. Raises :class:`Rejected` if it is not one this actor can use."""
    if len(buf) > max_message_bytes:
        raise Rejected("too_large", f"weights message of {len(buf)} bytes > {max_message_bytes}")
    try:
        msg = msgpack.unpackb(buf, raw=False, strict_map_key=True, max_ext_len=0)
    except Exception as e:
        raise Rejected("malformed", f"{type(e).__name__}: {e}") from None
    if type(msg) is not dict or msg.get("v") != PROTOCOL_VERSION:
        version = msg.get("v") if type(msg) is dict else None
        raise Rejected(
            "bad_version", f"weights of protocol version {short_repr(version)}; this actor speaks {PROTOCOL_VERSION}"
        )
    if msg.get("type") != TYPE_WEIGHTS:
        raise Rejected("bad_type", f"message type {short_repr(msg.get('type'))}")
    try:
        tensors = {}
        for name, t in msg["tensors"].items():
            dtype = np.dtype(t["dtype"])
            if dtype.hasobject or dtype.kind not in "fiub":
                raise ValueError(f"dtype {dtype} not allowed")
            tensors[name] = np.frombuffer(t["data"], dtype=dtype).reshape(t["shape"]).copy()  # writable
        incarnation = msg["incarnation"]
        if not _is_int(incarnation) or not 1 <= incarnation <= _MAX_UINT63:
            raise ValueError("incarnation is not an integer in [1, 2^63)")
        difficulty = msg.get("difficulty")  # optional: present only with a curriculum
        if difficulty is not None:
            if type(difficulty) not in (float, int) or not math.isfinite(difficulty):
                raise ValueError("difficulty is not a finite number")
            difficulty = float(difficulty)
        pace = msg.get("pace_s_per_trajectory", 0.0)  # optional: absent when the learner does not pace actors
        if type(pace) not in (float, int) or not math.isfinite(pace) or pace < 0:
            raise ValueError("pace_s_per_trajectory is not a finite number >= 0")
        return WeightsMessage(int(msg["version"]), incarnation, dict(msg["run"]), tensors, difficulty, float(pace))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise Rejected("bad_field", f"weights: {type(e).__name__}: {e}") from None


def _is_int(x) -> bool:
    return type(x) is int  # bool is an int subclass and is not accepted
