# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Cython core of the FastCDC chunker (``tb5sync._cdc``).

Same names, signatures and cut points as the pure-Python reference in ``tb5sync.engine.chunking``,
whose docstrings (and the module docstring there, for the chunking rules) are the
documentation; see also ``tb5sync/_cdc.pyi``. The hot loop runs without the GIL over a
``const unsigned char[::1]`` view, so read-only buffers (``bytes``, read-only ``mmap``) work,
and rolls two bytes per step (FastCDC 2020) with results identical to the one-byte loop;
long ranges go through a lane kernel (AVX-512, NEON, or portable interleaved C; see _roll_fast).
"""

from libc.stdint cimport uint64_t
from libc.stdlib cimport free, realloc

from tb5sync.errors import UsageError

include "_gear.pxi"

__all__ = ["cut_points", "Chunker", "vector_lanes", "set_vector_lanes", "lane_kernels", "lane_kernel", "set_lane_kernel",
           "default_lane_kernel"]

from tb5sync.engine.params import DEFAULT_PARAMS, ChunkParams

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
    /* Lane kernels of the cut search; see _roll_fast's docstring. Each rolls several blocks of
       TB5_BLOCK bytes side by side, each block's start state rebuilt from the TB5_WARM bytes
       before it, and reports the first cut in offset order, so the cut points are those of the
       one-lane loop. Kernels (tb5_kernel):
         0 "one"          the one-lane loop only (_roll), the reference every kernel is tested against
         1 "interleaved"  portable C, 2 scalar lanes interleaved, two bytes per step (instruction-level parallelism)
         2 "neon"         aarch64 only: 4 lanes of two-byte steps in two NEON registers, table loads scalar
         3 "avx512"       x86-64 with AVX-512 F+BW: 8 vector lanes (gathers) plus 1 scalar lane */
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    #include <immintrin.h>
    #define TB5_HAVE_AVX512 1
    #else
    #define TB5_HAVE_AVX512 0
    #endif
    #if defined(__aarch64__) && defined(__ARM_NEON)
    #include <arm_neon.h>
    #define TB5_HAVE_NEON 1
    #else
    #define TB5_HAVE_NEON 0
    #endif
    #define TB5_LANES 8
    #define TB5_BLOCK 4096
    #define TB5_WARM 64
    #define TB5_K_ONE 0
    #define TB5_K_INTERLEAVED 1
    #define TB5_K_NEON 2
    #define TB5_K_AVX512 3

    static int tb5_avx512_ok = -1;

    static int tb5_lanes_supported(void) {
    #if TB5_HAVE_AVX512
        if (tb5_avx512_ok < 0) {
            __builtin_cpu_init();
            tb5_avx512_ok = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) ? 1 : 0;
        }
        return tb5_avx512_ok;
    #else
        return 0;
    #endif
    }

    /* Is kernel k usable on this CPU? */
    static int tb5_kernel_ok(int k) {
        switch (k) {
        case TB5_K_ONE: case TB5_K_INTERLEAVED: return 1;
        case TB5_K_NEON: return TB5_HAVE_NEON;
        case TB5_K_AVX512: return tb5_lanes_supported();
        default: return 0;
        }
    }

    /* The fastest kernel usable here (AVX-512 where present, NEON on arm64, else interleaved). */
    static int tb5_best_kernel(void) {
        if (tb5_kernel_ok(TB5_K_AVX512)) return TB5_K_AVX512;
        if (tb5_kernel_ok(TB5_K_NEON)) return TB5_K_NEON;
        return TB5_K_INTERLEAVED;
    }

    /* Lanes a kernel rolls side by side; the bytes one round covers is this times TB5_BLOCK. */
    static Py_ssize_t tb5_kernel_lanes(int k) {
        switch (k) {
        case TB5_K_AVX512: return TB5_LANES + 1;
        case TB5_K_NEON: return 4;
        case TB5_K_INTERLEAVED: return 2;
        default: return 1;
        }
    }

    /* Roll one lane over p[j:stop] from state *f, one byte per step; return the end offset
       (relative to p) of its first cut, or -1 with *f updated. */
    static inline Py_ssize_t tb5_lane_rest(const unsigned char* p, Py_ssize_t j, Py_ssize_t stop,
                                           uint64_t mask, uint64_t* f) {
        uint64_t fp = *f;
        const uint64_t mask_ls = mask << 1;
        for (; j + 2 <= stop; j += 2) {  /* two bytes per step, as _roll */
            fp = (fp << 2) + TB5_GEAR_LS[p[j]];
            if ((fp & mask_ls) == 0) return j + 1;
            fp += TB5_GEAR[p[j + 1]];
            if ((fp & mask) == 0) return j + 2;
        }
        if (j < stop) {
            fp = (fp << 1) + TB5_GEAR[p[j]];
            if ((fp & mask) == 0) return j + 1;
        }
        *f = fp;
        return -1;
    }

    /* State of a lane starting at p[0] (the fingerprint after the TB5_WARM bytes before it). */
    static inline uint64_t tb5_warm(const unsigned char* p) {
        uint64_t fp = 0;
        Py_ssize_t j;
        for (j = -TB5_WARM; j < 0; j++) fp = (fp << 1) + TB5_GEAR[p[j]];
        return fp;
    }

    /* A hit at step j of a round of `lanes` blocks starting at a: lanes before the first hit
       lane hold earlier offsets, so they are finished in order first. hit: bit k set when lane
       k's state after byte j is a cut; f[k]: lane k's state after byte j. Returns the cut's
       end offset relative to a. */
    static Py_ssize_t tb5_resolve(const unsigned char* a, Py_ssize_t j, unsigned hit, int lanes,
                                  uint64_t mask, uint64_t* f) {
        int k;
        Py_ssize_t r;
        for (k = 0; k < lanes; k++) {
            if (hit & (1u << k)) return (Py_ssize_t)k * TB5_BLOCK + j + 1;
            r = tb5_lane_rest(a + (Py_ssize_t)k * TB5_BLOCK, j + 1, TB5_BLOCK, mask, &f[k]);
            if (r >= 0) return (Py_ssize_t)k * TB5_BLOCK + r;
        }
        return -1;  /* not reached: some bit of hit is set */
    }

    /* Lane kernels rolling two bytes per step (interleaved, NEON): lane k is the first lane with
       a hit, after byte j of each block (half 0: the first half of a step, where a lane holds its
       state shifted left by one, see _roll) or after byte j + 1 (half 1). Lanes before k hold
       earlier offsets, so each is finished in order first (its step completed, then the rest of
       its block) from its state f[m]. Returns the cut's end offset relative to a (lane 0's block). */
    static Py_ssize_t tb5_resolve_half(const unsigned char* a, Py_ssize_t j, int half, int k,
                                       const uint64_t* f, uint64_t mask) {
        int m;
        Py_ssize_t r;
        for (m = 0; m < k; m++) {
            const unsigned char* am = a + (Py_ssize_t)m * TB5_BLOCK;
            uint64_t fm = f[m];
            if (half == 0) {
                fm += TB5_GEAR[am[j + 1]];  /* complete lane m's step */
                if ((fm & mask) == 0) return (Py_ssize_t)m * TB5_BLOCK + j + 2;
            }
            r = tb5_lane_rest(am, j + 2, TB5_BLOCK, mask, &fm);
            if (r >= 0) return (Py_ssize_t)m * TB5_BLOCK + r;
        }
        return (Py_ssize_t)k * TB5_BLOCK + j + 1 + half;
    }

    /* Portable kernel: cut search over [*i_io, end) in rounds of 2 blocks, 2 scalar lanes
       interleaved, each rolling two bytes per step as _roll does (FastCDC 2020), so two serial
       shift-add chains overlap (about 1.5x the one-lane loop on an x86-64 core); the caller
       guarantees *i_io >= TB5_WARM. Returns the first cut's end offset, or -1 with
       (*i_io, *fp_io) moved to the end of the last whole round. */
    static Py_ssize_t tb5_roll_interleaved(const unsigned char* p, Py_ssize_t* i_io, Py_ssize_t end,
                                           uint64_t mask, uint64_t* fp_io) {
        const Py_ssize_t round = 2 * (Py_ssize_t)TB5_BLOCK;
        const uint64_t mask_ls = mask << 1;
        Py_ssize_t i = *i_io, j;
        while (end - i >= round) {
            const unsigned char* a = p + i;
            const unsigned char* a1 = a + TB5_BLOCK;
            uint64_t f0 = *fp_io, f1 = tb5_warm(a1);
            for (j = 0; j < TB5_BLOCK; j += 2) {
                f0 = (f0 << 2) + TB5_GEAR_LS[a[j]];
                f1 = (f1 << 2) + TB5_GEAR_LS[a1[j]];
                if (__builtin_expect(((f0 & mask_ls) == 0) | ((f1 & mask_ls) == 0), 0)) {
                    if ((f0 & mask_ls) == 0) return i + j + 1;
                    return i + tb5_resolve_half(a, j, 0, 1, &f0, mask);
                }
                f0 += TB5_GEAR[a[j + 1]];
                f1 += TB5_GEAR[a1[j + 1]];
                if (__builtin_expect(((f0 & mask) == 0) | ((f1 & mask) == 0), 0)) {
                    if ((f0 & mask) == 0) return i + j + 2;
                    return i + tb5_resolve_half(a, j, 1, 1, &f0, mask);
                }
            }
            *fp_io = f1;
            i += round;
        }
        *i_io = i;
        return -1;
    }

    #if TB5_HAVE_NEON
    /* NEON kernel (Apple silicon): 4 lanes rolling two bytes per step in two uint64x2_t (the
       shift-add and the mask test of two lanes one instruction each; two registers so their
       latencies overlap), one any-lane test per half step. The table has 256 64-bit entries,
       beyond NEON's byte-table lookups, so its loads stay scalar. Whether it beats the
       interleaved kernel depends on the core: the import measures both. */
    static inline unsigned tb5_hits4(const uint64_t* f, uint64_t mask) {
        return ((f[0] & mask) == 0) | (((f[1] & mask) == 0) << 1) | (((f[2] & mask) == 0) << 2) |
               ((unsigned)((f[3] & mask) == 0) << 3);
    }

    static Py_ssize_t tb5_roll_neon(const unsigned char* p, Py_ssize_t* i_io, Py_ssize_t end,
                                    uint64_t mask, uint64_t* fp_io) {
        const Py_ssize_t round = 4 * (Py_ssize_t)TB5_BLOCK;
        const uint64_t mask_ls = mask << 1;
        const uint64x2_t vmask = vdupq_n_u64(mask), vmask_ls = vdupq_n_u64(mask_ls);
        Py_ssize_t i = *i_io, j;
        uint64_t f[4];
        while (end - i >= round) {
            const unsigned char* a = p + i;
            const unsigned char *a1 = a + TB5_BLOCK, *a2 = a + 2 * TB5_BLOCK, *a3 = a + 3 * TB5_BLOCK;
            uint64x2_t v01 = vcombine_u64(vcreate_u64(*fp_io), vcreate_u64(tb5_warm(a1)));
            uint64x2_t v23 = vcombine_u64(vcreate_u64(tb5_warm(a2)), vcreate_u64(tb5_warm(a3)));
            for (j = 0; j < TB5_BLOCK; j += 2) {
                v01 = vaddq_u64(vshlq_n_u64(v01, 2),
                                vcombine_u64(vld1_u64(&TB5_GEAR_LS[a[j]]), vld1_u64(&TB5_GEAR_LS[a1[j]])));
                v23 = vaddq_u64(vshlq_n_u64(v23, 2),
                                vcombine_u64(vld1_u64(&TB5_GEAR_LS[a2[j]]), vld1_u64(&TB5_GEAR_LS[a3[j]])));
                /* vtstq: all ones where (lane & mask) != 0, so a zero word means a hit */
                if (__builtin_expect(vminvq_u32(vreinterpretq_u32_u64(
                        vandq_u64(vtstq_u64(v01, vmask_ls), vtstq_u64(v23, vmask_ls)))) == 0, 0)) {
                    vst1q_u64(f, v01);
                    vst1q_u64(f + 2, v23);
                    return i + tb5_resolve_half(a, j, 0, __builtin_ctz(tb5_hits4(f, mask_ls)), f, mask);
                }
                v01 = vaddq_u64(v01, vcombine_u64(vld1_u64(&TB5_GEAR[a[j + 1]]), vld1_u64(&TB5_GEAR[a1[j + 1]])));
                v23 = vaddq_u64(v23, vcombine_u64(vld1_u64(&TB5_GEAR[a2[j + 1]]), vld1_u64(&TB5_GEAR[a3[j + 1]])));
                if (__builtin_expect(vminvq_u32(vreinterpretq_u32_u64(
                        vandq_u64(vtstq_u64(v01, vmask), vtstq_u64(v23, vmask)))) == 0, 0)) {
                    vst1q_u64(f, v01);
                    vst1q_u64(f + 2, v23);
                    return i + tb5_resolve_half(a, j, 1, __builtin_ctz(tb5_hits4(f, mask)), f, mask);
                }
            }
            *fp_io = vgetq_lane_u64(v23, 1);
            i += round;
        }
        *i_io = i;
        return -1;
    }
    #else
    static Py_ssize_t tb5_roll_neon(const unsigned char* p, Py_ssize_t* i_io, Py_ssize_t end,
                                    uint64_t mask, uint64_t* fp_io) {
        return -1;
    }
    #endif

    #if TB5_HAVE_AVX512
    /* AVX-512 kernel: rounds of TB5_LANES + 1 blocks; lanes 0..7 roll blocks 0..7 in one
       vector register (table lookups by gather), lane 8 rolls block 8 as a scalar beside them
       (it uses the integer ports the gathers leave idle: about 15% more bytes per round on a
       Sapphire Rapids core). */
    __attribute__((target("avx512f,avx512bw")))
    static Py_ssize_t tb5_roll_lanes(const unsigned char* p, Py_ssize_t* i_io, Py_ssize_t end,
                                     uint64_t mask, uint64_t* fp_io) {
        const Py_ssize_t round = (Py_ssize_t)(TB5_LANES + 1) * TB5_BLOCK;
        const __m512i vmask = _mm512_set1_epi64((long long)mask);
        __m512i pick[8];  /* pick[s]: byte s of each 64-bit lane, zero-extended (vpshufb) */
        const __m512i offs = _mm512_set_epi64(7LL * TB5_BLOCK, 6LL * TB5_BLOCK, 5LL * TB5_BLOCK,
                                              4LL * TB5_BLOCK, 3LL * TB5_BLOCK, 2LL * TB5_BLOCK,
                                              1LL * TB5_BLOCK, 0);
        Py_ssize_t i = *i_io, j, r;
        int s;
        uint64_t f[TB5_LANES + 1], f8;
        __m512i v, g, fv;
        __mmask8 hit;
        for (s = 0; s < 8; s++)
            pick[s] = _mm512_set4_epi64((long long)(0x8080808080808000ULL | (unsigned)(8 + s)),
                                        (long long)(0x8080808080808000ULL | (unsigned)s),
                                        (long long)(0x8080808080808000ULL | (unsigned)(8 + s)),
                                        (long long)(0x8080808080808000ULL | (unsigned)s));
        while (end - i >= round) {
            const unsigned char* a = p + i;
            const unsigned char* a8 = a + (Py_ssize_t)TB5_LANES * TB5_BLOCK;
            /* Lane 0 goes on from the running state; lanes 1..8 rebuild theirs from the
               TB5_WARM bytes before their block (untested: those offsets are lane k-1's). */
            fv = _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, (long long)*fp_io);
            f8 = tb5_warm(a8);
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
                    f8 = (f8 << 1) + TB5_GEAR[a8[j + s]];
                    hit = _mm512_testn_epi64_mask(fv, vmask);
                    if (__builtin_expect((hit != 0) | ((f8 & mask) == 0), 0)) {
                        _mm512_storeu_si512((void*)f, fv);
                        f[TB5_LANES] = f8;
                        r = tb5_resolve(a, j + s, (unsigned)hit | ((unsigned)((f8 & mask) == 0) << TB5_LANES),
                                        TB5_LANES + 1, mask, f);
                        return i + r;
                    }
                }
            }
            *fp_io = f8;
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

    /* Kernel k over [*i_io, end); see the kernels above. */
    static inline Py_ssize_t tb5_roll_kernel(int k, const unsigned char* p, Py_ssize_t* i_io,
                                             Py_ssize_t end, uint64_t mask, uint64_t* fp_io) {
        switch (k) {
        case TB5_K_AVX512: return tb5_roll_lanes(p, i_io, end, mask, fp_io);
        case TB5_K_NEON: return tb5_roll_neon(p, i_io, end, mask, fp_io);
        case TB5_K_INTERLEAVED: return tb5_roll_interleaved(p, i_io, end, mask, fp_io);
        default: return -1;
        }
    }
    """
    Py_ssize_t TB5_BLOCK
    Py_ssize_t TB5_WARM
    int TB5_K_ONE
    int TB5_K_INTERLEAVED
    int tb5_kernel_ok(int k) noexcept nogil
    int tb5_best_kernel() noexcept nogil
    Py_ssize_t tb5_kernel_lanes(int k) noexcept nogil
    Py_ssize_t tb5_roll_kernel(int k, const unsigned char* p, Py_ssize_t* i_io, Py_ssize_t end,
                               uint64_t mask, uint64_t* fp_io) noexcept nogil


