"""The wire format: trajectory messages (actor -> learner) and weight messages (learner -> actors).

Pure: msgpack, lz4, cramjam and numpy only (no zmq, no asyncio). ``docs/protocol.md`` is the contract this module
implements; keep the two in agreement.

A trajectory message is one msgpack map carrying ``n`` trajectories of one actor. Every array travels as the raw
little-endian bytes of one trajectory's field, either uncompressed or as an LZ4 block preceded by its uncompressed size
(4 bytes, little-endian: the layout of ``lz4.block.compress(data)``). The decoder never trusts a size the sender
states: every expected size comes from the :class:`~impala_async.spec.TrajectorySpec`, every container length is
capped before anything is allocated, and decompression writes straight into the destination (a ring-buffer slot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import cramjam
import lz4.block
import msgpack
import numpy as np

from .spec import CHECK_ACTION, CHECK_FINITE, CHECK_FLAG, TrajectorySpec

PROTOCOL_VERSION = 1
TYPE_TRAJECTORIES = "trajectories"
TYPE_WEIGHTS = "weights"
CODEC_LZ4 = "lz4"
CODEC_NONE = "none"
CODECS = (CODEC_LZ4, CODEC_NONE)

_REQUIRED_KEYS = frozenset({"v", "type", "actor", "seq", "policy_version", "n", "episodes", "fields"})
_OPTIONAL_KEYS = frozenset({"sent_at_ns"})
_FIELD_KEYS = frozenset({"dtype", "shape", "codec", "data"})
_MAX_UINT63 = (1 << 63) - 1

# Every reason a message can be rejected for; metrics count them as ``rejected_<reason>``.
REJECT_REASONS = (
    "malformed",  # not msgpack, or msgpack beyond the caps (lengths, nesting, extension types)
    "multipart",  # more than one ZeroMQ frame
    "too_large",  # over max_message_bytes
    "bad_version",  # unknown protocol version
    "bad_type",  # unknown message type
    "bad_header",  # a header field missing, of the wrong type or out of range
    "bad_field",  # field set, dtype, shape, codec or payload count differs from the spec
    "bad_size",  # payload length or LZ4 size header differs from the spec's size
    "bad_lz4",  # LZ4 block invalid or decompressing to the wrong length
    "nonfinite",  # NaN or infinity in a float field
    "bad_action",  # action index outside [0, num_actions)
    "bad_flag",  # terminated/truncated not 0 or 1
    "future_version",  # policy version newer than the learner's
    "replay",  # (actor id, sequence number) not newer than the last one seen
    "bad_identity",  # with CURVE: no authenticated key name on the message
)


class Rejected(Exception):
    """A message that breaks the protocol. ``reason`` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str):
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class WireLimits:
    max_message_bytes: int = 64 << 20
    max_trajectories_per_message: int = 256
    max_episodes_per_message: int = 4096
    max_actor_id_bytes: int = 64


class TrajectoryMessage(NamedTuple):
    actor_id: str
    seq: int
    policy_version: int
    n: int
    episodes: list  # [[return: float, length: int], ...]
    fields: dict  # name -> (codec, [payload bytes] * n)
    sent_at_ns: int | None


def _compress(a: np.ndarray, codec: str) -> bytes:
    if codec == CODEC_LZ4:
        return lz4.block.compress(a, store_size=True)
    return a.tobytes()


def encode_trajectories(spec: TrajectorySpec, *, actor_id: str, seq: int, policy_version: int,
                        arrays: dict[str, np.ndarray], episodes=(), codec: str = CODEC_LZ4,
                        sent_at_ns: int | None = None) -> bytes:
    """Encode ``n`` trajectories; ``arrays[name]`` is ``[n, *field.shape]`` for every field of ``spec``.
    Each field travels as one payload holding all ``n`` trajectories (trajectory-major)."""
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    n = len(arrays[spec.fields[0].name])
    fields = {}
    for f in spec.fields:
        a = np.ascontiguousarray(arrays[f.name], dtype=f.dtype)
        if a.shape != (n, *f.shape):
            raise ValueError(f"field {f.name!r}: shape {a.shape}, expected {(n, *f.shape)}")
        fields[f.name] = {"dtype": f.wire_dtype, "shape": list(f.shape), "codec": codec, "data": _compress(a, codec)}
    msg = {"v": PROTOCOL_VERSION, "type": TYPE_TRAJECTORIES, "actor": actor_id, "seq": seq,
           "policy_version": policy_version, "n": n,
           "episodes": [[float(r), int(length)] for r, length in episodes], "fields": fields}
    if sent_at_ns is not None:
        msg["sent_at_ns"] = int(sent_at_ns)
    return msgpack.packb(msg, use_bin_type=True)


def _is_int(x) -> bool:
    return type(x) is int  # bool is an int subclass and is not accepted


