"""A bounded MessagePack reader: reads the value the caller expects next, and never builds a tree it did not ask for.

Pure Python over a buffer (no copy of the message). ``msgpack.unpackb`` caps each container, not the whole: 16 MiB of
4096-element arrays nested in each other is millions of objects, seconds of work and a GiB of memory before anyone
looks at them. Here the caller walks the layout it knows (a map header, then a key, then an int, ...) and every read
checks the type byte first: a value of another kind raises :class:`WrongKind` without being read, so the work and
memory spent on any message are bounded by the layout the caller walks, whatever the bytes say. Binary values come
back as zero-copy ``memoryview`` slices of the buffer.

Format reference: https://github.com/msgpack/msgpack/blob/master/spec.md
"""

from __future__ import annotations

import builtins  # Reader's methods int and str shadow the builtins in its annotations
import struct

_FLOAT32, _FLOAT64 = struct.Struct(">f"), struct.Struct(">d")


class Truncated(Exception):
    """The buffer ends inside a value, or an invalid type byte: the bytes are not MessagePack."""


class WrongKind(Exception):
    """The next value is not of the kind the caller asked for (it was not read)."""

    def __init__(self, expected: str, type_byte: int):
        super().__init__(f"expected {expected}, found {describe(type_byte)}")
        self.expected, self.type_byte = expected, type_byte


def describe(c: int) -> str:
    """What the type byte ``c`` starts."""
    if c <= 0x7F or c >= 0xE0 or 0xCC <= c <= 0xD3:
        return "an integer"
    if 0x80 <= c <= 0x8F or c in (0xDE, 0xDF):
        return "a map"
    if 0x90 <= c <= 0x9F or c in (0xDC, 0xDD):
        return "an array"
    if 0xA0 <= c <= 0xBF or 0xD9 <= c <= 0xDB:
        return "a string"
    if 0xC4 <= c <= 0xC6:
        return "binary"
    return {0xC0: "nil", 0xC2: "false", 0xC3: "true", 0xCA: "a float32", 0xCB: "a float64"}.get(
        c, "an extension type" if 0xC7 <= c <= 0xC9 or 0xD4 <= c <= 0xD8 else f"the invalid byte 0x{c:02x}"
    )