#: The lane kernels by name, in the order of their numbers in the C code above.
_KERNELS = ("one", "interleaved", "neon", "avx512")

cdef int _best = tb5_best_kernel()
cdef int _kernel = _best
cdef bint _calibrated = False  # the timing of _calibrate runs on first use, not at import


cdef inline void _ensure_calibrated():
    if not _calibrated:
        _calibrate()


def lane_kernels():
    """Names of the lane kernels usable on this CPU (``"one"``, ``"interleaved"``, and
    ``"neon"`` on arm64 / ``"avx512"`` on x86-64 with AVX-512 F+BW), slowest first."""
    return [name for k, name in enumerate(_KERNELS) if tb5_kernel_ok(k)]


def default_lane_kernel():
    """Name of the kernel chosen on first use (see ``_calibrate``): what ``set_vector_lanes(True)`` restores."""
    _ensure_calibrated()
    return _KERNELS[_best]


def lane_kernel():
    """Name of the kernel the cut search uses now (the one chosen on first use unless set)."""
    _ensure_calibrated()
    return _KERNELS[_kernel]


def set_lane_kernel(name):
    """Use the kernel ``name`` (one of :func:`lane_kernels`); returns the previous name.

    For tests and benchmarks: every kernel gives the same cut points. Raises UsageError for a
    name that is unknown or not usable on this CPU.
    """
    global _kernel
    _ensure_calibrated()
    prev = _KERNELS[_kernel]
    if name not in _KERNELS or not tb5_kernel_ok(_KERNELS.index(name)):
        raise UsageError(f"lane kernel {name!r} is not available here; have {lane_kernels()}")
    _kernel = _KERNELS.index(name)
    return prev


