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

__all__ = ["cut_points", "Chunker", "vector_lanes", "set_vector_lanes"]

from tb5sync._params import DEFAULT_PARAMS, ChunkParams

cdef object _DEFAULT = object()  # stands for DEFAULT_PARAMS


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
    if params is _DEFAULT:
        return DEFAULT_PARAMS
    if not isinstance(params, ChunkParams):
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


cdef extern from *:
    """
    /* AVX-512 rolling of 8 lanes at once; see _roll_fast's docstring. x86-64 with GCC or
       Clang only; elsewhere (and on CPUs without AVX-512) tb5_roll_lanes is never called. */
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    #include <immintrin.h>
    #define TB5_HAVE_LANES 1
    #else
    #define TB5_HAVE_LANES 0
    #endif
    #define TB5_LANES 8
    #define TB5_BLOCK 4096
    #define TB5_WARM 64

    static int tb5_lanes_ok = -1;

    static int tb5_lanes_supported(void) {
    #if TB5_HAVE_LANES
        if (tb5_lanes_ok < 0) {
            __builtin_cpu_init();
            tb5_lanes_ok = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) ? 1 : 0;
        }
        return tb5_lanes_ok;
    #else
        return 0;
    #endif
    }

    /* Roll one lane over p[j:stop] from state *f, one byte per step; return the end offset
       (relative to p) of its first cut, or -1 with *f updated. */
    static inline Py_ssize_t tb5_lane_rest(const unsigned char* p, Py_ssize_t j, Py_ssize_t stop,
                                           uint64_t mask, uint64_t* f) {
        uint64_t fp = *f;
        for (; j < stop; j++) {
            fp = (fp << 1) + TB5_GEAR[p[j]];
            if ((fp & mask) == 0) return j + 1;
        }
        *f = fp;
        return -1;
    }

    #if TB5_HAVE_LANES
    /* Cut search over [*i_io, end) in rounds of TB5_LANES blocks of TB5_BLOCK bytes, lane k
       rolling block k; the caller guarantees *i_io >= TB5_WARM. Returns the first cut's end
       offset, or -1 with (*i_io, *fp_io) moved to the end of the last whole round. */
    __attribute__((target("avx512f,avx512bw")))
    static Py_ssize_t tb5_roll_lanes(const unsigned char* p, Py_ssize_t* i_io, Py_ssize_t end,
                                     uint64_t mask, uint64_t* fp_io) {
        const Py_ssize_t round = (Py_ssize_t)TB5_LANES * TB5_BLOCK;
        const __m512i vmask = _mm512_set1_epi64((long long)mask);
        __m512i pick[8];  /* pick[s]: byte s of each 64-bit lane, zero-extended (vpshufb) */
        const __m512i offs = _mm512_set_epi64(7LL * TB5_BLOCK, 6LL * TB5_BLOCK, 5LL * TB5_BLOCK,
                                              4LL * TB5_BLOCK, 3LL * TB5_BLOCK, 2LL * TB5_BLOCK,
                                              1LL * TB5_BLOCK, 0);
        Py_ssize_t i = *i_io, j, r;
        int s, k;
        uint64_t f[TB5_LANES];
        __m512i v, g, fv;
        __mmask8 hit;
        for (s = 0; s < 8; s++)
            pick[s] = _mm512_set4_epi64((long long)(0x8080808080808000ULL | (unsigned)(8 + s)),
                                        (long long)(0x8080808080808000ULL | (unsigned)s),
                                        (long long)(0x8080808080808000ULL | (unsigned)(8 + s)),
                                        (long long)(0x8080808080808000ULL | (unsigned)s));
        while (end - i >= round) {
            const unsigned char* a = p + i;
            /* Lane 0 goes on from the running state; lanes 1..7 rebuild theirs from the
               TB5_WARM bytes before their block (untested: those offsets are lane k-1's). */
            fv = _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, (long long)*fp_io);
            for (j = -TB5_WARM; j < 0; j += 8) {
                v = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), 0xFE, offs, a + j, 1);
                for (s = 0; s < 8; s++) {
                    g = _mm512_i64gather_epi64(
                        _mm512_shuffle_epi8(v, pick[s]), TB5_GEAR, 8);
                    fv = _mm512_mask_add_epi64(fv, 0xFE, _mm512_slli_epi64(fv, 1), g);
                }
            }
            for (j = 0; j < TB5_BLOCK; j += 8) {
                v = _mm512_i64gather_epi64(offs, a + j, 1);  /* 8 bytes of each lane, little-endian */
                for (s = 0; s < 8; s++) {
                    g = _mm512_i64gather_epi64(
                        _mm512_shuffle_epi8(v, pick[s]), TB5_GEAR, 8);
                    fv = _mm512_add_epi64(_mm512_slli_epi64(fv, 1), g);
                    hit = _mm512_testn_epi64_mask(fv, vmask);
                    if (__builtin_expect(hit != 0, 0)) {
                        /* Lanes before the first hit lane hold earlier offsets: finish them
                           in order, then the hit itself. */
                        _mm512_storeu_si512((void*)f, fv);
                        for (k = 0; k < TB5_LANES; k++) {
                            if (hit & (1u << k)) return i + (Py_ssize_t)k * TB5_BLOCK + j + s + 1;
                            r = tb5_lane_rest(a + (Py_ssize_t)k * TB5_BLOCK, j + s + 1, TB5_BLOCK,
                                              mask, &f[k]);
                            if (r >= 0) return i + (Py_ssize_t)k * TB5_BLOCK + r;
                        }
                    }
                }
            }
            _mm512_storeu_si512((void*)f, fv);
            *fp_io = f[TB5_LANES - 1];
            i += round;
        }
        *i_io = i;
        return -1;
    }
    #else
    static Py_ssize_t tb5_roll_lanes(const unsigned char* p, Py_ssize_t* i_io, Py_ssize_t end,
                                     uint64_t mask, uint64_t* fp_io) {
        return -1;
    }
    #endif
    """
    Py_ssize_t TB5_LANES
    Py_ssize_t TB5_BLOCK
    Py_ssize_t TB5_WARM
    int tb5_lanes_supported() noexcept nogil
    Py_ssize_t tb5_roll_lanes(const unsigned char* p, Py_ssize_t* i_io, Py_ssize_t end,
                              uint64_t mask, uint64_t* fp_io) noexcept nogil