class Reader:
    """Reads values one at a time from ``buf`` (any bytes-like object; it is not copied)."""

    __slots__ = ("_b", "_i", "_n")

    def __init__(self, buf):
        mv = memoryview(buf)
        self._b = mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
        self._i = 0
        self._n = len(self._b)

    @property
    def at_end(self) -> bool:
        return self._i == self._n

    def _type(self) -> int:
        if self._i >= self._n:
            raise Truncated("the message ends where a value should start")
        return self._b[self._i]

    def _take(self, size: int, skip: int = 1):
        """The ``size`` bytes that follow ``skip`` bytes (the type byte); moves past them."""
        start = self._i + skip
        end = start + size
        if end > self._n:
            raise Truncated(f"a value claims {size} bytes, {self._n - start} are left")
        self._i = end
        return self._b[start:end]

    def _length(self, width: int) -> int:
        start = self._i + 1
        if start + width > self._n:
            raise Truncated("the message ends inside a length")
        self._i = start + width
        return int.from_bytes(self._b[start : start + width], "big")

    def map_header(self) -> int:
        """Number of key-value pairs of the map that starts here."""
        c = self._type()
        if 0x80 <= c <= 0x8F:
            self._i += 1
            return c & 0x0F
        if c == 0xDE or c == 0xDF:
            return self._length(2 if c == 0xDE else 4)
        raise WrongKind("a map", c)

    def array_header(self) -> int:
        """Number of elements of the array that starts here."""
        c = self._type()
        if 0x90 <= c <= 0x9F:
            self._i += 1
            return c & 0x0F
        if c == 0xDC or c == 0xDD:
            return self._length(2 if c == 0xDC else 4)
        raise WrongKind("an array", c)

    def int(self) -> int:
        """An integer (any width, signed or not; never a bool or a float)."""
        i = self._i
        if i < self._n:  # the common case inline: a positive fixint
            c = self._b[i]
            if c <= 0x7F:
                self._i = i + 1
                return c
        c = self._type()
        if c <= 0x7F:
            self._i += 1
            return c
        if c >= 0xE0:
            self._i += 1
            return c - 0x100
        if 0xCC <= c <= 0xCF:
            return int.from_bytes(self._take(1 << (c - 0xCC)), "big")
        if 0xD0 <= c <= 0xD3:
            return int.from_bytes(self._take(1 << (c - 0xD0)), "big", signed=True)
        raise WrongKind("an integer", c)

    def number(self) -> builtins.int | float:
        """An integer or a float (float32 or float64)."""
        c = self._type()
        if c == 0xCB:
            return _FLOAT64.unpack(self._take(8))[0]
        if c == 0xCA:
            return _FLOAT32.unpack(self._take(4))[0]
        try:
            return self.int()
        except WrongKind:
            raise WrongKind("a number", c) from None

    def raw_str(self, max_bytes: builtins.int) -> bytes:
        """The UTF-8 bytes of a string of at most ``max_bytes`` bytes (longer ones: WrongKind, unread)."""
        i = self._i
        if i < self._n:  # the common case inline: a fixstr (up to 31 bytes) that fits
            c = self._b[i]
            if 0xA0 <= c <= 0xBF and (c & 0x1F) <= max_bytes:
                end = i + 1 + (c & 0x1F)
                if end <= self._n:
                    self._i = end
                    return bytes(self._b[i + 1 : end])
        c = self._type()
        if 0xA0 <= c <= 0xBF:
            size, skip = c & 0x1F, 1
        elif 0xD9 <= c <= 0xDB:
            size = self._length(1 << (c - 0xD9))
            skip = 0
        else:
            raise WrongKind("a string", c)
        if size > max_bytes:
            self._i = i
            raise WrongKind(f"a string of at most {max_bytes} bytes", c)
        return bytes(self._take(size, skip))

    def str(self, max_bytes: builtins.int) -> builtins.str:
        """A string of at most ``max_bytes`` UTF-8 bytes; invalid UTF-8 is :class:`WrongKind`."""
        c = self._type()
        raw = self.raw_str(max_bytes)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise WrongKind("a UTF-8 string", c) from None

    def bin(self):
        """A binary value, as a zero-copy slice of the buffer."""
        i = self._i
        if i < self._n and 0xC4 <= self._b[i] <= 0xC6:  # inline: the length, then a slice
            start = i + 1 + (1 << (self._b[i] - 0xC4))
            end = start + int.from_bytes(self._b[i + 1 : start], "big")
            if end <= self._n:
                self._i = end
                return self._b[start:end]
        c = self._type()
        if not 0xC4 <= c <= 0xC6:
            raise WrongKind("binary", c)
        return self._take(self._length(1 << (c - 0xC4)), 0)

    def skip_prefix(self, prefix: bytes) -> bool:
        """If the next bytes are ``prefix``, move past them and return True (a fast path over a known encoding)."""
        i = self._i
        end = i + len(prefix)
        if bytes(self._b[i:end]) == prefix:  # a bytes copy compares faster than the memoryview
            self._i = end
            return True
        return False

    def number_int_pairs(self, count: builtins.int) -> list:
        """``count`` two-element arrays ``[number, integer]``, as ``[[x, k], ...]`` (the caller read the outer array's
        header). Common encodings are read inline; any other goes through :meth:`number` and :meth:`int`."""
        b, n = self._b, self._n
        out = []
        for _ in range(count):
            i = self._i
            if i + 2 >= n or b[i] != 0x92:
                if self.array_header() != 2:
                    raise WrongKind("an array of 2 elements", 0x92)
                out.append([self.number(), self.int()])
                continue
            c = b[i + 1]
            if c == 0xCB and i + 10 < n:
                x, i = _FLOAT64.unpack(b[i + 2 : i + 10])[0], i + 10
            elif c <= 0x7F:
                x, i = c, i + 2
            else:
                self._i = i + 1
                out.append([self.number(), self.int()])
                continue
            c = b[i]
            if c <= 0x7F:
                self._i = i + 1
                out.append([x, c])
            elif c == 0xCD and i + 3 <= n:
                self._i = i + 3
                out.append([x, (b[i + 1] << 8) | b[i + 2]])
            else:
                self._i = i
                out.append([x, self.int()])
        return out

    def is_nil(self) -> bool:
        return self._type() == 0xC0
