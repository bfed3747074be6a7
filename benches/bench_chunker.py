#!/usr/bin/env python3
"""The FastCDC chunker alone: tb5sync's Cython core against pyfastcdc, and what chunk size costs on a delta.

What it measures
----------------
1. **Throughput**: GB/s of ``tb5sync.engine.chunking.cut_points`` (the Cython core) and of
   ``pyfastcdc.FastCDC.cut_buf`` (its Cython build) on the same in-memory buffer of random bytes,
   with the same min/avg/max sizes and normalization level (tb5sync's format-v1 parameters unless
   ``--avg`` is given), median of ``--repeat`` alternating runs each, and the median of the
   per-round ratios to pyfastcdc. The two use different gear tables, so
   their cut points differ; only the speed is compared. BLAKE3 of the same buffer (one thread)
   is shown for scale.
2. **Identity**: the Cython core and the pure-Python reference (``py_cut_points``) must give the
   same cut points; they are compared on ``--check-mib`` MiB of the buffer (the reference runs
   at a few MB/s) and on a run of zeros (forced cuts).
3. **Delta wire bytes by chunk size** (``--delta``): an old and a new version of a file (the
   ``big_delta`` pattern of bench_sync.py: 64 scattered overwrites totalling 1% of it plus one
   4 KiB insertion in the middle) are chunked with several parameter sets; the bytes of new
   chunks not present in the old version are what a sync must send. This is the estimate behind
   the choice of chunk size (a new parameter set is a new chunking format version).

Usage::

    python benches/bench_chunker.py [--mib 512] [--repeat 5] [--delta] [--json-out PATH]
    python benches/bench_chunker.py --short          # 128 MiB, 3 repeats, delta on 256 MiB

Exit status 1 if the Cython and Python cut points differ, else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import blake3  # noqa: E402

import tb5sync.engine.chunking as chunking
from tb5sync.engine.chunking import PARAMS_V1, ChunkParams  # noqa: E402


def median_rates(fns: dict, nbytes: int, repeat: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Median throughput of each ``fns[name]()`` over ``repeat`` rounds, GB/s (1 GB = 1e9 bytes),
    and every round's figure.

    The functions take turns within each round (alternating), so a slow patch of a shared
    machine costs them alike instead of falling on whichever ran then; ratios are taken per
    round (see :func:`median_ratio`).
    """
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            runs[name].append(nbytes / (time.perf_counter() - t) / 1e9)
    return {name: statistics.median(r) for name, r in runs.items()}, runs


