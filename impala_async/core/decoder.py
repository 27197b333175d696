"""The trajectory decoder: validates trajectory messages against a spec and decodes them into caller-provided arrays.

Pure (no zmq, no asyncio). The layout it reads is core/wire.py's and docs/protocol.md's. It never trusts a size the
sender states: every expected size comes from the :class:`~impala_async.core.spec.TrajectorySpec`, every container
length is capped before anything is allocated, and decompression writes straight into the destination (a ring slot).
"""

from __future__ import annotations

import cramjam
import msgpack
import numpy as np

from . import codecs, mpack
from .spec import CHECK_ACTION, CHECK_FINITE, CHECK_FLAG, TrajectorySpec
from .wire import (
    _CODECS_RAW,
    _FIELD_KEYS,
    _MAX_KEY_BYTES,
    _MAX_SHAPE_DIMS,
    _MAX_TOP_KEYS,
    _MAX_UINT63,
    _REQUIRED,
    _REQUIRED_SET,
    ALL_CODECS,
    CODEC_JPEG,
    CODEC_LZ4,
    CODEC_NONE,
    FINITE_CHUNK,
    PROTOCOL_VERSION,
    OtherIncarnation,
    Rejected,
    TrajectoryMessage,
    WireLimits,
    short_repr,
)


class TrajectoryDecoder:
    """Validates trajectory messages against a spec and decodes them into caller-provided arrays.

    ``parse`` walks the fixed layout of docs/protocol.md with :class:`mpack.Reader` and reads nothing else: the work
    and memory a message costs are bounded by the layout and the limits (about 3 objects per episode entry plus 60),
    however the bytes are arranged."""

    def __init__(
        self,
        spec: TrajectorySpec,
        limits: WireLimits = WireLimits(),
        incarnation: int | None = None,
        accept_jpeg: bool = True,
    ):
        """``incarnation``: the learner run's; a message of another (keys in the encoder's order: ``incarnation``
        before ``fields``) raises :class:`OtherIncarnation` before its fields are read against this run's spec.
        ``accept_jpeg``: JPEG images are decoded (a learner asks for them with --obs-codec jpeg; otherwise its
        decoder refuses them, so a peer cannot make it spend 6x LZ4's decode time at will)."""
        self.spec = spec
        self.limits = limits
        self.incarnation = incarnation
        self.accept_jpeg = accept_jpeg
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
        head = self._read_message(buf)
        n = head[b"n"]
        if not 1 <= n <= self.limits.max_trajectories_per_message:
            raise Rejected("bad_header", f"n={n} not in [1, {self.limits.max_trajectories_per_message}]")
        fields = head[b"fields"]
        self._check_sizes(fields, n)
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

    def _read_message(self, buf) -> dict:
        """The whole message as {key bytes: checked value}, every required key there."""
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
        return head

    def _check_sizes(self, fields: dict, n: int) -> None:
        """Each payload's size against the spec's for ``n`` trajectories (JPEG: each piece's size and dimensions,
        nothing decoded; the field's entry becomes its pieces)."""
        for name, (codec, data) in fields.items():
            nbytes = n * self._nbytes[name]
            if codec == CODEC_NONE:
                if len(data) != nbytes:
                    raise Rejected("bad_size", f"field {name!r}: {len(data)} bytes, spec says {nbytes}")
            elif codec == CODEC_JPEG:
                if not self.accept_jpeg:
                    raise Rejected(
                        "bad_field",
                        f"field {name!r}: JPEG images only to a learner run with --obs-codec "
                        "jpeg; this one asked for lz4 (run.obs_codec)",
                    )
                fields[name] = (codec, _jpeg(name, codecs.split_field, self._images[name], data, n))
            elif len(data) < 5 or int.from_bytes(data[:4], "little") != nbytes:
                claimed = int.from_bytes(data[:4], "little") if len(data) >= 4 else None
                raise Rejected("bad_size", f"field {name!r}: LZ4 header claims {claimed} bytes, spec says {nbytes}")

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
            if key == b"fields":
                self._check_incarnation(head)
            try:
                head[key] = read(r, key)
            except mpack.WrongKind as e:
                reason = {b"v": "bad_version", b"type": "bad_type", b"fields": "bad_field"}.get(key, "bad_header")
                raise Rejected(reason, f"{key.decode()!r}: {e}") from None
        return head

    def _check_incarnation(self, head: dict) -> None:
        """Raise OtherIncarnation if the header read so far names another learner run than this decoder's."""
        other = head.get(b"incarnation")
        if self.incarnation is not None and other is not None and other != self.incarnation:
            n = min(head.get(b"n", 1), self.limits.max_trajectories_per_message)
            raise OtherIncarnation(other, max(1, n))

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
        for _ in range(count - len(out)):  # the general path: any order of fields and of their entries' keys
            name, codec, data = self._read_field(r, out)
            out[name] = (codec, data)
        return out

    def _read_field(self, r: mpack.Reader, seen: dict) -> tuple[str, str, bytes]:
        """One field's key and entry, any order of its keys: (name, codec, payload)."""
        raw = r.raw_str(_MAX_KEY_BYTES)
        if raw not in self._expected or self._expected[raw][0] in seen:
            raise Rejected(
                "bad_field",
                f"field {short_repr(raw.decode('utf-8', 'replace'))} unknown or "
                f"repeated; expected {sorted(f.name for f in self._fields)}",
            )
        name, dtype, shape = self._expected[raw]
        entry = _read_entry(r, name)
        if entry[b"dtype"] != dtype or entry[b"shape"] != shape:
            raise Rejected(
                "bad_field",
                f"field {name!r}: dtype {short_repr(entry[b'dtype'])} shape "
                f"{list(entry[b'shape'])}, expected {dtype.decode()!r} {list(shape)}",
            )
        codec = _CODECS_RAW.get(entry[b"codec"])
        if codec is None:
            raise Rejected("bad_field", f"field {name!r}: codec {short_repr(entry[b'codec'])} not in {ALL_CODECS}")
        return name, codec, entry[b"data"]

    def decode_into(self, msg: TrajectoryMessage, dest: dict[str, np.ndarray]) -> int:
        """Decode all ``n`` trajectories of ``msg`` into ``dest[name]``: C-contiguous arrays of the field's dtype
        holding exactly ``n`` trajectories (``[n, *field.shape]`` or flat). Then check the values. Returns the number
        of episode ends in its steps (terminated or truncated), which bounds its episode records: an episode ends at
        a step. On :class:`Rejected` the destination holds garbage and must not be used."""
        for name, _, check, aux in self._plan:
            codec, data = msg.fields[name]
            out = dest[name]
            if codec == CODEC_LZ4:
                _lz4_into(name, data, out)
            elif codec == CODEC_JPEG:  # parse() checked every piece's dimensions against the spec
                geometry = self._images[name]
                assert geometry is not None, "parse() accepts JPEG for image fields only"
                _jpeg(name, codecs.decode_jpeg_into, data, out, *geometry[1:])
            else:
                out.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
            if check:
                _check_values(name, check, aux, out)
        ends = _check_cuts(dest)
        if len(msg.episodes) > ends:
            raise Rejected("inconsistent", f"{len(msg.episodes)} episode records, but its steps end {ends} episodes")
        return ends