def _calibrate():
    """Choose the default lane kernel: ``$TB5SYNC_LANE_KERNEL`` if it names a usable one, else
    the fastest usable vector or interleaved kernel measured on 256 KiB (a few runs each,
    about two milliseconds; which is faster depends on the core: on arm64 NEON against the
    interleaved scalar lanes, on x86-64 AVX-512 against them). All give the same cut points.

    Runs once, on the first cut search or kernel query of the process (not at import: a
    no-change sync or a store read never chunks and should not pay for the timing)."""
    global _best, _kernel, _calibrated
    _calibrated = True
    import os
    import time

    forced = os.environ.get("TB5SYNC_LANE_KERNEL")
    if forced in _KERNELS and tb5_kernel_ok(_KERNELS.index(forced)):
        _best = _kernel = _KERNELS.index(forced)
        return
    candidates = [k for k in range(1, len(_KERNELS)) if tb5_kernel_ok(k)]
    if len(candidates) < 2:
        return
    buf = os.urandom(256 * 1024)
    rare = ChunkParams(version=0, min_size=64, avg_size=1 << 30, max_size=1 << 31)  # ~no cut in 256 KiB
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(3):
        for k in candidates:
            _kernel = k
            t = time.perf_counter()
            cut_points(buf, rare)
            best[k] = min(best[k], time.perf_counter() - t)
    _best = _kernel = min(candidates, key=best.__getitem__)


