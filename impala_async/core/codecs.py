"""The ``"jpeg"`` payload codec for uint8 image fields (docs/protocol.md, "Payload framing").

Pure: numpy, and simplejpeg (the optional extra ``[jpeg]``, imported on first use; it bundles libjpeg-turbo). A field
``[n, *shape]`` whose last two dimensions are an image's rows ``H`` and columns ``W`` is ``N = n * prod(shape[:-2])``
greyscale planes; one under the other they are a picture of ``N * H`` rows, cut between planes into pieces of at most
``planes_per_piece(H)`` planes (JPEG_MAX_ROWS rows). Each piece is one baseline JPEG; the payload is a table of the
pieces' byte lengths (4 bytes each, little-endian) followed by the pieces.

Decoding never allocates by a size the sender states: the number of pieces and every piece's dimensions follow from
the spec and ``n``; each piece's frame header is read (at most MAX_HEADER_SEGMENTS marker segments) and checked before
anything is decoded, and each piece is decoded straight into its rows of the destination (a ring-buffer slot).
"""

from __future__ import annotations

import struct

import numpy as np

from .spec import FieldSpec

CODEC_JPEG = "jpeg"
IMAGE_FIELDS = ("obs", "frames")  # the fields the codec may carry, when they are uint8 with >= 3 dimensions
JPEG_MAX_ROWS = 65500  # libjpeg's JPEG_MAX_DIMENSION; the frame header's 16-bit fields would allow 65535
LENGTH_BYTES = 4  # each entry of the length table: a little-endian unsigned piece size
MAX_HEADER_SEGMENTS = 16  # segments read up to a piece's scan (an honest piece has 6: APP0 DQT SOF0 DHT DHT SOS)
DEFAULT_QUALITY = 90  # the learner's --jpeg-quality
INSTALL_HINT = "pip install 'impala-async[jpeg]' (simplejpeg)"

_SOF0, _SOS = 0xC0, 0xDA
_STANDALONE = frozenset([0x01, *range(0xD0, 0xDA)])  # TEM, RST0-7, SOI, EOI: markers without a length
_SOF_OTHER = frozenset(range(0xC1, 0xD0)) - {0xC4, 0xC8, 0xCC}  # progressive, lossless, arithmetic, hierarchical


