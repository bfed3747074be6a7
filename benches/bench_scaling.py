#!/usr/bin/env python3
"""How cost grows: tb5sync and an rsync daemon side by side as the workload scales, on loopback.

Three sweeps, each point a cold push to an empty destination through a fresh server (tb5sync
and rsync alternating, median of ``--repeat``), verified afterwards:

* **file size**: one file of random bytes, 4 KiB ... 1 GiB (``--full``: ... 8 GiB); GB/s.
* **stream count**: one file (256 MiB; ``--full`` 1 GiB) with ``--streams`` 1, 2, 4, 8; GB/s,
  next to ``iperf3 -P N`` with the same N when iperf3 is installed.
* **tree size**: 1,000 ... 20,000 files (``--full``: ... 100,000) of 1-64 KiB random bytes,
  100 files per directory; files/s.

Output: tables on stdout, ``benches/results/scaling-<timestamp>.json`` and one PNG per sweep
(``scaling-<timestamp>-size.png``, ``-streams.png``, ``-tree.png``; matplotlib, installed by
``make bench``). The harness (servers, timing, rsync daemon) is bench_sync.py's.

Usage::

    python benches/bench_scaling.py            # default sizes, about 5 minutes here
    python benches/bench_scaling.py --full     # up to 8 GiB and 100,000 files (needs ~25 GB free)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_sync as B  # noqa: E402  (the shared harness)

KiB, MiB, GiB = B.KiB, B.MiB, B.GiB


def fresh_dir(path: str) -> str:
    """``path`` as a new empty directory (whatever was there is removed)."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def make_file(path: str, size: int, seed: int) -> None:
    rs = B.RandomStream(f"scaling-{seed}".encode())
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(left, 16 * MiB)
            f.write(rs.read(n))
            left -= n


def make_tree(root: str, files: int, seed: int) -> int:
    """``files`` files of 1-64 KiB random bytes, 100 per directory; returns their total size in bytes."""
    rng = random.Random(seed)
    rs = B.RandomStream(f"tree-{seed}".encode())
    total = 0
    for i in range(files):
        d = os.path.join(root, f"d{i // 100:04d}")
        if i % 100 == 0:
            os.makedirs(d, exist_ok=True)
        n = rng.randint(1 * KiB, 64 * KiB)
        with open(os.path.join(d, f"f{i:06d}.bin"), "wb") as f:
            f.write(rs.read(n))
        total += n
    return total


def sizes_of(root: str) -> dict[str, int]:
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != B.STATE_DIR]
        for name in files:
            full = os.path.join(d, name)
            out[os.path.relpath(full, root)] = os.path.getsize(full)
    return out


def push(tool, src_dir: str, work: str, label: str, verify_digest: bool) -> B.Run:
    """Cold push of ``src_dir/`` to a fresh server root; the copy is checked (sizes, and BLAKE3 of big files)."""
    root = fresh_dir(os.path.join(work, f"root-{label}"))
    B.clear_state(src_dir)
    with tool.serve(root) as srv:
        run = tool.sync(src_dir + "/", tool.remote(srv, "dst"))
    run.cpu_server = srv.cpu
    dst = os.path.join(root, "dst")
    want, got = sizes_of(src_dir), sizes_of(dst)
    if want != got:
        raise B.ToolError(f"{tool.name} {label}: destination differs ({len(got)} files vs {len(want)})")
    if verify_digest:
        for rel in want:
            if B.file_digest(os.path.join(src_dir, rel)) != B.file_digest(os.path.join(dst, rel)):
                raise B.ToolError(f"{tool.name} {label}: {rel} differs")
    shutil.rmtree(root, ignore_errors=True)
    return run


def measure(tools: list, src: str, work: str, label: str, repeat: int, digest: bool) -> dict[str, float]:
    """Median wall seconds per tool over ``repeat`` alternating runs."""
    walls: dict[str, list[float]] = {t.name: [] for t in tools}
    for i in range(repeat):
        for t in tools:
            run = push(t, src, work, f"{label}-{t.name}-{i}", digest)
            walls[t.name].append(run.wall)
            print(f"[{label} {i + 1}/{repeat}] {t.name}: {run.wall:.3f} s", file=sys.stderr)
    return {name: B.median(w) for name, w in walls.items()}


def iperf(streams: int, log_dir: str) -> float | None:
    if not shutil.which("iperf3"):
        return None
    try:
        return B.raw_iperf3(log_dir, streams, 2, 0)["gbps"]
    except (B.ToolError, OSError):
        return None