FINITE_CHUNK = 1 << 16  # elements per finiteness check (bounds its temporary)


class TrajectoryDecoder:
    """Validates trajectory messages against a spec and decodes them into caller-provided arrays."""

    def __init__(self, spec: TrajectorySpec, limits: WireLimits = WireLimits()):
        self.spec = spec
        self.limits = limits
        self._fields = spec.fields
        self._expected = {f.name: (f.wire_dtype, list(f.shape)) for f in self._fields}
        # decode_into's per-field plan: (name, bytes per trajectory, check, its argument).
        self._plan = [(f.name, f.nbytes, f.check, spec.num_actions if f.check == CHECK_ACTION else None)
                      for f in self._fields]
        self._unpack = dict(
            raw=False, strict_map_key=True, use_list=True,
            max_str_len=max(256, limits.max_actor_id_bytes), max_bin_len=limits.max_message_bytes,
            max_array_len=max(limits.max_episodes_per_message, 16), max_map_len=16, max_ext_len=0)

    def parse(self, buf) -> TrajectoryMessage:
        """Check everything but the payloads' contents. Raises :class:`Rejected`."""
        if len(buf) > self.limits.max_message_bytes:
            raise Rejected("too_large", f"{len(buf)} bytes > max_message_bytes={self.limits.max_message_bytes}")
        try:
            msg = msgpack.unpackb(buf, **self._unpack)
        except Exception as e:  # msgpack raises ValueError, ExtraData, StackError, FormatError, ... on hostile input
            raise Rejected("malformed", f"{type(e).__name__}: {e}") from None
        if type(msg) is not dict:
            raise Rejected("malformed", f"top level is {type(msg).__name__}, expected a map")
        if not all(type(k) is str for k in msg):  # msgpack's strict_map_key admits bin keys too
            raise Rejected("malformed", "a map key is not a string")
        if msg.get("v") != PROTOCOL_VERSION or not _is_int(msg.get("v")):
            raise Rejected("bad_version", f"protocol version {msg.get('v')!r}, this learner speaks {PROTOCOL_VERSION}")
        if msg.get("type") != TYPE_TRAJECTORIES:
            raise Rejected("bad_type", f"message type {msg.get('type')!r}")
        keys = msg.keys()
        if not _REQUIRED_KEYS <= keys or not keys <= _REQUIRED_KEYS | _OPTIONAL_KEYS:
            raise Rejected("bad_header", f"keys {sorted(map(repr, keys))}, required {sorted(_REQUIRED_KEYS)}")
        actor, seq, version, n = msg["actor"], msg["seq"], msg["policy_version"], msg["n"]
        if type(actor) is not str or not 0 < len(actor.encode()) <= self.limits.max_actor_id_bytes:
            raise Rejected("bad_header", f"actor id must be a string of 1..{self.limits.max_actor_id_bytes} bytes")
        if not _is_int(seq) or not 0 <= seq <= _MAX_UINT63:
            raise Rejected("bad_header", f"seq {seq!r} is not an integer in [0, 2^63)")
        if not _is_int(version) or not 0 <= version <= _MAX_UINT63:
            raise Rejected("bad_header", f"policy_version {version!r} is not an integer in [0, 2^63)")
        if not _is_int(n) or not 1 <= n <= self.limits.max_trajectories_per_message:
            raise Rejected("bad_header", f"n={n!r} not in [1, {self.limits.max_trajectories_per_message}]")
        sent_at = msg.get("sent_at_ns")
        if sent_at is not None and (not _is_int(sent_at) or not 0 <= sent_at <= _MAX_UINT63):
            raise Rejected("bad_header", "sent_at_ns is not an integer in [0, 2^63)")
        episodes = self._check_episodes(msg["episodes"])
        return TrajectoryMessage(actor, seq, version, n, episodes, self._check_fields(msg["fields"], n), sent_at)

    def _check_episodes(self, episodes) -> list:
        if type(episodes) is not list or len(episodes) > self.limits.max_episodes_per_message:
            raise Rejected("bad_header", "episodes must be a list of at most max_episodes_per_message entries")
        for ep in episodes:
            if (type(ep) is not list or len(ep) != 2 or type(ep[0]) not in (float, int) or not _is_int(ep[1])
                    or not math.isfinite(ep[0]) or ep[1] < 1):
                raise Rejected("bad_header", f"episode entry {ep!r} is not [finite return, length >= 1]")
        return episodes

    def _check_fields(self, fields, n: int) -> dict:
        if type(fields) is not dict or fields.keys() != self._expected.keys():
            got = sorted(map(repr, fields)) if type(fields) is dict else type(fields).__name__
            raise Rejected("bad_field", f"fields {got}, expected {sorted(self._expected)}")
        out = {}
        for name, per_trajectory, _, _ in self._plan:
            entry = fields[name]
            if type(entry) is not dict or entry.keys() != _FIELD_KEYS:
                raise Rejected("bad_field", f"field {name!r} must be a map with keys {sorted(_FIELD_KEYS)}")
            dtype, shape = self._expected[name]
            if entry["dtype"] != dtype or entry["shape"] != shape:
                raise Rejected("bad_field", f"field {name!r}: dtype {entry['dtype']!r} shape {entry['shape']!r}, "
                                            f"expected {dtype!r} {shape!r}")
            codec, data = entry["codec"], entry["data"]
            if codec not in CODECS:
                raise Rejected("bad_field", f"field {name!r}: codec {codec!r} not in {CODECS}")
            if type(data) is not bytes:
                raise Rejected("bad_field", f"field {name!r}: data must be binary")
            nbytes = n * per_trajectory
            if codec == CODEC_NONE:
                if len(data) != nbytes:
                    raise Rejected("bad_size", f"field {name!r}: {len(data)} bytes, spec says {nbytes}")
            elif len(data) < 5 or int.from_bytes(data[:4], "little") != nbytes:
                claimed = int.from_bytes(data[:4], "little") if len(data) >= 4 else None
                raise Rejected("bad_size", f"field {name!r}: LZ4 header claims {claimed} bytes, spec says {nbytes}")
            out[name] = (codec, data)
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
                    raise Rejected("bad_lz4", f"field {name!r}: decompressed to {written} bytes, "
                                              f"spec says {out.nbytes}")
            else:
                out.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
            # Value checks, in chunks that bound the temporaries.
            if check == CHECK_FINITE:
                flat = out.reshape(-1)
                for i in range(0, flat.size, FINITE_CHUNK):
                    if not _ISFINITE(flat[i:i + FINITE_CHUNK]).all():
                        raise Rejected("nonfinite", f"field {name!r} holds NaN or infinity")
            elif check == CHECK_ACTION:
                if _MAX_U32(out.reshape(-1).view(np.uint32)) >= aux:  # a negative int32 is a huge uint32
                    raise Rejected("bad_action", f"action outside [0, {aux})")
            elif check == CHECK_FLAG:
                if out.tobytes().translate(None, b"\x00\x01"):
                    raise Rejected("bad_flag", f"field {name!r} holds values other than 0 and 1")