def vector_lanes():
    """Number of gear-hash lanes the cut search runs side by side now: 9 with AVX-512 (8 in
    a vector register, 1 scalar), 4 with NEON, 2 with the interleaved kernel, 1 with ``"one"``."""
    _ensure_calibrated()
    return tb5_kernel_lanes(_kernel)


def set_vector_lanes(bint enabled):
    """Turn the lane kernels on (the one chosen on first use) or off (the one-lane loop);
    returns the previous setting. The cut points are the same either way."""
    global _kernel
    _ensure_calibrated()
    cdef bint prev = _kernel != TB5_K_ONE
    _kernel = _best if enabled else TB5_K_ONE
    return prev


cdef inline Py_ssize_t _roll_fast(const unsigned char* p, Py_ssize_t i, Py_ssize_t end,
                                  uint64_t mask, uint64_t* fp_io) noexcept nogil:
    """Like ``_roll``, but long ranges go several lanes at a time through a lane kernel first.

    The gear hash is a serial chain (each step needs the previous state), which caps a one-lane
    loop near one byte per cycle. Each step shifts the 64-bit state left by one, so the state
    at any offset depends only on the 64 bytes before it and can be rebuilt from them. A lane
    kernel (the C block above) rolls several blocks of 4 KiB side by side, each block's start
    state rebuilt from the 64 bytes before it; the first cut in offset order wins, so the cut
    points are exactly those of the one-byte loop. What is left after the last whole round
    goes through the interleaved kernel's smaller rounds, the rest (and short ranges) to
    ``_roll``.
    """
    cdef Py_ssize_t cut
    cdef int k = _kernel
    if k != TB5_K_ONE and end - i >= tb5_kernel_lanes(k) * TB5_BLOCK and i >= TB5_WARM:
        cut = tb5_roll_kernel(k, p, &i, end, mask, fp_io)
        if cut != -1:
            return cut
        # what is left after the last whole round (up to 36 KiB for AVX-512) in smaller rounds
        if k != TB5_K_INTERLEAVED and end - i >= tb5_kernel_lanes(TB5_K_INTERLEAVED) * TB5_BLOCK:
            cut = tb5_roll_kernel(TB5_K_INTERLEAVED, p, &i, end, mask, fp_io)
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
    _ensure_calibrated()
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
    """Return the chunk end offsets of ``buf``; see ``tb5sync.engine.chunking.py_cut_points``."""
    cdef _Params prm
    cdef Py_ssize_t pos = 0
    cdef uint64_t fp = 0
    mv = _byte_view(buf)
    prm = _to_struct(_resolve(params))
    with mv:
        return _run(mv, &prm, bool(final), &pos, &fp, 0)


cdef class Chunker:
    """Streaming chunker; see ``tb5sync.engine.chunking.PyChunker``."""

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
