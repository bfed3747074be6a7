"""The performance targets of the project, read from one `make bench` run's JSON results.

Each bench prints its own table with its peers (rsync, raw TCP, sshfs, nginx, pyfastcdc) measured
in the same run; this script gathers the figures the targets are stated in and prints one table:
the target, the figure of this run, and whether it is met. It measures nothing itself.

    python benches/targets.py --sync R/sync.json --sync-short R/sync-short.json --cpu R/cpu.json \
        --pinned R/pinned.json --chunker R/chunker.json --fs R/fs.json

The first table is issue 24's (the verified data plane): every target with tb5sync's and rsync's
figure from the same run and the value it is judged on. ``--sync`` may be given more than once
(e.g. the full profile for the trees and ``--short`` for the delta); per workload the first JSON
that ran it is used, and the row names its profile. Any file may be left out (its rows say so). Ratios > 1 mean tb5sync is faster (or, for CPU per
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

#: One row of issue 24's table: what, wanted, tb5sync's figure, rsync's figure (same run), the
#: value the target is judged on, met(value), where the figures come from.
Row24 = tuple[str, str, str, str, "float | None", Callable[[float], bool], str]

MiB = 1 << 20


def _fmt(v: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


def _workload(syncs: list[dict], key: str) -> tuple[dict | None, str]:
    """The first of ``syncs`` that ran workload ``key`` (they are given full profile first), and
    its profile's name."""
    for d in syncs:
        w = _get(d, "workloads", key)
        if w and _get(w, "tb5sync", "n_ok") and _get(w, "rsync", "n_ok"):
            return w, str(_get(d, "profile", "name") or "?")
    return None, "-"


def rows24(syncs: list[dict], cpu: dict | None) -> list[Row24]:
    """Every target of issue 24 with tb5sync's and rsync's figure of the same run.

    ``syncs``: bench_sync.py JSONs (first match per workload wins); ``cpu``: bench_cpu.py's JSON
    (parts ``e2e`` and ``gil``). CPU s/GB are per 1e9 bytes; walls in seconds; RSS in MiB.
    """
    out: list[Row24] = []
    e2e_t, e2e_r = _get(cpu, "e2e", "tb5sync"), _get(cpu, "e2e", "rsync")
    size = _get(cpu, "size")
    src = f"bench_cpu.py e2e, {size / (1 << 30):.0f} GiB" if size else "bench_cpu.py e2e"
    for side, who, limit in (("client", "sending side (client)", 0.85), ("server", "receiving side (server)", 0.80)):
        t, r = _get(e2e_t, side), _get(e2e_r, side)
        out.append((f"CPU s/GB, verified cold push, {who}", f"<= {limit:.2f}", _fmt(t), _fmt(r), t,
                     lambda v, lim=limit: v <= lim, src))
    t, r = _get(e2e_t, "total"), _get(e2e_r, "total")
    out.append(("CPU s/GB, both ends, tb5sync / rsync", "<= 1.25x", _fmt(t), _fmt(r),
                t / r if t and r else None, lambda v: v <= 1.25, src))
    for side in ("client", "server"):
        g = _get(cpu, "gil", side, "gil_steady_s_per_gb")
        out.append((f"GIL held s/GB, steady, {side}", "<= 0.02", _fmt(g, ".3f"), "n/a (no GIL)", g,
                    lambda v: v <= 0.02, "bench_cpu.py gil (py-spy --gil)"))
    for side in ("client", "server"):
        v = _get(cpu, "interp", side, "interp_s_per_gb")
        if v is not None:  # informational: what the GIL figure would be with no holder descheduled
            out.append((f"interpreter CPU s/GB (perf, libpython), {side}{' incl. start-up' if side == 'client' else ''}",
                        "<= 0.02 (as GIL)", _fmt(v, ".3f"), "n/a", v, lambda x: x <= 0.02, "bench_cpu.py interp"))
    for side in ("client", "server"):
        c = _get(e2e_t, side)
        out.append((f"cores for 10 GB/s at this CPU s/GB, {side}", "<= 8", _fmt(c * 10 if c else None, ".1f"),
                    _fmt(_get(e2e_r, side) * 10 if _get(e2e_r, side) else None, ".1f"), c * 10 if c else None,
                    lambda v: v <= 8, src + " x 10"))

    w, prof = _workload(syncs, "tree_cold")
    if w:
        n = w.get("files")
        tf, rf = _get(w, "tb5sync", "files_per_s"), _get(w, "rsync", "files_per_s")
        out.append((f"{n:,} small files cold, files/s, tb5sync / rsync", ">= 1.3x", _fmt(tf, ",.0f"), _fmt(rf, ",.0f"),
                    tf / rf if tf and rf else None, lambda v: v >= 1.3, f"bench_sync.py tree_cold ({prof})"))
    else:
        out.append(("small files cold, files/s, tb5sync / rsync", ">= 1.3x", "-", "-", None, lambda v: False, "bench_sync.py tree_cold"))
    wc, prof_c = _workload(syncs, "tree_cold")
    wp, prof_p = _workload(syncs, "tree_pull")
    pair = wc and wp and prof_c == prof_p
    tc = _get(wc, "tb5sync", "wall") if pair else None
    tp = _get(wp, "tb5sync", "wall") if pair else None
    rc = _get(wc, "rsync", "wall") if pair else None
    rp = _get(wp, "rsync", "wall") if pair else None
    out.append(("small-file tree: push wall / pull wall (tb5sync; rsync's beside)", "<= 1.0",
                f"{_fmt(tc, '.2f')} / {_fmt(tp, '.2f')} s", f"{_fmt(rc, '.2f')} / {_fmt(rp, '.2f')} s",
                tc / tp if tc and tp else None, lambda v: v <= 1.0, f"bench_sync.py tree_cold, tree_pull ({prof_p})"))
    w, prof = _workload(syncs, "tree_nochange")
    t, r = _get(w, "tb5sync", "wall"), _get(w, "rsync", "wall")
    out.append(("no-change re-run, wall, tb5sync / rsync", "<= 0.6x", _fmt(t, ".3f", " s"), _fmt(r, ".3f", " s"),
                t / r if t and r else None, lambda v: v <= 0.6, f"bench_sync.py tree_nochange ({prof})"))
    w, prof = _workload(syncs, "big_delta")
    t, r = _get(w, "tb5sync", "wall"), _get(w, "rsync", "wall")
    out.append(("delta push (1% + 4 KiB insert), wall, tb5sync / rsync", "<= 0.75x", _fmt(t, ".2f", " s"),
                _fmt(r, ".2f", " s"), t / r if t and r else None, lambda v: v <= 0.75, f"bench_sync.py big_delta ({prof})"))
    t, r = _get(w, "tb5sync", "wire_bytes"), _get(w, "rsync", "wire_bytes")
    out.append(("delta push, wire bytes, tb5sync / rsync", "<= 1.0x", _fmt(t / 1e6 if t else None, ".1f", " MB"),
                _fmt(r / 1e6 if r else None, ".1f", " MB"), t / r if t and r else None, lambda v: v <= 1.0,
                f"bench_sync.py big_delta ({prof})"))
    # peak RSS: the largest over every workload of every JSON given
    for side in ("client", "server"):
        k = f"rss_{side}_max"
        peaks: dict[str, list[tuple[float, str]]] = {"tb5sync": [], "rsync": []}
        for d in syncs:
            for key, wl in (_get(d, "workloads") or {}).items():
                for tool in peaks:
                    v = _get(wl, tool, k)
                    if v:
                        peaks[tool].append((v / MiB, key))
        for tool in peaks:
            v = _get(cpu, "e2e", tool, k)
            if v:
                peaks[tool].append((v / MiB, "e2e"))
        t, r = max(peaks["tb5sync"], default=None), max(peaks["rsync"], default=None)
        out.append((f"peak RSS, {side}, largest over the workloads (at: {t[1] if t else '-'})", "<= 256 MiB",
                    _fmt(t[0] if t else None, ".0f", " MiB"), _fmt(r[0] if r else None, ".0f", " MiB"),
                    t[0] if t else None, lambda v: v <= 256, "bench_sync.py, bench_cpu.py (VmHWM)"))
    return out


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


