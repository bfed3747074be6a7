/* Checks every lane kernel of ext/_cdc.pyx compiled for this target against the one-lane loop
   (tests/test_chunking.py builds it, natively and for aarch64 under qemu when present).
   The test writes kernels.h: the gear table and the kernels' C block, taken from the sources.
   Prints "ok <kernel> <cases>" per usable kernel, or "FAIL ..." and exits 1. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef long Py_ssize_t;
#include "kernels.h"

static uint64_t rng = 88172645463325252ULL;
static uint64_t next(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

/* Reference: one lane, one byte per step, from state fp at i; the first cut's end or -1. */
static Py_ssize_t ref(const unsigned char* p, Py_ssize_t i, Py_ssize_t end, uint64_t mask, uint64_t* fp) {
    for (; i < end; i++) {
        *fp = (*fp << 1) + TB5_GEAR[p[i]];
        if ((*fp & mask) == 0) return i + 1;
    }
    return -1;
}

int main(void) {
    const Py_ssize_t n = 1 << 20;
    unsigned char* p = malloc(n);
    int k, c, failed = 0;
    for (Py_ssize_t j = 0; j < n; j++) p[j] = (unsigned char)next();
    for (k = 1; k <= 3; k++) {
        if (!tb5_kernel_ok(k)) continue;
        for (c = 0; c < 4000; c++) {
            int bits = 8 + (int)(next() % 12);  /* cuts every 256 B .. 512 KiB */
            uint64_t mask = (((uint64_t)1 << bits) - 1) << (63 - bits);
            Py_ssize_t i = TB5_WARM + (Py_ssize_t)(next() % (n / 2));
            Py_ssize_t end = i + (Py_ssize_t)(next() % (Py_ssize_t)(n - i));
            uint64_t fp = next(), fk = fp, fr = fp;
            Py_ssize_t ik = i, got, want;
            if (c % 7 == 0) memset(p + i, 0, (size_t)((end - i) / 3));  /* runs of zeros: no cut there */
            got = tb5_roll_kernel(k, p, &ik, end, mask, &fk);
            if (got >= 0) {
                want = ref(p, i, end, mask, &fr);
            } else {  /* no cut before ik: the state there must be the reference's */
                want = ref(p, i, ik, mask, &fr);
                if (want < 0 && fr != fk) { printf("FAIL kernel %d case %d: state\n", k, c); failed = 1; }
            }
            if (got != want) {
                printf("FAIL kernel %d case %d: cut %ld, one-lane loop %ld\n", k, c, (long)got, (long)want);
                failed = 1;
            }
            if (c % 7 == 0) for (Py_ssize_t j = i; j < i + (end - i) / 3; j++) p[j] = (unsigned char)next();
        }
        printf("ok %d %d\n", k, c);
    }
    return failed;
}