def median_ratio(runs: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of ``a``'s throughput over ``b``'s measured in the same round."""
    return statistics.median(x / y for x, y in zip(runs[a], runs[b]))


def chunk_set(buf: memoryview, params: ChunkParams) -> dict[bytes, int]:
    """Digest -> length of every chunk of ``buf``."""
    out = {}
    prev = 0
    for c in chunking.cut_points(buf, params):
        out[blake3.blake3(buf[prev:c], max_threads=blake3.blake3.AUTO).digest()] = c - prev
        prev = c
    return out


def new_bytes(old: memoryview, new: memoryview, params: ChunkParams) -> tuple[int, int]:
    """(bytes of ``new``'s chunks missing from ``old``, number of chunks of ``new``)."""
    have = chunk_set(old, params)
    want = chunk_set(new, params)
    return sum(n for d, n in want.items() if d not in have), len(want)


def make_delta(old: bytes, seed: int = 7) -> bytes:
    """The big_delta edit pattern: 64 evenly spread overwrites totalling 1% plus one 4 KiB insert."""
    rnd = random.Random(seed)
    new = bytearray(old)
    n = len(old)
    each = max(1, n // 100 // 64)
    for i in range(64):
        off = (i * n) // 64 + rnd.randrange(max(1, n // 64 - each))
        new[off : off + each] = rnd.randbytes(each)
    mid = n // 2
    new[mid:mid] = rnd.randbytes(4096)
    return bytes(new)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="128 MiB buffer, 3 repeats, delta on 256 MiB")
    p.add_argument("--mib", type=int, help="buffer size for throughput, MiB (default 512; 128 short)")
    p.add_argument("--repeat", type=int, help="alternating runs per chunker, the median is kept (default 5; 3 short)")
    p.add_argument("--avg", type=int, help="average chunk size in bytes (default: format v1's, 1 MiB)")
    p.add_argument("--threads", type=int, default=2,
                   help="also measure parallel_cut_points with this many threads (default 2; 1: skip)")
    p.add_argument("--check-mib", type=float, default=4.0, help="MiB compared against the pure-Python reference")
    p.add_argument("--delta", action="store_true", help="also estimate delta wire bytes per chunk size")
    p.add_argument("--delta-mib", type=int, help="file size for --delta, MiB (default 2048; 256 short)")
    p.add_argument("--json-out", help="write the results as JSON here")
    a = p.parse_args()
    mib = a.mib or (128 if a.short else 512)
    repeat = a.repeat or (3 if a.short else 5)
    params = PARAMS_V1
    if a.avg:
        params = ChunkParams(version=0, min_size=a.avg // 4, avg_size=a.avg, max_size=a.avg * 4, normalization=2)
    res: dict = {"impl": chunking.IMPLEMENTATION, "mib": mib, "repeat": repeat,
                 "params": {"min": params.min_size, "avg": params.avg_size, "max": params.max_size,
                            "normalization": params.normalization}}
    if chunking.cy_cut_points is None:
        print("the Cython chunker is not built (tb5sync._cdc missing): nothing to measure", file=sys.stderr)
        return 1

    buf = memoryview(os.urandom(mib * 1024 * 1024))
    n = len(buf)
    from tb5sync import _cdc

    def with_kernel(name: str):  # noqa: ANN202
        def run() -> None:
            prev = _cdc.set_lane_kernel(name)
            try:
                chunking.cy_cut_points(buf, params)
            finally:
                _cdc.set_lane_kernel(prev)
        return run

    fns = {"ours": lambda: chunking.cy_cut_points(buf, params)}
    lanes = _cdc.vector_lanes()
    kernel = _cdc.lane_kernel()
    # the portable kernel (what a CPU with neither AVX-512 nor NEON runs) and the one-lane loop
    if kernel != "interleaved":
        fns["ours_interleaved"] = with_kernel("interleaved")
    fns["ours_scalar"] = with_kernel("one")
    try:
        import pyfastcdc.cy as pcy

        fc = pcy.FastCDC(params.avg_size, min_size=params.min_size, max_size=params.max_size,
                         normalized_chunking=params.normalization)
        fns["pyfastcdc"] = lambda: sum(1 for _ in fc.cut_buf(buf))
    except ImportError as exc:
        res["pyfastcdc_error"] = f"pyfastcdc (Cython build) not importable: {exc}"
    from concurrent.futures import ThreadPoolExecutor

    threads = max(1, a.threads)
    cut_pool = ThreadPoolExecutor(max(1, threads - 1))
    if threads > 1:
        fns["ours_parallel"] = lambda: chunking.parallel_cut_points(buf, params, True, threads, cut_pool)
    fns["blake3"] = lambda: blake3.blake3(buf).digest()
    rates, runs = median_rates(fns, n, repeat)
    ours = res["tb5sync_gbps"] = rates["ours"]
    res["vector_lanes"] = lanes
    res["lane_kernel"] = kernel
    res["tb5sync_scalar_gbps"] = rates["ours_scalar"]
    if "ours_interleaved" in rates:
        res["tb5sync_interleaved_gbps"] = rates["ours_interleaved"]
    theirs = res["pyfastcdc_gbps"] = rates.get("pyfastcdc")
    if theirs is not None:
        res["ratio_vs_pyfastcdc"] = median_ratio(runs, "ours", "pyfastcdc")
    res["blake3_1thread_gbps"] = rates["blake3"]
    if threads > 1:
        res["threads"] = threads
        res["tb5sync_parallel_gbps"] = rates["ours_parallel"]
        par_ok = chunking.parallel_cut_points(buf, params, True, threads, cut_pool) == chunking.cy_cut_points(buf, params)
        res["parallel_identical"] = par_ok

    # identity against the pure-Python reference
    k = int(a.check_mib * 1024 * 1024)
    sample = bytes(buf[:k]) + bytes(3 * params.max_size) + bytes(buf[k : k + params.max_size])
    cy = chunking.cy_cut_points(sample, params)
    py = chunking.py_cut_points(sample, params)
    res["identical_cut_points"] = cy == py
    res["checked_bytes"] = len(sample)
    res["checked_chunks"] = len(cy)

    print(f"FastCDC chunker, {mib} MiB of random bytes, params min/avg/max = "
          f"{params.min_size}/{params.avg_size}/{params.max_size} NC{params.normalization}, "
          f"median of {repeat} alternating runs")
    print(f"  tb5sync (Cython)   {ours:6.2f} GB/s   (lane kernel {kernel}, {lanes} lanes; one thread)")
    if "tb5sync_interleaved_gbps" in res:
        print(f"  tb5sync, portable  {res['tb5sync_interleaved_gbps']:6.2f} GB/s   (interleaved kernel: CPUs without "
              f"AVX-512 or NEON)   ratio to pyfastcdc "
              + (f"{median_ratio(runs, 'ours_interleaved', 'pyfastcdc'):.2f}x" if theirs else "-"))
    print(f"  tb5sync, one lane  {res['tb5sync_scalar_gbps']:6.2f} GB/s   (lane kernels off, for comparison)")
    if theirs is not None:
        print(f"  pyfastcdc (Cython) {theirs:6.2f} GB/s   ratio tb5sync/pyfastcdc {res['ratio_vs_pyfastcdc']:.2f}x "
              "(median of per-round ratios; target >= 1.5x)")
    else:
        print(f"  pyfastcdc          not measured: {res['pyfastcdc_error']}")
    if threads > 1:
        par = res["tb5sync_parallel_gbps"]
        vs = f"   ratio to pyfastcdc {par / theirs:.2f}x" if theirs else ""
        print(f"  tb5sync, {threads} threads {par:6.2f} GB/s   (parallel_cut_points, cut points "
              f"{'identical' if res['parallel_identical'] else 'DIFFERENT'} to one thread){vs}")
    print(f"  BLAKE3, 1 thread   {res['blake3_1thread_gbps']:6.2f} GB/s (for scale)")
    print(f"  cut points vs pure-Python reference on {len(sample) / 2**20:.1f} MiB ({len(cy)} chunks): "
          f"{'identical' if cy == py else 'DIFFERENT'}")

    if a.delta:
        dmib = a.delta_mib or (256 if a.short else 2048)
        old = os.urandom(dmib * 1024 * 1024)
        new = make_delta(old)
        ov, nv = memoryview(old), memoryview(new)
        rows = []
        print(f"\ndelta estimate: {dmib} MiB file, 64 overwrites totalling 1% + one 4 KiB insertion")
        print("  avg chunk   chunks     bytes to send   x of the edited bytes")
        edited = (len(old) // 100 // 64) * 64 + 4096
        for avg in (16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024):
            prm = PARAMS_V1 if avg == PARAMS_V1.avg_size else ChunkParams(
                version=0, min_size=avg // 4, avg_size=avg, max_size=avg * 4, normalization=2)
            sent, count = new_bytes(ov, nv, prm)
            rows.append({"avg": avg, "chunks": count, "bytes": sent})
            print(f"  {avg // 1024:6d} KiB {count:8d} {sent:14,d}      {sent / edited:6.1f}x"
                  + ("   (format v1)" if prm is PARAMS_V1 else ""))
        res["delta"] = {"mib": dmib, "edited_bytes": edited, "rows": rows}

    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["identical_cut_points"] and res.get("parallel_identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