_MAX_U32 = np.maximum.reduce
_ISFINITE = np.isfinite


# ---------------------------------------------------------------------------------------------------- weights
class WeightsMessage(NamedTuple):
    version: int
    run_info: dict
    tensors: dict  # name -> np.ndarray


def encode_weights(version: int, tensors: dict[str, np.ndarray], run_info: dict) -> bytes:
    """``tensors``: name -> array (as in a model's state_dict), sent uncompressed, little-endian."""
    out = {}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        out[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": TYPE_WEIGHTS, "version": int(version), "run": run_info,
                          "tensors": out}, use_bin_type=True)


def weights_version(buf) -> int | None:
    """The policy version of a weights message, read without decoding its tensors (None if it is not one).

    Lets an actor skip the re-sent copies of weights it already has at the cost of reading three keys."""
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(buf), max_ext_len=0)
        unpacker.feed(buf)
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "version":
                version = unpacker.unpack()
                return version if _is_int(version) else None
            unpacker.skip()
    except Exception:
        return None
    return None


def decode_weights(buf, max_message_bytes: int) -> WeightsMessage:
    """Decode a weights message. Raises :class:`Rejected` if it is not one this actor can use."""
    if len(buf) > max_message_bytes:
        raise Rejected("too_large", f"weights message of {len(buf)} bytes > {max_message_bytes}")
    try:
        msg = msgpack.unpackb(buf, raw=False, strict_map_key=True,
                              max_ext_len=0)
    except Exception as e:
        raise Rejected("malformed", f"{type(e).__name__}: {e}") from None
    if type(msg) is not dict or msg.get("v") != PROTOCOL_VERSION:
        raise Rejected("bad_version", "not a version-1 message")
    if msg.get("type") != TYPE_WEIGHTS:
        raise Rejected("bad_type", f"message type {msg.get('type')!r}")
    try:
        tensors = {}
        for name, t in msg["tensors"].items():
            dtype = np.dtype(t["dtype"])
            if dtype.hasobject or dtype.kind not in "fiub":
                raise ValueError(f"dtype {dtype} not allowed")
            tensors[name] = np.frombuffer(t["data"], dtype=dtype).reshape(t["shape"]).copy()  # writable
        return WeightsMessage(int(msg["version"]), dict(msg["run"]), tensors)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise Rejected("bad_field", f"weights: {type(e).__name__}: {e}") from None