def plot(path: str, title: str, xlabel: str, ylabel: str, xs: list, series: dict[str, list], logx: bool) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, ys in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def human(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="up to 8 GiB files and 100,000-file trees")
    ap.add_argument("--repeat", type=int, default=1, help="alternating runs per point (median); default 1")
    ap.add_argument("--workdir", default=None, help="scratch space (default: a temporary directory)")
    ap.add_argument("--sweeps", default="size,streams,tree")
    ap.add_argument("--tb5sync-cmd", default=None)
    args = ap.parse_args()
    sizes = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB, 1 * GiB] + ([8 * GiB] if args.full else [])
    trees = [1000, 5000, 20000] + ([100_000] if args.full else [])
    stream_file = 1 * GiB if args.full else 256 * MiB
    sweeps = set(args.sweeps.split(","))

    work = args.workdir or tempfile.mkdtemp(prefix="tb5-scaling-")
    log_dir = os.path.join(work, "logs")
    os.makedirs(log_dir, exist_ok=True)
    cmd, env = B.find_tb5sync(args.tb5sync_cmd)
    tb5 = B.Tb5sync(cmd, env, None, None, 3600, log_dir)
    tools: list = [tb5]
    if shutil.which("rsync"):
        tools.append(B.Rsync(3600, log_dir))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_base = os.path.join(B.HERE, "results", f"scaling-{stamp}")
    os.makedirs(os.path.dirname(out_base), exist_ok=True)
    result: dict = {"timestamp": stamp, "full": args.full, "repeat": args.repeat, "tools": [t.name for t in tools]}
    try:
        if "size" in sweeps:
            rows = []
            for size in sizes:
                src = fresh_dir(os.path.join(work, "size-src"))
                make_file(os.path.join(src, "file.bin"), size, size)
                walls = measure(tools, src, work, f"size-{human(size)}", args.repeat, size <= 1 * GiB)
                rows.append({"bytes": size, **{f"{k}_gbps": size / v / 1e9 for k, v in walls.items()}, **{f"{k}_s": v for k, v in walls.items()}})
                shutil.rmtree(src, ignore_errors=True)
            result["size"] = rows
            print("\nthroughput vs file size (cold push; wall includes process start, so small files show fixed costs)")
            print(f"| {'size':>8} | " + " | ".join(f"{t.name + ' s':>11} | {t.name + ' MB/s':>12}" for t in tools) + " | tb5/rsync |")
            for r in rows:
                ratio = r["tb5sync_gbps"] / r["rsync_gbps"] if "rsync_gbps" in r else float("nan")
                cells = " | ".join(f"{r[t.name + '_s']:11.3f} | {r[t.name + '_gbps'] * 1000:12.1f}" for t in tools)
                print(f"| {human(r['bytes']):>8} | {cells} | {ratio:8.2f}x |")
            note = plot(out_base + "-size.png", "cold push of one file", "file size (bytes, log2)", "GB/s",
                        [r["bytes"] for r in rows], {t.name: [r[t.name + "_gbps"] for r in rows] for t in tools}, True)
            if note:
                print(note)
        if "streams" in sweeps:
            src = fresh_dir(os.path.join(work, "streams-src"))
            make_file(os.path.join(src, "file.bin"), stream_file, 7)
            rows = []
            for n in (1, 2, 4, 8):
                tb5.streams = n
                walls = measure([tb5], src, work, f"streams-{n}", args.repeat, False)
                rows.append({"streams": n, "tb5sync_gbps": stream_file / walls["tb5sync"] / 1e9, "iperf3_gbps": iperf(n, log_dir)})
            tb5.streams = None
            shutil.rmtree(src, ignore_errors=True)
            result["streams"] = rows
            print(f"\nthroughput vs stream count ({human(stream_file)} cold push)")
            print("| streams | tb5sync GB/s | iperf3 -P N GB/s |")
            for r in rows:
                ip = f"{r['iperf3_gbps']:.2f}" if r["iperf3_gbps"] else "-"
                print(f"| {r['streams']:>7} | {r['tb5sync_gbps']:12.3f} | {ip:>16} |")
            series = {"tb5sync": [r["tb5sync_gbps"] for r in rows]}
            if all(r["iperf3_gbps"] for r in rows):
                series["iperf3 -P N"] = [r["iperf3_gbps"] for r in rows]
            note = plot(out_base + "-streams.png", f"cold push of {human(stream_file)}", "TCP streams", "GB/s", [r["streams"] for r in rows], series, True)
            if note:
                print(note)
        if "tree" in sweeps:
            rows = []
            for n in trees:
                src = fresh_dir(os.path.join(work, "tree-src"))
                total = make_tree(src, n, n)
                walls = measure(tools, src, work, f"tree-{n}", args.repeat, False)
                rows.append({"files": n, "bytes": total, **{f"{k}_files_per_s": n / v for k, v in walls.items()}})
                shutil.rmtree(src, ignore_errors=True)
            result["tree"] = rows
            print("\nfiles/s vs tree size (cold push of files of 1-64 KiB)")
            print("| files   | " + " | ".join(f"{t.name + ' files/s':>16}" for t in tools) + " | tb5/rsync |")
            for r in rows:
                ratio = r["tb5sync_files_per_s"] / r["rsync_files_per_s"] if "rsync_files_per_s" in r else float("nan")
                print(f"| {r['files']:>7} | " + " | ".join(f"{r[t.name + '_files_per_s']:16,.0f}" for t in tools) + f" | {ratio:8.2f}x |")
            note = plot(out_base + "-tree.png", "cold push of a tree of small files", "files (log2)", "files/s",
                        [r["files"] for r in rows], {t.name: [r[t.name + "_files_per_s"] for r in rows] for t in tools}, True)
            if note:
                print(note)
    finally:
        for proc in list(B.LIVE):
            proc.kill()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    with open(out_base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nJSON: {out_base}.json; plots: {out_base}-*.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
