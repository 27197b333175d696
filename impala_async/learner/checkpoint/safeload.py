"""Loading a file no one vouches for (a checkpoint: files.py, evaluate.py) at a bounded cost.

Loaded with ``torch.load(weights_only=True)`` (a checkpoint cannot run code), and only after the file passed checks
that bound what loading it costs: a regular file (a FIFO or a device is never opened) holding a zip archive (torch's
format) no larger than ``max_bytes`` whose records are all stored uncompressed, as torch writes them (so nothing
decompresses beyond the file's size), with a directory and a pickle of bounded size. What it holds is then walked
(:func:`check_tree`: a tree of bounded size, dense tensors inside their storage) before anything reads it.
"""

from __future__ import annotations

import collections
import os
import stat
import struct
import zipfile
from pathlib import Path

import torch

MAX_CHECKPOINT_NODES = 1 << 16  # values (containers, scalars, tensors) in a checkpoint; a learner's holds ~1,000
MAX_CHECKPOINT_PICKLE_BYTES = 1 << 20  # its pickle record, and its zip directory; a learner's: 10 to 40 KB each
MAX_CHECKPOINT_DEPTH = 32  # containers within containers; a learner's state nests 6 deep (learner.optimizer.state.0)


def open_regular(path: Path, max_bytes: int):
    """``path`` opened for binary reading, if it is a regular file of at most ``max_bytes``; ValueError otherwise.
    Prevents a FIFO, a device, a socket or a directory (or a symbolic link to one) named as a checkpoint from hanging
    or feeding the loader: each is refused from its stat, never opened (open() of a FIFO blocks until a writer comes,
    a device never ends); the file is opened non-blocking and its descriptor checked again, so that one swapped in
    between cannot block either."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f"not a regular file ({_file_kind(os.stat(path).st_mode)}): not opened")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"not a regular file ({_file_kind(st.st_mode)})")
        if st.st_size > max_bytes:
            raise ValueError(f"{st.st_size} bytes > max_checkpoint_bytes={max_bytes}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _zip_directory(f, size: int) -> tuple[int, int]:
    """(records, bytes) of the zip archive ``f``'s central directory (of ``size`` bytes), read from its end records
    alone (zip64's where torch writes them): what parsing the directory will cost, known before it is parsed.
    ValueError if there is no end record."""
    n = min(size, _EOCD_SIZE + 0xFFFF)  # the end record and a comment of at most 64 KiB
    f.seek(size - n)
    tail = f.read(n)
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < _EOCD_SIZE:
        raise ValueError("not a zip archive (torch.save's format)")
    records, directory_bytes = struct.unpack_from("<HL", tail, at + 10)
    if records != 0xFFFF and directory_bytes != 0xFFFFFFFF:
        return records, directory_bytes
    locator = at - 20
    if locator < 0 or tail[locator : locator + 4] != _EOCD64_LOCATOR:
        raise ValueError("a zip64 archive without its end record locator")
    (offset,) = struct.unpack_from("<Q", tail, locator + 8)
    f.seek(min(offset, size))
    record = f.read(56)
    if len(record) < 56 or record[:4] != _EOCD64:
        raise ValueError("a zip64 archive without its end record")
    return struct.unpack_from("<QQ", record, 32)


_EOCD, _EOCD64_LOCATOR, _EOCD64, _EOCD_SIZE = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06", 22


def check_archive(
    path: Path,
    max_bytes: int,
    max_nodes: int = MAX_CHECKPOINT_NODES,
    max_pickle_bytes: int = MAX_CHECKPOINT_PICKLE_BYTES,
) -> None:
    """Raise ValueError unless ``path`` is a regular file holding a torch zip archive of at most ``max_bytes`` with
    every record stored (see :func:`load`)."""
    with open_regular(path, max_bytes) as f:
        _check_archive(f, os.fstat(f.fileno()).st_size, max_bytes, max_nodes, max_pickle_bytes)


def _check_archive(f, size: int, max_bytes: int, max_nodes: int, max_pickle_bytes: int) -> None:
    """Prevents loading from costing more than the file's size: a directory of more than ``max_nodes`` records (each
    a tensor's storage) or ``max_pickle_bytes`` (parsed whole, by zipfile and by torch), a compressed record (which
    could decompress beyond the file's size) and a pickle record over ``max_pickle_bytes`` (unpickling makes ~100
    bytes of objects of each byte)."""
    records, directory_bytes = _zip_directory(f, size)
    if records > max_nodes + 8 or directory_bytes > max_pickle_bytes:
        raise ValueError(
            f"a zip directory of {records} records and {directory_bytes} bytes (at most max_checkpoint_nodes + 8 = "
            f"{max_nodes + 8} and max_checkpoint_pickle_bytes={max_pickle_bytes})"
        )
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError) as e:
        raise ValueError(f"not a zip archive (torch.save's format): {e}") from None
    if not infos:
        raise ValueError("an empty archive")
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"record {info.filename[:80]!r} is compressed; torch stores records uncompressed")
        if info.filename.endswith("data.pkl") and info.file_size > max_pickle_bytes:
            raise ValueError(f"a pickle of {info.file_size} bytes > max_checkpoint_pickle_bytes={max_pickle_bytes}")
    claimed = sum(info.file_size for info in infos)
    if claimed > max_bytes:
        raise ValueError(f"records of {claimed} bytes > max_checkpoint_bytes={max_bytes}")


def load(
    path: Path,
    max_bytes: int,
    map_location="cpu",
    max_nodes: int = MAX_CHECKPOINT_NODES,
    max_pickle_bytes: int = MAX_CHECKPOINT_PICKLE_BYTES,
) -> dict:
    """The dict a checkpoint file holds, after the checks that bound what loading and using it cost: a regular file
    (:func:`open_regular`), an archive whose loading costs no more than its size (:func:`_check_archive`), loaded with
    ``torch.load(weights_only=True)`` (no code runs) and walked (:func:`check_tree`). ValueError (or what torch raises
    for a corrupt archive) otherwise."""
    with open_regular(path, max_bytes) as f:
        _check_archive(f, os.fstat(f.fileno()).st_size, max_bytes, max_nodes, max_pickle_bytes)
        f.seek(0)
        state = torch.load(f, map_location=map_location, weights_only=True)
    if type(state) is not dict:
        raise ValueError(f"holds a {type(state).__name__}, not a dict")
    check_tree(state, max_bytes, max_nodes)
    return state


_SCALARS = (type(None), bool, int, float, str)
_CONTAINERS = (dict, collections.OrderedDict, list, tuple)
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_INT64 = 1 << 63


def check_tree(tree, max_bytes: int, max_nodes: int = MAX_CHECKPOINT_NODES) -> None:
    """Raise ValueError unless ``tree`` is what torch.save of a learner's state holds: dicts (an OrderedDict's
    attributes, a state dict's ``_metadata``, included), lists and tuples of scalars (None, bool, int within int64,
    float, str) and dense tensors; at most ``max_nodes`` values, nested at most ``MAX_CHECKPOINT_DEPTH`` deep; a tree,
    no container met twice; the tensors' bytes (numel * element size, each tensor once) at most ``max_bytes``.

    Walked with a stack and a visited set, so the walk itself is linear. Prevents: shared references (a list holding
    its child 16 times, 16 levels deep: under 1 KB of pickle, 2^64 paths) making any later walk, torch's
    included, spin forever; nesting deep enough to exhaust a recursive walk (pickling for the learner ranks,
    deepcopy) or to make this one's labels long; a tensor whose strides (0, or overlapping) make it far larger than
    the bytes its storage holds (2 GiB over a 4-byte storage), which whatever reads it whole would allocate."""
    seen: set[int] = set()
    stack, nodes, tensor_bytes = [("state", 0, tree)], 0, 0
    while stack:
        where, depth, x = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise ValueError(f"more than max_checkpoint_nodes={max_nodes} values")
        kind = type(x)
        if kind in _SCALARS:
            if kind is int and not -_INT64 <= x < _INT64:
                raise ValueError(f"{where}: an integer beyond int64")
        elif kind in _TENSORS:
            if id(x) not in seen:  # a tensor held twice (tied weights) counts once
                seen.add(id(x))
                tensor_bytes += dense_nbytes(where, x)
                if tensor_bytes > max_bytes:
                    raise ValueError(f"tensors of more than max_checkpoint_bytes={max_bytes} bytes")
        elif kind in _CONTAINERS:
            if x and id(x) in seen:
                raise ValueError(f"{where}: a container held twice (a shared reference); a learner's state is a tree")
            if depth >= MAX_CHECKPOINT_DEPTH:
                raise ValueError(f"{where}: nested more than MAX_CHECKPOINT_DEPTH={MAX_CHECKPOINT_DEPTH} deep")
            seen.add(id(x))
            stack.extend(_children(where, depth + 1, x))
        else:
            raise ValueError(f"{where}: a {kind.__name__}; a checkpoint holds containers, scalars and tensors only")


def _children(where: str, depth: int, x) -> list:
    """(label, depth, value) of a container's keys, values and attributes (an OrderedDict's ``_metadata``)."""
    if isinstance(x, dict):
        out = [(f"{where}: a key", depth, k) for k in x]
        out += [(f"{where}.{_label(k)}", depth, v) for k, v in x.items()]
        attributes = getattr(x, "__dict__", None) or {}
        return out + [(f"{where}.{_label(k)}", depth, v) for k, v in attributes.items()]
    return [(f"{where}[{i}]", depth, v) for i, v in enumerate(x)]


def _label(key) -> str:
    """A key as the error messages name it: short, and never an int of a million digits turned into a string."""
    if type(key) is str:
        return key[:40]
    return str(key) if type(key) is int and -_INT64 <= key < _INT64 else f"<{type(key).__name__}>"


def dense_nbytes(where: str, t: torch.Tensor) -> int:
    """``t``'s bytes (numel * element size); ValueError unless it is dense: strided (not sparse, quantized or nested),
    contiguous (no stride 0, no overlap), on the CPU, and within the storage it views."""
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type != "cpu":
        raise ValueError(f"{where}: a {t.layout} tensor on {t.device}; only dense CPU tensors")
    if not t.is_contiguous():
        shape = f"strides {tuple(t.stride())} for size {tuple(t.shape)}"
        raise ValueError(f"{where}: {shape}: not dense (a stride of 0, or overlapping)")
    nbytes = t.numel() * t.element_size()
    if t.storage_offset() * t.element_size() + nbytes > t.untyped_storage().nbytes():  # torch checks it too
        raise ValueError(f"{where}: {nbytes} bytes from offset {t.storage_offset()} beyond its storage")
    return nbytes