class JpegRejected(ValueError):
    """A payload the learner refuses; ``reason`` is a wire rejection reason (``bad_size``, ``bad_jpeg``,
    ``bad_jpeg_dimensions``, ``bad_field``)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def jpeg_module():
    """simplejpeg, or ImportError with one line naming the ``pip install``."""
    try:
        import simplejpeg
    except ImportError:
        raise ImportError(f"the jpeg codec needs simplejpeg: {INSTALL_HINT}") from None
    return simplejpeg


_available: list[bool] = []


def available() -> bool:
    """Whether simplejpeg can be imported (asked once)."""
    if not _available:
        try:
            jpeg_module()
            _available.append(True)
        except ImportError:
            _available.append(False)
    return _available[0]


def image_geometry(field: FieldSpec) -> tuple[int, int, int] | None:
    """``(planes per trajectory, H, W)`` if the codec may carry ``field``: ``obs`` or ``frames``, uint8, at least 3
    dimensions (``[T+1, C, H, W]``, ``[T+S, H, W]``), H and W within JPEG_MAX_ROWS. Else None."""
    shape = field.shape
    if field.name not in IMAGE_FIELDS or field.dtype != np.uint8 or len(shape) < 3:
        return None
    H, W = shape[-2:]
    if H > JPEG_MAX_ROWS or W > JPEG_MAX_ROWS:
        return None
    return int(np.prod(shape[:-2], dtype=np.int64)), H, W


def refusal(field: FieldSpec, high: float) -> str | None:
    """Why a learner cannot ask actors for JPEG observations (``field``: its first field, obs or frames; ``high``:
    the observation space's largest value), or None. JPEG is for pictures of pixels 0 to 255, not for MinAtar's 0/1
    planes (it would blur them into other values) nor for vectors."""
    if image_geometry(field) is None or high != 255.0:
        return (
            f"--obs-codec jpeg needs uint8 image observations [C, H, W] of pixels 0 to 255, not {field.dtype} "
            f"{field.name} {list(field.shape)} of values up to {high:g}"
        )
    if not available():
        return f"--obs-codec jpeg needs the jpeg extra: {INSTALL_HINT}"
    return None


def planes_per_piece(H: int) -> int:
    """Planes of H rows in one piece: as many as fit in JPEG_MAX_ROWS rows."""
    return JPEG_MAX_ROWS // H


def piece_planes(planes: int, H: int) -> list[int]:
    """Planes in each piece of a payload of ``planes`` planes, top to bottom: full pieces, then the rest."""
    per = planes_per_piece(H)
    return [per] * (planes // per) + ([planes % per] if planes % per else [])


def encode_jpeg(a: np.ndarray, quality: int) -> bytes:
    """``a [n, *shape]`` uint8 (``shape``'s last two dimensions rows and columns) -> the payload."""
    if a.dtype != np.uint8 or a.ndim < 3:
        raise ValueError(f"the jpeg codec takes uint8 images, got {a.dtype} {a.shape}")
    if not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality must lie in [1, 100], got {quality}")
    sj = jpeg_module()
    H, W = a.shape[-2:]
    tall = np.ascontiguousarray(a).reshape(-1, W, 1)  # [N*H, W, 1]: every plane, one under the other
    pieces, row = [], 0
    for planes in piece_planes(tall.shape[0] // H, H):
        pieces.append(
            sj.encode_jpeg(tall[row : row + planes * H], quality=quality, colorspace="GRAY", colorsubsampling="Gray")
        )
        row += planes * H
    table = b"".join(len(p).to_bytes(LENGTH_BYTES, "little") for p in pieces)
    return table + b"".join(pieces)


def frame_header(piece) -> tuple[int, int]:
    """``(rows, columns)`` of a baseline 8-bit greyscale JPEG, read from its markers up to its scan.

    Raises JpegRejected (``bad_jpeg``) for anything else: no start-of-image marker first or end-of-image marker last,
    a malformed or truncated segment, more than MAX_HEADER_SEGMENTS segments, a frame that is not baseline
    (progressive scans could make decoding cost many times the picture), not 8 bits, not one component, two frame
    headers, or a scan before the frame header."""
    if bytes(piece[:2]) != b"\xff\xd8" or bytes(piece[-2:]) != b"\xff\xd9":
        raise JpegRejected(
            "bad_jpeg", "a piece does not begin with a JPEG start-of-image marker and end with an end-of-image marker"
        )
    i, end, size = 2, len(piece), None
    for _ in range(MAX_HEADER_SEGMENTS):
        if i + 4 > end or piece[i] != 0xFF:
            raise JpegRejected("bad_jpeg", f"no marker segment at byte {i} of a piece")
        marker = piece[i + 1]
        if marker in _STANDALONE or marker == 0xFF:
            raise JpegRejected("bad_jpeg", f"marker 0x{marker:02X} before the frame's scan")
        length = int.from_bytes(piece[i + 2 : i + 4], "big")
        body, i = i + 4, i + 2 + length
        if length < 2 or i > end:
            raise JpegRejected("bad_jpeg", f"a marker segment of {length} bytes overruns the piece")
        if marker in _SOF_OTHER:
            raise JpegRejected("bad_jpeg", f"frame type 0x{marker:02X}: only baseline JPEG (SOF0) is accepted")
        if marker == _SOF0:
            if size is not None:
                raise JpegRejected("bad_jpeg", "two frame headers in a piece")
            if length != 11 or piece[body] != 8 or piece[body + 5] != 1:
                raise JpegRejected("bad_jpeg", "the frame header is not one of an 8-bit single-component picture")
            size = (
                int.from_bytes(piece[body + 1 : body + 3], "big"),
                int.from_bytes(piece[body + 3 : body + 5], "big"),
            )
        elif marker == _SOS:
            if size is None:
                raise JpegRejected("bad_jpeg", "a scan before the frame header")
            return size
    raise JpegRejected("bad_jpeg", f"no scan within the first {MAX_HEADER_SEGMENTS} marker segments of a piece")


def split_field(geometry: tuple[int, int, int] | None, data, n: int) -> list:
    """:func:`split_jpeg` for ``n`` trajectories of a field of this :func:`image_geometry`; rejects (``bad_field``) a
    field that is no image, and any jpeg where simplejpeg is missing (the learner could not decode it)."""
    if geometry is None:
        raise JpegRejected(
            "bad_field", "codec jpeg is for uint8 image fields only (obs of uint8 [T+1, C, H, W], frames)"
        )
    if not available():
        raise JpegRejected("bad_field", f"this learner cannot decode jpeg ({INSTALL_HINT})")
    planes, H, W = geometry
    return split_jpeg(data, n * planes, H, W)


def split_jpeg(data, planes: int, H: int, W: int) -> list:
    """Check a payload of ``planes`` planes of ``H x W`` (the number from the spec and ``n``) and return its pieces
    (slices of ``data``). Reads the length table and each piece's frame header; decodes nothing."""
    counts = piece_planes(planes, H)
    k = len(counts)
    table = LENGTH_BYTES * k
    if len(data) < table:
        raise JpegRejected(
            "bad_size",
            f"a jpeg payload of {len(data)} bytes cannot hold the length table of the {k} "
            f"pieces the spec gives ({planes} planes of {H}x{W})",
        )
    lengths = struct.unpack_from(f"<{k}I", data)
    if sum(lengths) != len(data) - table:
        raise JpegRejected(
            "bad_size",
            f"jpeg piece lengths {short(lengths)} do not add up to the {len(data) - table} "
            f"bytes after the length table",
        )
    pieces, at = [], table
    for count, length in zip(counts, lengths, strict=True):
        piece = data[at : at + length]
        at += length
        rows, cols = frame_header(piece)
        if (rows, cols) != (count * H, W):
            raise JpegRejected(
                "bad_jpeg_dimensions",
                f"a piece of {rows}x{cols} pixels where the spec gives {count * H}x{W} ({count} planes of {H}x{W})",
            )
        pieces.append(piece)
    return pieces


def decode_jpeg_into(pieces: list, out: np.ndarray, H: int, W: int) -> None:
    """Decode the pieces :func:`split_jpeg` checked straight into ``out``: C-contiguous uint8 holding exactly their
    planes (``[n, *shape]`` or flat). Raises JpegRejected (``bad_jpeg``) on corrupt data; ``out`` then holds garbage."""
    sj = jpeg_module()
    plane_bytes = H * W
    counts = piece_planes(out.size // plane_bytes, H)
    if not out.flags.c_contiguous or out.dtype != np.uint8 or out.size % plane_bytes or len(counts) != len(pieces):
        raise ValueError(f"{len(pieces)} pieces for a destination {out.dtype} {out.shape}")  # a caller's bug
    flat = out.reshape(-1)  # a view, since out is C-contiguous: decoding writes into the destination itself
    at = 0
    for piece, count in zip(pieces, counts, strict=True):
        size = count * plane_bytes
        try:  # simplejpeg writes the picture into the buffer; split_jpeg checked that it is exactly this size
            sj.decode_jpeg(piece, colorspace="GRAY", buffer=flat[at : at + size], strict=True)
        except (ValueError, RuntimeError) as e:  # libjpeg errors, and its warnings (strict): corrupt or truncated
            raise JpegRejected("bad_jpeg", f"a piece does not decode: {e}") from None
        at += size


def short(values: tuple, count: int = 4) -> str:
    """The first ``count`` of ``values`` (for rejection details: they are logged)."""
    return str(list(values[:count]))[:-1] + (", ...]" if len(values) > count else "]")