cdef bint _use_lanes = tb5_lanes_supported() != 0


def vector_lanes():
    """Number of gear-hash lanes the cut search runs side by side on this CPU: 8 with AVX-512, else 1."""
    return TB5_LANES if _use_lanes else 1


def set_vector_lanes(bint enabled):
    """Turn the AVX-512 lanes on or off (for tests and benchmarks); returns the previous setting.

    Turning them on is ignored on a CPU without AVX-512. The cut points are the same either way.
    """
    global _use_lanes
    cdef bint prev = _use_lanes
    _use_lanes = enabled and tb5_lanes_supported() != 0
    return prev


cdef inline Py_ssize_t _roll_fast(const unsigned char* p, Py_ssize_t i, Py_ssize_t end,
                                  uint64_t mask, uint64_t* fp_io) noexcept nogil:
    """Like ``_roll``, but long ranges go 8 lanes at a time through ``tb5_roll_lanes`` first.

    The gear hash is a serial chain (each step needs the previous state), which caps a scalar
    loop near one byte per cycle. Each step shifts the 64-bit state left by one, so the state
    at any offset depends only on the 64 bytes before it and can be rebuilt from them. With
    AVX-512, ``tb5_roll_lanes`` rolls 8 blocks of 4 KiB side by side in one vector register
    (table lookups by gather), each block's start state rebuilt from the 64 bytes before it;
    the first cut in offset order wins, so the cut points are exactly those of the one-byte
    loop. Ranges shorter than 32 KiB, and what is left after the last whole round, go to
    ``_roll``.
    """
    cdef Py_ssize_t cut
    if _use_lanes and end - i >= TB5_LANES * TB5_BLOCK and i >= TB5_WARM:
        cut = tb5_roll_lanes(p, &i, end, mask, fp_io)
        if cut != -1:
            return cut
    return _roll(p, i, end, mask, fp_io)


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
            cut = _roll_fast(p, i, normal, prm.mask_s, &fp)
            if cut < 0:
                i = normal
        if cut < 0 and i < limit:
            cut = _roll_fast(p, i, limit, prm.mask_l, &fp)
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