def _read_entry(r: mpack.Reader, name: str) -> dict:
    """A field's entry map: its four keys (dtype, shape, codec, data) in any order, each once."""
    if r.map_header() != 4:
        raise Rejected("bad_field", f"field {name!r} must be a map with keys dtype, shape, codec, data")
    entry: dict[bytes, object] = {}
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
    return entry


def _lz4_into(name: str, data: bytes, out: np.ndarray) -> None:
    """An LZ4 block into ``out``. parse() checked its 4-byte size header against the spec, and ``out`` has exactly
    that size: cramjam reads the header, writes at most len(out) bytes and returns how many it wrote."""
    try:
        written = cramjam.lz4.decompress_block_into(data, out)  # type: ignore[arg-type]  # an ndarray is a buffer
    except Exception as e:  # cramjam.DecompressionError on corrupt or oversized blocks
        raise Rejected("bad_lz4", f"field {name!r}: {e}") from None
    if written != out.nbytes:
        raise Rejected("bad_lz4", f"field {name!r}: decompressed to {written} bytes, spec says {out.nbytes}")


def _check_values(name: str, check: str, aux, out: np.ndarray) -> None:
    """The values of a decoded field (spec.py's check), in chunks that bound the temporaries."""
    if check == CHECK_FINITE:
        flat = out.reshape(-1)
        for i in range(0, flat.size, FINITE_CHUNK):
            if not np.isfinite(flat[i : i + FINITE_CHUNK]).all():
                raise Rejected("nonfinite", f"field {name!r} holds NaN or infinity")
    elif check == CHECK_ACTION:
        if np.maximum.reduce(out.reshape(-1).view(np.uint32)) >= aux:  # a negative int32 is a huge uint32
            raise Rejected("bad_action", f"action outside [0, {aux})")
    elif check == CHECK_FLAG:
        if out.tobytes().translate(None, b"\x00\x01"):
            raise Rejected("bad_flag", f"field {name!r} holds values other than 0 and 1")


def _check_cuts(dest: dict[str, np.ndarray]) -> int:
    """Rules between fields (flags are 0 or 1 by now); returns the episodes the steps end (terminated plus
    truncated: never both at a step). Most messages cut no episode: that case is one byte search and two counts."""
    truncated, values, terminated = dest["truncated"], dest["truncation_value"], dest["terminated"]
    if b"\x01" not in truncated.tobytes():
        if np.count_nonzero(values):
            raise Rejected("inconsistent", "truncation_value is non-zero at a step that was not truncated")
        return int(np.count_nonzero(terminated))
    cut = truncated.view(bool)
    if (terminated.view(bool) & cut).any():
        raise Rejected("inconsistent", "terminated and truncated both 1 at a step (a terminal state is not cut)")
    if np.count_nonzero(values) != np.count_nonzero(values.reshape(cut.shape)[cut]):
        raise Rejected("inconsistent", "truncation_value is non-zero at a step that was not truncated")
    return int(np.count_nonzero(terminated) + np.count_nonzero(cut))


def _jpeg(name: str, fn, *args):
    """``fn(*args)`` of codecs, its rejections as :class:`Rejected` naming the field."""
    try:
        return fn(*args)
    except codecs.JpegRejected as e:
        raise Rejected(e.reason, f"field {name!r}: {e.detail}") from None