def _table(head: tuple[str, ...], body: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in body:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def main(argv: list[str] | None = None) -> int:
    """Print issue 24's targets, then the other targets; exits 0 (a target not met is a figure,
    not an error)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sync", metavar="JSON", action="append", default=[],
                   help="a bench_sync.py JSON of this run (repeatable: per workload the first that ran it is used)")
    for name in ("sync-short", "cpu", "pinned", "chunker", "fs"):
        p.add_argument(f"--{name}", metavar="JSON", help=f"the JSON of the {name} bench of this run")
    a = p.parse_args(argv)
    syncs = [d for d in (_load(x) for x in a.sync) if d]
    cpu = _load(a.cpu)
    print("\nIssue 24, the verified data plane: each target, tb5sync and rsync in the same run\n")
    body24 = [(t, w, ft, fr, "-" if v is None else f"{v:.2f}", "-" if v is None else ("yes" if ok(v) else "NO"), src)
              for t, w, ft, fr, v, ok, src in rows24(syncs, cpu)]
    _table(("target", "wanted", "tb5sync", "rsync", "judged on", "met", "from"), body24)
    pinned = _load(a.pinned)
    if pinned and pinned.get("points"):
        print("\nPinned to disjoint cores (bench_pinned.py): cores per side, GB/s and CPU s/GB, tb5sync | rsync\n")
        _table(("cores per side", "GB/s tb5sync", "GB/s rsync", "CPU s/GB tb5sync", "CPU s/GB rsync"),
               [(str(pt["cores"]), _fmt(_get(pt, "tb5sync", "gb_per_s")), _fmt(_get(pt, "rsync", "gb_per_s")),
                 _fmt(_get(pt, "tb5sync", "cpu_per_gb")), _fmt(_get(pt, "rsync", "cpu_per_gb")))
                for pt in pinned["points"]])
        if pinned.get("note"):
            print(f"({pinned['note']})")
    table = rows(syncs[0] if syncs else None, _load(a.sync_short), cpu, _load(a.chunker), _load(a.fs))
    body = [(t, w, "-" if v is None else f"{v:.2f}", "-" if v is None else ("yes" if ok(v) else "NO"), src)
            for t, w, v, ok, src in table]
    print("\nThe other performance targets, this run (ratios > 1: tb5sync faster; CPU: tb5sync / rsync)\n")
    _table(("target", "wanted", "this run", "met", "from"), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
