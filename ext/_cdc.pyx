# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Cython core of the FastCDC chunker (``tb5sync._cdc``).

Same names, signatures and cut points as the pure-Python reference in ``tb5sync.chunking``,
whose docstrings (and the module docstring there, for the chunking rules) are the
documentation; see also ``tb5sync/_cdc.pyi``. The hot loop runs without the GIL over a
``const unsigned char[::1]`` view, so read-only buffers (``bytes``, read-only ``mmap``) work,
and rolls two bytes per step (FastCDC 2020) with results identical to the one-byte loop.
"""

from libc.stdint cimport uint64_t
from libc.stdlib cimport free, realloc

from tb5sync.errors import UsageError

include "_gear.pxi"

__all__ = ["cut_points", "Chunker"]

cdef object _DEFAULT = object()  # stands for chunking.DEFAULT_PARAMS (imported lazily: no cycle)
cdef object _chunking = None


cdef struct _Params:
    Py_ssize_t mins
    Py_ssize_t avg
    Py_ssize_t maxs
    uint64_t mask_s
    uint64_t mask_l


cdef struct _Cuts:
    Py_ssize_t* data
    Py_ssize_t size
    Py_ssize_t cap


cdef object _resolve(object params):
    """Return the ChunkParams meant by ``params`` or raise UsageError."""
    global _chunking
    if _chunking is None:
        from tb5sync import chunking
        _chunking = chunking
    if params is _DEFAULT:
        return _chunking.DEFAULT_PARAMS
    if not isinstance(params, _chunking.ChunkParams):
        raise UsageError(f"params must be a ChunkParams, got {type(params).__name__}")
    return params


cdef _Params _to_struct(object params):
    cdef _Params p
    p.mins = params.min_size
    p.avg = params.avg_size
    p.maxs = params.max_size
    p.mask_s = params.mask_s
    p.mask_l = params.mask_l
    return p


cdef object _byte_view(object buf):
    """A 1-D unsigned-byte memoryview of ``buf`` (no copy), or UsageError."""
    try:
        mv = memoryview(buf)
    except TypeError as exc:
        raise UsageError(f"expected a bytes-like object, got {type(buf).__name__}") from exc
    if not mv.c_contiguous:
        raise UsageError("the buffer must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


cdef inline Py_ssize_t _roll(const unsigned char* p, Py_ssize_t i, Py_ssize_t end,
                             uint64_t mask, uint64_t* fp_io) noexcept nogil:
    """Hash p[i:end] into *fp_io; return the end offset of the first cut, or -1 (then i == end).

    Two bytes per step: ``(fp << 2) + GEAR_LS[a]`` equals ``fp_a << 1`` (fp after byte a,
    shifted), and since bit 63 of ``mask`` is clear, ``fp_a & mask == 0`` exactly when
    ``(fp_a << 1) & (mask << 1) == 0``; adding ``GEAR[b]`` then gives fp after byte b exactly.
    """
    cdef uint64_t fp = fp_io[0]
    cdef uint64_t mask_ls = mask << 1
    while i + 2 <= end:
        fp = (fp << 2) + TB5_GEAR_LS[p[i]]
        if (fp & mask_ls) == 0:
            return i + 1
        fp = fp + TB5_GEAR[p[i + 1]]
        if (fp & mask) == 0:
            return i + 2
        i += 2
    if i < end:
        fp = (fp << 1) + TB5_GEAR[p[i]]
        if (fp & mask) == 0:
            return i + 1
    fp_io[0] = fp
    return -1


cdef int _push(_Cuts* cuts, Py_ssize_t value) noexcept nogil:
    cdef Py_ssize_t cap
    cdef Py_ssize_t* data
    if cuts.size == cuts.cap:
        cap = cuts.cap * 2 if cuts.cap else 64
        data = <Py_ssize_t*> realloc(cuts.data, cap * sizeof(Py_ssize_t))
        if data == NULL:
            return -1
        cuts.data = data
        cuts.cap = cap
    cuts.data[cuts.size] = value
    cuts.size += 1
    return 0


cdef int _scan(const unsigned char* p, Py_ssize_t n, const _Params* prm, bint final,
               Py_ssize_t* pos_io, uint64_t* fp_io, _Cuts* cuts) noexcept nogil:
    """Cut points of p[0:n], first chunk at 0, resumed from (*pos_io, *fp_io); see _py_scan.

    Returns 0, or -1 when out of memory. On return (*pos_io, *fp_io) is the resume state of the
    undecided tail (0, 0 when final).
    """
    cdef Py_ssize_t start = 0, pos = pos_io[0], i, limit, normal, cut
    cdef uint64_t fp = fp_io[0]
    pos_io[0] = 0
    fp_io[0] = 0
    while start < n:
        if n - start <= prm.mins:
            if final:
                return _push(cuts, n)
            return 0
        if pos <= prm.mins:
            pos = prm.mins
            fp = 0
        i = start + pos
        limit = start + prm.maxs if n - start > prm.maxs else n
        normal = start + prm.avg if limit - start > prm.avg else limit
        cut = -1
        if i < normal:
            cut = _roll(p, i, normal, prm.mask_s, &fp)
            if cut < 0:
                i = normal
        if cut < 0 and i < limit:
            cut = _roll(p, i, limit, prm.mask_l, &fp)
            if cut < 0:
                i = limit
        if cut < 0:
            if limit - start == prm.maxs or final:
                cut = limit
            else:
                pos_io[0] = i - start
                fp_io[0] = fp
                return 0
        if _push(cuts, cut) < 0:
            return -1
        start = cut
        pos = 0
        fp = 0
    return 0


cdef list _run(object mv, const _Params* prm, bint final, Py_ssize_t* pos_io, uint64_t* fp_io,
               Py_ssize_t base):
    """Scan a 1-D 'B' memoryview without the GIL; return the cuts plus ``base`` as a list."""
    cdef const unsigned char[::1] view = mv
    cdef Py_ssize_t n = view.shape[0], k
    cdef const unsigned char* p = &view[0] if n else NULL
    cdef _Cuts cuts
    cdef int rc
    cdef list out
    cuts.data = NULL
    cuts.size = 0
    cuts.cap = 0
    try:
        with nogil:
            rc = _scan(p, n, prm, final, pos_io, fp_io, &cuts)
        if rc < 0:
            raise MemoryError()
        out = [None] * cuts.size
        for k in range(cuts.size):
            out[k] = base + cuts.data[k]
        return out
    finally:
        free(cuts.data)


def cut_points(buf, params=_DEFAULT, final=True):
    """Return the chunk end offsets of ``buf``; see ``tb5sync.chunking.py_cut_points``."""
    cdef _Params prm
    cdef Py_ssize_t pos = 0
    cdef uint64_t fp = 0
    mv = _byte_view(buf)
    prm = _to_struct(_resolve(params))
    with mv:
        return _run(mv, &prm, bool(final), &pos, &fp, 0)


cdef class Chunker:
    """Streaming chunker; see ``tb5sync.chunking.PyChunker``."""

    cdef object _params
    cdef _Params _prm
    cdef bytearray _tail
    cdef Py_ssize_t _base
    cdef Py_ssize_t _pos
    cdef uint64_t _fp

    def __init__(self, params=_DEFAULT):
        self._params = _resolve(params)
        self._prm = _to_struct(self._params)
        self._tail = bytearray()
        self._base = 0
        self._pos = 0
        self._fp = 0

    @property
    def params(self):
        """The chunk size parameters."""
        return self._params

    @property
    def offset(self):
        """Total bytes fed so far."""
        return self._base + len(self._tail)

    def feed(self, data):
        """Add the next bytes of the stream; see ``PyChunker.feed``."""
        cdef list cuts
        cdef Py_ssize_t base = self._base, last
        mv = _byte_view(data)
        with mv:
            if len(mv) == 0:
                return []
            if self._tail:
                self._tail += mv
                with memoryview(self._tail) as tv:
                    cuts = _run(tv, &self._prm, False, &self._pos, &self._fp, base)
                if cuts:
                    last = cuts[len(cuts) - 1]
                    del self._tail[: last - base]
            else:
                self._pos = 0
                self._fp = 0
                cuts = _run(mv, &self._prm, False, &self._pos, &self._fp, base)
                last = cuts[len(cuts) - 1] if cuts else base
                self._tail += mv[last - base :]
        if cuts:
            self._base = cuts[len(cuts) - 1]
        return cuts

    def finish(self):
        """End the stream and return the remaining cut points; see ``PyChunker.finish``."""
        cdef list cuts
        with memoryview(self._tail) as tv:
            cuts = _run(tv, &self._prm, True, &self._pos, &self._fp, self._base)
        self._tail = bytearray()
        self._base = 0
        self._pos = 0
        self._fp = 0
        return cuts
