# cython: language_level=3, boundscheck=False, wraparound=False
"""What a msgpack payload would cost to decode, found without decoding it.

``skim(data)`` walks the msgpack encoding (the format's spec:
https://github.com/msgpack/msgpack/blob/master/spec.md) in one pass, building nothing, and
returns an upper bound of the bytes CPython holds once ``msgpack.unpackb(data, raw=False)``
has built the value, the number of arrays and maps in it, the first extension type code met
and where the value ends. ``tb5sync.wire.protocol.decode_control`` refuses a payload from these
figures before msgpack allocates anything. The pure-Python twin is
``tb5sync.wire.skim_py.skim`` (same results, used when this module is not built or with
``TB5SYNC_PUREPYTHON=1``); the cost model is documented there.
"""

from libc.stdint cimport int64_t, uint64_t


cdef enum:
    OBJ = 16          # allocator overhead counted per object
    LIST_BASE = 64    # an empty list (56) rounded
    DICT_SMALL = 200  # a dict of up to 5 keys (184) rounded
    DICT_BASE = 128   # past 5 keys: DICT_BASE + DICT_PER per key bounds every presized dict
    DICT_PER = 38
    INT_COST = 40     # an int outside CPython's cache (28..36)
    FLOAT_COST = 24
    STR_ASCII = 56    # "ab" is 51
    STR_WIDE = 80     # "é" is 74, plus the code points' width each
    BYTES_BASE = 40   # b"ab" is 35


cdef inline uint64_t _be(const unsigned char* p, int n) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    for i in range(n):
        v = (v << 8) | p[i]
    return v


cdef inline int64_t _str_cost(const unsigned char* p, uint64_t n) noexcept nogil:
    cdef uint64_t i, chars = 0
    cdef unsigned char c, top = 0
    cdef int width
    if n == 0:
        return 0
    for i in range(n):
        c = p[i]
        if (c & 0xC0) != 0x80:
            chars += 1
        if c > top:
            top = c
    if top < 0x80:
        return 0 if n == 1 else <int64_t>(STR_ASCII + OBJ + n)
    # lead bytes: 0xC2-0xC3 latin-1 (width 1), up to 0xEF the BMP (2), past it astral (4);
    # a bad encoding fails in msgpack later, counted here at the widest
    width = 1 if top < 0xC4 else (2 if top < 0xF0 else 4)
    return <int64_t>(STR_WIDE + OBJ + (chars + 1) * width)


def skim(const unsigned char[::1] data):
    """``(cost, containers, ext, end)`` of the msgpack value at the start of ``data``.

    ``cost``: an upper bound of the bytes the decoded value holds (bytes); ``containers``: arrays
    plus maps; ``ext``: the first extension type code met (``-1`` is msgpack's timestamp) or None;
    ``end``: the offset just past the value.

    Raises
    ------
    ValueError
        ``data`` ends inside the value, or holds a byte that starts no msgpack value (0xC1).
    """
    cdef const unsigned char* p = &data[0] if data.shape[0] else NULL
    cdef Py_ssize_t size = data.shape[0], pos = 0
    cdef uint64_t pending = 1, n, need
    cdef int64_t cost = 0, containers = 0
    cdef int ext = 0, have_ext = 0, hdr
    cdef unsigned char b
    cdef signed char sv
    with nogil:
        while pending:
            if pos >= size:
                with gil:
                    raise ValueError("msgpack data ends inside a value")
            b = p[pos]
            pending -= 1
            if b <= 0x7F or b >= 0xE0:  # fixint: -32..-6 are not cached
                pos += 1
                sv = <signed char>b
                if sv < -5:
                    cost += INT_COST + OBJ
                continue
            if b <= 0x8F or (b >= 0x90 and b <= 0x9F) or b == 0xDC or b == 0xDD or b == 0xDE or b == 0xDF:
                if b <= 0x8F:
                    n = b & 0x0F; hdr = 1
                elif b <= 0x9F:
                    n = b & 0x0F; hdr = 1
                else:
                    hdr = 3 if (b == 0xDC or b == 0xDE) else 5
                    if pos + hdr > size:
                        with gil:
                            raise ValueError("msgpack data ends inside a value")
                    n = _be(p + pos + 1, hdr - 1)
                pos += hdr
                containers += 1
                if b <= 0x8F or b >= 0xDE:  # map
                    cost += (DICT_SMALL if n <= 5 else DICT_BASE + DICT_PER * <int64_t>n) + OBJ
                    pending += 2 * n
                else:
                    cost += LIST_BASE + OBJ + 8 * <int64_t>n
                    pending += n
                continue
            if b >= 0xA0 and b <= 0xBF:  # fixstr
                n = b & 0x1F
                if pos + 1 + <Py_ssize_t>n > size:
                    with gil:
                        raise ValueError("msgpack data ends inside a value")
                cost += _str_cost(p + pos + 1, n)
                pos += 1 + n
                continue
            if b == 0xC0 or b == 0xC2 or b == 0xC3:
                pos += 1
                continue
            if b == 0xC1:
                with gil:
                    raise ValueError("byte 0xc1 starts no msgpack value")
            if b == 0xC4 or b == 0xC5 or b == 0xC6 or b == 0xD9 or b == 0xDA or b == 0xDB:  # bin, str
                hdr = 2 if (b == 0xC4 or b == 0xD9) else (3 if (b == 0xC5 or b == 0xDA) else 5)
                if pos + hdr > size:
                    with gil:
                        raise ValueError("msgpack data ends inside a value")
                n = _be(p + pos + 1, hdr - 1)
                if <uint64_t>(size - pos - hdr) < n:
                    with gil:
                        raise ValueError("msgpack data ends inside a value")
                if b >= 0xD9:
                    cost += _str_cost(p + pos + hdr, n)
                elif n > 1:
                    cost += BYTES_BASE + OBJ + <int64_t>n
                pos += hdr + n
                continue
            if b == 0xC7 or b == 0xC8 or b == 0xC9 or (b >= 0xD4 and b <= 0xD8):  # ext
                if b >= 0xD4:
                    n = 1 << (b - 0xD4); hdr = 2
                else:
                    hdr = 3 if b == 0xC7 else (4 if b == 0xC8 else 6)
                    if pos + hdr > size:
                        with gil:
                            raise ValueError("msgpack data ends inside a value")
                    n = _be(p + pos + 1, hdr - 2)
                if pos + hdr > size or <uint64_t>(size - pos - hdr) < n:
                    with gil:
                        raise ValueError("msgpack data ends inside a value")
                if not have_ext:
                    have_ext = 1
                    ext = <signed char>p[pos + hdr - 1]
                cost += BYTES_BASE + OBJ + <int64_t>n
                pos += hdr + n
                continue
            # numbers: 0xCA float32, 0xCB float64, 0xCC-0xCF uint, 0xD0-0xD3 int
            need = 5 if b == 0xCA else (9 if b == 0xCB else 1 + (1 << ((b - 0xCC) & 3)))
            if pos + <Py_ssize_t>need > size:
                with gil:
                    raise ValueError("msgpack data ends inside a value")
            if b == 0xCA or b == 0xCB:
                cost += FLOAT_COST + OBJ
            elif b == 0xCC:
                pass  # 0..255: CPython's cached ints
            elif b == 0xD0:
                sv = <signed char>p[pos + 1]
                if sv < -5:
                    cost += INT_COST + OBJ
            else:
                cost += INT_COST + OBJ
            pos += need
    return cost, containers, (ext if have_ext else None), pos
