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

import secrets
from dataclasses import dataclass
from typing import NamedTuple

import cramjam
import lz4.block
import msgpack
import numpy as np

from . import codecs, mpack
from .spec import CHECK_ACTION, CHECK_FINITE, CHECK_FLAG, TrajectorySpec

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


class TrajectoryDecoder:
    """Validates trajectory messages against a spec and decodes them into caller-provided arrays.

    ``parse`` walks the fixed layout of docs/protocol.md with :class:`mpack.Reader` and reads nothing else: the work
    and memory a message costs are bounded by the layout and the limits (about 3 objects per episode entry plus 60),
    however the bytes are arranged."""

    def __init__(self, spec: TrajectorySpec, limits: WireLimits = WireLimits()):
        self.spec = spec
        self.limits = limits
        self._fields = spec.fields
        self._expected = {f.name.encode(): (f.name, f.wire_dtype.encode(), f.shape) for f in self._fields}
        # decode_into's per-field plan: (name, bytes per trajectory, check, its argument).
        self._plan = [
            (f.name, f.nbytes, f.check, spec.num_actions if f.check == CHECK_ACTION else None) for f in self._fields
        ]
        self._nbytes = {f.name: f.nbytes for f in self._fields}
        self._images = {f.name: codecs.image_geometry(f) for f in self._fields}  # (planes, H, W) or None
        # The top-level keys and their readers (each checks type and range, raising Rejected).
        self._readers = {
            b"v": self._read_v,
            b"type": self._read_type,
            b"actor": self._read_actor,
            b"seq": self._read_uint63,
            b"policy_version": self._read_uint63,
            b"incarnation": self._read_incarnation,
            b"n": self._read_uint63,
            b"episodes": self._read_episodes,
            b"fields": self._read_fields,
            b"sent_at_ns": self._read_sent_at,
        }
        # The bytes of each field's key and its entry up to the payload, as msgpack writes the canonical order
        # (dtype, shape, codec, data): most messages take this fast path; any other order takes the general one.
        self._prefixes = [
            (
                f.name,
                tuple(
                    msgpack.packb(f.name)
                    + b"\x84"
                    + b"".join(
                        msgpack.packb(x)
                        for x in ("dtype", f.wire_dtype, "shape", list(f.shape), "codec", codec, "data")
                    )
                    for codec in (CODEC_LZ4, CODEC_NONE, CODEC_JPEG)
                ),
            )
            for f in self._fields
        ]

    def parse(self, buf) -> TrajectoryMessage:
        """Check everything but the payloads' contents. Raises :class:`Rejected`."""
        if len(buf) > self.limits.max_message_bytes:
            raise Rejected("too_large", f"{len(buf)} bytes > max_message_bytes={self.limits.max_message_bytes}")
        r = mpack.Reader(buf)
        try:
            head = self._read_top(r)
        except mpack.Truncated as e:
            raise Rejected("malformed", str(e)) from None
        if not r.at_end:
            raise Rejected("malformed", "bytes after the end of the message map")
        if not _REQUIRED_SET <= head.keys():
            if b"v" not in head:
                raise Rejected("bad_version", f"no protocol version; this learner speaks {PROTOCOL_VERSION}")
            if b"type" not in head:
                raise Rejected("bad_type", "no message type")
            raise Rejected("bad_header", f"missing keys {[k.decode() for k in _REQUIRED if k not in head]}")
        n = head[b"n"]
        if not 1 <= n <= self.limits.max_trajectories_per_message:
            raise Rejected("bad_header", f"n={n} not in [1, {self.limits.max_trajectories_per_message}]")
        fields = head[b"fields"]
        for name, (codec, data) in fields.items():
            nbytes = n * self._nbytes[name]
            if codec == CODEC_NONE:
                if len(data) != nbytes:
                    raise Rejected("bad_size", f"field {name!r}: {len(data)} bytes, spec says {nbytes}")
            elif codec == CODEC_JPEG:  # pieces checked (sizes, dimensions), nothing decoded
                fields[name] = (codec, _jpeg(name, codecs.split_field, self._images[name], data, n))
            elif len(data) < 5 or int.from_bytes(data[:4], "little") != nbytes:
                claimed = int.from_bytes(data[:4], "little") if len(data) >= 4 else None
                raise Rejected("bad_size", f"field {name!r}: LZ4 header claims {claimed} bytes, spec says {nbytes}")
        return TrajectoryMessage(
            head[b"actor"],
            head[b"seq"],
            head[b"policy_version"],
            head[b"incarnation"],
            n,
            head[b"episodes"],
            fields,
            head.get(b"sent_at_ns"),
        )

    def _read_top(self, r: mpack.Reader) -> dict:
        """The top-level map, as {key bytes: checked value}; every key known, none twice."""
        try:
            count = r.map_header()
        except mpack.WrongKind as e:
            raise Rejected("malformed", f"the message is not a map: {e}") from None
        if count > _MAX_TOP_KEYS:
            raise Rejected("bad_header", f"a map of {count} keys; the layout has at most {_MAX_TOP_KEYS}")
        head: dict = {}
        readers = self._readers
        for _ in range(count):
            try:
                key = r.raw_str(_MAX_KEY_BYTES)
            except mpack.WrongKind as e:
                raise Rejected("malformed", f"a map key: {e}") from None
            read = readers.get(key)
            if read is None:
                raise Rejected(
                    "bad_header",
                    f"unknown key {short_repr(key.decode('utf-8', 'replace'))} (protocol {PROTOCOL_VERSION} is closed)",
                )
            if key in head:
                raise Rejected("bad_header", f"key {short_repr(key.decode())} twice")
            try:
                head[key] = read(r, key)
            except mpack.WrongKind as e:
                reason = {b"v": "bad_version", b"type": "bad_type", b"fields": "bad_field"}.get(key, "bad_header")
                raise Rejected(reason, f"{key.decode()!r}: {e}") from None
        return head

    @staticmethod
    def _read_uint63(r: mpack.Reader, key: bytes) -> int:
        value = r.int()
        if not 0 <= value <= _MAX_UINT63:
            raise Rejected("bad_header", f"{key.decode()}={value} is not in [0, 2^63)")
        return value

    @staticmethod
    def _read_incarnation(r: mpack.Reader, key: bytes) -> int:
        value = r.int()
        if not 1 <= value <= _MAX_UINT63:
            raise Rejected("bad_header", f"incarnation {value} is not in [1, 2^63): copy the weights message's")
        return value

    @staticmethod
    def _read_sent_at(r: mpack.Reader, key: bytes) -> int:
        if r.is_nil():
            raise Rejected("bad_header", "sent_at_ns is nil: leave the key out instead")
        return TrajectoryDecoder._read_uint63(r, key)

    @staticmethod
    def _read_v(r: mpack.Reader, key: bytes) -> int:
        v = r.int()
        if v != PROTOCOL_VERSION:
            raise Rejected("bad_version", f"protocol version {v}, this learner speaks {PROTOCOL_VERSION}")
        return v

    @staticmethod
    def _read_type(r: mpack.Reader, key: bytes) -> bytes:
        t = r.raw_str(_MAX_KEY_BYTES)
        if t != b"trajectories":
            raise Rejected("bad_type", f"message type {short_repr(t)}")
        return t

    def _read_actor(self, r: mpack.Reader, key: bytes) -> str:
        actor = r.str(self.limits.max_actor_id_bytes)
        if not actor:
            raise Rejected("bad_header", "empty actor id")
        return actor

    def _read_episodes(self, r: mpack.Reader, key: bytes = b"episodes") -> list:
        lim = self.limits
        count = r.array_header()
        if count > lim.max_episodes_per_message:
            raise Rejected("bad_header", f"{count} episodes > max_episodes_per_message={lim.max_episodes_per_message}")
        episodes = r.number_int_pairs(count)  # WrongKind: an entry that is not [return, length]
        max_return, max_length = lim.max_abs_episode_return, lim.max_episode_length_steps
        for ret, length in episodes:
            if not (-max_return <= ret <= max_return and 1 <= length <= max_length):  # NaN fails every comparison
                raise Rejected(
                    "bad_header",
                    f"episode [{short_repr(ret)}, {length}]: the return must be finite and "
                    f"within +-{max_return:g}, the length in [1, {max_length}]",
                )
        return episodes

    def _read_fields(self, r: mpack.Reader, key: bytes = b"fields") -> dict:
        count = r.map_header()
        if count != len(self._expected):
            hint = (
                f" (this learner's network has an LSTM core: core_state, the [2, {self.spec.core_state_size}] "
                f"state the unroll began with, is required)"
                if self.spec.core_state_size
                else ""
            )
            raise Rejected(
                "bad_field",
                f"{count} fields, the spec has {len(self._expected)}: {sorted(f.name for f in self._fields)}{hint}",
            )
        out = {}
        for name, (lz4_prefix, none_prefix, jpeg_prefix) in self._prefixes:  # fast path: spec order, canonical
            if r.skip_prefix(lz4_prefix):
                out[name] = (CODEC_LZ4, r.bin())
            elif r.skip_prefix(none_prefix):
                out[name] = (CODEC_NONE, r.bin())
            elif r.skip_prefix(jpeg_prefix):
                out[name] = (CODEC_JPEG, r.bin())
            else:
                break
        for _ in range(count - len(out)):
            raw = r.raw_str(_MAX_KEY_BYTES)
            if raw not in self._expected or self._expected[raw][0] in out:
                raise Rejected(
                    "bad_field",
                    f"field {short_repr(raw.decode('utf-8', 'replace'))} unknown or "
                    f"repeated; expected {sorted(f.name for f in self._fields)}",
                )
            name, dtype, shape = self._expected[raw]
            if r.map_header() != 4:
                raise Rejected("bad_field", f"field {name!r} must be a map with keys dtype, shape, codec, data")
            entry = {}
            for _ in range(4):
                k = r.raw_str(_MAX_KEY_BYTES)
                if k not in _FIELD_KEYS or k in entry:
                    raise Rejected("bad_field", f"field {name!r}: key {short_repr(k)} unknown or repeated")
                if k == b"shape":
                    dims = r.array_header()
                    if dims > _MAX_SHAPE_DIMS:
                        raise Rejected("bad_field", f"field {name!r}: a shape of {dims} dimensions")
                    entry[k] = tuple(r.int() for _ in range(dims))
                elif k == b"data":
                    entry[k] = r.bin()
                else:
                    entry[k] = r.raw_str(_MAX_KEY_BYTES)
            if entry[b"dtype"] != dtype or entry[b"shape"] != shape:
                raise Rejected(
                    "bad_field",
                    f"field {name!r}: dtype {short_repr(entry[b'dtype'])} shape "
                    f"{list(entry[b'shape'])}, expected {dtype.decode()!r} {list(shape)}",
                )
            codec = _CODECS_RAW.get(entry[b"codec"])
            if codec is None:
                raise Rejected("bad_field", f"field {name!r}: codec {short_repr(entry[b'codec'])} not in {ALL_CODECS}")
            out[name] = (codec, entry[b"data"])
        return out

    def decode_into(self, msg: TrajectoryMessage, dest: dict[str, np.ndarray]) -> None:
        """Decode all ``n`` trajectories of ``msg`` into ``dest[name]``: C-contiguous arrays of the field's dtype
        holding exactly ``n`` trajectories (``[n, *field.shape]`` or flat). Then check the values. On
        :class:`Rejected` the destination holds garbage and must not be used."""
        for name, _, check, aux in self._plan:
            codec, data = msg.fields[name]
            out = dest[name]
            if codec == CODEC_LZ4:
                # parse() checked the 4-byte size header against the spec, and ``out`` has exactly that size:
                # cramjam reads the header, writes at most len(out) bytes and returns how many it wrote.
                try:
                    written = cramjam.lz4.decompress_block_into(data, out)
                except Exception as e:  # cramjam.DecompressionError on corrupt or oversized blocks
                    raise Rejected("bad_lz4", f"field {name!r}: {e}") from None
                if written != out.nbytes:
                    raise Rejected(
                        "bad_lz4", f"field {name!r}: decompressed to {written} bytes, spec says {out.nbytes}"
                    )
            elif codec == CODEC_JPEG:  # parse() checked every piece's dimensions against the spec
                _jpeg(name, codecs.decode_jpeg_into, data, out, *self._images[name][1:])
            else:
                out.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
            # Value checks, in chunks that bound the temporaries.
            if check == CHECK_FINITE:
                flat = out.reshape(-1)
                for i in range(0, flat.size, FINITE_CHUNK):
                    if not _ISFINITE(flat[i : i + FINITE_CHUNK]).all():
                        raise Rejected("nonfinite", f"field {name!r} holds NaN or infinity")
            elif check == CHECK_ACTION:
                if _MAX_U32(out.reshape(-1).view(np.uint32)) >= aux:  # a negative int32 is a huge uint32
                    raise Rejected("bad_action", f"action outside [0, {aux})")
            elif check == CHECK_FLAG:
                if out.tobytes().translate(None, b"\x00\x01"):
                    raise Rejected("bad_flag", f"field {name!r} holds values other than 0 and 1")
        # Rules between fields (flags are 0 or 1 by now). Most messages cut no episode: that case is one byte search
        # and one count.
        truncated, values = dest["truncated"], dest["truncation_value"]
        if b"\x01" not in truncated.tobytes():
            if _COUNT_NONZERO(values):
                raise Rejected("inconsistent", "truncation_value is non-zero at a step that was not truncated")
            return
        cut = truncated.view(bool)
        if (dest["terminated"].view(bool) & cut).any():
            raise Rejected("inconsistent", "terminated and truncated both 1 at a step (a terminal state is not cut)")
        if _COUNT_NONZERO(values) != _COUNT_NONZERO(values.reshape(cut.shape)[cut]):
            raise Rejected("inconsistent", "truncation_value is non-zero at a step that was not truncated")


def _jpeg(name: str, fn, *args):
    """``fn(*args)`` of codecs, its rejections as :class:`Rejected` naming the field."""
    try:
        return fn(*args)
    except codecs.JpegRejected as e:
        raise Rejected(e.reason, f"field {name!r}: {e.detail}") from None


_MAX_U32 = np.maximum.reduce
_COUNT_NONZERO = np.count_nonzero
_ISFINITE = np.isfinite


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
    control's pace (learner/pacing.py), written next (left out when 0)."""
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
            if type(difficulty) not in (float, int) or not _ISFINITE(difficulty):
                raise ValueError("difficulty is not a finite number")
            difficulty = float(difficulty)
        pace = msg.get("pace_s_per_trajectory", 0.0)  # optional: absent when the learner does not pace actors
        if type(pace) not in (float, int) or not _ISFINITE(pace) or pace < 0:
            raise ValueError("pace_s_per_trajectory is not a finite number >= 0")
        return WeightsMessage(int(msg["version"]), incarnation, dict(msg["run"]), tensors, difficulty, float(pace))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise Rejected("bad_field", f"weights: {type(e).__name__}: {e}") from None


def _is_int(x) -> bool:
    return type(x) is int  # bool is an int subclass and is not accepted
