"""The performance targets of the project, read from one `make bench` run's JSON results.

Each bench prints its own table with its peers (rsync, raw TCP, sshfs, nginx, pyfastcdc) measured
in the same run; this script gathers the figures the targets are stated in and prints one table:
the target, the figure of this run, and whether it is met. It measures nothing itself.

    python benches/targets.py --sync R/sync.json --sync-short R/sync-short.json --cpu R/cpu.json \
        --chunker R/chunker.json --fs R/fs.json

Any file may be left out (its rows say so). Ratios > 1 mean tb5sync is faster (or, for CPU per
GB, uses more: that row is "tb5sync / rsync", target <= 1).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Callable


def _load(path: str | None) -> dict[str, Any] | None:
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _get(d: dict[str, Any] | None, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


Row = tuple[str, str, "float | None", Callable[[float], bool], str]


def rows(sync: dict | None, short: dict | None, cpu: dict | None, chunker: dict | None, fs: dict | None) -> list[Row]:
    """``(target, figure, value, met(value), source)`` for every target."""
    out: list[Row] = []

    def sync_ratio(d: dict | None, key: str) -> float | None:
        return _get(d, "workloads", key, "ratio_tb5_rsync")

    out.append(("20,000 small files cold, files/s", "tb5sync / rsync >= 1.3", sync_ratio(sync, "tree_cold"),
                lambda v: v >= 1.3, "bench_sync.py"))
    out.append(("2,000 small files cold, files/s", "tb5sync / rsync >= 1.0", sync_ratio(short, "tree_cold"),
                lambda v: v >= 1.0, "bench_sync.py --short"))
    out.append(("no-change push, time", "rsync / tb5sync > 1", sync_ratio(sync, "tree_nochange"), lambda v: v > 1.0,
                "bench_sync.py"))
    out.append(("delta of the big file, time", "rsync / tb5sync > 1", sync_ratio(sync, "big_delta"), lambda v: v > 1.0,
                "bench_sync.py"))
    out.append(("cold push of the big file, GB/s", "tb5sync / rsync > 1", sync_ratio(sync, "big_push"), lambda v: v > 1.0,
                "bench_sync.py"))
    for part, what in (("e2e", "1 GiB file"), ("medium", "64 x 6 MiB")):
        t, r = _get(cpu, part, "tb5sync", "total"), _get(cpu, part, "rsync", "total")
        out.append((f"CPU per GB, verified cold push ({what}), both ends", "tb5sync / rsync <= 1.0",
                    t / r if t and r else None, lambda v: v <= 1.0, "bench_cpu.py"))
    ratios = _get(fs, "ratios") or {}

    def fs_ratio(pattern: str) -> float | None:
        for k, v in ratios.items():
            if re.fullmatch(pattern, k):
                return float(v)
        return None

    out.append(("tb5:// open().read(), one call", "tb5 / one raw TCP stream >= 0.7",
                fs_ratio(r"open\(\)\.read\(\) \d+ MiB: tb5/raw"), lambda v: v >= 0.7, "bench_fs.py"))
    out.append(("tb5:// cat_file of a large file (several connections)", "tb5 / one raw TCP stream > 1",
                fs_ratio(r"cat_file \d+ MiB: tb5/raw"), lambda v: v > 1.0, "bench_fs.py"))
    out.append(("tb5:// info, one at a time", "tb5 / raw ping-pong >= 0.5", fs_ratio(r"info, one at a time: tb5/raw"),
                lambda v: v >= 0.5, "bench_fs.py"))
    out.append(("tb5:// cat_file 4 KiB, one at a time", "tb5 / raw ping-pong >= 0.5",
                fs_ratio(r"cat_file 4 KiB, one at a time: tb5/raw"), lambda v: v >= 0.5, "bench_fs.py"))
    peers = [p for p in (_get(fs, "peers") or []) if p != "tb5"]
    against = {k: float(v) for k, v in ratios.items() if any(k.endswith(f": tb5/{p}") for p in peers)}
    worst_key = min(against, key=against.__getitem__, default="")
    out.append((f"tb5:// ahead of {' and '.join(peers) or 'its peers'} on every row (lowest: {worst_key or '-'})",
                "lowest tb5 / peer > 1", against.get(worst_key), lambda v: v > 1.0, "bench_fs.py"))
    small = _get(fs, "small_targets") or {}
    for key, what, lim in (("info:cpu_server_us", "server CPU per info, us", 30), ("info:cpu_client_us", "client CPU per info, us", 30),
                           ("cat4k:cpu_server_us", "server CPU per 4 KiB cat_file, us", 40),
                           ("cat4k:cpu_client_us", "client CPU per 4 KiB cat_file, us", 40)):
        out.append((f"tb5:// {what}", f"<= {lim}", small.get(key), lambda v, lim=lim: v <= lim, "bench_fs.py"))
    for how in ("cat_ranges", "gather"):
        out.append((f"tb5:// 4 KiB random reads in flight ({how}), ops/s", ">= 30,000", small.get(f"random4k_{how}:ops"),
                    lambda v: v >= 30_000, "bench_fs.py"))
    out.append(("tb5:// server pinned to 2 cores vs 1, ops/s", ">= 1.7", small.get("pinned_ratio"), lambda v: v >= 1.7, "bench_fs.py"))
    out.append(("chunker, one thread", "tb5sync / pyfastcdc >= 1.5", _get(chunker, "ratio_vs_pyfastcdc"), lambda v: v >= 1.5,
                "bench_chunker.py"))
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the targets table; exits 0 (a target not met is a figure, not an error)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("sync", "sync-short", "cpu", "chunker", "fs"):
        p.add_argument(f"--{name}", metavar="JSON", help=f"the JSON of the {name} bench of this run")
    a = p.parse_args(argv)
    table = rows(_load(a.sync), _load(a.sync_short), _load(a.cpu), _load(a.chunker), _load(a.fs))
    head = ("target", "wanted", "this run", "met", "from")
    body = [(t, w, "-" if v is None else f"{v:.2f}", "-" if v is None else ("yes" if ok(v) else "NO"), src)
            for t, w, v, ok, src in table]
    widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
    print("\nPerformance targets, this run (ratios > 1: tb5sync faster; CPU: tb5sync / rsync)\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in body:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
