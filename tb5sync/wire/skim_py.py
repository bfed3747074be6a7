"""Pure-Python twin of ``tb5sync._skim`` (``ext/_skim.pyx``): what a msgpack payload costs to decode.

:func:`skim` walks the msgpack encoding (https://github.com/msgpack/msgpack/blob/master/spec.md)
without building anything. A value is a prefix code, so one count of the values still to read
replaces a stack: an array of n adds n, a map 2n. The cost model is CPython 3 on a 64-bit
machine, measured with ``sys.getsizeof`` and rounded up, plus :data:`OBJ` of allocator overhead
per object:

======================  ==========================================================
value                   bytes counted
======================  ==========================================================
nil, bool, int 0..255,  0 (CPython's shared objects; the pointer to them is counted
int -5..-1, "", one     by their container)
ASCII char, b"", one
byte
other int               :data:`INT_COST`
float                   :data:`FLOAT_COST`
str of n bytes          ASCII: :data:`STR_ASCII` + n; else :data:`STR_WIDE` +
                        (code points + 1) x width (1, 2 or 4 by the largest lead byte)
bin of n bytes          :data:`BYTES_BASE` + n
array of n              :data:`LIST_BASE` + 8 n
map of n                :data:`DICT_SMALL` up to 5 keys, else :data:`DICT_BASE` +
                        :data:`DICT_PER` n (msgpack presizes it)
ext of n bytes          :data:`BYTES_BASE` + n (refused by the protocol anyway)
======================  ==========================================================

Many times slower than the Cython module on payloads of many small values (it is the fallback);
bin and str bodies are skipped whole.
"""

from __future__ import annotations

from typing import Final

__all__ = ["skim"]

OBJ: Final = 16
LIST_BASE: Final = 64
DICT_SMALL: Final = 200
DICT_BASE: Final = 128
DICT_PER: Final = 38
INT_COST: Final = 40
FLOAT_COST: Final = 24
STR_ASCII: Final = 56
STR_WIDE: Final = 80
BYTES_BASE: Final = 40


def _short() -> ValueError:
    return ValueError("msgpack data ends inside a value")


def _str_cost(body: bytes) -> int:
    n = len(body)
    if n == 0:
        return 0
    top = max(body)
    if top < 0x80:
        return 0 if n == 1 else STR_ASCII + OBJ + n
    chars = n - sum(1 for c in body if c & 0xC0 == 0x80)
    width = 1 if top < 0xC4 else (2 if top < 0xF0 else 4)
    return STR_WIDE + OBJ + (chars + 1) * width


def skim(data: bytes | bytearray | memoryview) -> tuple[int, int, int | None, int]:
    """``(cost, containers, ext, end)`` of the msgpack value at the start of ``data``.

    ``cost``: an upper bound of the bytes the decoded value holds (bytes); ``containers``: arrays
    plus maps; ``ext``: the first extension type code met (``-1`` is msgpack's timestamp) or None;
    ``end``: the offset just past the value.

    Raises
    ------
    ValueError
        ``data`` ends inside the value, or holds a byte that starts no msgpack value (0xC1).
    """
    p = bytes(data)
    size = len(p)
    pos = cost = containers = 0
    pending = 1
    ext: int | None = None
    while pending:
        if pos >= size:
            raise _short()
        b = p[pos]
        pending -= 1
        if b <= 0x7F or b >= 0xE0:
            pos += 1
            if b >= 0xE0 and b - 256 < -5:
                cost += INT_COST + OBJ
            continue
        if b <= 0x9F or 0xDC <= b <= 0xDF:
            if b <= 0x9F:
                n, hdr = b & 0x0F, 1
            else:
                hdr = 3 if b in (0xDC, 0xDE) else 5
                if pos + hdr > size:
                    raise _short()
                n = int.from_bytes(p[pos + 1 : pos + hdr], "big")
            pos += hdr
            containers += 1
            if b <= 0x8F or b >= 0xDE:
                cost += (DICT_SMALL if n <= 5 else DICT_BASE + DICT_PER * n) + OBJ
                pending += 2 * n
            else:
                cost += LIST_BASE + OBJ + 8 * n
                pending += n
            continue
        if 0xA0 <= b <= 0xBF:
            n = b & 0x1F
            if pos + 1 + n > size:
                raise _short()
            cost += _str_cost(p[pos + 1 : pos + 1 + n])
            pos += 1 + n
            continue
        if b in (0xC0, 0xC2, 0xC3):
            pos += 1
            continue
        if b == 0xC1:
            raise ValueError("byte 0xc1 starts no msgpack value")
        if b in (0xC4, 0xC5, 0xC6, 0xD9, 0xDA, 0xDB):
            hdr = 2 if b in (0xC4, 0xD9) else (3 if b in (0xC5, 0xDA) else 5)
            if pos + hdr > size:
                raise _short()
            n = int.from_bytes(p[pos + 1 : pos + hdr], "big")
            if size - pos - hdr < n:
                raise _short()
            if b >= 0xD9:
                cost += _str_cost(p[pos + hdr : pos + hdr + n])
            elif n > 1:
                cost += BYTES_BASE + OBJ + n
            pos += hdr + n
            continue
        if b in (0xC7, 0xC8, 0xC9) or 0xD4 <= b <= 0xD8:
            if b >= 0xD4:
                n, hdr = 1 << (b - 0xD4), 2
            else:
                hdr = 3 if b == 0xC7 else (4 if b == 0xC8 else 6)
                if pos + hdr > size:
                    raise _short()
                n = int.from_bytes(p[pos + 1 : pos + hdr - 1], "big")
            if pos + hdr > size or size - pos - hdr < n:
                raise _short()
            if ext is None:
                code = p[pos + hdr - 1]
                ext = code - 256 if code >= 0x80 else code
            cost += BYTES_BASE + OBJ + n
            pos += hdr + n
            continue
        need = 5 if b == 0xCA else (9 if b == 0xCB else 1 + (1 << ((b - 0xCC) & 3)))
        if pos + need > size:
            raise _short()
        if b in (0xCA, 0xCB):
            cost += FLOAT_COST + OBJ
        elif b == 0xD0:
            v = p[pos + 1]
            if v >= 0x80 and v - 256 < -5:
                cost += INT_COST + OBJ
        elif b != 0xCC:
            cost += INT_COST + OBJ
        pos += need
    return cost, containers, ext, pos
